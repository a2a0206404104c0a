"""``OpenCLBackend.attend_batch``: the batch's rows assembled on the device
from the layer mirrors (incrementally) and attended in one launch of each
attention program; row ``b`` must be the backend's own ``attend_layer`` on
sequence ``b`` bit for bit (outputs and importance), in every KV mode, with
windows, learned sinks, softcap, ragged and dead heads, an empty sequence
(no storage yet) and one whose every head is dead."""

import numpy as np
import pytest

import kvreg
from kvreg import KvMode

NKV, HPK, HD = 2, 3, 64
NH = NKV * HPK
#: Rows per sequence: none (cap 0), every head dead, short, ragged, past
#: the q8 field's freeze (64 rows) and past the float16 window.
LENGTHS = (0, "dead", 1, 13, 70, 29)
CALLS = [dict(), dict(window=5), dict(softcap=3.0), dict(sinks=True),
         dict(window=11, softcap=2.0, sinks=True)]


@pytest.fixture
def be(dev):
    from kvreg_opencl.backend import OpenCLBackend

    return OpenCLBackend()


def _append(lay, rng, s, i):
    alive = np.ones(NKV, bool)
    if s == 3:
        alive[1] = i % 3 != 1  # a lagging head
    if s == 5:
        alive[1] = i < 4  # a head that died
    lay.append(rng.standard_normal((NKV, HD)).astype(np.float32),
               rng.standard_normal((NKV, HD)).astype(np.float32), alive=alive)


def _layers(mode, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for s, n in enumerate(LENGTHS):
        lay = kvreg.LayerKvCache(NKV, HD, mode, backend="reference")
        if n == "dead":
            for _ in range(3):
                x = rng.standard_normal((NKV, HD)).astype(np.float32)
                lay.append(x, x, alive=np.zeros(NKV, bool))
        else:
            for i in range(n):
                _append(lay, rng, s, i)
        out.append(lay)
    return out


def _views(layers):
    views = [lay.storage.view() for lay in layers]
    assert views[0].cap == 0 and views[1].cap > 0 and int(views[1].lens.max()) == 0
    return views


def _bits(a):
    return np.ascontiguousarray(a).view(np.uint32)


def _check(be, views, call, seed=1):
    rng = np.random.default_rng(seed)
    B = len(views)
    q = rng.standard_normal((B, NH, HD)).astype(np.float32)
    kw = dict(call)
    sinks = rng.standard_normal((B, NH)).astype(np.float32) if kw.pop("sinks", False) else None
    sizes = [int(v.lens.max()) for v in views]
    imp_len = [None if b % 4 == 2 else max(sizes[b] + (b % 3) * 5 - 3, 0) for b in range(B)]
    base = [None if m is None else rng.standard_normal(m).astype(np.float32) for m in imp_len]
    imps = [None if a is None else a.copy() for a in base]
    got = be.attend_batch(q, views, scale=0.125, sinks=sinks, imps=imps, **kw)
    assert got.shape == (B, NH, HD) and got.dtype == np.float32
    for b, kv in enumerate(views):
        imp = None if base[b] is None else base[b].copy()
        want = be.attend_layer(q[b], kv, scale=0.125, sinks=None if sinks is None else sinks[b], imp=imp, **kw)
        assert (_bits(got[b]) == _bits(want)).all(), (b, call)
        if imp is not None:
            assert (_bits(imps[b]) == _bits(imp)).all(), (b, call)
    for b, kv in enumerate(views):
        if kv.cap == 0 or int(kv.lens.max()) == 0:
            assert not got[b].any()  # no storage / no rows: zeros


@pytest.mark.parametrize("mode", [m.value for m in KvMode])
def test_batch_is_the_layer_call_per_sequence(be, small_blocks, mode):
    views = _views(_layers(KvMode(mode)))
    for call in CALLS:
        _check(be, views, call)


def test_batch_at_the_default_tunables(be):
    views = _views(_layers(KvMode.Q8, seed=4))
    for call in (dict(), dict(window=7, sinks=True)):
        _check(be, views, call, seed=5)


def test_one_launch_per_program(be, small_blocks, monkeypatch):
    from kvreg_opencl import batch as KB
    from kvreg_opencl import programs

    views = _views(_layers(KvMode.F16))
    launches = []
    real_partial, real_kernel = KB.launch_partial, programs.kernel

    def partial(*a, **kw):
        launches.append("partial")
        return real_partial(*a, **kw)

    def kernel(prg, name):
        launches.append(name)
        return real_kernel(prg, name)

    monkeypatch.setattr(KB, "launch_partial", partial)
    monkeypatch.setattr(programs, "kernel", kernel)
    monkeypatch.setattr(type(be), "attend_layer", None)  # no per-sequence fallback
    q = np.ones((len(views), NH, HD), np.float32)
    imps = [np.zeros(80, np.float32) for _ in views]
    be.attend_batch(q, views, scale=0.1, imps=imps)
    assert launches.count("partial") == 1
    assert [n for n in launches if n != "partial" and not n.startswith("partial")] == \
        ["merge", "probs", "importance_batch"]


@pytest.mark.parametrize("mode", ["f32", "q8"])
def test_a_decode_step_copies_one_row_per_head(be, small_blocks, mode):
    from kvreg_opencl import batch as KB

    rng = np.random.default_rng(9)
    layers = _layers(KvMode(mode))
    _check(be, _views(layers), dict(window=6))
    bb = KB.batch_buffers(be._dev)
    for step in range(3):
        full, copied = bb.full_copies, bb.rows_copied
        for s, lay in enumerate(layers[2:], start=2):
            _append(lay, rng, s, 1000 + step)
        _check(be, [lay.storage.view() for lay in layers], dict(window=6), seed=step)
        assert bb.full_copies == full
        heads = sum(int((lay.storage.view().lens > 0).sum()) for lay in layers[2:])
        # one row per live head, and for q8 one int8 row per head leaving the window
        assert copied < bb.rows_copied <= copied + 2 * heads * (2 if mode == "q8" else 1)
    layers[4].truncate_last(9)  # a rewrite the slot must follow from the floor
    _check(be, [lay.storage.view() for lay in layers], dict(), seed=7)
    for s, lay in enumerate(layers[2:], start=2):
        _append(lay, rng, s, 2000)
    _check(be, [lay.storage.view() for lay in layers], dict(sinks=True), seed=8)


def test_sequences_keep_their_slots_when_the_batch_changes(be, small_blocks):
    from kvreg_opencl import batch as KB

    rng = np.random.default_rng(12)
    layers = _layers(KvMode.Q8V)
    _check(be, _views(layers), dict())
    bb = KB.batch_buffers(be._dev)
    full = bb.full_copies
    # a sequence leaves, the others come in another order, then one joins
    for batch in ([5, 3, 2, 4], [4, 2, 5, 3, 0, 1]):
        for s in batch:
            if s >= 2:
                _append(layers[s], rng, s, 3000 + s)
        _check(be, [layers[s].storage.view() for s in batch], dict(window=4, sinks=True), seed=len(batch))
        assert bb.full_copies == full
    fresh = kvreg.LayerKvCache(NKV, HD, "q8v", backend="reference")
    for i in range(20):
        _append(fresh, rng, 2, i)
    _check(be, [layers[s].storage.view() for s in (2, 3)] + [fresh.storage.view()], dict(), seed=3)
    assert bb.full_copies == full + 1  # only the newcomer


def test_refusals(be):
    assert be.attend_batch(np.zeros((0, NH, HD), np.float32), [], scale=0.1).shape == (0, NH, HD)
    a = _views(_layers(KvMode.F32))[2]
    b = kvreg.LayerKvCache(NKV, HD, "q8", backend="reference")
    b.append(np.ones((NKV, HD), np.float32), np.ones((NKV, HD), np.float32))
    with pytest.raises(ValueError):
        be.attend_batch(np.zeros((2, NH, HD), np.float32), [a, b.storage.view()], scale=0.1)
    with pytest.raises(ValueError):
        be.attend_batch(np.zeros((3, NH, HD), np.float32), [a, a], scale=0.1)
