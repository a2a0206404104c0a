"""Decode attention: the f64 oracle (tolerance) and every invariant of
docs/kernels.md bit for bit, on multi-block inputs (block size 4)."""

import numpy as np
import pytest

from kvreg_numba import dispatch, quant

from naive import attend_oracle, dequant_k, dequant_v
from kvreg.conformance.tolerances import tolerance

MODES = ["f32", "q8", "q8k", "q8v"]
RTOL, ATOL, _ = tolerance("decode_small")


def make_layer(mode, nkv=2, hd=40, cap=70, lens=(53, 29), seed=0):
    """Storage arrays of one layer (kwargs for the kernels) and its f64 rows."""
    rng = np.random.default_rng(seed)
    kf = rng.standard_normal((nkv, cap, hd)).astype(np.float32)
    vf = rng.standard_normal((nkv, cap, hd)).astype(np.float32)
    st = {}
    kcol = (0.5 + rng.random((nkv, hd))).astype(np.float32)
    vcol = (0.5 + rng.random((nkv, hd))).astype(np.float32)
    col_set = np.array([True] + [False] * (nkv - 1))
    if mode in ("q8", "q8k"):
        kq, ks = quant.quantize_rows(kf.reshape(-1, hd), np.empty((0, hd), np.float32), 32)
        st.update(kq=kq.reshape(nkv, cap, hd), ks=ks.reshape(nkv, cap, -1), kcol=kcol, kcol_set=col_set)
        k64 = np.stack([dequant_k(st["kq"][g], st["ks"][g], kcol[g] if col_set[g] else np.ones(hd)) for g in range(nkv)])
    else:
        st["k"] = kf
        k64 = kf.astype(np.float64)
    if mode in ("q8", "q8v"):
        vq, vs = quant.quantize_rows(vf.reshape(-1, hd), np.empty((0, hd), np.float32), hd)
        st.update(vq=vq.reshape(nkv, cap, hd), vs=vs.reshape(nkv, cap), vcol=vcol, vcol_set=col_set)
        v64 = np.stack([dequant_v(st["vq"][g], st["vs"][g], vcol[g] if col_set[g] else np.ones(hd)) for g in range(nkv)])
    else:
        st["v"] = vf
        v64 = vf.astype(np.float64)
    return st, np.array(lens, np.int64), k64, v64


def qs(nh, hd, seed=1):
    return np.random.default_rng(seed).standard_normal((nh, hd)).astype(np.float32)


def assert_bits(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    bad = np.flatnonzero(a.view(np.uint32) != b.view(np.uint32)) if a.dtype == np.float32 else np.flatnonzero(a != b)
    assert bad.size == 0, f"{bad.size} elements differ; first at {bad[0]}: {a.flat[bad[0]]!r} vs {b.flat[bad[0]]!r}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("window,softcap,sink", [(0, 0.0, False), (9, 0.0, True), (0, 3.0, True), (100, 2.0, False)])
def test_layer_matches_f64_oracle(small_blocks, mode, window, softcap, sink):
    st, lens, k64, v64 = make_layer(mode)
    hpk, hd = 3, 40
    q = qs(2 * hpk, hd)
    sinks = np.linspace(-1, 2, 2 * hpk).astype(np.float32) if sink else None
    imp = np.zeros(60, np.float32)
    out = dispatch.attend_layer(q, lens, scale=0.2, window=window, softcap=softcap, sinks=sinks, imp=imp, **st)
    imp_ref = np.zeros(60)
    for g in range(2):
        n = int(lens[g])
        first = max(0, n - window) if window else 0
        o, p = attend_oracle(q[g * hpk:(g + 1) * hpk], k64[g], v64[g], scale=0.2, first=first, n=n,
                             softcap=softcap, sinks=None if sinks is None else sinks[g * hpk:(g + 1) * hpk])
        np.testing.assert_allclose(out[g * hpk:(g + 1) * hpk], o, rtol=RTOL, atol=ATOL)
        imp_ref[first:n] += p.sum(axis=0)
    np.testing.assert_allclose(imp, imp_ref, rtol=RTOL, atol=ATOL)


@pytest.mark.parametrize("mode", MODES)
def test_grouped_equals_each_head_alone(small_blocks, mode):
    st, lens, _, _ = make_layer(mode)
    q = qs(5, 40)
    sinks = np.linspace(-1, 1, 5).astype(np.float32)
    imp = np.zeros(53, np.float32)
    out = dispatch.attend_group(q, 0, lens, first=7, scale=0.3, softcap=4.0, sinks=sinks, imp=imp, **st)
    imp_h = np.zeros(53, np.float32)
    for h in range(5):
        o = dispatch.attend_group(q[h:h + 1], 0, lens, first=7, scale=0.3, softcap=4.0, sinks=sinks[h:h + 1], imp=imp_h, **st)
        assert_bits(out[h:h + 1], o)
    assert_bits(imp, imp_h)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("hd", [64, 128, 256])
def test_the_unrolled_head_dims_answer_the_oracle_and_each_head_alone(small_blocks, mode, hd):
    # four heads at hd 64 / 128 / 256 take the unrolled score passes (hd 256
    # for four heads only; q8 K rows scored as stored there too) and, at 256,
    # the windowed value pass; one head alone takes the per-row loop (q8 at
    # 256: its rows dequantized first): the same bits, and the oracle's answer
    st, lens, k64, v64 = make_layer(mode, hd=hd)
    q = qs(4, hd)
    imp = np.zeros(53, np.float32)
    out = dispatch.attend_group(q, 0, lens, scale=0.1, imp=imp, **st)
    o64, p64 = attend_oracle(q, k64[0], v64[0], scale=0.1, first=0, n=53, softcap=0.0, sinks=None)
    np.testing.assert_allclose(out, o64, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(imp, p64.sum(axis=0), rtol=RTOL, atol=ATOL)
    for h in range(4):
        assert_bits(out[h:h + 1], dispatch.attend_group(q[h:h + 1], 0, lens, scale=0.1, **st))


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("window", [0, 6, 30])
def test_layer_equals_group_calls(small_blocks, mode, window):
    st, lens, _, _ = make_layer(mode, nkv=3, lens=(53, 0, 29))  # head 1 is dead
    hpk = 2
    q = qs(3 * hpk, 40)
    sinks = np.arange(3 * hpk, dtype=np.float32) * 0.1
    imp = np.zeros(64, np.float32)
    out = dispatch.attend_layer(q, lens, scale=0.2, window=window, sinks=sinks, imp=imp, **st)
    imp_g = np.zeros(64, np.float32)
    for g in range(3):
        n = int(lens[g])
        first = max(0, n - window) if window else 0
        hs = slice(g * hpk, (g + 1) * hpk)
        o = dispatch.attend_group(q[hs], g, lens, first=first, scale=0.2, sinks=sinks[hs], imp=imp_g, **st)
        assert_bits(out[hs], o)
    assert_bits(imp, imp_g)
    assert not out[2:4].any()


def _shifted(st, lens, d):
    """The same layer with its first ``d`` rows dropped (a trimmed tail), in
    blocks of a different capacity."""
    out = {}
    for name, a in st.items():
        if name in ("kcol", "kcol_set", "vcol", "vcol_set"):
            out[name] = a
        else:
            b = np.zeros((a.shape[0], a.shape[1] + 11) + a.shape[2:], a.dtype)
            b[:, : a.shape[1] - d] = a[:, d:]
            out[name] = b
    return out, np.maximum(lens - d, 0)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("first", [0, 1, 13, 28])
def test_windowed_equals_trimmed_and_ignores_rows_before_first(small_blocks, mode, first):
    st, lens, _, _ = make_layer(mode, nkv=1, lens=(29,))
    q = qs(3, 40)
    imp = np.zeros(29, np.float32)
    out = dispatch.attend_group(q, 0, lens, first=first, scale=0.25, imp=imp, **st)
    # Rows before `first` have probability exactly 0: garbage there changes nothing.
    junk = {n: a.copy() for n, a in st.items()}
    for name in ("k", "kq", "v", "vq"):
        if name in junk:
            junk[name][:, :first] = 99 if name.endswith("q") else 1e3
    imp2 = np.zeros(29, np.float32)
    assert_bits(out, dispatch.attend_group(q, 0, lens, first=first, scale=0.25, imp=imp2, **junk))
    assert_bits(imp, imp2)
    assert not imp[:first].any()
    # The trimmed layer (rows [first, n) at position 0) answers the same bits.
    tst, tlens = _shifted(st, lens, first)
    imp3 = np.zeros(29 - first, np.float32)
    assert_bits(out, dispatch.attend_group(q, 0, tlens, first=0, scale=0.25, imp=imp3, **tst))
    assert_bits(imp[first:], imp3)


@pytest.mark.parametrize("mode", MODES)
def test_upto_equals_the_layer_that_held_upto_rows(small_blocks, mode):
    st, lens, _, _ = make_layer(mode, nkv=1, lens=(53,))
    q = qs(2, 40)
    for upto in (1, 4, 5, 17, 53):
        for first in (0, 3):
            imp = np.zeros(53, np.float32)
            out = dispatch.attend_group(q, 0, lens, first=first, upto=upto, scale=0.3, imp=imp, **st)
            short = {n: (a.copy() if n.endswith("col") or n.endswith("set") else a[:, :upto].copy()) for n, a in st.items()}
            imp2 = np.zeros(53, np.float32)
            assert_bits(out, dispatch.attend_group(q, 0, np.array([upto]), first=first, scale=0.3, imp=imp2, **short))
            assert_bits(imp, imp2)


def test_result_does_not_depend_on_thread_count(small_blocks, monkeypatch):
    import kvreg
    from kvreg import threads

    monkeypatch.setattr(threads, "SMALL_WORK_BYTES", 0)  # tiny inputs, parallel anyway
    st, lens, _, _ = make_layer("q8", nkv=2, lens=(70, 61), cap=70)
    q = qs(8, 40)
    try:
        kvreg.set_num_threads(2)
        imp = np.zeros(70, np.float32)
        out = dispatch.attend_layer(q, lens, scale=0.2, imp=imp, **st)
        kvreg.set_num_threads(1)
        imp1 = np.zeros(70, np.float32)
        assert_bits(out, dispatch.attend_layer(q, lens, scale=0.2, imp=imp1, **st))
        assert_bits(imp, imp1)
    finally:
        kvreg.set_num_threads(None)


def test_empty_heads_give_zeros_and_leave_imp_alone():
    st, _, _, _ = make_layer("f32")
    imp = np.ones(10, np.float32)
    out = dispatch.attend_layer(qs(4, 40), np.array([0, 0]), scale=0.2, imp=imp, **st)
    assert not out.any() and (imp == 1).all()


@pytest.mark.parametrize("block", [1, 6, 256])
@pytest.mark.parametrize("mode", ["f32", "q8"])
def test_invariants_hold_for_any_block_size(monkeypatch, block, mode):
    # block 6: every block mixes the 4-row and the 1-row score/value forms.
    from kvreg_numba import config

    monkeypatch.setattr(config, "DECODE_BLOCK", block)
    st, lens, _, _ = make_layer(mode, nkv=1, lens=(61,), cap=70)
    q = qs(4, 40)
    imp = np.zeros(61, np.float32)
    out = dispatch.attend_group(q, 0, lens, first=9, scale=0.3, imp=imp, **st)
    imp_h = np.zeros(61, np.float32)
    for h in range(4):
        assert_bits(out[h:h + 1], dispatch.attend_group(q[h:h + 1], 0, lens, first=9, scale=0.3, imp=imp_h, **st))
    assert_bits(imp, imp_h)
    tst, tlens = _shifted(st, lens, 9)
    assert_bits(out, dispatch.attend_group(q, 0, tlens, first=0, scale=0.3, **tst))
