"""NumbaBackend through the core's objects (skipped until the core is there)."""

import numpy as np
import pytest

kvreg = pytest.importorskip("kvreg")
backend_mod = pytest.importorskip("kvreg_numba.backend")
reference = pytest.importorskip("kvreg.reference")
layer_mod = pytest.importorskip("kvreg.layer")


def _layers(mode, rows=80, nkv=2, hd=64, seed=0):
    rng = np.random.default_rng(seed)
    nb = backend_mod.NumbaBackend()
    a = layer_mod.LayerKvCache(nkv, hd, mode=mode, backend=nb)
    r = layer_mod.LayerKvCache(nkv, hd, mode=mode, backend=reference.ReferenceBackend())
    for _ in range(rows):
        k = rng.standard_normal((nkv, hd)).astype(np.float32)
        v = rng.standard_normal((nkv, hd)).astype(np.float32)
        a.append(k, v)
        r.append(k, v)
    return a, r


def test_native_kernels_are_listed():
    native = backend_mod.NumbaBackend.native_kernels()
    for k in ("attend_group", "attend_layer", "attend_chunk", "quantize_rows", "gather_rows"):
        assert k in native


@pytest.mark.parametrize("mode", ["f32", "q8", "q8k", "q8v"])
def test_storage_and_attend_layer_agree_with_the_reference(mode):
    a, r = _layers(mode)
    # quantize_rows is exact class: the stored rows are the same bits.
    for name in a._st.block_names():
        np.testing.assert_array_equal(getattr(a._st, name)[:, :80], getattr(r._st, name)[:, :80])
    q = np.random.default_rng(9).standard_normal((8, 64)).astype(np.float32)
    oa = a.attend_layer(q, window=50)
    orf = r.attend_layer(q, window=50)
    np.testing.assert_allclose(oa, orf, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", ["f32", "q8"])
def test_attend_group_upto_and_importance_agree_with_the_reference(mode):
    a, r = _layers(mode, rows=70)
    q = np.random.default_rng(3).standard_normal((4, 64)).astype(np.float32)
    ia = np.zeros(70, np.float32)
    ir = np.zeros(70, np.float32)
    oa = a.attend_group(q, 1, scale=0.125, first=5, softcap=8.0, upto=60, imp_acc=ia)
    orf = r.attend_group(q, 1, scale=0.125, first=5, softcap=8.0, upto=60, imp_acc=ir)
    np.testing.assert_allclose(oa, orf, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(ia, ir, rtol=1e-4, atol=1e-6)


def test_attend_chunk_agrees_with_the_reference():
    rng = np.random.default_rng(4)
    nkv, hpk, hd, s0, b = 2, 4, 64, 40, 24
    a, r = _layers("f32", rows=s0 + b, nkv=nkv, hd=hd)
    q = rng.standard_normal((b, nkv * hpk, hd)).astype(np.float32)
    for window in (None, 16):
        oa = a.attend_chunk(q, b, s0, hpk, window=window)
        orf = r.attend_chunk(q, b, s0, hpk, window=window)
        np.testing.assert_allclose(oa, orf, rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(a._st.imp, r._st.imp, rtol=1e-4, atol=1e-5)
