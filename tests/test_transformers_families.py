"""KvregCache inside tiny random models of every mainstream decoder family.

Each model is built from its transformers config (no download: hidden 64,
4 layers, vocab 128, sliding windows of 16 that the prompts exceed, weights
large enough that soft-caps, sinks and windows change the answer). The
reference is the same model with transformers' ``DynamicCache`` and the
attention it was configured with: greedy tokens must be identical,
teacher-forced log-probabilities within 1e-4 (prefill and decode), a left-
padded batch and seeded sampling must give DynamicCache's tokens.

The default tier runs a few families that each carry a feature (GQA, soft-
cap, learned sinks, multi-head attention without ``num_key_value_heads``);
the rest are marked ``model_families``.
"""

from __future__ import annotations

import inspect

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, DynamicCache  # noqa: E402

from kvreg.errors import ConfigError, KvregError  # noqa: E402
from kvreg.integrations.transformers import KvregCache  # noqa: E402

COMMON = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, vocab_size=128, max_position_embeddings=256,
              initializer_range=0.2, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
WINDOW = 16

#: family -> (config class, what differs from COMMON). Each is a capability.
FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "mistral": ("MistralConfig", {"sliding_window": WINDOW}),
    "qwen2": ("Qwen2Config", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 2,
                              "layer_types": ["full_attention", "full_attention", "sliding_attention",
                                              "sliding_attention"]}),
    "qwen3": ("Qwen3Config", {}),
    "phi3": ("Phi3Config", {"sliding_window": WINDOW}),
    "gemma2": ("Gemma2Config", {"sliding_window": WINDOW, "attn_logit_softcapping": 2.0,
                                "final_logit_softcapping": 30.0, "query_pre_attn_scalar": 16}),
    "gemma3_text": ("Gemma3TextConfig", {"sliding_window": WINDOW, "query_pre_attn_scalar": 16}),
    "olmo2": ("Olmo2Config", {}),
    "gpt_oss": ("GptOssConfig", {"sliding_window": WINDOW, "num_local_experts": 4, "num_experts_per_tok": 2}),
    # multi-head attention: the config has no num_key_value_heads at all
    "gpt_neox": ("GPTNeoXConfig", {"num_key_value_heads": None, "head_dim": None, "rotary_pct": 0.5}),
    "mixtral": ("MixtralConfig", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # a window its masks apply (its attention call names none)
    "phimoe": ("PhimoeConfig", {"sliding_window": WINDOW, "num_local_experts": 4, "num_experts_per_tok": 2}),
    # an encoder family run as a causal decoder: absolute positions, post-norm
    "bert_decoder": ("BertConfig", {"is_decoder": True, "num_key_value_heads": None, "head_dim": None}),
    # sliding layers with twice the KV heads of the global one, and sinks on them only
    "mimo_v2_flash": ("MiMoV2FlashConfig", {"sliding_window": WINDOW, "n_routed_experts": 4,
                                            "num_experts_per_tok": 2, "v_head_dim": 16}),
    # fused QKV through Conv1D, multi-head attention, learned absolute positions
    "gpt2": ("GPT2Config", {"num_key_value_heads": None, "head_dim": None}),
    "opt": ("OPTConfig", {"num_key_value_heads": None, "head_dim": None, "ffn_dim": 128, "word_embed_proj_dim": 64}),
    # fused QKV with grouped KV heads, parallel attention and MLP
    "falcon": ("FalconConfig", {"head_dim": None, "new_decoder_architecture": True, "num_kv_heads": 2}),
    # partial rotary on multi-head attention
    "phi": ("PhiConfig", {"partial_rotary_factor": 0.5, "num_key_value_heads": None, "head_dim": None}),
    # an attention scaling multiplier in place of 1/sqrt(head_dim)
    "granite": ("GraniteConfig", {"attention_multiplier": 0.3, "residual_multiplier": 0.7, "logits_scaling": 2.0,
                                  "embedding_multiplier": 3.0}),
    "starcoder2": ("Starcoder2Config", {"sliding_window": WINDOW}),
    # sliding layers with a global one every fourth, NoPE on the global
    "cohere2": ("Cohere2Config", {"sliding_window": WINDOW}),
    "olmo3": ("Olmo3Config", {"sliding_window": WINDOW}),
    # alternating windows with soft-capping
    "vaultgemma": ("VaultGemmaConfig", {"sliding_window": WINDOW, "query_pre_attn_scalar": 16,
                                        "attn_logit_softcapping": 2.0, "final_logit_softcapping": 30.0}),
    "qwen3_moe": ("Qwen3MoeConfig", {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
}
DEFAULT_TIER = ("llama", "gemma2", "gpt_oss", "gpt_neox")


def family_params(default=DEFAULT_TIER):
    """Every family; those outside ``default`` marked ``model_families``."""
    return [pytest.param(n, marks=() if n in default else pytest.mark.model_families) for n in FAMILIES]


def tiny_model(family: str, attn_implementation: str | None = None):
    cls_name, extra = FAMILIES[family]
    kw = {k: v for k, v in {**COMMON, **extra}.items() if v is not None}
    config = getattr(transformers, cls_name)(**kw)
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    return model


_MODELS: dict = {}


@pytest.fixture(scope="module")
def models():
    yield _MODELS
    _MODELS.clear()


def _model(models, family, attn_implementation=None):
    key = family if attn_implementation is None else (family, attn_implementation)
    if key not in models:
        models[key] = tiny_model(family, attn_implementation)
    return models[key]


def _kw(model) -> str:
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _ids(n: int, seed: int = 1, batch: int = 1):
    return torch.randint(3, 128, (batch, n), generator=torch.Generator().manual_seed(seed))


def _generate(model, cache, ids, mask=None, n=12, **kw):
    mask = torch.ones_like(ids) if mask is None else mask
    with torch.no_grad():
        return model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n,
                              pad_token_id=0, **{_kw(model): cache}, **kw)


def _teacher_forced_logp(model, ids, cache, prefix):
    kw = _kw(model)
    out = []
    with torch.no_grad():
        logits = model(input_ids=ids[:, :prefix], use_cache=True, **{kw: cache}).logits[0, -1]
        out.append(torch.log_softmax(logits.double(), -1))
        for t in range(prefix, ids.shape[1] - 1):
            logits = model(input_ids=ids[:, t:t + 1], use_cache=True, **{kw: cache}).logits[0, -1]
            out.append(torch.log_softmax(logits.double(), -1))
    return torch.stack(out)


@pytest.mark.parametrize("family", family_params())
def test_greedy_tokens_equal_dynamic_cache_past_the_window(models, family):
    model = _model(models, family)
    ids = _ids(20)
    ref = _generate(model, DynamicCache(config=model.config), ids)
    got = _generate(model, KvregCache(model, mode="f32"), ids)
    assert got.shape[1] > WINDOW + 12
    assert torch.equal(got, ref), family


@pytest.mark.parametrize("family", family_params())
def test_teacher_forced_logprobs_within_1e4_prefill_and_decode(models, family):
    model = _model(models, family)
    ids = _ids(44, seed=2)
    ref = _teacher_forced_logp(model, ids, DynamicCache(config=model.config), prefix=24)
    got = _teacher_forced_logp(model, ids, KvregCache(model, mode="f32"), prefix=24)
    err = (got - ref).abs().max(dim=-1).values
    assert float(err[0]) < 1e-4, f"{family} prefill: {float(err[0]):.2e}"
    assert float(err[1:].max()) < 1e-4, f"{family} decode: {float(err[1:].max()):.2e}"


@pytest.mark.parametrize("family", family_params(default=("gemma2",)))
def test_left_padded_batch_of_two_gives_dynamic_cache_tokens(models, family):
    model = _model(models, family)
    ids = torch.cat([_ids(22, seed=3), torch.cat([torch.zeros(1, 6, dtype=torch.long), _ids(16, seed=4)], 1)])
    mask = (ids != 0).long()
    mask[0] = 1
    ref = _generate(model, DynamicCache(config=model.config), ids, mask)
    cache = KvregCache(model, mode="f32")
    got = _generate(model, cache, ids, mask)
    assert torch.equal(got, ref), family
    # the pad columns are not stored: with prompts inside the window, every
    # layer, sliding or global, holds 6 rows fewer for the padded one
    short = torch.cat([_ids(12, seed=3), torch.cat([torch.zeros(1, 6, dtype=torch.long), _ids(6, seed=4)], 1)])
    mask = (short != 0).long()
    mask[0] = 1
    cache = KvregCache(model, mode="f32")
    with torch.no_grad():
        model(input_ids=short, attention_mask=mask, use_cache=True, **{_kw(model): cache})
    for i in range(cache.num_layers):
        rows = [seq.layers[i].seq_len for seq in cache.sequences]
        assert rows == [12, 6], (family, i, rows)


@pytest.mark.parametrize("family", family_params(default=("llama",)))
def test_seeded_sampling_gives_dynamic_cache_tokens(models, family):
    model = _model(models, family)
    ids = _ids(20, seed=5)
    torch.manual_seed(7)
    ref = _generate(model, DynamicCache(config=model.config), ids, do_sample=True, top_k=0, temperature=1.0)
    torch.manual_seed(7)
    got = _generate(model, KvregCache(model, mode="f32"), ids, do_sample=True, top_k=0, temperature=1.0)
    assert torch.equal(got, ref), family


@pytest.mark.parametrize("family", family_params(default=("gpt_oss",)))
def test_q8_follows_f32_inside_the_model(models, family):
    model = _model(models, family)
    ids = _ids(44, seed=6)
    ref = _teacher_forced_logp(model, ids, KvregCache(model, mode="f32"), prefix=24)
    cache = KvregCache(model, mode="q8")
    got = _teacher_forced_logp(model, ids, cache, prefix=24)
    kl = float((ref.exp() * (ref - got)).sum(-1).mean())
    # loose: these random models' peaked attention is harder on int8 than
    # real text; a broken format misses by orders of magnitude
    assert 0 < kl < 5e-2, (family, kl)
    assert all(layer.mode.value == "q8" for layer in cache.sequences[0].layers)


# ── the features the reference would miss if kvreg ignored them ──


def test_soft_capping_and_sinks_change_these_models_answers(models):
    # Without these, the equality tests above would pass even if kvreg
    # ignored soft-capping or sinks.
    ids = _ids(30, seed=8)
    gemma = _model(models, "gemma2")
    oss = _model(models, "gpt_oss")
    with torch.no_grad():
        capped = gemma(input_ids=ids).logits
        for layer in gemma.model.layers:
            layer.self_attn.attn_logit_softcapping = None
        try:
            uncapped = gemma(input_ids=ids).logits
        finally:
            for layer in gemma.model.layers:
                layer.self_attn.attn_logit_softcapping = 2.0
        with_sinks = oss(input_ids=ids).logits
        saved = [layer.self_attn.sinks.detach().clone() for layer in oss.model.layers]
        for layer in oss.model.layers:
            layer.self_attn.sinks.data.fill_(-1e4)
        try:
            without = oss(input_ids=ids).logits
        finally:
            for layer, s in zip(oss.model.layers, saved):
                layer.self_attn.sinks.data.copy_(s)
    assert float((capped - uncapped).abs().max()) > 1e-2
    assert float((with_sinks - without).abs().max()) > 1e-2


def test_a_changed_sink_parameter_reaches_the_next_step(models):
    # The sinks are read from the model at each call (converted once per
    # change of the parameter): an edited parameter is not served stale.
    model = _model(models, "gpt_oss")
    ids = _ids(24, seed=9)
    got, ref = [], []
    for cache, out in ((KvregCache(model, mode="f32"), got), (DynamicCache(config=model.config), ref)):
        kw = {_kw(model): cache}
        saved = [layer.self_attn.sinks.detach().clone() for layer in model.model.layers]
        try:
            with torch.no_grad():
                model(input_ids=ids[:, :20], use_cache=True, **kw)
                for layer in model.model.layers:
                    layer.self_attn.sinks.data.add_(1.5)
                out.append(model(input_ids=ids[:, 20:21], use_cache=True, **kw).logits)
        finally:
            for layer, s in zip(model.model.layers, saved):
                layer.self_attn.sinks.data.copy_(s)
    assert float((got[0] - ref[0]).abs().max()) < 1e-4


# ── scoped switching ──


def test_other_caches_run_the_models_own_attention_eager_included(models, monkeypatch):
    # Gemma 2 loaded with eager attention: building a KvregCache and running
    # it leaves the config as it was, and a DynamicCache forward afterwards
    # runs Gemma 2's eager attention, bit for bit as before.
    from transformers.models.gemma2 import modeling_gemma2

    model = _model(models, "gemma2", "eager")
    ids = _ids(24, seed=10)
    kw = _kw(model)
    eager_calls = []
    eager = modeling_gemma2.eager_attention_forward
    monkeypatch.setattr(modeling_gemma2, "eager_attention_forward",
                        lambda *a, **k: (eager_calls.append(1), eager(*a, **k))[1])
    with torch.no_grad():
        before = model(input_ids=ids, use_cache=True, **{kw: DynamicCache(config=model.config)}).logits
        cache = KvregCache(model, mode="f32")
        assert model.config._attn_implementation == "eager"
        model(input_ids=ids, use_cache=True, **{kw: cache})
        assert model.config._attn_implementation == "eager"
        eager_calls.clear()
        after = model(input_ids=ids, use_cache=True, **{kw: DynamicCache(config=model.config)}).logits
        assert len(eager_calls) == model.config.num_hidden_layers
        no_cache = model(input_ids=ids, use_cache=False).logits
    assert torch.equal(before, after)
    assert torch.equal(no_cache, before)


def test_a_forward_in_another_thread_meanwhile_runs_as_configured(models, monkeypatch):
    # While one thread's kvreg forward has the config switched, another
    # thread's DynamicCache forward of the same model gets the configured
    # (eager) mask and attention: the same logits as alone.
    import threading

    model = _model(models, "gemma2", "eager")
    ids = _ids(24, seed=13)
    kw = _kw(model)
    with torch.no_grad():
        alone = model(input_ids=ids, use_cache=True, **{kw: DynamicCache(config=model.config)}).logits
    inside, release = threading.Event(), threading.Event()
    real = KvregCache._attend

    def held(self, *a, **k):
        inside.set()
        release.wait(30)
        return real(self, *a, **k)

    monkeypatch.setattr(KvregCache, "_attend", held)
    cache = KvregCache(model, mode="f32")
    errors = []

    def kvreg_forward():
        try:
            with torch.no_grad():
                model(input_ids=ids, use_cache=True, **{kw: cache})
        except Exception as exc:   # pragma: no cover - reported below
            errors.append(exc)

    worker = threading.Thread(target=kvreg_forward)
    worker.start()
    try:
        assert inside.wait(30)
        assert model.config._attn_implementation == "kvreg"    # the other thread's forward, meanwhile
        with torch.no_grad():
            meanwhile = model(input_ids=ids, use_cache=True, **{kw: DynamicCache(config=model.config)}).logits
    finally:
        release.set()
        worker.join(30)
    assert not errors and torch.equal(meanwhile, alone)
    assert model.config._attn_implementation == "eager" and cache.get_seq_length() == 24


def test_a_failed_kvreg_forward_leaves_the_config_as_configured(models):
    model = _model(models, "llama")
    cache = KvregCache(model, mode="f32")
    with pytest.raises(KvregError, match="batch"), torch.no_grad():
        model(input_ids=_ids(8), use_cache=True, **{_kw(model): cache})
        model(input_ids=_ids(1, batch=2), use_cache=True, **{_kw(model): cache})
    assert model.config._attn_implementation == "sdpa"


def test_update_outside_the_models_forward_is_refused(models):
    model = _model(models, "llama")
    cache = KvregCache(model, mode="f32")
    k = torch.zeros(1, 2, 1, 16)
    with pytest.raises(ConfigError, match="outside a forward"):
        cache.update(k, k, 0)
    assert cache.get_seq_length() == 0


def test_a_mask_kvreg_would_not_follow_is_refused_before_the_layer_changes(models):
    # Padding between a sequence's tokens under a sliding window: the mask's
    # window counts columns, pads included; kvreg's counts stored tokens.
    model = _model(models, "mistral")
    ids = _ids(30, seed=12)
    mask = torch.ones_like(ids)
    mask[0, 10:18] = 0
    cache = KvregCache(model, mode="f32")
    with pytest.raises(ConfigError, match="mask"), torch.no_grad():
        model(input_ids=ids, attention_mask=mask, use_cache=True, **{_kw(model): cache})
    assert cache.sequences[0].layers[0].seq_len == 0


# ── refusals at construction ──


def _refused(cls_name: str, **kw):
    config = getattr(transformers, cls_name)(**kw)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    with pytest.raises(ConfigError) as exc:
        KvregCache(model)
    return str(exc.value)


def test_latent_attention_is_refused_at_construction():
    why = _refused("DeepseekV3Config", hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, vocab_size=128,
                   kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                   n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, first_k_dense_replace=1)
    assert "latent" in why


def test_bidirectional_attention_is_refused_at_construction():
    # BERT as an encoder: every token sees the later ones
    why = _refused("BertConfig", hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   vocab_size=128)
    assert "bidirectional" in why


@pytest.mark.model_families
def test_alibi_and_hybrid_models_are_refused_at_construction():
    why = _refused("BloomConfig", hidden_size=64, n_layer=2, n_head=4, vocab_size=128)
    assert "attention interface" in why
    why = _refused("BambaConfig", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, vocab_size=128, attn_layer_indices=[1],
                   mamba_n_heads=4, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=8, mamba_expand=2)
    assert "hybrid" in why


TINY = dict(COMMON, num_hidden_layers=2)


@pytest.mark.model_families
@pytest.mark.parametrize("cls_name,kw,why", [
    ("Llama4TextConfig", dict(TINY, intermediate_size_mlp=128, num_local_experts=2, num_experts_per_tok=1),
     "chunked attention"),
    ("Gemma3nTextConfig", dict(TINY, num_hidden_layers=4, num_kv_shared_layers=2, vocab_size_per_layer_input=128,
                               hidden_size_per_layer_input=16, sliding_window=WINDOW,
                               layer_types=["sliding_attention", "full_attention"] * 2), "shared across layers"),
    ("MambaConfig", dict(hidden_size=64, num_hidden_layers=2, vocab_size=128, state_size=8), "state-space"),
    ("DiffLlamaConfig", TINY, "did not hand it"),
], ids=["llama4_chunked", "gemma3n_shared_kv", "mamba", "diffllama"])
def test_what_per_head_rows_cannot_serve_is_refused_at_construction(cls_name, kw, why):
    assert why in _refused(cls_name, **kw)


# ── crop, as DynamicCache crops ──


def _prefilled(model, n=12):
    caches = [DynamicCache(config=model.config), KvregCache(model, mode="f32")]
    with torch.no_grad():
        for cache in caches:
            model(input_ids=_ids(n, seed=11), use_cache=True, **{_kw(model): cache})
    return caches


def test_crop_zero_keeps_every_token_and_too_many_empties_as_dynamic_cache(models):
    model = _model(models, "llama")
    dyn, kv = _prefilled(model)
    for cache in (dyn, kv):
        cache.crop(0)
    assert kv.get_seq_length() == dyn.get_seq_length() == 12
    assert kv.sequences[0].layers[0].seq_len == 12
    for cache in (dyn, kv):
        cache.crop(-20)
    assert kv.get_seq_length() == dyn.get_seq_length() == 0
    assert kv.sequences[0].layers[0].seq_len == 0


@pytest.mark.parametrize("bad", [3.7, True, -2.0, "1", None])
def test_crop_refuses_a_non_integer_before_any_change(models, bad):
    model = _model(models, "llama")
    _, kv = _prefilled(model)
    with pytest.raises(ConfigError, match="integer"):
        kv.crop(bad)
    assert kv.get_seq_length() == 12 and kv.sequences[0].layers[0].seq_len == 12


def test_crop_refuses_a_positive_count_as_dynamic_cache_does(models):
    model = _model(models, "llama")
    dyn, kv = _prefilled(model)
    with pytest.raises(ValueError):
        dyn.crop(5)
    with pytest.raises(ConfigError, match="positive"):
        kv.crop(5)
    assert kv.get_seq_length() == 12 and kv.sequences[0].layers[0].seq_len == 12
