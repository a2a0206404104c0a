"""The machine's streaming-read bandwidth, measured the way the decode
kernel reads memory (a Numba parallel reduction over float32), so that a
bandwidth fraction compares like with like in one run."""

from __future__ import annotations

import time

import numpy as np
from numba import njit, prange

from . import config
from .intrinsics import lane_sum


@njit(parallel=True, nogil=True, cache=config.CACHE, fastmath=set(config.FASTMATH))
def _parallel_sum(a):
    nchunk = 256
    n = a.shape[0]
    step = (n + nchunk - 1) // nchunk
    part = np.zeros(nchunk, np.float32)
    for c in prange(nchunk):
        # A slice indexed from 0: numba's negative-index wraparound on
        # `a[i]` with i from range(lo, hi) would defeat the vectorizer.
        # The decode kernel's own lane reduction (lane_sum): without fast-math a
        # plain `s += x[i]` loop is a serial scalar chain, which measured a
        # sixth of the bandwidth.
        part[c] = lane_sum(a[c * step:min(n, (c + 1) * step)])
    return part.sum()


def stream_read_bandwidth(nbytes: int = config.BANDWIDTH_BYTES, repeats: int = 5) -> float:
    """Best-of-``repeats`` read bandwidth in GB/s (1e9 bytes/s) of a Numba
    parallel sum over a float32 array of ``nbytes``."""
    a = np.ones(nbytes // 4, np.float32)
    _parallel_sum(a[:1024])
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        _parallel_sum(a)
        best = min(best, time.perf_counter() - t0)
    return a.nbytes / best / 1e9
