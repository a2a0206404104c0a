"""The prefill GEMMs run on one BLAS thread, whatever the host set.

numpy's BLAS sums the same product in a thread-count dependent order, and
not only along a long reduction: on an AMD Zen 5 with numpy's OpenBLAS
0.3.31 (DYNAMIC_ARCH), ``[1536, 64] @ [64, 4096]`` (SmolLM2's prefill score
tile) gave other bits under ``OPENBLAS_NUM_THREADS=1`` and ``=2``. So
:func:`kvreg_numba.chunk.attend_chunk` holds the BLAS libraries loaded in
this process to one thread while it runs (threadpoolctl; about 8 us a
call), and its answer no longer depends on the host's BLAS setting. On 2
cores it is also faster: a 4k SmolLM2 chunk took 254 ms on one BLAS thread
against 393 ms on two, which contend with the chunk's own numba threads.

The limit is process-wide while it is held: another thread's BLAS calls in
that window run on one thread too. Nested and concurrent holders share one
limit, restored when the last leaves. Without threadpoolctl, or with a BLAS
it cannot drive, nothing is changed (and the bits follow the host's BLAS).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager

_lock = threading.Lock()
_holders = 0
_limiter = None
_controller = None


def _blas():
    """threadpoolctl's controller of the BLAS libraries loaded now (False: none)."""
    global _controller
    if _controller is None:
        try:
            from threadpoolctl import ThreadpoolController

            ctl = ThreadpoolController().select(user_api="blas")
            _controller = ctl if ctl.lib_controllers else False
        except Exception:  # noqa: BLE001  (not installed, or a library it cannot read)
            _controller = False
    return _controller


@contextmanager
def one_blas_thread():
    """Hold this process's BLAS to one thread inside."""
    global _holders, _limiter
    ctl = _blas()
    if not ctl:
        yield
        return
    with _lock:
        if _holders == 0:
            _limiter = ctl.limit(limits=1)
        _holders += 1
    try:
        yield
    finally:
        with _lock:
            _holders -= 1
            if _holders == 0:
                _limiter.restore_original_limits()
                _limiter = None
