"""Eviction and quantization composed inside the transformers drop-in:
``EvictionPolicy.Snap`` (per-KV-group rows chosen by the prompt's last
queries, then decode's mass) and the tiered seal's far formats and
observation window, on tiny random models."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvreg import EvictionPolicy  # noqa: E402
from kvreg.errors import ConfigError, KvregError  # noqa: E402
from kvreg.integrations.transformers import KvregCache  # noqa: E402
from kvreg.tiered_seal import seal_bytes  # noqa: E402
from tests.test_transformers_families import COMMON, tiny_model  # noqa: E402

PROMPT, STEPS = 80, 6


@pytest.fixture(scope="module")
def llama():
    return tiny_model("llama")


def _run(model, cache, ids):
    """Prefill ``PROMPT`` ids, then decode the rest one at a time; the cache's
    bytes after each forward and the last logits."""
    held = []
    with torch.no_grad():
        out = model(input_ids=ids[:, :PROMPT], cache=cache, use_cache=True)
        held.append(cache.memory_bytes())
        for t in range(PROMPT, ids.shape[1]):
            out = model(input_ids=ids[:, t:t + 1], cache=cache, use_cache=True)
            held.append(cache.memory_bytes())
    return held, out.logits[0, -1]


def _ids():
    return torch.randint(3, 128, (1, PROMPT + STEPS), generator=torch.Generator().manual_seed(3))


@pytest.mark.parametrize("mode, fmt", [("f32", "f32"), ("q8", "int8"), ("q4", "int8")])
def test_snap_holds_its_budget_per_group_from_the_prompts_end_in_every_mode(llama, mode, fmt):
    budget, nkv, hd = 48, COMMON["num_key_value_heads"], COMMON["head_dim"]
    cache = KvregCache(llama, mode=mode, policy=EvictionPolicy.Snap(sink=4, recent=8, observe=8), budget=budget)
    held, logits = _run(llama, cache, _ids())
    layers = cache.sequences[0].layers
    assert all(layer.o1_sealed() for layer in layers)
    per_layer = seal_bytes(0, 8, 4, hd, nkv, heavy=budget - 12, fmt=fmt)
    assert held == [per_layer * len(layers)] * len(held)      # fixed from the prefill's end on
    state = layers[0].seal.phase.tiered
    assert state.exact.n == budget and state.far.n == 0
    assert torch.isfinite(logits).all()


def test_snap_with_a_budget_over_the_text_answers_as_the_full_cache(llama):
    ids = _ids()
    _, full = _run(llama, KvregCache(llama, mode="f32"), ids)
    _, snap = _run(llama, KvregCache(llama, mode="f32", policy=EvictionPolicy.Snap(), budget=PROMPT + STEPS + 4), ids)
    torch.testing.assert_close(snap, full, rtol=1e-4, atol=1e-4)


def test_snap_and_the_seals_options_change_the_answer(llama):
    ids = _ids()
    _, full = _run(llama, KvregCache(llama, mode="f32"), ids)
    errs = {}
    for name, kw in {"int4": {}, "int2": {"o1_far_format": "int2"}, "int8": {"o1_far_format": "int8"}}.items():
        # m = 40: every format's far tier holds every row the exact one does not
        _, got = _run(llama, KvregCache(llama, mode="f32", o1=(40, 8, 4, 8), o1_observe=8, **kw), ids)
        errs[name] = float((got - full).abs().max())
    # more far bits, closer to the full cache; none exact
    assert 0 < errs["int8"] < errs["int4"] < errs["int2"]


@pytest.mark.parametrize("kw, match", [
    ({"policy": EvictionPolicy.Snap(sink=4, recent=32), "budget": 30}, "smaller"),
    ({"policy": EvictionPolicy.Snap(), "budget": 64, "o1": (8, 8, 4)}, "one of them"),
    ({"policy": EvictionPolicy.Snap(recent=0), "budget": 64}, "Snap.recent"),
    ({"o1": (8, 8, 4), "o1_far_format": "int3"}, "o1_far_format"),
    ({"o1": (8, 8, 4), "o1_far": "nystrom", "o1_observe": 8}, "tiered"),
])
def test_bad_compression_options_are_refused_at_construction(llama, kw, match):
    with pytest.raises(KvregError, match=match):
        KvregCache(llama, **kw)


def test_a_cache_wide_snap_eviction_says_how_to_arm_it():
    from kvreg import KvCache

    cache = KvCache(1, 2, 8, 64, EvictionPolicy.Snap())
    x = np.ones((4, 2, 8), np.float32)
    cache[0].extend(x, x)
    with pytest.raises(ConfigError, match="o1_begin"):
        cache.evict(2)
    assert cache[0].seq_len == 4


@pytest.fixture(scope="module")
def qwen2():
    return tiny_model("qwen2")    # two global layers, two sliding ones (window 16)


def test_a_sliding_layer_sealed_with_room_for_its_window_answers_as_the_full_cache():
    mistral = tiny_model("mistral")     # every layer sliding (window 16)
    ids = _ids()
    _, full = _run(mistral, KvregCache(mistral, mode="f32"), ids)
    cache = KvregCache(mistral, mode="f32", o1=(0, 8, 4, 40), o1_sliding=True)
    _, got = _run(mistral, cache, ids)
    assert all(layer.o1_sealed() for layer in cache.sequences[0].layers)
    torch.testing.assert_close(got, full, rtol=1e-4, atol=1e-4)


def test_sealed_sliding_layers_hold_only_their_window_and_fixed_bytes(qwen2):
    ids = _ids()
    cache = KvregCache(qwen2, mode="q8", o1=(8, 4, 2, 4), o1_sliding=True, o1_observe=4)
    held, logits = _run(qwen2, cache, ids)
    layers = cache.sequences[0].layers
    assert all(layer.o1_sealed() for layer in layers) and torch.isfinite(logits).all()
    assert len(set(held)) == 1
    for layer, w in zip(layers, cache.windows):
        state = layer.seal.phase.tiered
        if w is not None:
            seen = state.seen
            for t in (state.exact, state.far):
                assert (t.pos[:, :t.n] > seen - 1 - w).all()       # what the next query reads, no older row
    plain = KvregCache(qwen2, mode="q8", o1=(8, 4, 2, 4), o1_observe=4)
    _run(qwen2, plain, ids)
    assert not any(layer.o1_sealed() for w, layer in zip(plain.windows, plain.sequences[0].layers) if w is not None)


def test_a_q2_sliding_layer_trims_whole_blocks_so_no_row_is_requantized(qwen2):
    """A sliding layer's trim in a blocked mode drops whole 2-bit blocks
    (``Storage.drop_align``): a partial block would be quantized again from
    its dequantized rows at every trim, compounding the error."""
    ids = torch.randint(3, 128, (1, PROMPT + 60), generator=torch.Generator().manual_seed(4))
    cache = KvregCache(qwen2, mode="q2")
    sliding = [layer for w, layer in zip(cache.windows, cache.sequences[0].layers) if w is not None]
    align = sliding[0].storage.drop_align
    assert align > 1
    drops, rows = [], []
    with torch.no_grad():
        for start, stop in [(0, PROMPT)] + [(t, t + 1) for t in range(PROMPT, ids.shape[1])]:
            before = [layer.seq_len for layer in sliding]
            qwen2(input_ids=ids[:, start:stop], cache=cache, use_cache=True)
            after = [layer.seq_len for layer in sliding]
            drops += [b + stop - start - a for b, a in zip(before, after) if b + stop - start != a]
            rows += after
    assert len(drops) > len(sliding) and all(d % align == 0 for d in drops), drops
    assert max(rows) < 16 - 1 + align + 1, max(rows)     # window 16: never a whole block more than it needs
