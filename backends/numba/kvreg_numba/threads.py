"""numba's parallel regions on kvreg's thread budget, and per-thread scratch.

kvreg decides how many threads a call may use (:mod:`kvreg.threads`: the
budget, the measured choice per kind of call, the torch host's pool); this
module applies that to numba: it starts numba's threading layer once
without disturbing torch's thread count, sets numba's per-thread count
around a parallel call (:func:`thread_budget`), tells whether numba's
regions run on torch's OpenMP workers (:func:`in_torch_pool`), and keeps
each calling thread's scratch buffer (:func:`thread_scratch`). It is about
threads, not arithmetic: no kernel's bits depend on anything here, and
every parallel kernel of the backend (decode, batch, chunk, ring) runs
through it.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numba
import numpy as np

from kvreg.threads import pick

_tls = threading.local()


def thread_scratch(nfloats: int) -> np.ndarray:
    """A float32 buffer of at least ``nfloats``, the calling thread's own."""
    # Per thread (kernels release the GIL), grown by doubling, never shrunk.
    buf = getattr(_tls, "buf", None)
    if buf is None or buf.shape[0] < nfloats:
        buf = np.empty(max(nfloats, 2 * (0 if buf is None else buf.shape[0]), 1024), np.float32)
        _tls.buf = buf
    return buf


_layer_started = False
_omp_layer = False


def _start_threading_layer() -> None:
    """Start numba's threading layer once, leaving torch's thread count as
    the host set it. Measured: under numba's OpenMP layer, the first launch
    (or ``numba.set_num_threads``) set the process's OpenMP thread count,
    which is torch's intra-op count too, to ``NUMBA_NUM_THREADS``: a host
    that ran torch on one thread found it on two after kvreg's first decode
    (an SDPA step then took 166 ms instead of 1.9 ms on a shared machine)."""
    global _layer_started
    if _layer_started:
        return
    import sys

    from numba.np.ufunc import parallel

    torch = sys.modules.get("torch")
    before = torch.get_num_threads() if torch is not None else None
    parallel._launch_threads()
    numba.set_num_threads(numba.get_num_threads())
    if before is not None and torch.get_num_threads() != before:
        torch.set_num_threads(before)
    global get_threads, set_threads, _omp_layer
    # The threading layer's own per-thread entry points, once it is up:
    # numba's public get/set_num_threads take two process-wide locks a call
    # (~1-2 us each, paid twice a parallel call). Counts set here come from
    # kvreg.threads.pick, capped to NUMBA_NUM_THREADS, so they need no check.
    get_threads = getattr(parallel, "_get_num_threads", None) or numba.get_num_threads
    set_threads = getattr(parallel, "_set_num_threads", None) or numba.set_num_threads
    _omp_layer = numba.threading_layer() == "omp"
    _layer_started = True


# numba's per-thread count, through the threading layer's own entry points
# once :func:`_start_threading_layer` ran; read them as ``threads.get_threads``
# (the module attribute), never imported by name, which would keep these.
get_threads = numba.get_num_threads
set_threads = numba.set_num_threads


def in_torch_pool() -> bool:
    """Whether numba's parallel regions run on OpenMP's worker pool (its
    ``omp`` threading layer), the pool torch's intra-op threads are: a
    region then reuses torch's spinning workers instead of adding threads."""
    if not _layer_started:
        _start_threading_layer()
    return _omp_layer


@contextmanager
def thread_budget(nbytes: int, kind: str = "decode", measure: bool = True) -> Iterator[int]:
    """Run the parallel kernels inside on kvreg's thread budget for a call
    reading ``nbytes`` of K/V rows (:func:`kvreg.threads.pick`: one thread
    for small work; under the default budget, the faster of one thread and
    the budget, measured per ``kind`` of call; ``measure=False``: the
    budget). numba's
    ``set_num_threads`` is per calling thread, so a host's own numba code
    keeps its setting. The bits do not depend on the count (every reduction
    has a fixed order). Yields the count."""
    if not _layer_started:
        _start_threading_layer()
    nbytes = int(nbytes)
    want, chooser, budget = pick(nbytes, "numba." + kind, numba.config.NUMBA_NUM_THREADS, measure=measure)
    old = get_threads()
    if want != old:
        set_threads(want)
    t0 = time.perf_counter_ns()
    try:
        yield want
    finally:
        if want != old:
            set_threads(old)
        if chooser is not None:
            chooser.record(want, budget, nbytes, time.perf_counter_ns() - t0)
