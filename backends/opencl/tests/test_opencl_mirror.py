"""Device mirrors: what is uploaded when, proven by the counters."""

from __future__ import annotations

import numpy as np
from ocl_helpers import FakeStorage

from kvreg_opencl import kernels
from kvreg_opencl.mirror import DeviceMirror


def rows(rng, nkv, hd):
    return rng.standard_normal((nkv, hd)), rng.standard_normal((nkv, hd))


def answer(m, st, q):
    return kernels.attend_layer(m, q, lens=st.lens, scale=0.25)[0]


def synced(dev, st):
    """A fresh mirror of ``st``, synced once."""
    m = DeviceMirror(dev)
    m.sync(st)
    return m


def fresh_answer(dev, st, q):
    return answer(synced(dev, st), st, q)


def filled(rng, nrows, nkv, hd, **kw):
    """A fake storage holding ``nrows`` random rows."""
    st = FakeStorage(nkv, hd, **kw)
    for _ in range(nrows):
        st.append(*rows(rng, nkv, hd))
    return st


def test_decode_steps_upload_only_the_new_rows(dev, small_blocks):
    nkv, hd = 2, 16
    rng = np.random.default_rng(0)
    st = filled(rng, 10, nkv, hd)
    m = synced(dev, st)
    assert m.full_reuploads == 1
    base = m.bytes_uploaded
    for _ in range(1000):
        st.append(*rows(rng, nkv, hd))
        m.sync(st)
    row_bytes = 2 * hd * 4  # one K and one V row of one head
    assert m.bytes_uploaded - base == 1000 * nkv * row_bytes
    assert m.partial_uploads == 1000
    assert m.full_reuploads == 1, "device capacity growth must not re-upload"
    assert m.cap >= 1010
    q = rng.standard_normal((2, hd)).astype(np.float32)
    np.testing.assert_array_equal(answer(m, st, q), fresh_answer(dev, st, q))


def test_truncate_then_append_reuploads_the_rewritten_rows(dev, small_blocks):
    nkv, hd = 2, 16
    rng = np.random.default_rng(1)
    st = filled(rng, 20, nkv, hd)
    m = synced(dev, st)
    before = m.bytes_uploaded
    st.truncate_last(5)
    for _ in range(5):  # back to 20 rows, same generation: (gen, rows) alone would miss it
        st.append(*rows(rng, nkv, hd))
    assert st.lens[0] == 20
    m.sync(st)
    assert m.bytes_uploaded - before == 5 * nkv * 2 * hd * 4
    assert m.full_reuploads == 1
    q = rng.standard_normal((2, hd)).astype(np.float32)
    np.testing.assert_array_equal(answer(m, st, q), fresh_answer(dev, st, q))


def test_truncate_without_append_uploads_nothing(dev, small_blocks):
    rng = np.random.default_rng(2)
    st = filled(rng, 9, 1, 8)
    m = synced(dev, st)
    before = m.bytes_uploaded
    st.truncate_last(3)
    m.sync(st)
    assert m.bytes_uploaded == before


def test_lost_edit_history_forces_full_upload(dev, small_blocks):
    rng = np.random.default_rng(3)
    st = filled(rng, 9, 1, 8)
    m = synced(dev, st)
    st.truncate_last(1)
    st.truncate_last(1)
    st._hist = st._hist[1:]  # the log no longer reaches the mirror's edit number
    st.append(*rows(rng, 1, 8))
    m.sync(st)
    assert m.full_reuploads == 2


def test_new_generation_forces_full_upload(dev, small_blocks):
    rng = np.random.default_rng(4)
    st = filled(rng, 12, 2, 8)
    m = synced(dev, st)
    st.drop_front(4)
    for _ in range(4):
        st.append(*rows(rng, 2, 8))  # same row count as before the trim
    m.sync(st)
    assert m.full_reuploads == 2
    q = rng.standard_normal((2, 8)).astype(np.float32)
    np.testing.assert_array_equal(answer(m, st, q), fresh_answer(dev, st, q))


def test_field_freeze_forces_full_upload(dev, small_blocks):
    rng = np.random.default_rng(5)
    st = filled(rng, 6, 1, 32, kq=True, vq=True)
    m = synced(dev, st)
    # a freeze requantizes stored rows in place: no new generation, no edit
    st.kcol[0] = 2.0
    st.kcol_set[0] = True
    st.kq[0, :6] //= 2
    st.append(*rows(rng, 1, 32))
    m.sync(st)
    assert m.full_reuploads == 2
    q = rng.standard_normal((1, 32)).astype(np.float32)
    np.testing.assert_array_equal(answer(m, st, q), fresh_answer(dev, st, q))


def test_dead_head_uploads_nothing_for_it(dev, small_blocks):
    rng = np.random.default_rng(6)
    st = FakeStorage(3, 8)
    m = DeviceMirror(dev)
    for _ in range(10):
        st.append(*rows(rng, 3, 8), alive=np.array([True, False, True]))
    m.sync(st)
    assert m.bytes_uploaded == 2 * 10 * 2 * 8 * 4
