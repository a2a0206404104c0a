"""The bounded anchor ring (swa_sink_v1): ring bookkeeping, undo, snapshots,
RoPE and bounded attention against the float64 oracle."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvreg.bounded import (
    BoundedRope,
    BoundedSnapshot,
    BoundedState,
    BoundedWeights,
    bounded_attend,
    ring_view,
)
from kvreg.errors import ConfigError, KvregError, ShapeError, StateError
from kvreg_conformance.oracle import bounded_attend_oracle
from kvreg_conformance.tolerances import tolerance

RTOL = tolerance("bounded_attend")[0]


def rows(rng, kvh, hd):
    return rng.standard_normal((kvh, hd)).astype(np.float32)


def filled(kvh=2, hd=4, window=4, n=0, seed=0, undo_depth=8):
    """A state after ``n`` random inserts, and the list of inserted (k, v)."""
    rng = np.random.default_rng(seed)
    s = BoundedState(kvh, hd, window, undo_depth=undo_depth)
    hist = []
    for _ in range(n):
        k, v = rows(rng, kvh, hd), rows(rng, kvh, hd)
        s.insert(k, v)
        hist.append((k, v))
    return s, hist


def expected_ring(hist, kvh, hd, window):
    """The ring a plain list of tokens implies: token t at slot t % window."""
    rk = np.zeros((kvh, window, hd), np.float32)
    rv = np.zeros((kvh, window, hd), np.float32)
    for t in range(max(0, len(hist) - window), len(hist)):
        rk[:, t % window], rv[:, t % window] = hist[t]
    return rk, rv


def bits(a):
    return a.view(np.uint32).tobytes()


# ── ring bookkeeping ──


def test_new_state_is_zeroed_and_empty():
    s = BoundedState(2, 4, 8)
    assert (s.seen, s.len(), len(s), s.head()) == (0, 0, 0, 0)
    assert s.ring_k.shape == s.ring_v.shape == (2, 8, 4)
    assert s.ring_k.dtype == np.float32 and not s.ring_k.any() and not s.ring_v.any()


def test_len_and_head_follow_seen_through_wraparound():
    s, _ = filled(window=4, n=0)
    got = []
    for _ in range(9):
        s.insert(np.ones((2, 4)), np.ones((2, 4)))
        got.append((s.seen, s.len(), s.head()))
    assert got == [(t, min(t, 4), t % 4) for t in range(1, 10)]


def test_ring_after_three_windows_holds_the_last_window_rows():
    kvh, hd, w = 2, 4, 5
    s, hist = filled(kvh, hd, w, n=3 * w + 2)
    rk, rv = expected_ring(hist, kvh, hd, w)
    assert bits(s.ring_k) == bits(rk) and bits(s.ring_v) == bits(rv)


def test_insert_accepts_flat_rows_and_integer_dtype():
    a, b = BoundedState(2, 3, 4), BoundedState(2, 3, 4)
    k = np.arange(6, dtype=np.int64)
    a.insert(k, k)
    b.insert(k.reshape(2, 3).astype(np.float32), k.reshape(2, 3).astype(np.float32))
    assert a.same_state(b)


@pytest.mark.parametrize(
    "k",
    [
        np.zeros((2, 5), np.float32),  # wrong head_dim
        np.zeros((3, 4), np.float32),  # wrong kv heads
        np.zeros(7, np.float32),  # wrong flat length
        np.full((2, 4), np.nan, np.float32),  # not finite
        np.full((2, 4), 1e300),  # overflows float32
        np.zeros((2, 4), np.complex64),  # not real
        np.array([["a"] * 4] * 2),  # not numeric
    ],
    ids=["hd", "kvh", "flat", "nan", "overflow", "complex", "str"],
)
def test_refused_insert_raises_shape_error_and_changes_nothing(k):
    s, _ = filled(2, 4, 4, n=6)
    before = s.snapshot()
    with pytest.raises(ShapeError):
        s.insert(k, np.zeros((2, 4), np.float32))
    with pytest.raises(ShapeError):
        s.insert(np.zeros((2, 4), np.float32), k)
    assert bits(s.ring_k) == bits(before.ring_k) and bits(s.ring_v) == bits(before.ring_v)
    assert s.seen == 6 and s.undo_available == 6


@pytest.mark.parametrize("args", [(0, 4, 4), (2, 0, 4), (2, 4, 0), (2.0, 4, 4), (True, 4, 4)])
def test_bad_geometry_is_refused(args):
    with pytest.raises(ConfigError):
        BoundedState(*args)


def test_negative_undo_depth_is_refused():
    with pytest.raises(ConfigError):
        BoundedState(1, 4, 4, undo_depth=-1)


# ── undo ──


def test_rollback_restores_overwritten_rows_bit_for_bit():
    s, _ = filled(2, 4, 4, n=10)
    before = s.snapshot()
    rng = np.random.default_rng(7)
    for _ in range(6):  # more than a window: every slot is overwritten
        s.insert(rows(rng, 2, 4), rows(rng, 2, 4))
    assert s.rollback(6) == 6
    assert s.seen == 10
    assert bits(s.ring_k) == bits(before.ring_k) and bits(s.ring_v) == bits(before.ring_v)


def test_rollback_before_the_ring_fills_restores_zero_slots():
    s, hist = filled(1, 4, 8, n=5)
    assert s.rollback(3) == 3
    rk, rv = expected_ring(hist[:2], 1, 4, 8)
    assert (s.seen, s.len()) == (2, 2)
    assert bits(s.ring_k) == bits(rk) and bits(s.ring_v) == bits(rv)


def test_rollback_stops_at_undo_depth_and_returns_the_count():
    s, hist = filled(2, 4, 4, n=10, undo_depth=3)
    assert s.rollback(5) == 3
    assert s.seen == 7
    rk, _ = expected_ring(hist[:7], 2, 4, 4)
    assert bits(s.ring_k) == bits(rk)
    assert s.rollback(1) == 0 and s.seen == 7


def test_rollback_is_limited_to_inserts_made():
    s, _ = filled(1, 4, 4, n=2, undo_depth=8)
    assert s.rollback(5) == 2 and s.seen == 0 and not s.ring_k.any()


def test_undo_depth_zero_never_rolls_back():
    s, _ = filled(1, 4, 4, n=3, undo_depth=0)
    assert s.rollback(2) == 0 and s.seen == 3


def test_inserts_after_a_rollback_can_be_rolled_back_again():
    s, hist = filled(2, 4, 4, n=9, undo_depth=4)
    assert s.rollback(2) == 2
    rng = np.random.default_rng(3)
    for _ in range(3):
        s.insert(rows(rng, 2, 4), rows(rng, 2, 4))
    # 2 undo entries left before + 3 new ones, capped at depth 4.
    assert s.undo_available == 4
    assert s.rollback(4) == 4
    rk, rv = expected_ring(hist[:6], 2, 4, 4)
    assert s.seen == 6 and bits(s.ring_k) == bits(rk) and bits(s.ring_v) == bits(rv)


@pytest.mark.parametrize("d", [-1, 1.5, None])
def test_bad_rollback_depth_is_refused(d):
    s, _ = filled(n=3)
    with pytest.raises(KvregError):
        s.rollback(d)
    assert s.seen == 3 and s.undo_available == 3


def test_reset_undo_forgets_undo_rows_only():
    s, _ = filled(n=5)
    before = s.snapshot()
    s.reset_undo()
    assert s.rollback(3) == 0
    assert s.seen == 5 and bits(s.ring_k) == bits(before.ring_k)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.one_of(st.just(-1), st.integers(0, 6)), max_size=40), st.integers(0, 4))
def test_ring_matches_a_list_model_under_inserts_and_rollbacks(ops, depth):
    # -1 inserts a token; d >= 0 rolls back d. The model keeps the whole
    # token list and how many of its latest tokens can still be undone.
    kvh, hd, w = 1, 2, 3
    s = BoundedState(kvh, hd, w, undo_depth=depth)
    hist, undo, counter = [], 0, 0
    for op in ops:
        if op == -1:
            counter += 1
            k = np.full((kvh, hd), counter, np.float32)
            s.insert(k, -k)
            hist.append((k, -k))
            undo = min(undo + 1, depth)
        else:
            n = min(op, undo)
            assert s.rollback(op) == n
            del hist[len(hist) - n :]
            undo -= n
    rk, rv = expected_ring(hist, kvh, hd, w)
    assert s.seen == len(hist)
    assert bits(s.ring_k) == bits(rk) and bits(s.ring_v) == bits(rv)


# ── snapshot / restore / same_state / clear / bytes ──


def test_snapshot_restore_round_trips_rings_seen_and_undo():
    s, _ = filled(2, 4, 4, n=7)
    snap = s.snapshot()
    rng = np.random.default_rng(9)
    for _ in range(5):
        s.insert(rows(rng, 2, 4), rows(rng, 2, 4))
    s.restore(snap)
    assert s.seen == 7
    assert bits(s.ring_k) == bits(snap.ring_k) and bits(s.ring_v) == bits(snap.ring_v)
    # The undo rows came back too: rolling back from the restore point works.
    ref, _ = filled(2, 4, 4, n=7)
    assert s.rollback(3) == ref.rollback(3) == 3
    assert s.same_state(ref)


def test_snapshot_is_a_read_only_copy():
    s, _ = filled(n=3)
    snap = s.snapshot()
    s.insert(np.ones((2, 4)), np.ones((2, 4)))
    assert snap.seen == 3 and not np.shares_memory(snap.ring_k, s.ring_k)
    with pytest.raises(ValueError):
        snap.ring_k[0, 0, 0] = 1.0


@pytest.mark.parametrize("geom", [(2, 4, 8, 8), (2, 8, 4, 8), (1, 4, 4, 8), (2, 4, 4, 3)])
def test_restore_refuses_another_geometry_and_changes_nothing(geom):
    kvh, hd, w, depth = geom
    other, _ = filled(kvh, hd, w, n=2, undo_depth=depth)
    s, _ = filled(2, 4, 4, n=5)
    before = s.snapshot()
    with pytest.raises(ShapeError):
        s.restore(other.snapshot())
    assert s.seen == 5 and bits(s.ring_k) == bits(before.ring_k)


def test_restore_refuses_a_snapshot_whose_arrays_disagree_with_it():
    import dataclasses

    s, _ = filled(2, 4, 4, n=5)
    bad = dataclasses.replace(s.snapshot(), undo_v=np.zeros((1, 2, 4), np.float32))
    s.insert(np.ones((2, 4)), np.ones((2, 4)))
    before = s.snapshot()
    with pytest.raises(ShapeError):
        s.restore(bad)
    assert s.seen == 6 and s.undo_available == 6 and bits(s.ring_k) == bits(before.ring_k)


def test_restore_refuses_a_non_snapshot():
    s, _ = filled(n=1)
    with pytest.raises(ShapeError):
        s.restore(object())


def test_restore_keeps_array_identity():
    s, _ = filled(n=5)
    snap = s.snapshot()
    ids = (id(s.ring_k), id(s.ring_v))
    s.restore(snap)
    assert (id(s.ring_k), id(s.ring_v)) == ids


def test_same_state_compares_seen_and_rings_but_not_undo():
    a, _ = filled(n=6, seed=1)
    b, _ = filled(n=6, seed=1)
    b.reset_undo()
    assert a.same_state(b)
    b.insert(np.ones((2, 4)), np.ones((2, 4)))
    assert not a.same_state(b)
    c, _ = filled(n=6, seed=2)
    assert not a.same_state(c)
    assert not a.same_state(BoundedState(2, 4, 8))


def test_same_state_compares_seen_even_when_rings_agree():
    # Two full laps of identical rows leave the same ring as one lap.
    a, b = BoundedState(1, 2, 3), BoundedState(1, 2, 3)
    for _ in range(3):
        a.insert([1.0, 2.0], [3.0, 4.0])
    for _ in range(6):
        b.insert([1.0, 2.0], [3.0, 4.0])
    assert bits(a.ring_k) == bits(b.ring_k) and not a.same_state(b)


def test_same_state_distinguishes_negative_zero():
    a, b = BoundedState(1, 2, 2), BoundedState(1, 2, 2)
    a.insert([0.0, 0.0], [0.0, 0.0])
    b.insert([-0.0, 0.0], [0.0, 0.0])
    assert not a.same_state(b)


def test_clear_zeroes_in_place_and_keeps_array_identity():
    s, _ = filled(n=9)
    rk, rv = s.ring_k, s.ring_v
    s.clear()
    assert s.ring_k is rk and s.ring_v is rv
    assert not rk.any() and not rv.any()
    assert (s.seen, s.len(), s.head(), s.rollback(3)) == (0, 0, 0, 0)


def test_state_bytes_is_constant_from_token_1_to_10k():
    s = BoundedState(2, 2, 16, undo_depth=4)
    k = np.ones((2, 2), np.float32)
    s.insert(k, k)
    first = s.state_bytes()
    for _ in range(9999):
        s.insert(k, k)
    assert s.seen == 10_000 and s.state_bytes() == first
    # Rings (2 × 2·16·2 f32) plus the undo capacity (2 × 4·2·2 f32).
    assert first == 2 * 2 * 16 * 2 * 4 + 2 * 4 * 2 * 2 * 4


def test_load_overwrites_rings_in_place_and_resets_undo():
    a, _ = filled(2, 4, 4, n=11)
    b, _ = filled(2, 4, 4, n=3, seed=5)
    rk = b.ring_k
    b.load(a.ring_k.ravel(), a.ring_v, a.seen)
    assert b.ring_k is rk and b.same_state(a) and b.rollback(1) == 0


def test_refused_load_changes_nothing():
    b, _ = filled(2, 4, 4, n=3)
    before = b.snapshot()
    with pytest.raises(ShapeError):
        b.load(np.zeros((2, 8, 4), np.float32), np.zeros((2, 8, 4), np.float32), 3)
    assert b.seen == 3 and b.undo_available == 3 and bits(b.ring_k) == bits(before.ring_k)


# ── RoPE ──


def test_rope_rotates_each_pair_by_position_times_inverse_frequency():
    rope = BoundedRope(theta=100.0)
    x = np.array([[1.0, 2.0, 3.0, 4.0]], np.float32)
    got = rope.apply(x, [3])[0]
    # pairs (0, 2) at freq 1 and (1, 3) at freq 100**(-1/2) = 0.1
    a0, a1 = 3 * 1.0, 3 * 0.1
    want = [
        1 * np.cos(a0) - 3 * np.sin(a0),
        2 * np.cos(a1) - 4 * np.sin(a1),
        3 * np.cos(a0) + 1 * np.sin(a0),
        4 * np.cos(a1) + 2 * np.sin(a1),
    ]
    np.testing.assert_allclose(got, want, rtol=1e-6)


def test_rope_leaves_channels_past_rotary_dims_unchanged():
    x = np.random.default_rng(0).standard_normal((3, 6)).astype(np.float32)
    got = BoundedRope(rotary_dims=2).apply(x, [5, 6, 7])
    assert bits(got[:, 2:].copy()) == bits(x[:, 2:].copy())
    assert not np.array_equal(got[:, :2], x[:, :2])


def test_rope_at_position_zero_is_the_identity():
    x = np.random.default_rng(0).standard_normal((1, 8)).astype(np.float32)
    assert bits(BoundedRope().apply(x, [0])) == bits(x)


@pytest.mark.parametrize("start", [0, 7, 123_456])
def test_rope_range_tables_match_direct_evaluation(start):
    rope = BoundedRope(theta=10000.0)
    got_c, got_s = rope.cos_sin_range(start, 300, 64)
    want_c, want_s = rope.cos_sin(np.arange(start, start + 300), 64)
    np.testing.assert_allclose(got_c, want_c, rtol=0, atol=2e-7)
    np.testing.assert_allclose(got_s, want_s, rtol=0, atol=2e-7)


@pytest.mark.parametrize(
    "kw", [{"rotary_dims": 3}, {"rotary_dims": -2}, {"theta": 0.0}, {"theta": float("nan")}]
)
def test_bad_rope_is_refused(kw):
    with pytest.raises(ConfigError):
        BoundedRope(**kw)


def test_rope_wider_than_head_dim_is_refused_at_attend():
    s, _ = filled(1, 4, 4, n=1)
    w = BoundedWeights(np.zeros(0), np.zeros(0), 0, [4])
    with pytest.raises(ConfigError, match="rotary_dims"):
        s.attend(np.zeros((1, 4)), 1, w, BoundedRope(rotary_dims=6), 0.5)


# ── attention ──


def make_case(kvh, hd, window, gqa, sink, gws, seen, seed=0):
    rng = np.random.default_rng(seed)
    s = BoundedState(kvh, hd, window)
    for _ in range(seen):
        s.insert(rng.standard_normal((kvh, hd)), rng.standard_normal((kvh, hd)))
    sk = rng.standard_normal((kvh, sink, hd)).astype(np.float32)
    sv = rng.standard_normal((kvh, sink, hd)).astype(np.float32)
    q = rng.standard_normal((kvh * gqa, hd)).astype(np.float32)
    return s, BoundedWeights(sk, sv, sink, gws), q


def oracle(s, w, q, rope, scale, num_heads):
    return bounded_attend_oracle(
        q, s.ring_k, s.ring_v, s.seen, w.sink_k, w.sink_v, w.group_windows, rope, scale, num_heads
    )


CASES = {
    # kvh, hd, window, gqa, sink, group_windows, rotary_dims
    "baseline": (2, 8, 6, 1, 2, [6, 6], None),
    "no_sinks": (2, 8, 6, 1, 0, [6, 6], None),
    "window_1": (2, 8, 1, 2, 1, [1, 1], None),
    "narrow_groups": (3, 8, 8, 2, 2, [3, 8, 1], None),
    "gqa_4": (2, 8, 5, 4, 3, [5, 2], None),
    "partial_rotary": (2, 12, 6, 4, 1, [4, 6], 4),
    "no_rotary": (1, 4, 4, 1, 1, [4], 0),
}


@pytest.mark.parametrize("seen", [1, 3, 7, 20, 1000])
@pytest.mark.parametrize("case", list(CASES))
def test_reference_attend_matches_the_f64_oracle(case, seen):
    kvh, hd, window, gqa, sink, gws, rd = CASES[case]
    s, w, q = make_case(kvh, hd, window, gqa, sink, gws, seen)
    rope = BoundedRope(theta=10000.0, rotary_dims=rd)
    got = s.attend(q, kvh * gqa, w, rope, hd**-0.5)
    want = oracle(s, w, q, rope, hd**-0.5, kvh * gqa)
    assert got.dtype == np.float32 and got.shape == (kvh * gqa, hd)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=RTOL)


def test_softmax_stays_finite_for_scores_past_float32_exp_range():
    # Scores near 1e3 overflow exp() in float32 unless the max is subtracted.
    s, w, q = make_case(2, 8, 4, 2, 1, [4, 4], 6)
    q = q * np.float32(100.0)
    rope = BoundedRope()
    got = s.attend(q, 4, w, rope, 1.0)
    want = oracle(s, w, q, rope, 1.0, 4)
    assert np.isfinite(got).all()
    rtol, atol, _ = tolerance("bounded_large_logits")
    np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


def test_attend_does_not_change_the_state():
    s, w, q = make_case(2, 8, 4, 2, 1, [4, 2], 9)
    before = s.snapshot()
    s.attend(q, 4, w, BoundedRope(), 0.3)
    assert s.seen == 9
    assert bits(s.ring_k) == bits(before.ring_k) and bits(s.ring_v) == bits(before.ring_v)


def test_group_window_limits_which_rows_a_group_sees():
    # Only the newest row is visible with a group window of 1 and no sinks,
    # so the output is exactly that row's value whatever the query.
    s, w, q = make_case(1, 4, 4, 2, 0, [1], 6)
    got = s.attend(q, 2, w, BoundedRope(), 1.0)
    newest = s.ring_v[0, (s.seen - 1) % 4]
    assert bits(got) == bits(np.stack([newest, newest]))


def test_sinks_join_the_softmax_without_rotation():
    # One ring row and one sink with identical raw keys: at position 0 the
    # ring key is unrotated too, so both score the same and share mass evenly.
    s = BoundedState(1, 2, 4)
    s.insert([1.0, 0.0], [2.0, 0.0])
    w = BoundedWeights([1.0, 0.0], [0.0, 4.0], 1, [4])
    got = s.attend([[1.0, 0.0]], 1, w, BoundedRope(), 1.0)
    np.testing.assert_allclose(got, [[1.0, 2.0]], rtol=1e-6)


def test_bounded_ring_equals_plain_sliding_window_attention():
    # A ring of width W without sinks must equal the textbook sliding window:
    # the last W raw rows of a plain list, rotated at their positions.
    kvh, gqa, hd, w, theta = 2, 2, 8, 5, 500.0
    rng = np.random.default_rng(11)
    s = BoundedState(kvh, hd, w)
    weights = BoundedWeights(np.zeros(0), np.zeros(0), 0, [w] * kvh)
    rope = BoundedRope(theta=theta)
    ks, vs = [], []
    half = hd // 2
    inv = theta ** (-np.arange(half) * 2.0 / hd)

    def rot(x, pos):  # x [n, hd] f32 at positions pos [n]
        a = np.asarray(pos, np.float64)[:, None] * inv
        c, sn = np.cos(a).astype(np.float32), np.sin(a).astype(np.float32)
        x1, x2 = x[:, :half], x[:, half:]
        return np.concatenate([x1 * c - x2 * sn, x2 * c + x1 * sn], 1)

    for t in range(3 * w + 2):
        k, v = rows(rng, kvh, hd), rows(rng, kvh, hd)
        q = rng.standard_normal((kvh * gqa, hd)).astype(np.float32)
        s.insert(k, v)
        ks.append(k)
        vs.append(v)
        got = s.attend(q, kvh * gqa, weights, rope, 0.25)
        lo = max(0, t + 1 - w)
        pos = np.arange(lo, t + 1)
        for h in range(kvh * gqa):
            g = h // gqa
            kw = rot(np.stack([x[g] for x in ks[lo:]]), pos)
            vw = np.stack([x[g] for x in vs[lo:]])
            sc = (rot(q[h][None], [t]) @ kw.T)[0] * np.float32(0.25)
            p = np.exp(sc - sc.max())
            p /= p.sum()
            np.testing.assert_allclose(got[h], p @ vw, rtol=1e-5, atol=1e-5)


def test_attend_before_any_insert_is_refused():
    s = BoundedState(1, 4, 4)
    w = BoundedWeights(np.zeros(0), np.zeros(0), 0, [4])
    with pytest.raises(StateError):
        s.attend(np.zeros((1, 4)), 1, w, BoundedRope(), 1.0)


@pytest.mark.parametrize(
    "mutate, err",
    [
        (lambda a: a.update(num_heads=3), ConfigError),  # not a multiple of kvh=2
        (lambda a: a.update(q=np.zeros((4, 5), np.float32)), ShapeError),
        (lambda a: a.update(q=np.full((4, 4), np.inf, np.float32)), ShapeError),
        (lambda a: a.update(group_windows=(4, 5)), ConfigError),  # > window
        (lambda a: a.update(group_windows=(4,)), ConfigError),  # one per group
        (lambda a: a.update(group_windows=(0, 4)), ConfigError),
        (lambda a: a.update(sink_k=np.zeros((2, 1, 3), np.float32)), ShapeError),
        (lambda a: a.update(ring_v=np.zeros((2, 4, 4), np.float64)), ShapeError),
        (lambda a: a.update(scale=float("nan")), ConfigError),
        (lambda a: a.update(rope=None), ConfigError),
    ],
    ids=[
        "heads", "q_shape", "q_inf", "gw_big", "gw_count", "gw_zero",
        "sink_shape", "ring_dtype", "scale", "rope",
    ],
)
def test_bounded_attend_refuses_bad_arguments(mutate, err):
    s, w, q = make_case(2, 4, 4, 2, 1, [4, 4], 5)
    args = dict(
        q=q, ring_k=s.ring_k, ring_v=s.ring_v, seen=s.seen, sink_k=w.sink_k, sink_v=w.sink_v,
        group_windows=w.group_windows, rope=BoundedRope(), scale=0.5, num_heads=4,
    )
    mutate(args)
    with pytest.raises(err):
        a = args
        ring = ring_view(a["ring_k"], a["ring_v"], a["seen"], a["sink_k"], a["sink_v"], a["group_windows"],
                         a["rope"])
        bounded_attend(a["q"], ring, scale=a["scale"], num_heads=a["num_heads"])


@pytest.mark.parametrize(
    "args",
    [
        (np.zeros((2, 1, 4)), np.zeros((2, 1, 4)), 2, [4, 4]),  # sink count disagrees
        (np.zeros((2, 1, 4)), np.zeros((2, 1, 8)), 1, [4, 4]),  # k and v differ
        (np.zeros(7), np.zeros(7), 1, [4, 4]),  # flat not divisible
        (np.zeros(0), np.zeros(0), 0, []),  # no groups
        (np.zeros(0), np.zeros(0), 0, [0]),  # empty window
    ],
)
def test_bad_weights_are_refused(args):
    with pytest.raises(KvregError):
        BoundedWeights(*args)


def test_weights_accept_flat_sinks_and_zero_sinks():
    w = BoundedWeights(np.arange(16.0), np.arange(16.0), 2, [3, 4])
    assert w.sink_k.shape == (2, 2, 4) and w.sink_k.dtype == np.float32
    z = BoundedWeights(np.zeros((2, 0, 4)), np.zeros((2, 0, 4)), 0, (1, 1))
    assert z.sink == 0 and z.group_windows == (1, 1)


def test_snapshot_type_is_exported():
    assert isinstance(BoundedState(1, 1, 1).snapshot(), BoundedSnapshot)
