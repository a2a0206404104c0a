"""The helpers the suite shares with kvreg's tests and benchmarks: the realistic
Q/K/V generator (kvreg_conformance.data) and the float64 attention oracle and
RoPE (kvreg_conformance.oracle) it is measured with."""

import numpy as np
import pytest

from kvreg.errors import ShapeError
from kvreg_conformance.data import _realistic_cached, realistic_qkv
from kvreg_conformance.oracle import attention_oracle, rope64


def test_same_seed_gives_identical_arrays():
    a = realistic_qkv(300, 4, 2, 32, seed=3)
    _realistic_cached.cache_clear()  # regenerate, not a cache hit
    b = realistic_qkv(300, 4, 2, 32, seed=3)
    assert a.k is not b.k
    assert np.array_equal(a.q, b.q) and np.array_equal(a.k, b.k) and np.array_equal(a.v, b.v)


def test_different_seed_gives_different_arrays():
    a = realistic_qkv(300, 4, 2, 32, seed=3)
    b = realistic_qkv(300, 4, 2, 32, seed=4)
    assert not np.array_equal(a.k, b.k)


def test_shapes_and_dtypes():
    d = realistic_qkv(100, 8, 2, 64)
    assert d.q.shape == (100, 8, 64) and d.k.shape == (100, 2, 64) and d.v.shape == (100, 2, 64)
    assert d.q.dtype == d.k.dtype == d.v.dtype == np.float32
    assert d.scale == pytest.approx(1 / 8)


def test_cached_arrays_are_read_only():
    d = realistic_qkv(50, 2, 1, 16)
    with pytest.raises(ValueError):
        d.k[0, 0, 0] = 1.0


def test_outlier_channels_dominate_key_rms():
    d = realistic_qkv(2000, 4, 2, 64, outlier_channels=4, outlier_scale=10.0)
    rms = np.sqrt((d.k[1:].astype(np.float64) ** 2).mean(axis=0))  # [nkv, hd], sink row aside
    for g in range(2):
        idx = d.outlier_idx[g]
        others = np.delete(rms[g], idx)
        assert idx.size == 4
        assert rms[g, idx].min() > 5 * np.median(others)


def test_sink_at_position_zero_takes_large_mass():
    d = realistic_qkv(2048, 4, 2, 64, seed=1)
    _, probs = attention_oracle(d.q[-32:], d.k, d.v, d.scale, return_probs=True)
    sink = probs[:, :, 0]
    # uniform share would be 1/2048; a sink takes orders of magnitude more
    assert np.median(sink) > 0.1
    assert np.median(sink) > 100 / 2048


def test_attention_is_peaked_but_not_one_hot():
    d = realistic_qkv(2048, 4, 2, 64, seed=1)
    _, probs = attention_oracle(d.q[-32:], d.k, d.v, d.scale, return_probs=True)
    top = probs.max(axis=-1)
    assert np.median(top) < 0.9
    assert np.median(top) > 20 / 2048


def test_rope_at_position_zero_is_identity():
    x = np.random.default_rng(0).standard_normal((1, 3, 8)).astype(np.float32)
    assert np.array_equal(rope64(x, np.array([0]), 10000.0), x)


def test_rope_preserves_norm():
    x = np.random.default_rng(0).standard_normal((5, 8))
    y = rope64(x, np.arange(5) * 1000, 10000.0)
    assert np.allclose(np.linalg.norm(y, axis=-1), np.linalg.norm(x, axis=-1))


def test_oracle_single_row_returns_its_value():
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((1, 2, 4)), rng.standard_normal((1, 1, 4)), rng.standard_normal((1, 1, 4))
    out = attention_oracle(q, k, v, 0.5)
    assert np.allclose(out[0], v[0, 0])


def test_oracle_window_hides_old_rows():
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((1, 2, 4)), rng.standard_normal((10, 1, 4)), rng.standard_normal((10, 1, 4))
    _, probs = attention_oracle(q, k, v, 0.5, window=3, return_probs=True)
    assert np.all(probs[0, :, :7] == 0) and np.allclose(probs[0].sum(-1), 1)


def test_oracle_learned_sink_absorbs_mass():
    rng = np.random.default_rng(0)
    q, k, v = rng.standard_normal((1, 2, 4)), rng.standard_normal((5, 1, 4)), rng.standard_normal((5, 1, 4))
    _, probs = attention_oracle(q, k, v, 0.5, sinks=np.array([50.0, -50.0]), return_probs=True)
    assert probs[0, 0].sum() < 1e-10 and probs[0, 1].sum() == pytest.approx(1.0)


def test_oracle_refuses_mismatched_heads():
    with pytest.raises(ShapeError, match="multiple"):
        attention_oracle(np.zeros((1, 3, 4)), np.zeros((2, 2, 4)), np.zeros((2, 2, 4)), 1.0)


def test_rope_leaves_the_channels_past_rotary_dims():
    x = np.random.default_rng(1).standard_normal((3, 10))
    pos = np.arange(3) * 7
    y = rope64(x, pos, 500.0, rotary_dims=6)
    assert np.array_equal(y[:, 6:], x[:, 6:])
    assert np.array_equal(y[:, :6], rope64(x[:, :6], pos, 500.0))


def test_oracle_softcap_bounds_every_score():
    # a huge score capped at 1 leaves the other row a visible share
    q = np.array([[[100.0, 0.0]]])
    k = np.array([[[1.0, 0.0]], [[0.0, 1.0]]])
    v = np.array([[[1.0, 0.0]], [[0.0, 1.0]]])
    _, probs = attention_oracle(q, k, v, 1.0, softcap=1.0, return_probs=True)
    assert probs[0, 0, 1] == pytest.approx(1 / (1 + np.exp(np.tanh(100.0))))
