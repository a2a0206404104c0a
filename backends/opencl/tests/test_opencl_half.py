"""f16 / bf16 storage on the OpenCL backend: the mirror holds the 2-byte
rows as stored (half the bytes of F32 on the device and over the bus) and
the attend kernels widen them as they read (vload_half; bf16 bits shifted
into a float), exactly, so a half layer answers the bits the F32 kernel
answers on the widened rows: windows, soft-cap, sinks, importance, ragged
and dead heads, NaN/inf all carry over."""

from __future__ import annotations

import numpy as np
import pytest

from kvreg.layer import LayerKvCache
from kvreg.quant import from_half
from kvreg_opencl import config, kernels

HALF = ["f16", "bf16"]
DTYPE = {"f16": np.float16, "bf16": np.uint16}


def layers(mode, nkv=3, hd=40, n=45, seed=0, specials=True):
    """A half layer and an F32 layer holding its rows widened; ragged heads
    (the last one dead for the last row), and with ``specials`` an inf key, a
    NaN value and a binary16 subnormal."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((n, nkv, hd)).astype(np.float32)
    v = rng.standard_normal((n, nkv, hd)).astype(np.float32)
    if specials:
        k[7, 1, 3] = np.inf
        v[11, 2, hd - 1] = np.nan
        v[3, 0] = 3e-6
    half = LayerKvCache(nkv, hd, mode, backend="opencl")
    half.extend(k, v)
    alive = np.ones(nkv, bool)
    alive[-1] = False
    half.append(k[0], v[0], alive=alive)
    st = half.storage
    f32 = LayerKvCache(nkv, hd, "f32", backend="opencl")
    f32.extend(np.ascontiguousarray(from_half(st.k[:, :n]).transpose(1, 0, 2)),
               np.ascontiguousarray(from_half(st.v[:, :n]).transpose(1, 0, 2)))
    f32.append(from_half(st.k[:, n]), from_half(st.v[:, n]), alive=alive)
    return half, f32


@pytest.mark.parametrize("mode", HALF)
@pytest.mark.parametrize("hd,local", [(40, 4), (40, 64), (128, 4), (36, 4), (10, 4), (10, 32)],
                         ids=["hd40", "hd40-lanes", "hd128", "hd36", "hd10", "hd10-lanes"])
def test_a_half_layer_answers_the_f32_kernels_bits_on_its_widened_rows(dev, small_blocks, monkeypatch,
                                                                       mode, hd, local):
    monkeypatch.setattr(config, "LOCAL_SIZE", local)  # 64 / 32: the value pass's row lanes (R > 1)
    half, f32 = layers(mode, hd=hd)
    rng = np.random.default_rng(1)
    nh = 3 * 3
    q = rng.standard_normal((nh, hd)).astype(np.float32)
    for kw in (dict(), dict(window=9), dict(softcap=5.0), dict(sinks=rng.standard_normal(nh).astype(np.float32)),
               dict(window=20, softcap=3.0, sinks=rng.standard_normal(nh).astype(np.float32))):
        i1 = np.zeros(half.storage.cap, np.float32)
        i2 = np.zeros(half.storage.cap, np.float32)
        a = half.backend.attend_layer(q, half.storage.view(), scale=0.3, imp=i1, **kw)
        b = f32.backend.attend_layer(q, f32.storage.view(), scale=0.3, imp=i2, **kw)
        assert a.tobytes() == b.tobytes(), list(kw)
        assert i1.tobytes() == i2.tobytes(), list(kw)
    for g in range(3):
        a = half.backend.attend_group(q[:3], half.storage.view(), g, scale=0.3, first=5, upto=40, softcap=2.0)
        b = f32.backend.attend_group(q[:3], f32.storage.view(), g, scale=0.3, first=5, upto=40, softcap=2.0)
        assert a.tobytes() == b.tobytes()


@pytest.mark.parametrize("mode", HALF)
def test_the_mirror_holds_2_byte_elements_and_decode_uploads_2_bytes(dev, mode):
    nkv, hd = 2, 64
    half, _ = layers(mode, nkv=nkv, hd=hd, specials=False)
    be, st = half.backend, half.storage
    m = be.mirror(st.view())
    assert m.kv_dtype == np.dtype(DTYPE[mode])
    for name in ("k", "v"):
        assert m.row_shapes[name] == ((hd,), np.dtype(DTYPE[mode]))
        assert m.buffers[name].size == nkv * m.cap * hd * 2
    assert kernels.partial_variant((False, False), m.kv_dtype) == {"f16": "partial_kh_vh",
                                                                   "bf16": "partial_kb_vb"}[mode]
    before = m.bytes_uploaded
    rng = np.random.default_rng(2)
    q = rng.standard_normal((nkv * 2, hd)).astype(np.float32)
    for _ in range(5):
        half.append(rng.standard_normal((nkv, hd)).astype(np.float32),
                    rng.standard_normal((nkv, hd)).astype(np.float32))
        be.attend_layer(q, st.view(), scale=0.1)
    assert be.mirror(st.view()) is m
    assert m.bytes_uploaded - before == 5 * nkv * 2 * hd * 2  # K and V rows, 2 bytes an element


def test_an_f32_layer_keeps_the_f32_kernel():
    assert kernels.partial_variant((False, False), np.float32) == "partial_kf_vf"
    assert kernels.partial_variant((True, False), np.float32) == "partial_kq_vf"
    assert kernels.partial_variant((True, True), None) == "partial_kq_vq"


@pytest.mark.parametrize("mode", HALF)
def test_a_prefill_chunk_on_a_half_layer_matches_the_reference(dev, mode):
    rng = np.random.default_rng(5)
    nkv, hd, n = 2, 32, 50
    k = rng.standard_normal((n, nkv, hd)).astype(np.float32)
    v = rng.standard_normal((n, nkv, hd)).astype(np.float32)
    q = rng.standard_normal((10, nkv * 2, hd)).astype(np.float32)
    out = {}
    for be in ("opencl", "reference"):
        lay = LayerKvCache(nkv, hd, mode, backend=be)
        lay.extend(k, v)
        out[be] = lay.attend_chunk(q, 10, 40, 2, window=16)
    np.testing.assert_allclose(out["opencl"], out["reference"], rtol=1e-5, atol=1e-6)
