"""Attention kernels against the f64 oracle, and the bit-for-bit invariants."""

from __future__ import annotations

import numpy as np
import pytest
from ocl_helpers import check_close, mirrored, oracle_group
from ocl_helpers import filled_storage as filled

from kvreg_opencl import kernels


@pytest.mark.parametrize("mode", ["f32", "q8_2f"])
def test_head_dim_not_multiple_of_8_uses_scalar_path(dev, small_blocks, mode):
    st = filled(1, 36, 20, mode, seed=3)
    q = np.random.default_rng(4).standard_normal((2, 36)).astype(np.float32)
    out, _ = kernels.attend_layer(mirrored(dev, st), q, lens=st.lens, scale=0.3)
    o, _ = oracle_group(st, q, 0, scale=0.3)
    check_close(out, o, f"{mode} hd=36")


def test_default_tunables_multi_block_matches_oracle(dev):
    st = filled(1, 64, 1100, "f32", seed=5)  # 3 blocks of 512 rows
    q = np.random.default_rng(6).standard_normal((2, 64)).astype(np.float32)
    out, _ = kernels.attend_layer(mirrored(dev, st), q, lens=st.lens, scale=0.125)
    want = np.zeros((2, 64))
    K, V = st.keys(0), st.values(0)
    for h in range(2):
        s = (K @ q[h].astype(np.float64)) * 0.125
        e = np.exp(s - s.max())
        want[h] = (e / e.sum()) @ V
    check_close(out, want, "default tunables")


def test_empty_head_gives_zeros(dev, small_blocks):
    st = filled(2, 16, 9, "f32", alive=np.array([True, False]))
    q = np.ones((4, 16), np.float32)
    out, _ = kernels.attend_layer(mirrored(dev, st), q, lens=st.lens, scale=0.5)
    assert np.all(out[2:] == 0)
    assert np.any(out[:2] != 0)


# ── bit-for-bit invariants (docs/kernels.md) ──


def test_repeated_calls_are_deterministic(dev, small_blocks):
    st = filled(2, 40, 50, "q8_2f", seed=15)
    m = mirrored(dev, st)
    q = np.random.default_rng(16).standard_normal((4, 40)).astype(np.float32)
    a, _ = kernels.attend_layer(m, q, lens=st.lens, scale=0.2)
    b, _ = kernels.attend_layer(m, q, lens=st.lens, scale=0.2)
    np.testing.assert_array_equal(a, b)


# ── prefill chunk (tolerance class) ──


def test_gpu_like_geometry_row_lanes(dev, monkeypatch):
    """LOCAL_SIZE 64 with hd 64: 8 value-pass row lanes merged through local
    memory (the GPU shape), still matching the oracle and per-head bits."""
    from kvreg_opencl import config

    monkeypatch.setattr(config, "LOCAL_SIZE", 64)
    monkeypatch.setattr(config, "BLOCK_ROWS", 32)
    monkeypatch.setattr(config, "HEADS_PER_WG", 2)
    st = filled(1, 64, 75, "q8v_2f", seed=21)
    m = mirrored(dev, st)
    q = np.random.default_rng(22).standard_normal((2, 64)).astype(np.float32)
    out, _ = kernels.attend_layer(m, q, lens=st.lens, scale=0.125, first=2)
    o, _ = oracle_group(st, q, 0, scale=0.125, first=2)
    check_close(out, o, "gpu-like geometry")
    one, _ = kernels.attend_layer(m, q[1:], lens=st.lens, scale=0.125, first=2)
    np.testing.assert_array_equal(out[1], one[0])
