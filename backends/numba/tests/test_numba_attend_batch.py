"""``NumbaBackend.attend_batch``: one parallel launch for the same layer of
B sequences, whose row ``b`` must be ``attend_layer`` on sequence ``b`` bit
for bit (outputs and the importance it adds), in every KV mode, with
windows, learned sinks, softcap, ragged and dead heads, an empty sequence
(no storage yet) and one whose every head is dead (storage, no rows), and
the q8 field frozen on some sequences and not on others."""

import numpy as np
import pytest

import kvreg
from kvreg import KvMode, threads
from kvreg_numba import batch, dispatch
from kvreg_numba.backend import NumbaBackend

NKV, HPK, HD = 2, 3, 64
NH = NKV * HPK
#: Rows per sequence: none (cap 0), every head dead, short, ragged, past
#: the q8 field's freeze (64 rows) and past the float16 window.
LENGTHS = (0, "dead", 1, 13, 70, 29)
CALLS = [dict(), dict(window=5), dict(softcap=3.0), dict(sinks=True),
         dict(window=11, softcap=2.0, sinks=True)]


def _layers(mode, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for s, n in enumerate(LENGTHS):
        lay = kvreg.LayerKvCache(NKV, HD, mode, backend="numba")
        if n == "dead":
            for _ in range(3):
                x = rng.standard_normal((NKV, HD)).astype(np.float32)
                lay.append(x, x, alive=np.zeros(NKV, bool))
        else:
            for i in range(n):
                alive = np.ones(NKV, bool)
                if s == 3:
                    alive[1] = i % 3 != 1  # a lagging head
                if s == 5:
                    alive[1] = i < 4  # a head that died
                lay.append(rng.standard_normal((NKV, HD)).astype(np.float32),
                           rng.standard_normal((NKV, HD)).astype(np.float32), alive=alive)
        out.append(lay)
    views = [lay.storage.view() for lay in out]
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
    # accumulators: none, shorter than the rows, longer, exactly as long
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
    assert not got[0].any() and not got[1].any()  # no storage / no rows: zeros


@pytest.mark.parametrize("mode", [m.value for m in KvMode])
def test_batch_is_the_layer_call_per_sequence(small_blocks, mode):
    views = _layers(KvMode(mode))
    be = NumbaBackend()
    for call in CALLS:
        _check(be, views, call)


@pytest.mark.parametrize("mode", ["f32", "q8"])
def test_batch_at_the_default_block(mode):
    views = _layers(KvMode(mode), seed=4)
    be = NumbaBackend()
    for call in (dict(), dict(window=7, sinks=True)):
        _check(be, views, call, seed=5)


def test_q8_field_frozen_on_some_sequences_only(small_blocks):
    views = _layers(KvMode.Q8_2F)
    assert views[4].q8.kcol_set.all() and views[4].q8.vcol_set.all() and not views[3].q8.kcol_set.any()
    _check(NumbaBackend(), views, dict(window=6, sinks=True))


def test_one_launch_for_the_batch(small_blocks, monkeypatch):
    views = _layers(KvMode.Q8V)
    be = NumbaBackend()
    calls = []
    real = batch.attend_batch_kernel

    def counted(*a):
        calls.append(1)
        return real(*a)

    monkeypatch.setattr(batch, "attend_batch_kernel", counted)
    monkeypatch.setattr(dispatch, "attend_groups", None)  # the layer kernel is not called
    q = np.ones((len(views), NH, HD), np.float32)
    be.attend_batch(q, views, scale=0.1)
    assert calls == [1]


def test_same_bits_on_every_thread_count(small_blocks, monkeypatch):
    monkeypatch.setattr(threads, "SMALL_WORK_BYTES", 0)
    views = _layers(KvMode.F32, seed=2)
    be = NumbaBackend()
    q = np.random.default_rng(3).standard_normal((len(views), NH, HD)).astype(np.float32)
    outs = []
    try:
        for t in (1, 2, 3):
            kvreg.set_num_threads(t)
            imps = [np.zeros(80, np.float32) for _ in views]
            outs.append((be.attend_batch(q, views, scale=0.1, window=9, imps=imps), imps))
    finally:
        kvreg.set_num_threads(None)
    for out, imps in outs[1:]:
        assert out.tobytes() == outs[0][0].tobytes()
        assert all(a.tobytes() == b.tobytes() for a, b in zip(imps, outs[0][1]))


def test_empty_batch_and_refusals():
    be = NumbaBackend()
    assert be.attend_batch(np.zeros((0, NH, HD), np.float32), [], scale=0.1).shape == (0, NH, HD)
    a = _layers(KvMode.F32)[2]
    b = kvreg.LayerKvCache(NKV, HD, "q8", backend="numba")
    b.append(np.ones((NKV, HD), np.float32), np.ones((NKV, HD), np.float32))
    with pytest.raises(ValueError):
        be.attend_batch(np.zeros((2, NH, HD), np.float32), [a, b.storage.view()], scale=0.1)
    with pytest.raises(ValueError):
        be.attend_batch(np.zeros((3, NH, HD), np.float32), [a, a], scale=0.1)


@pytest.mark.parametrize("mode", ["f32", "f16", "q8"])
def test_cached_rows_follow_a_reallocation_and_keep_nothing_alive(mode):
    import gc
    import weakref

    rng = np.random.default_rng(6)
    be = NumbaBackend()
    lay = kvreg.LayerKvCache(NKV, HD, mode, backend="numba")
    for _ in range(5):
        lay.append(rng.standard_normal((NKV, HD)).astype(np.float32), rng.standard_normal((NKV, HD)).astype(np.float32))
    q = rng.standard_normal((1, NH, HD)).astype(np.float32)
    kv = lay.storage.view()
    be.attend_batch(q, [kv], scale=0.1)
    old = weakref.ref((kv.dense.k if kv.dense.k is not None else kv.q8.kq).base)
    cap = kv.cap
    while lay.storage.view().cap == cap:  # grow until the storage reallocates
        lay.append(rng.standard_normal((NKV, HD)).astype(np.float32),
                   rng.standard_normal((NKV, HD)).astype(np.float32))
    del kv
    kv = lay.storage.view()
    got = be.attend_batch(q, [kv], scale=0.1)
    assert (_bits(got[0]) == _bits(be.attend_layer(q[0], kv, scale=0.1))).all()
    gc.collect()
    assert old() is None  # the batch rows held no reference to the old blocks
