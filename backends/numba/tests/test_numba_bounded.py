"""Bounded ring attention: the f64 oracle and the reference, on multi-block
inputs (block 5, rows rotated SUB_ROWS at a time, runs split at the wrap)."""

import numpy as np
import pytest

from kvreg.bounded import BoundedRope, bounded_attend, ring_view
from kvreg.errors import ConfigError, StateError
from kvreg_conformance.oracle import bounded_attend_oracle
from kvreg_conformance.tolerances import tolerance
from kvreg_numba.backend import NumbaBackend

RTOL, ATOL, _ = tolerance("bounded_attend")


def attend(be, q, rk, rv, seen, sk, sv, gws, rope, scale, nh):
    """``be.bounded_attend`` (or the module's reference) on the flat arguments the oracle takes."""
    ring = ring_view(rk, rv, seen, sk, sv, gws, rope)
    if be is None:
        return bounded_attend(q, ring, scale=scale, num_heads=nh)
    return be.bounded_attend(q, ring, scale=scale, num_heads=nh)


def ring(kvh, window, hd, sink, seed=0, hpk=3):
    rng = np.random.default_rng(seed)

    def f(*s):
        return rng.standard_normal(s).astype(np.float32)

    return f(kvh, window, hd), f(kvh, window, hd), f(kvh, sink, hd), f(kvh, sink, hd), f(kvh * hpk, hd)


@pytest.mark.parametrize("seen", [1, 7, 37, 40, 41, 100_003])
@pytest.mark.parametrize("rotary_dims,sink", [(None, 2), (10, 0), (0, 3)])
def test_bounded_attend_matches_the_f64_oracle(small_blocks, seen, rotary_dims, sink):
    kvh, window, hd = 3, 40, 22  # odd pairs, an unrotated tail when rd = 10
    rk, rv, sk, sv, q = ring(kvh, window, hd, sink)
    rope = BoundedRope(theta=500.0, rotary_dims=rotary_dims)
    args = (q, rk, rv, seen, sk, sv, [40, 17, 1], rope, 0.3, 3 * kvh)
    got = attend(NumbaBackend(), *args)
    want = bounded_attend_oracle(*args)
    assert got.dtype == np.float32 and got.shape == (9, hd)
    np.testing.assert_allclose(got, want, rtol=RTOL, atol=ATOL)


def test_bounded_attend_agrees_with_the_reference_at_decode_size():
    kvh, window, hd = 2, 600, 128
    rk, rv, sk, sv, q = ring(kvh, window, hd, 4, seed=3, hpk=4)
    args = (q, rk, rv, 5_000, sk, sv, [600, 300], BoundedRope(), hd ** -0.5, 4 * kvh)
    np.testing.assert_allclose(attend(NumbaBackend(), *args), attend(None, *args), rtol=RTOL, atol=ATOL)


def test_bounded_attend_is_deterministic_across_calls(small_blocks):
    rk, rv, sk, sv, q = ring(3, 40, 22, 2)
    args = (q, rk, rv, 77, sk, sv, [40, 17, 3], BoundedRope(), 0.3, 9)
    be = NumbaBackend()
    a = attend(be, *args)
    attend(be, q, rk, rv, 5, sk, sv, [40, 17, 3], BoundedRope(), 0.3, 9)  # other tables
    assert np.array_equal(a.view(np.uint32), attend(be, *args).view(np.uint32))


def test_bounded_attend_validates_like_the_reference():
    rk, rv, sk, sv, q = ring(3, 40, 22, 2)
    be = NumbaBackend()
    with pytest.raises(StateError):
        attend(be, q, rk, rv, 0, sk, sv, [40, 17, 3], BoundedRope(), 0.3, 9)
    with pytest.raises(ConfigError):
        attend(be, q, rk, rv, 5, sk, sv, [41, 17, 3], BoundedRope(), 0.3, 9)
