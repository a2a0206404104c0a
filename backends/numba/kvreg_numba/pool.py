"""The decode's helper threads: a pool that shares decode calls.

A caller posts its decode call to helper threads and runs the call itself;
each helper claims the call's tasks from the other end
(:func:`kvreg_numba.decode.decode_helper`), and the caller never waits for a
helper longer than one of its own tasks (docs/threads.md). The pool's
threads outlive calls: they watch for the next one, then sleep; they do not
survive a fork, and the process waits for a call in flight at exit. Kept
apart from the compiled decode (:mod:`.decode`) because this is Python
threading (locks, wake-ups, fork and exit hooks), and from
:mod:`.dispatch`, which decides per call whether to use the pool at all.
"""

from __future__ import annotations

import atexit
import os
import threading

import numpy as np
from numba import njit

from . import config
from .atomics import claim_of
from .decode import decode_helper
from .intrinsics import JIT_CACHE

_tls = threading.local()


class _Helpers:
    """Daemon threads that share decode calls (:func:`decode_helper`).

    The caller posts its call to ``n`` of them and runs :func:`attend_groups`
    itself; a helper takes the newest call posted to it (an older one it
    missed was finished without it). The caller never waits for a helper
    longer than one of its own tasks: beside a busy process a helper may not
    get a core for milliseconds, and a numba parallel region's barrier
    would wait for it (docs/threads.md).

    After a call a helper watches for the next one for
    ``config.HELPER_SPIN`` reads (nogil, ~100 µs: a decode's layers come
    back to back), then sleeps on a plain lock, released to wake it (a
    sleeping thread took ~60 µs to start; a ``threading.Event`` wakes 2.5x
    slower than a lock). Threads do not survive a fork: a child starts its
    own. At exit the process waits for a helper still in a call
    (:meth:`drain`): the interpreter would free the call's arrays under it,
    or end it inside numba's first compile of its kernel (an LLVM abort,
    seen)."""

    def __init__(self):
        self.lock = threading.Lock()
        self.pid = None
        self.jobs: list = []     # per helper: (sequence, arguments) or None
        self.wake: list = []     # per helper: a lock held while it has nothing to do
        self.busy: list = []     # per helper: a lock held while it runs a call
        self.seq = 0
        self.closing = False
        self.posted = np.zeros(1, np.int64)   # the newest sequence, for the watching helpers

    def post(self, jobs) -> None:
        with self.lock:
            if self.closing:
                return
            if self.pid != os.getpid():   # a fork's child (see register_at_fork below)
                self.pid, self.jobs, self.wake, self.busy = os.getpid(), [], [], []
            while len(self.wake) < len(jobs):
                i = len(self.wake)
                self.jobs.append(None)
                self.wake.append(threading.Lock())
                self.busy.append(threading.Lock())
                self.wake[i].acquire()
                threading.Thread(target=self._main, args=(i, self.wake[i], self.busy[i]), daemon=True,
                                 name=f"kvreg-numba-decode-{i}").start()
            self.seq += 1
            for i, job in enumerate(jobs):
                self.jobs[i] = (self.seq, job)
            self.posted[0] = self.seq
        for i in range(len(jobs)):
            try:
                self.wake[i].release()
            except RuntimeError:   # already awake: it reads the newest job next
                pass

    def drain(self, timeout: float = 300.0) -> None:
        """Take no more calls and wait for those in flight (atexit)."""
        with self.lock:
            self.closing = True
            busy = list(self.busy) if self.pid == os.getpid() else []
        for b in busy:
            if b.acquire(timeout=timeout):
                b.release()

    def _main(self, i, wake, busy) -> None:
        done = 0
        while True:
            if _watch(self.posted, done, config.HELPER_SPIN):
                wake.acquire(blocking=False)   # the post's wake-up, if it came yet
            else:
                wake.acquire()
            with self.lock:
                if self.closing or i >= len(self.jobs) or self.jobs[i] is None or self.jobs[i][0] == done:
                    continue
                done, job = self.jobs[i]
                busy.acquire()
            try:
                decode_helper(*job)
            except Exception:  # noqa: BLE001  (the caller runs every task a helper did not finish)
                pass
            finally:
                busy.release()
            with self.lock:   # drop the call's arrays unless a newer call came
                if i < len(self.jobs) and self.jobs[i] is not None and self.jobs[i][0] == done:
                    self.jobs[i] = None


@njit(nogil=True, cache=JIT_CACHE)
def _watch(posted, last, reads):
    """Whether ``posted[0]`` moves off ``last`` within ``reads`` atomic reads
    (no GIL held while watching)."""
    for _ in range(reads):
        if claim_of(posted, 0) != last:
            return True
    return False


helpers = _Helpers()
atexit.register(helpers.drain)
if hasattr(os, "register_at_fork"):   # a lock a helper held at the fork stays held in the child
    os.register_at_fork(after_in_child=helpers.__init__)


def helper_scratch(n: int, nfloats: int) -> np.ndarray:
    """``[n, nfloats]`` float32 (at least), the calling thread's own: helper
    ``i``'s partial states go to row ``i``."""
    hs = getattr(_tls, "helpers", None)
    if hs is None or hs.shape[0] < n or hs.shape[1] < nfloats:
        rows = max(n, 0 if hs is None else hs.shape[0])
        cols = max(nfloats, 2 * (0 if hs is None else hs.shape[1]), 1024)
        hs = _tls.helpers = np.empty((rows, cols), np.float32)
    return hs
