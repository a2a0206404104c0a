"""Decode attention kernels beyond what the conformance suite checks
through the backend (which runs its invariants and oracle cases at the
small tunables too): the unrolled head sizes, any thread count, any block
size, empty heads."""

import numpy as np
import pytest

from kvreg_conformance.oracle import attend_rows_oracle, dequantize64
from kvreg_conformance.tolerances import tolerance
from kvreg_numba import dispatch, quant

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
        k64 = np.stack([dequantize64(st["kq"][g], st["ks"][g], 32, kcol[g] if col_set[g] else None)
                        for g in range(nkv)])
    else:
        st["k"] = kf
        k64 = kf.astype(np.float64)
    if mode in ("q8", "q8v"):
        vq, vs = quant.quantize_rows(vf.reshape(-1, hd), np.empty((0, hd), np.float32), hd)
        st.update(vq=vq.reshape(nkv, cap, hd), vs=vs.reshape(nkv, cap), vcol=vcol, vcol_set=col_set)
        v64 = np.stack([dequantize64(st["vq"][g], st["vs"][g], hd, vcol[g] if col_set[g] else None)
                        for g in range(nkv)])
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
    o64, p64 = attend_rows_oracle(q, k64[0], v64[0], scale=0.1, first=0, n=53, softcap=0.0, sinks=None)
    np.testing.assert_allclose(out, o64, rtol=RTOL, atol=ATOL)
    np.testing.assert_allclose(imp, p64.sum(axis=0), rtol=RTOL, atol=ATOL)
    for h in range(4):
        assert_bits(out[h:h + 1], dispatch.attend_group(q[h:h + 1], 0, lens, scale=0.1, **st))


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
