"""The vectorizable exp used by the softmax passes."""

import numpy as np
from numba import njit

from kvreg_numba.intrinsics import exp_sum, fexp, lane_sum


@njit
def _apply(x):
    out = np.empty_like(x)
    for i in range(x.shape[0]):
        out[i] = fexp(x[i])
    return out


def test_fexp_is_within_3e7_relative_on_the_softmax_range():
    x = -np.concatenate([np.linspace(0, 87, 200001), np.random.default_rng(0).random(10000) * 87]).astype(np.float32)
    ref = np.exp(x.astype(np.float64))
    got = _apply(x)
    assert np.max(np.abs(got - ref) / ref) < 3e-7


def test_fexp_edges():
    got = _apply(np.array([0.0, -0.0, -np.inf, -87.5, -1e-30], np.float32))
    assert got[0] == 1.0 and got[1] == 1.0 and got[4] == 1.0
    assert got[2] == 0.0 and got[3] == 0.0  # -inf and the flushed tail are exactly 0


@njit
def _exp_then_sum(x, scale, mx):
    for i in range(x.shape[0]):
        x[i] = fexp(x[i] * scale - mx)
    return lane_sum(x)


@njit
def _fused(x, scale, mx):
    return exp_sum(x, scale, mx)


def test_the_fused_exp_and_sum_give_fexp_then_sums_bits():
    # exp_sum (the softmax's one pass, LANES wide) against fexp per element
    # then lane_sum: every length's tail, -inf scores, 4M arguments over the range.
    rng = np.random.default_rng(1)
    cases = []
    for n in (0, 1, 5, 16, 17, 100, 4099):
        for spread in (1, 10, 100):
            x = (rng.standard_normal(n) * spread).astype(np.float32)
            if n > 3:
                x[rng.integers(0, n, 2)] = -np.inf
            cases.append((x, np.float32(rng.random() + 0.01)))
    cases.append((np.linspace(-100, 0, 1 << 22, dtype=np.float32), np.float32(1)))
    for x, scale in cases:
        mx = np.float32(np.max(x) * scale) if x.size and np.isfinite(x).any() else np.float32(0)
        a, b = x.copy(), x.copy()
        za, zb = _exp_then_sum(a, scale, mx), _fused(b, scale, mx)
        assert a.tobytes() == b.tobytes() and np.float32(za).tobytes() == np.float32(zb).tobytes()
