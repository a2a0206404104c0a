"""bounded_attend on the device: the f64 oracle, the reference, and the ring mirror."""

from __future__ import annotations

import numpy as np
import pytest

from kvreg.bounded import BoundedRope, BoundedState, BoundedWeights, bounded_attend, ring_view
from kvreg.errors import ConfigError, StateError
from kvreg_conformance.oracle import bounded_attend_oracle as _oracle
from kvreg_conformance.tolerances import tolerance

RTOL, ATOL, _ = tolerance("bounded_attend")


@pytest.fixture(scope="module")
def be(dev):
    from kvreg_opencl.backend import OpenCLBackend

    return OpenCLBackend()


def weights(rng, kvh, hd, sink, gws):
    sk = rng.standard_normal((kvh, sink, hd)).astype(np.float32)
    sv = rng.standard_normal((kvh, sink, hd)).astype(np.float32)
    return BoundedWeights(sk, sv, sink, gws)


def bounded_attend_oracle(q, ring, *, scale, num_heads):
    """The f64 oracle on a RingView."""
    return _oracle(q, ring.k, ring.v, ring.seen, ring.sink_k, ring.sink_v, ring.group_windows, ring.rope,
                   scale, num_heads)


def attend(fn, st, q, w, rope, scale=0.25):
    """``fn`` (a bounded_attend kernel) on the view of ``st``'s ring."""
    return fn(q, st.view(w, rope), scale=scale, num_heads=q.shape[0])


def ring_mirror(be, st, w, rope):
    return be.ring_mirror(st.view(w, rope))


def assert_close(got, want, what):
    err = np.abs(got - want) - (ATOL + RTOL * np.abs(want))
    assert err.max() <= 0, f"{what}: worst excess {err.max():.3g}"


def insert(st, rng):
    st.insert(rng.standard_normal((st.num_kv_heads, st.head_dim)),
              rng.standard_normal((st.num_kv_heads, st.head_dim)))


@pytest.mark.parametrize("sink, rd", [(0, None), (3, None), (2, 6), (2, 0)])
def test_every_step_matches_the_oracle_and_the_reference(be, small_blocks, sink, rd):
    # window 10 wraps twice; group windows narrower than the ring; the small
    # blocks split a group's rows over several work-groups
    kvh, hd, hpk, window = 3, 12, 2, 10
    rng = np.random.default_rng(sink)
    st = BoundedState(kvh, hd, window)
    w = weights(rng, kvh, hd, sink, [10, 4, 7])
    rope = BoundedRope(theta=500.0, rotary_dims=rd)
    for t in range(25):
        insert(st, rng)
        q = (2 * rng.standard_normal((kvh * hpk, hd))).astype(np.float32)
        got = attend(be.bounded_attend, st, q, w, rope)
        assert got.dtype == np.float32 and got.shape == q.shape
        assert_close(got, attend(bounded_attend_oracle, st, q, w, rope), f"oracle step {t}")
        assert_close(got, attend(bounded_attend, st, q, w, rope), f"reference step {t}")


def test_a_long_window_at_large_positions_matches_the_reference(be):
    # default tunables: one group's 600 rows span two 512-row blocks;
    # positions near 1e5 exercise the host-computed float64 angles
    kvh, hd, hpk, window = 2, 64, 4, 600
    rng = np.random.default_rng(3)
    st = BoundedState(kvh, hd, window)
    st.load(rng.standard_normal((kvh, window, hd)), rng.standard_normal((kvh, window, hd)), 99_000)
    w = weights(rng, kvh, hd, 4, [600, 300])
    rope = BoundedRope()
    for _ in range(3):
        insert(st, rng)
        q = rng.standard_normal((kvh * hpk, hd)).astype(np.float32)
        assert_close(attend(be.bounded_attend, st, q, w, rope, 0.125),
                     attend(bounded_attend, st, q, w, rope, 0.125), "reference")


def test_a_1000_step_decode_uploads_1000_slots(be, small_blocks):
    kvh, hd, window = 2, 16, 64
    rng = np.random.default_rng(4)
    st = BoundedState(kvh, hd, window)
    w = weights(rng, kvh, hd, 2, [64, 16])
    rope = BoundedRope()
    q = rng.standard_normal((kvh * 2, hd)).astype(np.float32)
    insert(st, rng)
    attend(be.bounded_attend, st, q, w, rope)
    m = ring_mirror(be, st, w, rope)
    c0 = m.counters()
    assert c0["full_reuploads"] == 1
    for _ in range(1000):
        insert(st, rng)
        out = attend(be.bounded_attend, st, q, w, rope)
    c = m.counters()
    assert c["slot_uploads"] - c0["slot_uploads"] == 1000
    assert c["full_reuploads"] == 1 and c["sink_uploads"] == 1
    assert c["bytes_uploaded"] - c0["bytes_uploaded"] == 1000 * kvh * hd * 4 * 2
    assert_close(out, attend(bounded_attend_oracle, st, q, w, rope), "after 1000 steps")


def test_inserts_between_attends_upload_their_slots_only(be, small_blocks):
    # several inserts between two attends: the ring's version says only
    # inserts happened, so their slots are uploaded; a window's worth or more
    # of them (every slot rewritten) is a full upload
    kvh, hd, window = 2, 16, 8
    rng = np.random.default_rng(11)
    st = BoundedState(kvh, hd, window)
    w = weights(rng, kvh, hd, 1, [8, 5])
    rope = BoundedRope()
    q = rng.standard_normal((kvh * 2, hd)).astype(np.float32)
    insert(st, rng)
    attend(be.bounded_attend, st, q, w, rope)
    m = ring_mirror(be, st, w, rope)
    for n, full in ((3, 0), (window - 1, 0), (window, 1), (2 * window + 3, 1)):
        c0 = m.counters()
        for _ in range(n):
            insert(st, rng)
        got = attend(be.bounded_attend, st, q, w, rope)
        c = m.counters()
        assert c["full_reuploads"] - c0["full_reuploads"] == full, n
        assert c["bytes_uploaded"] - c0["bytes_uploaded"] == min(n, window) * kvh * hd * 4 * 2, n
        assert_close(got, attend(bounded_attend, st, q, w, rope), f"{n} inserts")
        assert got.tobytes() == attend(type(be)().bounded_attend, st, q, w, rope).tobytes(), n


def test_rollback_forces_a_reupload_and_answers_like_the_reference(be, small_blocks):
    kvh, hd, window = 2, 16, 8
    rng = np.random.default_rng(5)
    st = BoundedState(kvh, hd, window, undo_depth=4)
    w = weights(rng, kvh, hd, 1, [8, 5])
    rope = BoundedRope()
    q = rng.standard_normal((kvh * 2, hd)).astype(np.float32)
    for _ in range(12):
        insert(st, rng)
        attend(be.bounded_attend, st, q, w, rope)
    m = ring_mirror(be, st, w, rope)
    full = m.full_reuploads
    assert st.rollback(3) == 3
    got = attend(be.bounded_attend, st, q, w, rope)
    assert m.full_reuploads == full + 1
    assert_close(got, attend(bounded_attend, st, q, w, rope), "after rollback")
    # rolled back by one and stepped again: seen is back where the mirror
    # was, not one ahead, and a rollback is not an insert: a re-upload too
    st.rollback(1)
    insert(st, rng)
    got = attend(be.bounded_attend, st, q, w, rope)
    assert m.full_reuploads == full + 2
    assert_close(got, attend(bounded_attend, st, q, w, rope), "rollback then insert")


def test_restoring_a_sibling_branch_one_ahead_is_not_mistaken_for_a_step(be, small_blocks):
    # branch A reaches seen 11 (snapshot), branch B also reaches 11 and is
    # attended; restoring A then inserting gives seen 12 = the mirror's 11 + 1,
    # but slot 10 holds A's row, not B's: the restore moved the ring's
    # reset_version, so the mirror must not take it for a one-slot step.
    kvh, hd, window = 2, 16, 16
    rng = np.random.default_rng(6)
    st = BoundedState(kvh, hd, window)
    w = weights(rng, kvh, hd, 0, [16, 16])
    rope = BoundedRope()
    q = rng.standard_normal((kvh * 2, hd)).astype(np.float32)
    for _ in range(10):
        insert(st, rng)
    base = st.snapshot()
    insert(st, rng)
    branch_a = st.snapshot()
    st.restore(base)
    insert(st, rng)
    attend(be.bounded_attend, st, q, w, rope)
    m = ring_mirror(be, st, w, rope)
    full = m.full_reuploads
    st.restore(branch_a)
    insert(st, rng)
    got = attend(be.bounded_attend, st, q, w, rope)
    assert m.full_reuploads == full + 1
    assert_close(got, attend(bounded_attend, st, q, w, rope), "sibling branch")


def test_clear_and_load_reupload(be, small_blocks):
    kvh, hd, window = 1, 8, 4
    rng = np.random.default_rng(7)
    st = BoundedState(kvh, hd, window)
    w = weights(rng, kvh, hd, 0, [4])
    rope = BoundedRope()
    q = rng.standard_normal((2, hd)).astype(np.float32)
    for _ in range(6):
        insert(st, rng)
        attend(be.bounded_attend, st, q, w, rope)
    m = ring_mirror(be, st, w, rope)
    full = m.full_reuploads
    st.clear()
    insert(st, rng)
    assert_close(attend(be.bounded_attend, st, q, w, rope), attend(bounded_attend, st, q, w, rope), "clear")
    st.load(rng.standard_normal((kvh, window, hd)), rng.standard_normal((kvh, window, hd)), 7)
    assert_close(attend(be.bounded_attend, st, q, w, rope), attend(bounded_attend, st, q, w, rope), "load")
    assert m.full_reuploads == full + 2


def test_an_incremental_mirror_equals_a_fresh_one_bit_for_bit(be, small_blocks):
    from kvreg_opencl.backend import OpenCLBackend

    kvh, hd, window = 2, 16, 8
    rng = np.random.default_rng(8)
    st = BoundedState(kvh, hd, window)
    w = weights(rng, kvh, hd, 2, [8, 3])
    rope = BoundedRope(rotary_dims=8)
    q = rng.standard_normal((kvh * 3, hd)).astype(np.float32)
    for _ in range(19):
        insert(st, rng)
        got = attend(be.bounded_attend, st, q, w, rope)
    fresh = attend(OpenCLBackend().bounded_attend, st, q, w, rope)
    np.testing.assert_array_equal(got.view(np.uint32), fresh.view(np.uint32))


def test_changed_sinks_or_rope_are_uploaded(be, small_blocks):
    kvh, hd, window = 1, 8, 4
    rng = np.random.default_rng(9)
    st = BoundedState(kvh, hd, window)
    w1, w2 = weights(rng, kvh, hd, 2, [4]), weights(rng, kvh, hd, 2, [4])
    q = rng.standard_normal((2, hd)).astype(np.float32)
    for _ in range(5):
        insert(st, rng)
    for w, rope in ((w1, BoundedRope()), (w2, BoundedRope()), (w2, BoundedRope(theta=50.0))):
        assert_close(attend(be.bounded_attend, st, q, w, rope), attend(bounded_attend, st, q, w, rope),
                     f"theta {rope.theta}")


def test_two_rings_keep_separate_mirrors(be, small_blocks):
    kvh, hd, window = 1, 8, 4
    rng = np.random.default_rng(10)
    a, b = BoundedState(kvh, hd, window), BoundedState(kvh, hd, window)
    w = weights(rng, kvh, hd, 0, [4])
    rope = BoundedRope()
    q = rng.standard_normal((2, hd)).astype(np.float32)
    for _ in range(6):
        insert(a, rng)
        insert(b, rng)
        for st in (a, b):
            assert_close(attend(be.bounded_attend, st, q, w, rope), attend(bounded_attend, st, q, w, rope), "ring")
    assert ring_mirror(be, a, w, rope) is not ring_mirror(be, b, w, rope)
    assert ring_mirror(be, a, w, rope).full_reuploads == 1


def test_a_mirror_handed_another_rings_view_reuploads_it(be, small_blocks):
    from kvreg_opencl.bounded import RingMirror

    kvh, hd, window = 1, 8, 4
    rng = np.random.default_rng(12)
    a, b = BoundedState(kvh, hd, window), BoundedState(kvh, hd, window)
    w = weights(rng, kvh, hd, 0, [4])
    rope = BoundedRope()
    for _ in range(3):
        insert(a, rng)
        insert(b, rng)
    m = RingMirror(be._dev)
    m.sync(a.view(w, rope))
    insert(b, rng)  # b: only inserts since a's version, one ahead of a's seen
    m.sync(b.view(w, rope))
    assert m.full_reuploads == 2 and m.slot_uploads == 0
    m.sync(a.view(w, rope))  # back to a at the version the mirror first saw
    assert m.full_reuploads == 3


def test_arguments_are_checked_like_the_reference(be):
    kvh, hd = 2, 8
    st = BoundedState(kvh, hd, 4)
    empty = np.zeros((kvh, 0, hd), np.float32)
    q = np.zeros((4, hd), np.float32)
    # the ring's own arguments are checked where its view is built, for every backend
    with pytest.raises(StateError):
        ring_view(st.ring_k, st.ring_v, 0, empty, empty, [4, 4], BoundedRope())
    with pytest.raises(ConfigError):
        ring_view(st.ring_k, st.ring_v, 1, empty, empty, [5, 4], BoundedRope())
    # the query and the parameters by the kernel: the backend refuses what the reference refuses
    ring = ring_view(st.ring_k, st.ring_v, 1, empty, empty, [4, 4], BoundedRope())
    for fn in (be.bounded_attend, bounded_attend):
        with pytest.raises(ConfigError):
            fn(q[:3], ring, scale=0.5, num_heads=3)  # not a multiple of the KV heads
        with pytest.raises(ConfigError):
            fn(q, ring, scale=float("inf"), num_heads=4)
        with pytest.raises(ConfigError):
            fn(q, (st.ring_k, st.ring_v), scale=0.5, num_heads=4)  # not a RingView
