"""KvregCache inside real pretrained models (SmolLM2-135M, Gemma-3-270M).

The reference is transformers' own DynamicCache with SDPA on the same model:
greedy tokens must be identical in F32 on every installed backend, and a
teacher-forced run must give the same log-probabilities.
"""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from transformers import DynamicCache  # noqa: E402

import kvreg  # noqa: E402
from kvreg import EvictionPolicy  # noqa: E402
from kvreg.errors import ConfigError  # noqa: E402
from kvreg.integrations.transformers import KvregCache, sliding_slack  # noqa: E402
from kvreg_conformance import startable_backends  # noqa: E402

PROMPT = "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"
# SmolLM2 in the default tier; Gemma-3 (sliding layers) in the full tier.
MODELS = ["smollm2-135m", pytest.param("gemma3-270m", marks=pytest.mark.real_models)]


@pytest.fixture(scope="module", params=MODELS)
def lm(request, pretrained):
    model, tok = pretrained(request.param)
    return request.param, model, tok


def _generate(model, inputs, cache, n=16):
    with torch.no_grad():
        return model.generate(**inputs, cache=cache, max_new_tokens=n, do_sample=False)


def _teacher_forced_logp(model, ids, cache, prefix):
    """Log-probabilities of ids[prefix:] fed one token at a time after a prefill."""
    out = []
    with torch.no_grad():
        logits = model(input_ids=ids[:, :prefix], cache=cache, use_cache=True).logits[0, -1]
        out.append(torch.log_softmax(logits.double(), -1))
        for t in range(prefix, ids.shape[1] - 1):
            logits = model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True).logits[0, -1]
            out.append(torch.log_softmax(logits.double(), -1))
    return torch.stack(out)


# The reference and numba by default; every other backend in the full tier.
@pytest.mark.parametrize("backend", [p if p.values[0] in ("reference", "numba")
                                     else pytest.param(*p.values, marks=(*p.marks, pytest.mark.real_models))
                                     for p in startable_backends()])
def test_f32_greedy_tokens_equal_dynamic_cache(lm, backend):
    name, model, tok = lm
    inputs = tok(PROMPT, return_tensors="pt")
    ref = _generate(model, inputs, DynamicCache(config=model.config))
    cache = KvregCache(model, mode="f32", backend=backend)
    got = _generate(model, inputs, cache)
    assert cache.backend_name == backend
    assert torch.equal(got, ref), f"{name} on {backend}: {tok.decode(got[0])!r} != {tok.decode(ref[0])!r}"
    assert cache.get_seq_length() == got.shape[1] - 1   # the last token is never fed


def test_kvreg_knows_it_runs_inside_the_model_during_its_attention_calls(lm, monkeypatch):
    # kvreg-numba's decode then runs on torch's spinning OpenMP workers
    # (kvreg.threads.set_torch_model, docs/threads.md); outside the calls,
    # e.g. a standalone decode in the same process, it does not
    from kvreg import threads

    name, model, tok = lm
    seen = []
    real = KvregCache._attend
    monkeypatch.setattr(KvregCache, "_attend", lambda self, *a, **kw: (seen.append(threads.torch_model()),
                                                                       real(self, *a, **kw))[1])
    _generate(model, tok(PROMPT, return_tensors="pt"), KvregCache(model, mode="f32"), n=2)
    assert seen and all(seen)
    assert threads.torch_model() is False


@pytest.mark.parametrize("mode", ["f32", "q8"])
def test_decode_steps_run_through_each_layers_prepared_step(lm, mode, monkeypatch):
    # A one-sequence decode step calls the layer's DecodeStep, which goes
    # through append_attend only where something else changed the layer (the
    # first step, a sliding layer's trim): on numba the rest take the
    # prepared launch. The tokens are DynamicCache's either way.
    if "numba" not in kvreg.backends():
        pytest.skip("the prepared launch is numba's")
    monkeypatch.setenv("KVREG_THREADS", "1")     # q8: prepared where the decode runs on one thread
    name, model, tok = lm
    inputs = tok(PROMPT, return_tensors="pt")
    calls = []
    real = kvreg.LayerKvCache.append_attend
    monkeypatch.setattr(kvreg.LayerKvCache, "append_attend", lambda self, *a, **kw: (calls.append(1),
                                                                                   real(self, *a, **kw))[1])
    cache = KvregCache(model, mode=mode, backend="numba")
    got = _generate(model, inputs, cache, n=12)
    layers = cache.num_layers
    assert len(calls) <= 2 * layers, f"{name} {mode}: {len(calls)} append_attend calls in 11 steps of {layers} layers"
    assert all(step.prepared for _, step, _ in cache._steps.values())
    if mode == "f32":
        assert torch.equal(got, _generate(model, inputs, DynamicCache(config=model.config), n=12))


def test_past_key_values_keyword_works_too(lm):
    name, model, tok = lm
    inputs = tok(PROMPT, return_tensors="pt")
    ref = _generate(model, inputs, DynamicCache(config=model.config), n=8)
    with pytest.warns(FutureWarning), torch.no_grad():
        got = model.generate(**inputs, past_key_values=KvregCache(model, mode="f32"), max_new_tokens=8,
                             do_sample=False)
    assert torch.equal(got, ref)


def test_teacher_forced_logprobs_match_dynamic_cache_past_the_sliding_window(lm):
    """Long enough that Gemma's sliding layers trim (window 512 + slack): the
    log-probabilities stay those of DynamicCache, and the sliding layers hold
    no more than window - 1 + sliding_slack(window) rows."""
    name, model, tok = lm
    text = open(__file__).read() * 3
    ids = tok(text, return_tensors="pt").input_ids[:, :610]
    ref = _teacher_forced_logp(model, ids, DynamicCache(config=model.config), prefix=560)
    cache = KvregCache(model, mode="f32")
    got = _teacher_forced_logp(model, ids, cache, prefix=560)
    nll_ref = -ref[torch.arange(len(ref)), ids[0, 560:]].mean()
    nll_got = -got[torch.arange(len(got)), ids[0, 560:]].mean()
    assert abs(float(torch.exp(nll_got) / torch.exp(nll_ref)) - 1) < 1e-4
    assert float((got - ref).abs().max()) < 2e-3
    layers = cache.sequences[0].layers
    for w, layer in zip(cache.windows, layers):
        if w is None:
            assert layer.seq_len == ids.shape[1] - 1
        else:
            assert layer.seq_len <= w - 1 + sliding_slack(w)
    if name == "gemma3-270m":
        assert any(w is not None and layer.seq_len < ids.shape[1] - 1 for w, layer in zip(cache.windows, layers))


BATCH_CONFIGS = {"f32": {"mode": "f32"}, "q8_born": {"mode": "q8", "budget": 12},
                 "o1": {"mode": "f32", "o1": (4, 8, 2)}}


@pytest.mark.parametrize("cfg", list(BATCH_CONFIGS))
def test_batch_of_two_with_left_padding_equals_two_single_runs(lm, cfg):
    # The batch's decode steps run one kvreg.attend_batch per layer; each
    # sequence alone runs attend_layer: the same bits, so the same tokens.
    name, model, tok = lm
    kw = BATCH_CONFIGS[cfg]
    prompts = [PROMPT, "The capital of France is"]
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    batch = tok(prompts, return_tensors="pt", padding=True)
    assert not bool(batch.attention_mask.all()), "the prompts must differ in length"
    cache = KvregCache(model, **kw)
    got = _generate(model, batch, cache, n=16)
    width = batch.input_ids.shape[1]
    for i, p in enumerate(prompts):
        single = tok(p, return_tensors="pt")
        one = _generate(model, single, KvregCache(model, **kw), n=16)
        assert torch.equal(got[i, width:], one[0, single.input_ids.shape[1]:]), f"{name} {cfg}: sequence {i}"
    if cfg != "f32":
        return
    # Each sequence stores its own tokens only (no pad rows).
    full = [w is None for w in cache.windows].index(True)
    lens = [seq.layers[full].seq_len for seq in cache.sequences]
    assert lens[0] != lens[1]


def test_bf16_and_f16_models_run(lm):
    import copy

    name, model, tok = lm
    inputs = tok(PROMPT, return_tensors="pt")
    ref32 = _generate(model, inputs, DynamicCache(config=model.config), n=8)
    for dtype in (torch.bfloat16, torch.float16):
        m = copy.deepcopy(model).to(dtype)
        ref = _generate(m, inputs, DynamicCache(config=m.config), n=8)
        got = _generate(m, inputs, KvregCache(m, mode="f32"), n=8)
        assert got.shape == ref.shape == ref32.shape
        # kvreg attends in float32 where SDPA rounds to the model's 2-byte
        # type, so later tokens may drift; the first one is the prompt's.
        n_in = inputs.input_ids.shape[1]
        assert got[0, n_in] == ref[0, n_in], (dtype, tok.decode(got[0]), tok.decode(ref[0]))


def test_a_half_model_gets_its_own_dtype_by_default(lm, monkeypatch):
    import copy

    monkeypatch.delenv("KVREG_KV", raising=False)
    name, model, tok = lm
    for dtype, mode in ((torch.float16, kvreg.KvMode.F16), (torch.bfloat16, kvreg.KvMode.BF16),
                        (torch.float32, kvreg.KvMode.F32)):
        m = copy.deepcopy(model).to(dtype) if dtype is not torch.float32 else model
        assert KvregCache(m).mode is mode


# Mean KL over 40 teacher-forced tokens after a 48-token prompt: loose bounds
# a broken format misses by orders of magnitude (kvreg eval measures the
# real figures: docs/formats.md).
_MODE_KL_BOUND = {"f16": 1e-4, "bf16": 2e-3, "q8": 1e-2, "q4": 1e-1}


def test_every_storage_mode_follows_f32_inside_the_model(lm):
    name, model, tok = lm
    ids = tok(PROMPT * 6, return_tensors="pt").input_ids[:, :88]
    ref = _teacher_forced_logp(model, ids, KvregCache(model, mode="f32"), 48)
    for mode, bound in _MODE_KL_BOUND.items():
        cache = KvregCache(model, mode=mode)
        got = _teacher_forced_logp(model, ids, cache, 48)
        kl = float((ref.exp() * (ref - got)).sum(-1).mean())
        assert 0 <= kl < bound, (name, mode, kl)
        assert all(layer.mode.value == mode for layer in cache._seqs[0].layers)


def test_q8_generates_and_holds_quarter_of_f32_bytes(lm):
    name, model, tok = lm
    inputs = tok(PROMPT * 4, return_tensors="pt")
    f32, q8 = KvregCache(model, mode="f32"), KvregCache(model, mode="q8")
    ref = _generate(model, inputs, f32, n=8)
    got = _generate(model, inputs, q8, n=8)
    assert got.shape == ref.shape
    assert q8.memory_bytes() < 0.4 * f32.memory_bytes()


def test_born_budget_bounds_global_layers_and_positions_never_shrink(lm):
    name, model, tok = lm
    inputs = tok(PROMPT * 6, return_tensors="pt")
    n_in = inputs.input_ids.shape[1]
    budget = 48
    cache = KvregCache(model, mode="f32", policy=EvictionPolicy.Born(sink=4), budget=budget)
    out = _generate(model, inputs, cache, n=12)
    assert cache.get_seq_length() == n_in + 11
    for w, layer in zip(cache.windows, cache.sequences[0].layers):
        if w is None:
            assert layer.seq_len == budget
    # The model's positions stayed absolute: the same run with the budget
    # larger than the context is the plain cache, token for token.
    wide = _generate(model, inputs, KvregCache(model, mode="f32", budget=n_in + 64), n=12)
    assert torch.equal(wide, _generate(model, inputs, DynamicCache(config=model.config), n=12))
    assert out.shape == wide.shape


@pytest.mark.parametrize("mode", ["f32", "q8"])
def test_o1_seal_runs_inside_generate_with_memory_constant_in_context(lm, mode):
    name, model, tok = lm
    inputs = tok(PROMPT * 6, return_tensors="pt")
    cache = KvregCache(model, mode=mode, o1=(8, 16, 4))
    _generate(model, inputs, cache, n=4)
    glob = [layer for w, layer in zip(cache.windows, cache.sequences[0].layers) if w is None]
    assert glob and all(layer.o1_sealed() for layer in glob)
    before = sum(layer.memory_bytes() for layer in glob)
    with torch.no_grad():
        for t in range(3):
            model(input_ids=inputs.input_ids[:, t:t + 1], cache=cache, use_cache=True)
    assert sum(layer.memory_bytes() for layer in glob) == before


def test_refusals_name_what_is_supported(lm):
    name, model, tok = lm
    with pytest.raises(ConfigError, match="budget"):
        KvregCache(model, policy=EvictionPolicy.Born(sink=4))
    with pytest.raises(ConfigError, match="one of them"):
        KvregCache(model, budget=64, o1=(16, 64, 4))
    with pytest.raises(kvreg.ConfigError, match="accepted"):
        KvregCache(model, mode="q3")


def test_a_model_kvreg_cannot_serve_exactly_is_refused_at_construction_with_the_reason():
    from transformers import BloomConfig, BloomForCausalLM

    # Bloom adds ALiBi biases inside its own attention, not through
    # transformers' attention interface
    tiny = BloomForCausalLM(BloomConfig(n_layer=1, n_head=2, hidden_size=16, vocab_size=32)).eval()
    with pytest.raises(ConfigError, match="attention interface"):
        KvregCache(tiny)


def test_readme_drop_in_runs_as_written():
    import pathlib
    import re

    text = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    code = next(c for c in re.findall(r"```python\n(.*?)```", text, re.S) if "KvregCache(" in c)
    env: dict = {"print": lambda *a: None}
    exec(compile(code, "README.md", "exec"), env)
    assert isinstance(env["cache"], KvregCache) and env["cache"].mode.value == "q8"
    assert env["out"].shape[1] > env["inputs"]["input_ids"].shape[1]


def test_crop_rolls_back_like_dynamic_cache_or_refuses_before_any_change(lm):
    name, model, tok = lm
    ids = tok(PROMPT * 2, return_tensors="pt").input_ids[:, :30]
    caches = [DynamicCache(config=model.config), KvregCache(model, mode="f32")]
    logits = []
    with torch.no_grad():
        for cache in caches:
            model(input_ids=ids[:, :20], cache=cache, use_cache=True)
            for t in range(20, 25):
                model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True)
    kv = caches[1]
    if name == "gemma3-270m":
        before = [layer.seq_len for layer in kv.sequences[0].layers]
        with pytest.raises(ConfigError, match="sliding"):
            kv.crop(-3)
        assert [layer.seq_len for layer in kv.sequences[0].layers] == before and kv.get_seq_length() == 25
        return
    with torch.no_grad():
        for cache in caches:
            cache.crop(-3)
            logits.append(model(input_ids=ids[:, 22:23], cache=cache, use_cache=True).logits[0, -1])
    assert kv.get_seq_length() == caches[0].get_seq_length() == 23
    assert float((logits[0] - logits[1]).abs().max()) < 1e-3


def test_other_caches_run_the_models_own_attention_after_a_kvreg_cache(lm):
    name, model, tok = lm
    ids = tok(PROMPT, return_tensors="pt").input_ids
    configured = model.config._attn_implementation
    with torch.no_grad():
        before = model(input_ids=ids, cache=DynamicCache(config=model.config), use_cache=True).logits
        model(input_ids=ids, cache=KvregCache(model), use_cache=True)
        after = model(input_ids=ids, cache=DynamicCache(config=model.config), use_cache=True).logits
    assert model.config._attn_implementation == configured
    assert torch.equal(before, after)


def test_fork_shares_a_prefilled_prompt_and_continues_as_a_fresh_prefill(lm):
    # A system prompt prefilled once, forked per request: each fork answers
    # as a cache that prefilled the prompt itself, and the prompt's rows are
    # held once while the forks decode (kvreg.resident_bytes).
    name, model, tok = lm
    ids = tok(PROMPT * 40, return_tensors="pt").input_ids[:, :400]

    def prefilled():
        cache = KvregCache(model, mode="f32")
        with torch.no_grad():
            model(input_ids=ids, cache=cache, use_cache=True)
        return cache

    parent = prefilled()
    alone = parent.memory_bytes()
    forks = [parent.fork() for _ in range(2)]
    for i, fork in enumerate(forks):
        request = torch.cat([ids, tok(f" # request {i}", return_tensors="pt").input_ids], dim=1)
        mask = torch.ones_like(request)
        got = _generate(model, {"input_ids": request, "attention_mask": mask}, fork, n=6)
        want = _generate(model, {"input_ids": request, "attention_mask": mask}, prefilled(), n=6)
        assert torch.equal(got, want), f"{name}: fork {i}"
    held = kvreg.resident_bytes([c.sequences for c in [parent] + forks])
    assert held < 1.25 * alone, (name, held, alone)
    assert parent.memory_bytes() == alone


def test_a_forks_decode_step_leaves_its_siblings_answer_alone(lm):
    # A decode step writes each layer's answer into a buffer the cache
    # reuses every token. A fork gets buffers of its own: two requests
    # forked from one prompt may decode in two threads at once, so one's
    # step must not overwrite the tensor the other's layer just returned.
    from kvreg.integrations.transformers import kvreg_attention_forward

    name, model, tok = lm
    ids = tok(PROMPT, return_tensors="pt").input_ids[:, :40]
    parent = KvregCache(model, mode="f32")
    with torch.no_grad():
        model(input_ids=ids, cache=parent, use_cache=True)
    nh, nkv, hd = parent.num_heads, parent.num_kv_heads, parent.head_dim
    gen = torch.Generator().manual_seed(0)
    answers = []
    for fork in (parent.fork(), parent.fork()):
        k, v = (torch.randn(1, nkv, 1, hd, generator=gen) for _ in range(2))
        q = torch.randn(1, nh, 1, hd, generator=gen)
        with fork._router.routed():    # a layer's forward, by hand
            k, v = fork.update(k, v, 0)
            out, _ = kvreg_attention_forward(model.model.layers[0].self_attn, q, k, v, None)
        answers.append((out, out.clone()))
    assert not torch.equal(answers[0][1], answers[1][1])
    for out, copy in answers:
        assert torch.equal(out, copy), f"{name}: a sibling fork's step rewrote this fork's answer"
