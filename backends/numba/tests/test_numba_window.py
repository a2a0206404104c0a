"""q8's float16 window on the numba backend: each quantized side's newest
rows live in ``thk``/``thv`` (float16, ``[nkv, window, hd]``), rows
``[b8[h], lens[h])`` of a head, and the decode kernel reads them itself, in
the same kernel as the int8 rows (one more row source at the tail of each
head, score pass and value pass), widened in registers from the stored
bits. These tests would catch a window regression: an answer off the
reference's, a kernel that reads the (unwritten) int8 slots of the window
rows or a copy of the window, bits that move with the thread count, and
the edges: a window straddling the exact rows (fewer than 8 rows held), a
window cut by a truncation, dead and ragged heads, NaN."""

import numpy as np
import pytest

import kvreg
from kvreg import threads
from kvreg.layer import LayerKvCache
from kvreg.reference import ReferenceBackend
from kvreg_conformance.fill import poison_window_slots
from kvreg_numba import dispatch
from kvreg_numba.backend import NumbaBackend

MODES = ["q8", "q8k", "q8v"]
CALLS = [dict(), dict(window=5), dict(softcap=3.0), dict(sinks=True), dict(window=11, softcap=2.0, sinks=True)]
REF = ReferenceBackend()


def layer(mode, *, nkv=4, hd=64, n=29, exact=1, seed=0, truncate=0):
    """A windowed q8 layer on numba: ragged heads (head 2 misses every third
    row, head 3 dies after 5 rows), then ``truncate`` rows dropped."""
    rng = np.random.default_rng(seed)
    lay = LayerKvCache(nkv, hd, mode, backend="numba", q8_exact_rows=exact)
    for i in range(n):
        alive = np.ones(nkv, bool)
        alive[2] = i % 3 != 1
        alive[3] = i < 5
        lay.append(rng.standard_normal((nkv, hd)).astype(np.float32),
                   rng.standard_normal((nkv, hd)).astype(np.float32), alive=alive)
    if truncate:
        lay.truncate_last(truncate)
    st = lay.storage
    assert st.window == 8 and (st.lens - st.b8 <= 8).all()
    return lay


def close(a, b):
    np.testing.assert_allclose(a, b, rtol=2e-5, atol=2e-6)


def answers(be, st, q, call, rng_seed=1):
    kw = dict(call)
    if kw.pop("sinks", False):
        kw["sinks"] = np.random.default_rng(rng_seed).standard_normal(q.shape[0]).astype(np.float32)
    imp = np.zeros(int(st.lens.max()), np.float32)
    return be.attend_layer(q, st.view(), scale=0.125, imp=imp, **kw), imp


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("shape", ["long", "straddles-exact", "truncated", "hd40"])
def test_windowed_q8_answers_the_reference(small_blocks, mode, shape):
    kw = {"long": dict(n=61), "straddles-exact": dict(n=6, exact=3), "truncated": dict(n=40, truncate=13),
          "hd40": dict(n=37, hd=40)}[shape]
    lay = layer(mode, **kw)
    st = lay.storage
    if shape == "straddles-exact":
        # fewer than 8 rows held: the whole head is window, its first rows exact
        assert (st.b8 == 0).all() and (st.xlen == np.minimum(st.lens, 3)).all()
    if shape == "truncated":
        assert ((st.lens - st.b8) < 8).any() and (st.lens > 8).any()
    be = lay.backend
    assert isinstance(be, NumbaBackend)
    hd = st.head_dim
    q = np.random.default_rng(7).standard_normal((st.num_kv_heads * 3, hd)).astype(np.float32)
    for call in CALLS:
        a, ia = answers(be, st, q, call)
        b, ib = answers(REF, st, q, call)
        close(a, b)
        close(ia, ib)
    for g in range(st.num_kv_heads):
        n = int(st.lens[g])
        for first, upto in ((0, None), (2, None), (1, max(n - 2, 1))):
            a = be.attend_group(q[:3], st.view(), g, scale=0.2, first=first, upto=upto, softcap=4.0)
            b = REF.attend_group(q[:3], st.view(), g, scale=0.2, first=first, upto=upto, softcap=4.0)
            close(a, b)


@pytest.mark.parametrize("mode", MODES)
def test_the_layer_kernel_equals_its_groups(small_blocks, mode):
    st = layer(mode, n=45).storage
    be = NumbaBackend()
    q = np.random.default_rng(2).standard_normal((12, 64)).astype(np.float32)
    whole = be.attend_layer(q, st.view(), scale=0.1, softcap=3.0)
    for g in range(4):
        part = be.attend_group(q[3 * g:3 * g + 3], st.view(), g, scale=0.1, softcap=3.0)
        assert part.tobytes() == whole[3 * g:3 * g + 3].tobytes()
        for h in range(3):  # grouped == per-head
            one = be.attend_group(q[3 * g + h:3 * g + h + 1], st.view(), g, scale=0.1, softcap=3.0)
            assert one.tobytes() == whole[3 * g + h:3 * g + h + 1].tobytes()


def _spy(monkeypatch):
    seen = []
    real = dispatch._run

    def run(nbytes, nfloats, *args):
        seen.append(args)
        return real(nbytes, nfloats, *args)

    monkeypatch.setattr(dispatch, "_run", run)
    return seen


@pytest.mark.parametrize("mode", MODES)
def test_the_kernel_reads_the_window_arrays_themselves(monkeypatch, mode):
    st = layer(mode, n=20).storage
    be = NumbaBackend()
    seen = _spy(monkeypatch)
    q = np.ones((8, 64), np.float32)
    view = st.view()
    be.attend_layer(q, view, scale=0.1)
    be.attend_group(q[:2], view, 1, scale=0.1)
    assert len(seen) == 2
    for args in seen:
        # attend_groups(q, hpk, gids, firsts, ns, kf, kq, ks, kcol, kcol_set, vf, vq, vs, vcol,
        #               vcol_set, kquant, vquant, xk, xv, xlen, thk, thv, b8, ...)
        thk, thv, b8 = args[20], args[21], args[22]
        for got, th in ((thk, st.thk), (thv, st.thv)):
            if th is None:
                assert got.size == 0
            else:  # the stored float16 window itself, viewed as its int16 bits
                assert got.dtype == np.int16 and got.shape == th.shape
                assert got.ctypes.data == th.ctypes.data
        assert b8.ctypes.data == view.window.b8.ctypes.data


@pytest.mark.parametrize("mode", MODES)
def test_an_in_place_window_change_reaches_the_answer(mode):
    """No copy kept anywhere: a window row rewritten in place changes the
    next answer, to the reference's answer on the rewritten rows."""
    st = layer(mode, n=30).storage
    be = NumbaBackend()
    q = np.random.default_rng(4).standard_normal((12, 64)).astype(np.float32)
    before = be.attend_layer(q, st.view(), scale=0.3)
    th = st.thk if st.thk is not None else st.thv
    th[0, int(st.lens[0] - st.b8[0]) - 1] = np.float16(3.0)  # head 0's newest row
    after = be.attend_layer(q, st.view(), scale=0.3)
    assert not np.array_equal(before[:3], after[:3])
    assert before[3:].tobytes() == after[3:].tobytes()  # other heads untouched
    close(after, REF.attend_layer(q, st.view(), scale=0.3))


@pytest.mark.parametrize("mode", MODES)
def test_the_int8_slots_of_window_rows_are_never_read(mode):
    st = layer(mode, n=30, exact=2).storage
    be = NumbaBackend()
    q = np.random.default_rng(5).standard_normal((12, 64)).astype(np.float32)
    imp1 = np.zeros(30, np.float32)
    want = be.attend_layer(q, st.view(), scale=0.3, imp=imp1, softcap=5.0)
    poison_window_slots(st)
    imp2 = np.zeros(30, np.float32)
    got = be.attend_layer(q, st.view(), scale=0.3, imp=imp2, softcap=5.0)
    assert got.tobytes() == want.tobytes() and imp1.tobytes() == imp2.tobytes()


@pytest.mark.parametrize("mode", MODES)
def test_a_nan_window_row_poisons_only_its_head(mode):
    st = layer(mode, n=25).storage
    be = NumbaBackend()
    th = st.thk if st.thk is not None else st.thv
    th[1, 0, 3] = np.float16(np.nan)
    q = np.random.default_rng(6).standard_normal((12, 64)).astype(np.float32)
    a = be.attend_layer(q, st.view(), scale=0.2)
    b = REF.attend_layer(q, st.view(), scale=0.2)
    assert np.array_equal(np.isnan(a), np.isnan(b))
    # a NaN key poisons head 1's whole group; a NaN value its channel 3 only
    assert np.isnan(a[3:6] if st.thk is not None else a[3:6, 3]).all()
    assert not np.isnan(np.delete(a, np.s_[3:6], axis=0)).any()
    close(np.nan_to_num(a), np.nan_to_num(b))


@pytest.mark.parametrize("mode", MODES)
def test_the_same_bits_on_every_thread_count(monkeypatch, mode):
    monkeypatch.setattr(threads, "SMALL_WORK_BYTES", 0)
    st = layer(mode, n=300, exact=3, truncate=3).storage
    be = NumbaBackend()
    rng = np.random.default_rng(8)
    q = rng.standard_normal((12, 64)).astype(np.float32)
    sinks = rng.standard_normal(12).astype(np.float32)
    outs = []
    try:
        for t in (1, 2, 3):
            kvreg.set_num_threads(t)
            imp = np.zeros(300, np.float32)
            o1 = dispatch.attend_layer(q, st.lens, scale=0.1, imp=imp, block=32, **_args(st))
            o2 = dispatch.attend_layer(q, st.lens, scale=0.1, window=100, softcap=4.0, sinks=sinks, block=32,
                                **_args(st))
            o3 = be.attend_layer(q, st.view(), scale=0.1, window=40)
            outs.append(o1.tobytes() + imp.tobytes() + o2.tobytes() + o3.tobytes())
    finally:
        kvreg.set_num_threads(None)
    assert outs[1] == outs[0] and outs[2] == outs[0]


def _args(st):
    from kvreg_numba.backend import _storage_args

    return _storage_args(st.view())


def test_q4_still_takes_the_reference(monkeypatch):
    """q4's rows live in three tiers: that layout keeps the reference kernel."""
    lay = LayerKvCache(2, 32, "q4", backend="numba")
    rng = np.random.default_rng(9)
    for _ in range(30):
        lay.append(rng.standard_normal((2, 32)).astype(np.float32), rng.standard_normal((2, 32)).astype(np.float32))
    seen = _spy(monkeypatch)
    q = rng.standard_normal((4, 32)).astype(np.float32)
    a = lay.backend.attend_layer(q, lay.storage.view(), scale=0.2)
    assert not seen
    assert a.tobytes() == REF.attend_layer(q, lay.storage.view(), scale=0.2).tobytes()
