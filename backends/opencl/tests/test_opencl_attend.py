"""Attention kernels against the f64 oracle, and the bit-for-bit invariants."""

from __future__ import annotations

import numpy as np
import pytest
from kvreg_opencl import kernels
from ocl_helpers import MODES, check_close, mirrored, oracle_group
from ocl_helpers import filled_storage as filled


@pytest.mark.parametrize("mode", MODES)
def test_attend_matches_f64_oracle(dev, small_blocks, mode):
    nkv, hpk, hd, rows = 2, 3, 40, 45
    st = filled(nkv, hd, rows, mode)
    rng = np.random.default_rng(7)
    q = rng.standard_normal((nkv * hpk, hd)).astype(np.float32)
    sinks = rng.standard_normal(nkv * hpk).astype(np.float32)
    imp = np.zeros(rows, np.float32)
    first, softcap, scale = 5, 3.0, 0.2
    out, probs = kernels.attend_layer(mirrored(dev, st), q, lens=st.lens, scale=scale, first=first,
                                      softcap=softcap, sinks=sinks, imp=imp, want_probs=True)
    want_imp = np.zeros(rows)
    for g in range(nkv):
        hs = slice(g * hpk, (g + 1) * hpk)
        o, p = oracle_group(st, q[hs], g, scale=scale, first=first, softcap=softcap, sinks=sinks[hs])
        check_close(out[hs], o, f"{mode} out g={g}")
        check_close(probs[hs, : p.shape[1]], p, f"{mode} probs g={g}")
        want_imp[first:] += p.sum(0)
    check_close(imp, want_imp, f"{mode} importance")
    assert np.all(imp[:first] == 0), "rows before first must not be touched"


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


@pytest.mark.parametrize("mode", ["f32", "q8_2f"])
def test_grouped_equals_per_head_bitexact(dev, small_blocks, mode):
    st = filled(2, 40, 37, mode, seed=1)
    m = mirrored(dev, st)
    q = np.random.default_rng(2).standard_normal((3, 40)).astype(np.float32)
    sinks = np.array([0.5, -1.0, 2.0], np.float32)
    imp_g = np.zeros(37, np.float32)
    grouped, _ = kernels.attend_layer(m, q, lens=st.lens, scale=0.2, first=4, softcap=2.0,
                                      sinks=sinks, imp=imp_g, g0=1, ng=1)
    imp_h = np.zeros(37, np.float32)
    for h in range(3):
        alone, _ = kernels.attend_layer(m, q[h:h + 1], lens=st.lens, scale=0.2, first=4, softcap=2.0,
                                        sinks=sinks[h:h + 1], imp=imp_h, g0=1, ng=1)
        np.testing.assert_array_equal(grouped[h], alone[0], err_msg=f"head {h}")
    np.testing.assert_array_equal(imp_g, imp_h)


def test_layer_equals_per_group_bitexact(dev, small_blocks):
    st = filled(3, 32, 29, "q8k_2f", seed=8, alive=None)
    m = mirrored(dev, st)
    q = np.random.default_rng(9).standard_normal((6, 32)).astype(np.float32)
    imp_l = np.zeros(29, np.float32)
    layer, _ = kernels.attend_layer(m, q, lens=st.lens, scale=0.3, first=2, imp=imp_l)
    imp_g = np.zeros(29, np.float32)
    for g in range(3):
        o, _ = kernels.attend_layer(m, q[2 * g:2 * g + 2], lens=st.lens, scale=0.3, first=2,
                                    imp=imp_g, g0=g, ng=1)
        np.testing.assert_array_equal(layer[2 * g:2 * g + 2], o, err_msg=f"group {g}")
    np.testing.assert_array_equal(imp_l, imp_g)


@pytest.mark.parametrize("mode", ["f32", "q8_2f"])
def test_trimmed_tail_equals_untrimmed_window_bitexact(dev, small_blocks, mode):
    full = filled(2, 24, 41, mode, seed=11)
    trimmed = filled(2, 24, 41, mode, seed=11)
    trimmed.drop_front(13)
    q = np.random.default_rng(12).standard_normal((4, 24)).astype(np.float32)
    window = 19
    a, _ = kernels.attend_layer(mirrored(dev, full), q, lens=full.lens, scale=0.4,
                                first=full.lens - window, softcap=1.5)
    b, _ = kernels.attend_layer(mirrored(dev, trimmed), q, lens=trimmed.lens, scale=0.4,
                                first=trimmed.lens - window, softcap=1.5)
    np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("mode", ["f32", "q8v_2f"])
def test_upto_equals_sequential_bitexact(dev, small_blocks, mode):
    st = filled(2, 16, 30, mode, seed=13)
    m = mirrored(dev, st)
    q = np.random.default_rng(14).standard_normal((2, 16)).astype(np.float32)
    for i in (1, 7, 8, 9, 17, 30):
        up, _ = kernels.attend_layer(m, q, lens=st.lens, scale=0.5, first=3, upto=i)
        short = filled(2, 16, i, mode, seed=13)
        seq, _ = kernels.attend_layer(mirrored(dev, short), q, lens=short.lens, scale=0.5, first=3)
        np.testing.assert_array_equal(up, seq, err_msg=f"upto={i}")


def test_repeated_calls_are_deterministic(dev, small_blocks):
    st = filled(2, 40, 50, "q8_2f", seed=15)
    m = mirrored(dev, st)
    q = np.random.default_rng(16).standard_normal((4, 40)).astype(np.float32)
    a, _ = kernels.attend_layer(m, q, lens=st.lens, scale=0.2)
    b, _ = kernels.attend_layer(m, q, lens=st.lens, scale=0.2)
    np.testing.assert_array_equal(a, b)


# ── prefill chunk (tolerance class) ──


@pytest.mark.parametrize("mode,window", [("f32", None), ("f32", 6), ("q8_2f", 5)])
def test_chunk_matches_oracle(dev, small_blocks, mode, window):
    nkv, hpk, hd, s0, b = 2, 2, 16, 11, 7
    st = filled(nkv, hd, s0 + b, mode, seed=17)
    q = np.random.default_rng(18).standard_normal((b, nkv * hpk, hd)).astype(np.float32)
    imp = np.zeros(s0 + b, np.float32)
    out = kernels.attend_chunk(mirrored(dev, st), q, lens=st.lens, s0=s0, hpk=hpk, scale=0.25,
                               window=window, imp=imp)
    want_imp = np.zeros(s0 + b)
    for i in range(b):
        n = s0 + i + 1
        lo = 0 if window is None else max(0, n - window)
        for g in range(nkv):
            hs = slice(g * hpk, (g + 1) * hpk)
            o, p = oracle_group(st, q[i, hs], g, scale=0.25, first=lo, upto=n)
            check_close(out[i, hs], o, f"chunk row {i} group {g}")
            want_imp[lo:n] += p.sum(0)
    check_close(imp, want_imp, "chunk importance")


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
