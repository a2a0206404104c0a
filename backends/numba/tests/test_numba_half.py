"""f16 / bf16 storage on the numba backend: the kernels read the 2-byte rows
as stored (no float32 copy of the block, not even per call) and widen them
in registers, exactly, so a half layer answers the bits the F32 kernel
answers on the widened rows: every behaviour of the F32 path (windows,
soft-cap, sinks, importance, ragged and dead heads, NaN/inf) carries over,
and so does the thread-count independence."""

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from numba import njit

import kvreg
from kvreg import threads
from kvreg.layer import LayerKvCache
from kvreg.quant import from_bf16, from_half, to_bf16
from kvreg_numba import dispatch, intrinsics
from kvreg_numba.backend import NumbaBackend

HALF = ["f16", "bf16"]
ALL_BITS = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)


def _widen_loop():
    # A fresh dispatcher per call: the decode is chosen at codegen time.
    @njit
    def widen_all(a, out):
        for i in range(a.shape[0]):
            out[i] = intrinsics.widen(a[i])

    @njit
    def dots(q, rows, out):
        for i in range(rows.shape[0]):
            out[i] = intrinsics.lane_dot(q, rows[i])

    return widen_all, dots


@pytest.mark.parametrize("fpext", [True, False], ids=["fpext", "integer-decode"])
def test_widening_is_exact_for_every_bit_pattern(monkeypatch, fpext):
    if fpext and not intrinsics.target_has("f16c"):
        pytest.skip("no F16C on this CPU: only the integer decode is used")
    monkeypatch.setattr(intrinsics, "F16_FPEXT", fpext)
    widen_all, dots = _widen_loop()
    out = np.empty(ALL_BITS.size, np.float32)
    widen_all(ALL_BITS.view(np.int16), out)
    ref = ALL_BITS.view(np.float16).astype(np.float32)
    nan = np.isnan(ref)
    assert np.isnan(out[nan]).all()
    assert out[~nan].view(np.uint32).tobytes() == ref[~nan].view(np.uint32).tobytes()
    widen_all(ALL_BITS, out)
    assert out.view(np.uint32).tobytes() == from_bf16(ALL_BITS).view(np.uint32).tobytes()
    # the vector loads of the lane dots (16 lanes and the scalar tail: hd 100)
    rng = np.random.default_rng(0)
    q = rng.standard_normal(100).astype(np.float32)
    rows = ALL_BITS[: 655 * 100].reshape(655, 100)
    a, b = np.empty(655, np.float32), np.empty(655, np.float32)
    dots(q, rows.view(np.int16), a)
    dots(q, np.ascontiguousarray(rows.view(np.float16).astype(np.float32)), b)
    assert np.array_equal(a, b, equal_nan=True)
    dots(q, rows, a)
    dots(q, np.ascontiguousarray(from_bf16(rows)), b)
    assert np.array_equal(a, b, equal_nan=True)


def layers(mode, nkv=4, hd=40, n=61, seed=0, specials=True):
    """A half layer and an F32 layer holding its rows widened; ragged heads
    (one dead for the last row) and, with ``specials``, an inf key, a NaN
    value and f16 subnormals."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((n, nkv, hd)).astype(np.float32)
    v = rng.standard_normal((n, nkv, hd)).astype(np.float32)
    if specials:
        k[7, 1, 3] = np.inf
        v[11, 2, 5] = np.nan
        v[3, 0] = 3e-6  # subnormal in binary16
    half = LayerKvCache(nkv, hd, mode, backend="numba")
    half.extend(k, v)
    alive = np.ones(nkv, bool)
    alive[nkv - 1] = False
    half.append(k[0], v[0], alive=alive)
    f32 = LayerKvCache(nkv, hd, "f32", backend="numba")
    st = half.storage
    f32.extend(np.ascontiguousarray(from_half(st.k[:, :n]).transpose(1, 0, 2)),
               np.ascontiguousarray(from_half(st.v[:, :n]).transpose(1, 0, 2)))
    f32.append(from_half(st.k[:, n]), from_half(st.v[:, n]), alive=alive)
    return half, f32


CALLS = [dict(), dict(window=9), dict(softcap=5.0), dict(sinks=True), dict(window=20, softcap=3.0, sinks=True)]


@pytest.mark.parametrize("mode", HALF)
@pytest.mark.parametrize("hd", [40, 128, 7])
def test_a_half_layer_answers_the_f32_kernels_bits_on_its_widened_rows(small_blocks, mode, hd):
    half, f32 = layers(mode, hd=hd)
    assert half.storage.k.dtype == half.mode.float_dtype and half.storage.k.itemsize == 2
    rng = np.random.default_rng(1)
    nh = 4 * 3
    q = rng.standard_normal((nh, hd)).astype(np.float32)
    for call in CALLS:
        kw = dict(call)
        if kw.pop("sinks", False):
            kw["sinks"] = rng.standard_normal(nh).astype(np.float32)
        i1 = np.zeros(half.storage.cap, np.float32)
        i2 = np.zeros(half.storage.cap, np.float32)
        a = half.backend.attend_layer(q, half.storage.view(), scale=0.3, imp=i1, **kw)
        b = f32.backend.attend_layer(q, f32.storage.view(), scale=0.3, imp=i2, **kw)
        assert a.tobytes() == b.tobytes(), call
        assert i1.tobytes() == i2.tobytes(), call
    for g in range(4):
        a = half.backend.attend_group(q[:3], half.storage.view(), g, scale=0.3, first=5, upto=40, softcap=2.0)
        b = f32.backend.attend_group(q[:3], f32.storage.view(), g, scale=0.3, first=5, upto=40, softcap=2.0)
        assert a.tobytes() == b.tobytes()


def _spy(monkeypatch):
    seen = []
    real = dispatch._run

    def run(nbytes, nfloats, *args):
        seen.append((nbytes, args))
        return real(nbytes, nfloats, *args)

    monkeypatch.setattr(dispatch, "_run", run)
    return seen


@pytest.mark.parametrize("mode", HALF)
def test_the_kernel_receives_the_stored_2_byte_block_itself(monkeypatch, mode):
    half, _ = layers(mode, specials=False)
    st = half.storage
    seen = _spy(monkeypatch)
    q = np.ones((8, 40), np.float32)
    half.backend.attend_layer(q, st.view(), scale=0.1)
    half.backend.attend_group(q[:2], st.view(), 1, scale=0.1)
    want = {"f16": np.int16, "bf16": np.uint16}[mode]
    assert len(seen) == 2
    for _nbytes, args in seen:
        kf, vf = args[5], args[10]  # attend_groups(q, hpk, gids, firsts, ns, kf, kq, ks, kcol, kcol_set, vf, ...)
        assert kf.dtype == want and vf.dtype == want
        # the storage's own memory: no float32 copy, no 2-byte copy either
        assert kf.ctypes.data == st.k.ctypes.data and vf.ctypes.data == st.v.ctypes.data
        assert kf.nbytes == st.k.nbytes
    # the thread budget counts 2 bytes an element
    rows = int(st.lens.sum())
    assert seen[0][0] == rows * 40 * 2 * 2


@pytest.mark.parametrize("mode", HALF)
def test_the_same_bits_on_every_thread_count(monkeypatch, mode):
    monkeypatch.setattr(threads, "SMALL_WORK_BYTES", 0)
    rng = np.random.default_rng(3)
    nkv, hpk, hd, n = 2, 4, 64, 300
    x = rng.standard_normal((2, nkv, n, hd)).astype(np.float32)
    k, v = (x.astype(np.float16) if mode == "f16" else to_bf16(x))
    q = rng.standard_normal((nkv * hpk, hd)).astype(np.float32)
    sinks = rng.standard_normal(nkv * hpk).astype(np.float32)
    lens = np.array([n, n - 77])
    outs = []
    try:
        for t in (1, 2, 3):
            kvreg.set_num_threads(t)
            imp = np.zeros(n, np.float32)
            o1 = dispatch.attend_layer(q, lens, k=k, v=v, scale=0.1, imp=imp, block=32)
            o2 = dispatch.attend_layer(q, lens, k=k, v=v, scale=0.1, window=100, softcap=4.0, sinks=sinks, block=32)
            outs.append(o1.tobytes() + imp.tobytes() + o2.tobytes())
    finally:
        kvreg.set_num_threads(None)
    assert outs[1] == outs[0] and outs[2] == outs[0]


def test_gather_rows_moves_float16_bits():
    be = NumbaBackend()
    rows = ALL_BITS[:4096].view(np.float16).reshape(64, 64)
    idx = np.array([5, 0, 63, 7], np.int64)
    out = be.gather_rows(rows, idx)
    assert out.dtype == np.float16 and out.view(np.uint16).tobytes() == rows[idx].view(np.uint16).tobytes()


@pytest.mark.parametrize("mode", HALF)
def test_eviction_and_prefill_on_a_half_layer(mode):
    """A prefill chunk (the core's widened F32 view) and an eviction (gather
    of the 2-byte rows) on the numba backend, against the reference."""
    rng = np.random.default_rng(5)
    nkv, hd, n = 2, 32, 50
    k = rng.standard_normal((n, nkv, hd)).astype(np.float32)
    v = rng.standard_normal((n, nkv, hd)).astype(np.float32)
    out = {}
    for be in ("numba", "reference"):
        lay = LayerKvCache(nkv, hd, mode, backend=be)
        lay.extend(k, v)
        q = np.random.default_rng(9).standard_normal((10, nkv * 2, hd)).astype(np.float32)
        c = lay.attend_chunk(q, 10, 40, 2)  # rows [40, 50) are the chunk's own
        lay.evict_born(6, 2, 4)  # rows 0, 1 and 46..49: a gather of the 2-byte rows
        assert lay.storage.k.dtype == lay.mode.float_dtype
        out[be] = (c, lay.storage.k[:, :6].copy(), lay.storage.v[:, :6].copy())
    assert np.allclose(out["numba"][0], out["reference"][0], rtol=1e-5, atol=1e-6)
    assert out["numba"][1].tobytes() == out["reference"][1].tobytes()
    assert out["numba"][2].tobytes() == out["reference"][2].tobytes()


_PROBE = """
import numpy as np, sys
sys.path[:0] = {paths!r}
from kvreg_numba import dispatch, intrinsics
assert intrinsics.F16_FPEXT is False and intrinsics.JIT_CACHE is False
rng = np.random.default_rng(2)
x = rng.standard_normal((2, 2, 90, 24)).astype(np.float32)
x[0, 0, 4, 2] = 3e-6; x[1, 1, 7] = 6e-8; x[0, 1, 9, 1] = np.inf; x[1, 0, 3, 3] = np.nan
k, v = x.astype(np.float16)
q = rng.standard_normal((6, 24)).astype(np.float32)
lens = np.array([90, 61])
imp1, imp2 = np.zeros(90, np.float32), np.zeros(90, np.float32)
a = dispatch.attend_layer(q, lens, k=k, v=v, scale=0.2, imp=imp1, block=16, softcap=3.0)
b = dispatch.attend_layer(q, lens, k=k.astype(np.float32), v=v.astype(np.float32), scale=0.2, imp=imp2, block=16,
                   softcap=3.0)
assert a.tobytes() == b.tobytes() and imp1.tobytes() == imp2.tobytes()
print("ok")
"""


@pytest.mark.cold_jit
def test_the_integer_binary16_decode_in_the_whole_kernel(tmp_path):
    """``KVREG_NUMBA_F16_FPEXT=0`` (and a CPU without F16C) decode binary16 in
    integer arithmetic: the same bits through the whole decode kernel."""
    here = Path(__file__).resolve()
    paths = [str(here.parents[1]), str(here.parents[3])]
    env = dict(os.environ, KVREG_NUMBA_F16_FPEXT="0", NUMBA_CACHE_DIR=str(tmp_path), NUMBA_NUM_THREADS="2")
    proc = subprocess.run([sys.executable, "-c", _PROBE.format(paths=paths)], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-3000:]
