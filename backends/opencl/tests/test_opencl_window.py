"""q8's float16 window on the OpenCL backend: the mirror uploads
``thk``/``thv`` (binary16, as stored) and ``b8`` whenever they may have
changed, and the int8 blocks of a windowed side only over the rows that have
left the window; ``partial_*`` reads rows ``[b8[g], n)`` of a quantized side
from the window (vload_half). These tests would catch a window regression:
an answer off the reference's, a stale window or int8 row after decode
steps and truncations (an incrementally synced mirror must answer the bits
a fresh one does), a kernel that reads the unwritten int8 slots of the
window rows, and the edges: a window straddling the exact rows, a window cut
by a truncation, dead and ragged heads."""

from __future__ import annotations

import numpy as np
import pytest

from kvreg.layer import LayerKvCache
from kvreg.reference import ReferenceBackend
from kvreg_conformance.fill import poison_window_slots
from kvreg_opencl import kernels
from kvreg_opencl.mirror import DeviceMirror

MODES = ["q8", "q8k", "q8v"]
REF = ReferenceBackend()
CALLS = [dict(), dict(window=5), dict(softcap=3.0), dict(sinks=True), dict(window=11, softcap=2.0, sinks=True)]


def rows(rng, nkv, hd):
    return (rng.standard_normal((nkv, hd)).astype(np.float32), rng.standard_normal((nkv, hd)).astype(np.float32))


def layer(mode, *, nkv=3, hd=64, n=29, exact=1, seed=0, truncate=0):
    """A windowed q8 layer on opencl: ragged heads (head 1 misses every
    third row, head 2 dies after 5 rows), then ``truncate`` rows dropped."""
    rng = np.random.default_rng(seed)
    lay = LayerKvCache(nkv, hd, mode, backend="opencl", q8_exact_rows=exact)
    for i in range(n):
        alive = np.ones(nkv, bool)
        alive[1] = i % 3 != 1
        alive[2] = i < 5
        lay.append(*rows(rng, nkv, hd), alive=alive)
    if truncate:
        lay.truncate_last(truncate)
    assert lay.storage.window == 8
    return lay


def close(a, b):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


def fresh(dev, kv, q, **kw):
    """The answer of a fresh mirror of the view ``kv``."""
    m = DeviceMirror(dev)
    m.sync(kv)
    return kernels.attend_layer(m, q, lens=kv.lens, scale=0.2, **kw)[0]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", ["long", "straddles-exact", "truncated", "hd40"])
def test_windowed_q8_answers_the_reference(dev, small_blocks, mode, shape):
    kw = {"long": dict(n=61), "straddles-exact": dict(n=6, exact=3), "truncated": dict(n=40, truncate=13),
          "hd40": dict(n=37, hd=40)}[shape]
    lay = layer(mode, **kw)
    kv, be = lay.storage.view(), lay.backend
    if shape == "straddles-exact":
        assert (kv.window.b8 == 0).all() and (kv.exact.xlen == np.minimum(kv.lens, 3)).all()
    if shape == "truncated":
        assert ((kv.lens - kv.window.b8) < 8).any() and (kv.lens > 8).any()
    nkv, hd = kv.num_kv_heads, kv.head_dim
    rng = np.random.default_rng(7)
    q = rng.standard_normal((nkv * 3, hd)).astype(np.float32)
    for call in CALLS:
        kw = dict(call)
        if kw.pop("sinks", False):
            kw["sinks"] = rng.standard_normal(nkv * 3).astype(np.float32)
        i1 = np.zeros(int(kv.lens.max()), np.float32)
        i2 = np.zeros_like(i1)
        close(be.attend_layer(q, kv, scale=0.125, imp=i1, **kw), REF.attend_layer(q, kv, scale=0.125, imp=i2, **kw))
        close(i1, i2)
    for g in range(nkv):
        n = int(kv.lens[g])
        for first, upto in ((0, None), (2, None), (1, max(n - 2, 1))):
            close(be.attend_group(q[:3], kv, g, scale=0.2, first=first, upto=upto, softcap=4.0),
                  REF.attend_group(q[:3], kv, g, scale=0.2, first=first, upto=upto, softcap=4.0))


@pytest.mark.parametrize("mode", MODES)
def test_decode_steps_and_truncations_keep_the_mirror_exact(dev, small_blocks, mode):
    """Every step appends (rows leave the window into their int8 slots, the
    window is rewritten in place), some truncate then re-append: the
    incrementally synced mirror answers the bits of a fresh mirror, and a
    decode step past the window uploads one int8 row per head plus the window."""
    nkv, hd = 2, 32
    rng = np.random.default_rng(1)
    lay = LayerKvCache(nkv, hd, mode, backend="opencl")
    be = lay.backend
    q = rng.standard_normal((nkv * 2, hd)).astype(np.float32)
    for step in range(45):
        lay.append(*rows(rng, nkv, hd))
        if step in (20, 33):
            lay.truncate_last(5 if step == 20 else 11)  # cuts the window; 11 reaches the int8 rows
        kv = lay.storage.view()
        got = be.attend_layer(q, kv, scale=0.2)
        assert got.tobytes() == fresh(dev, kv, q).tobytes(), step
        close(got, REF.attend_layer(q, kv, scale=0.2))
    m = be.mirror(kv)
    assert m.full_reuploads == 1
    c0 = m.counters()
    lay.append(*rows(rng, nkv, hd))
    m = be.mirror(lay.storage.view())
    c1 = m.counters()
    quant = {"q8": ("kq", "ks", "vq", "vs"), "q8k": ("kq", "ks", "v"), "q8v": ("k", "vq", "vs")}[mode]
    row = {"kq": hd, "ks": 4, "vq": hd, "vs": 4, "k": 4 * hd, "v": 4 * hd}
    assert c1["bytes_uploaded"] - c0["bytes_uploaded"] == nkv * sum(row[n] for n in quant)
    win = nkv * 8 * hd * 2 * (2 if mode == "q8" else 1) + nkv * 4
    assert c1["window_bytes_uploaded"] - c0["window_bytes_uploaded"] == win
    # a second sync with nothing changed uploads nothing (per-group calls sync each time)
    be.attend_group(q[:2], lay.storage.view(), 0, scale=0.2)
    be.attend_group(q[2:], lay.storage.view(), 1, scale=0.2)
    assert be.mirror(lay.storage.view()).counters()["window_bytes_uploaded"] == c1["window_bytes_uploaded"]


@pytest.mark.parametrize("mode", MODES)
def test_the_int8_slots_of_window_rows_are_never_read(dev, small_blocks, mode):
    lay = layer(mode, n=30, exact=2)
    st = lay.storage
    q = np.random.default_rng(5).standard_normal((9, 64)).astype(np.float32)
    want = fresh(dev, st.view(), q, softcap=5.0)
    poison_window_slots(st)  # writes the storage's arrays behind its back: a fresh mirror reads them
    assert fresh(dev, st.view(), q, softcap=5.0).tobytes() == want.tobytes()


@pytest.mark.parametrize("mode", MODES)
def test_the_window_travels_at_2_bytes_an_element(dev, mode):
    lay = layer(mode, n=20)
    st = lay.storage
    m = DeviceMirror(dev)
    m.sync(st.view())
    thk, thv, b8, wcap = m.window_args()
    assert wcap == 8
    for buf, th in ((thk, st.thk), (thv, st.thv)):
        if th is None:
            assert buf is None
            continue
        assert buf.size == th.nbytes
        back = np.empty_like(th)
        dev.cl.enqueue_copy(dev.queue, back, buf)
        assert back.view(np.uint16).tobytes() == th.view(np.uint16).tobytes()


def test_q4_still_takes_the_reference(dev):
    lay = LayerKvCache(2, 32, "q4", backend="opencl")
    rng = np.random.default_rng(9)
    for _ in range(30):
        lay.append(*rows(rng, 2, 32))
    q = rng.standard_normal((4, 32)).astype(np.float32)
    a = lay.backend.attend_layer(q, lay.storage.view(), scale=0.2)
    assert a.tobytes() == REF.attend_layer(q, lay.storage.view(), scale=0.2).tobytes()
    assert lay.storage not in lay.backend._mirrors


def host_backend(monkeypatch, choice):
    """A fresh OpenCLBackend whose host rows run in ``choice``."""
    from kvreg_opencl import config
    from kvreg_opencl.backend import OpenCLBackend

    monkeypatch.setattr(config, "HOST_KERNELS", choice)
    return OpenCLBackend()


def test_the_host_rows_follow_the_config(dev, monkeypatch):
    from kvreg import registry
    from kvreg.errors import BackendError

    assert host_backend(monkeypatch, "numpy").host_rows() is None
    be = host_backend(monkeypatch, "numba")
    if "numba" in registry.backends():
        assert be.host_rows().name == "numba" and "host rows in numba" in be.describe()
    else:
        assert be.host_rows() is None and "host rows in NumPy" in be.describe()
    with pytest.raises(BackendError, match="HOST_KERNELS is 'cuda'; expected 'numba' or 'numpy'"):
        host_backend(monkeypatch, "cuda")


@pytest.mark.parametrize("mode", MODES)
def test_q8_appends_store_the_same_bits_with_host_rows_in_numba_and_in_numpy(dev, monkeypatch, mode):
    """A q8 decode append on opencl runs in numba's kernels when kvreg-numba
    is installed: the window's stores, the field freeze at row 64 and the
    attention over them answer bit for bit what NumPy's host rows give."""
    pytest.importorskip("kvreg_numba")
    via_numpy = host_backend(monkeypatch, "numpy")
    via_numba = host_backend(monkeypatch, "numba")
    host = via_numba.host_rows()
    steps = []
    real = host.store_window_row
    monkeypatch.setattr(host, "store_window_row", lambda *a, **kw: steps.append(1) or real(*a, **kw))
    rng = np.random.default_rng(5)
    a = LayerKvCache(4, 64, mode, backend=via_numba)
    b = LayerKvCache(4, 64, mode, backend=via_numpy)
    for _ in range(100):
        k, v = rows(rng, 4, 64)
        a.append(k, v)
        b.append(k, v)
    assert len(steps) > 50   # numba's one call stored the rows past the window's first fill
    for name in ("k", "v", "kq", "ks", "vq", "vs", "kcol", "vcol", "thk", "thv", "lens", "b8"):
        x, y = getattr(a.storage, name), getattr(b.storage, name)
        assert (x is None) == (y is None), name
        if x is not None:
            np.testing.assert_array_equal(x.view(np.uint8), y.view(np.uint8), err_msg=name)
    q = rng.standard_normal((8, 64)).astype(np.float32)
    np.testing.assert_array_equal(a.attend_layer(q), b.attend_layer(q))
