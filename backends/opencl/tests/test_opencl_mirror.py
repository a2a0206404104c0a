"""Device mirrors: what is uploaded when, proven by the counters, on the
core's real storage (every mutation moves its view's version)."""

from __future__ import annotations

import numpy as np
from ocl_helpers import Rows

from kvreg.modes import KV_COL_WARMUP
from kvreg.storage import FLOOR_LOG as _FLOOR_LOG
from kvreg_opencl import kernels
from kvreg_opencl.mirror import DeviceMirror


def rows(rng, nkv, hd):
    return rng.standard_normal((nkv, hd)), rng.standard_normal((nkv, hd))


def answer(m, st, q):
    return kernels.attend_layer(m, q, lens=st.lens, scale=0.25)[0]


def synced(dev, st):
    """A fresh mirror of ``st``, synced once."""
    m = DeviceMirror(dev)
    m.sync(st.view())
    return m


def fresh_answer(dev, st, q):
    return answer(synced(dev, st), st, q)


def filled(rng, nrows, nkv, hd, mode="f32"):
    """Real storage holding ``nrows`` random rows."""
    st = Rows(nkv, hd, mode)
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
    for _ in range(1000):  # the host storage doubles its capacity on the way
        st.append(*rows(rng, nkv, hd))
        m.sync(st.view())
    row_bytes = 2 * hd * 4  # one K and one V row of one head
    assert m.bytes_uploaded - base == 1000 * nkv * row_bytes
    assert m.partial_uploads == 1000
    assert m.full_reuploads == 1, "device capacity growth must not re-upload"
    assert m.cap >= 1010
    q = rng.standard_normal((2, hd)).astype(np.float32)
    np.testing.assert_array_equal(answer(m, st, q), fresh_answer(dev, st, q))


def test_the_same_version_uploads_nothing(dev, small_blocks):
    rng = np.random.default_rng(7)
    st = filled(rng, 9, 2, 8)
    m = synced(dev, st)
    c = m.counters()
    for _ in range(3):
        m.sync(st.view())
    after = m.counters()
    assert after["syncs"] == c["syncs"] + 3
    assert {k: v for k, v in after.items() if k != "syncs"} == {k: v for k, v in c.items() if k != "syncs"}


def test_truncate_then_append_reuploads_the_rewritten_rows(dev, small_blocks):
    nkv, hd = 2, 16
    rng = np.random.default_rng(1)
    st = filled(rng, 20, nkv, hd)
    m = synced(dev, st)
    before = m.bytes_uploaded
    st.truncate_last(5)
    for _ in range(5):  # back to 20 rows: the row counts alone would miss the rewrite
        st.append(*rows(rng, nkv, hd))
    assert st.lens[0] == 20
    assert st.view().unchanged_rows(m.version).min() == 15  # the truncation log says where
    m.sync(st.view())
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
    m.sync(st.view())
    assert m.bytes_uploaded == before
    assert m.full_reuploads == 1


def test_lost_truncation_history_forces_full_upload(dev, small_blocks):
    rng = np.random.default_rng(3)
    st = filled(rng, 2 * _FLOOR_LOG + 10, 1, 8)
    m = synced(dev, st)
    # as many truncations as the log keeps: it still reaches the mirror's version
    for _ in range(_FLOOR_LOG):
        st.truncate_last(1)
    st.append(*rows(rng, 1, 8))
    m.sync(st.view())
    assert m.full_reuploads == 1 and m.partial_uploads == 1
    # one more than it keeps: the oldest record since the mirror's version is gone
    for _ in range(_FLOOR_LOG + 1):
        st.truncate_last(1)
    st.append(*rows(rng, 1, 8))
    assert st.view().unchanged_rows(m.version) is None
    m.sync(st.view())
    assert m.full_reuploads == 2
    q = rng.standard_normal((2, 8)).astype(np.float32)
    np.testing.assert_array_equal(answer(m, st, q), fresh_answer(dev, st, q))


def test_a_trim_forces_full_upload(dev, small_blocks):
    rng = np.random.default_rng(4)
    st = filled(rng, 12, 2, 8)
    m = synced(dev, st)
    st.drop_front(4)
    for _ in range(4):
        st.append(*rows(rng, 2, 8))  # same row count as before the trim
    m.sync(st.view())
    assert m.full_reuploads == 2
    q = rng.standard_normal((2, 8)).astype(np.float32)
    np.testing.assert_array_equal(answer(m, st, q), fresh_answer(dev, st, q))


def test_clear_forces_full_upload(dev, small_blocks):
    rng = np.random.default_rng(8)
    st = filled(rng, 12, 2, 8)
    m = synced(dev, st)
    st.clear()
    for _ in range(12):
        st.append(*rows(rng, 2, 8))  # the same row count again
    m.sync(st.view())
    assert m.full_reuploads == 2
    q = rng.standard_normal((2, 8)).astype(np.float32)
    np.testing.assert_array_equal(answer(m, st, q), fresh_answer(dev, st, q))


def test_field_freeze_forces_full_upload(dev, small_blocks):
    rng = np.random.default_rng(5)
    st = filled(rng, KV_COL_WARMUP, 1, 32, "q8_2f")
    m = synced(dev, st)
    assert not st.storage.field_frozen()
    # the append that finds 64 rows stored freezes the field first:
    # every stored row is requantized in place
    st.append(*rows(rng, 1, 32))
    assert st.storage.field_frozen()
    m.sync(st.view())
    assert m.full_reuploads == 2
    q = rng.standard_normal((1, 32)).astype(np.float32)
    np.testing.assert_array_equal(answer(m, st, q), fresh_answer(dev, st, q))


def test_dead_head_uploads_nothing_for_it(dev, small_blocks):
    rng = np.random.default_rng(6)
    st = Rows(3, 8)
    m = DeviceMirror(dev)
    for _ in range(10):
        st.append(*rows(rng, 3, 8), alive=np.array([True, False, True]))
    m.sync(st.view())
    assert m.bytes_uploaded == 2 * 10 * 2 * 8 * 4


def test_a_view_of_another_storage_is_a_full_upload(dev, small_blocks):
    # versions are process-wide, so another storage's unchanged_rows(since)
    # can answer "only appends" for this mirror's version: the mirror must
    # not take its rows for the ones it holds
    rng = np.random.default_rng(9)
    a, b = Rows(2, 16), Rows(2, 16)
    for _ in range(12):
        a.append(*rows(rng, 2, 16))
        b.append(*rows(rng, 2, 16))
    b.append(*rows(rng, 2, 16))
    m = synced(dev, a)
    assert b.view().unchanged_rows(m.version) is not None
    m.sync(b.view())
    assert m.full_reuploads == 2
    q = rng.standard_normal((2, 16)).astype(np.float32)
    np.testing.assert_array_equal(answer(m, b, q), fresh_answer(dev, b, q))
    m.sync(a.view())  # and back: a's version alone must not look current
    assert m.full_reuploads == 3
    np.testing.assert_array_equal(answer(m, a, q), fresh_answer(dev, a, q))
