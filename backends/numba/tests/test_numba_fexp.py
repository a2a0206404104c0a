"""The vectorizable exp used by the softmax passes."""

import numpy as np
from numba import njit

from kvreg_numba.kernels import fexp


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
