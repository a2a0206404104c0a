"""The fused decode append of a q8 layer (``NumbaBackend.store_window_row``):
the window's oldest row quantized, the window moved up, the new row stored
as float16, counts grown, in one kernel call instead of a dozen NumPy calls
(inside a model each costs ~10 µs). It must store exactly what the general
path (``Int8Storage.append_window_row``) stores, refuse what it refuses
without writing, and leave a fork's rows alone. These tests would catch a
float16 rounding off numpy's, a slot or scale written to the wrong row, a
half-applied refusal, or a fused path that silently stopped being taken."""

import numpy as np
import pytest

from kvreg import ShapeError
from kvreg.layer import LayerKvCache
from kvreg.quant import to_bf16
from kvreg_numba.store import bf16_bits, half_bits

MODES = ["q8", "q8k", "q8v"]


def _stored(lay):
    st = lay.storage
    names = ("k", "v", "kq", "ks", "vq", "vs", "thk", "thv", "xk", "xv", "lens", "b8")
    out = {n: getattr(st, n).copy() for n in names if getattr(st, n, None) is not None}
    out["imp"] = st._imp[:st.seq_len].copy()
    return out


def _assert_same(a, b):
    assert a.keys() == b.keys()
    for n in a:
        assert a[n].shape == b[n].shape, n
        assert np.array_equal(a[n].view(np.uint8), b[n].view(np.uint8)), n


def _general(lay):
    """Send this layer's decode appends down the general path."""
    lay.backend = type(lay.backend)()
    lay.backend.store_window_row = lambda *a, **kw: False
    return lay


def _rows(n, nkv, hd, seed):
    rng = np.random.default_rng(seed)
    mag = rng.choice([1e-6, 1e-3, 1.0, 300.0, 7e4], (n, 2, 1, 1))  # f16 subnormals and overflow
    return (rng.standard_normal((n, 2, nkv, hd)) * mag).astype(np.float32)


def test_half_bits_rounds_as_numpy():
    # every float16 value's float32, its neighbours and the exact ties
    # between two halves, then random bit patterns
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(np.float16)
    base = h[np.isfinite(h)].astype(np.float32).view(np.uint32).astype(np.int64)
    cand = np.concatenate([base + d for d in (-1, 0, 1, 0x0FFF, 0x1000, 0x1001, -0x1000)])
    rnd = np.random.default_rng(0).integers(0, 1 << 32, 1 << 20, dtype=np.int64)
    bits = np.concatenate([cand, rnd, [0x477FEFFF, 0x477FF000, 0x33000000, 0x33000001, 0x387FFFFF,
                                       0x38800000, 0x7F800000, 0xFF800000]]) & 0xFFFFFFFF
    x = bits.astype(np.uint32).view(np.float32)
    x = x[~np.isnan(x)]
    got = np.empty(x.shape, np.int16)
    half_bits(x, got)
    with np.errstate(over="ignore"):
        want = x.astype(np.float16).view(np.int16)
    np.testing.assert_array_equal(got, want)
    nan = np.array([np.nan, -np.nan], np.float32)
    out = np.empty(2, np.int16)
    half_bits(nan, out)
    assert np.isnan(out.view(np.float16)).all()


def test_bf16_bits_rounds_as_the_core():
    # kvreg.quant.to_bf16 (the bf16 storage's rounding, which the fused
    # decode store reproduces): ties both ways, the largest finite values,
    # infinities, subnormals, every NaN sign, then random bit patterns
    ends = np.arange(1 << 16, dtype=np.int64) << 16
    cand = np.concatenate([ends + d for d in (-1, 0, 1, 0x7FFF, 0x8000, 0x8001, 0xFFFF)])
    rnd = np.random.default_rng(1).integers(0, 1 << 32, 1 << 20, dtype=np.int64)
    x = (np.concatenate([cand, rnd]) & 0xFFFFFFFF).astype(np.uint32).view(np.float32)
    got = np.empty(x.shape, np.uint16)
    bf16_bits(x, got)
    np.testing.assert_array_equal(got, to_bf16(x))


# 7e4 rows overflow the float16 window to inf on both paths (numpy warns)
@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("nkv,hd", [(1, 256), (3, 64), (2, 128), (2, 48)])
def test_fused_append_stores_the_general_paths_bits(mode, nkv, hd):
    x = _rows(160, nkv, hd, seed=hd + nkv)
    fused, general = LayerKvCache(nkv, hd, mode, "numba"), _general(LayerKvCache(nkv, hd, mode, "numba"))
    taken = []
    store = fused.backend.store_window_row
    fused.backend.store_window_row = lambda *a, **kw: taken.append(store(*a, **kw)) or taken[-1]
    for lay in (fused, general):
        lay.extend(x[:40, 0], x[:40, 1])
        for i in range(40, 160):   # past a capacity growth too
            lay.append(x[i, 0], x[i, 1])
    _assert_same(_stored(fused), _stored(general))
    assert sum(taken) >= 100   # the fused kernel stored them (all but the growth's rows)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
@pytest.mark.parametrize("mode", MODES)
def test_a_forks_rows_stay_its_own(mode):
    x = _rows(120, 2, 64, seed=3)
    parent = LayerKvCache(2, 64, mode, "numba")
    parent.extend(x[:60, 0], x[:60, 1])
    parent.append(x[60, 0], x[60, 1])
    before = _stored(parent)
    child = parent.fork()
    for i in range(61, 90):
        child.append(x[i, 0], x[i, 1])
    _assert_same(_stored(parent), before)
    twin = _general(LayerKvCache(2, 64, mode, "numba"))
    twin.extend(x[:60, 0], x[:60, 1])
    for i in range(60, 90):
        twin.append(x[i, 0], x[i, 1])
    _assert_same(_stored(child), _stored(twin))


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("bad", [np.nan, np.inf, 2e18])
@pytest.mark.parametrize("side", ["k", "v"])
def test_a_refused_row_writes_nothing(mode, bad, side):
    x = _rows(50, 2, 64, seed=4)
    lay = LayerKvCache(2, 64, mode, "numba")
    lay.extend(x[:40, 0], x[:40, 1])
    before = _stored(lay)
    k, v = x[40, 0].copy(), x[40, 1].copy()
    (k if side == "k" else v)[1, 5] = bad
    quantized = side == "k" and mode != "q8v" or side == "v" and mode != "q8k"
    if quantized:
        with pytest.raises(ShapeError, match=f"{side} has"):
            lay.append(k, v)
        _assert_same(_stored(lay), before)
    else:   # a float32 side stores it as it is
        lay.append(k, v)
        assert lay.seq_len == 41


@pytest.mark.parametrize("mode", MODES)
def test_the_fused_decode_step_stores_and_attends_in_one_launch(mode, monkeypatch):
    # LayerKvCache.append_attend on a q8 layer past its window's first fill:
    # window.append_window_attend stores the row (store_window_row's bits)
    # and attends in one launch where the decode runs on one thread; where
    # it would share threads it runs nothing and the two calls take the step.
    nkv, hd = 2, 64
    fused, two = LayerKvCache(nkv, hd, mode, "numba"), LayerKvCache(nkv, hd, mode, "numba")
    rows = _rows(4200, nkv, hd, 11)
    for lay in (fused, two):
        lay.extend(rows[:4096, 0], rows[:4096, 1])
    taken = []
    kernel = fused.backend._append_window_attend
    fused.backend._append_window_attend = lambda *a: taken.append(kernel(*a)) or taken[-1]
    q = np.random.default_rng(3).standard_normal((3 * nkv, hd)).astype(np.float32)
    for threads, window, steps in (("1", None, range(4096, 4110)), ("2", None, range(4110, 4114)),
                                   ("2", 300, range(4114, 4120))):
        monkeypatch.setenv("KVREG_THREADS", threads)
        before = len(taken)
        for i in steps:
            two.append(rows[i, 0], rows[i, 1])
            want = two.attend_layer(q, window=window)
            got = fused.append_attend(rows[i, 0], rows[i, 1], q, window=window)
            assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), (mode, threads, window, i)
        _assert_same(_stored(fused), _stored(two))
        # one thread: fused (the first step may grow the capacity first);
        # 4k rows on two threads: shared, so the two calls; a 300-row window: one task, fused
        ran = len(taken) - before
        assert ran >= len(steps) - 1 if threads == "1" or window else ran == 0, (mode, threads, window, ran)
    assert all(taken)
