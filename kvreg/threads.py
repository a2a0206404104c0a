"""kvreg's thread budget: how many threads its kernels may use.

One number for every backend (docs/threads.md). In order of precedence:

1. :func:`set_num_threads` (``None`` goes back to what follows);
2. the ``KVREG_THREADS`` environment variable (a positive integer, read at
   each call so a test or a host can change it; anything else is a
   :class:`~kvreg.errors.ConfigError`);
3. a default that cooperates with the host: torch's intra-op thread count
   when torch is already imported (kvreg never imports it), else the CPUs
   this process may run on (``os.sched_getaffinity``), so a process pinned
   to 2 cores of 64 starts 2 threads, not 64.

Small work runs on one thread whatever the budget (:func:`threads_for`):
below :data:`SMALL_WORK_BYTES` of K/V rows a parallel region costs more in
wake-ups than it saves, and on a machine shared with a busy process a
second thread that loses its core stalls the whole call.
"""

from __future__ import annotations

import os
import sys
import threading

from .errors import ConfigError

ENV = "KVREG_THREADS"

#: Bytes of K/V rows a call reads below which it runs on one thread.
#: Measured with kvreg-numba's F32 decode on 2 shared cores (docs/threads.md):
#: a 3 KV / 9 Q head, hd 64 layer took 0.79x / 0.88x / 1.01x the 1-thread
#: time's speed with 2 threads at 16 / 64 / 256 rows (0.02 / 0.10 / 0.39 MB),
#: 1.2-1.3x from 1.6 MB (1k rows; 8/32 heads, hd 128 at 256 rows).
SMALL_WORK_BYTES = 512 << 10

_lock = threading.Lock()
_override: int | None = None


def _positive(value, what: str) -> int:
    if isinstance(value, bool):
        raise ConfigError(f"{what} must be a positive integer, got {value!r}")
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ConfigError(f"{what} must be a positive integer, got {value!r}") from None
    if isinstance(value, float) and value != n or n < 1:
        raise ConfigError(f"{what} must be a positive integer, got {value!r}")
    return n


def set_num_threads(n: int | None) -> None:
    """Use at most ``n`` threads in kvreg's kernels (None: back to
    ``KVREG_THREADS`` or the default). Process-wide."""
    global _override
    with _lock:
        _override = None if n is None else _positive(n, "kvreg.set_num_threads(n)")


def env_threads() -> int | None:
    """``KVREG_THREADS`` parsed (None when unset or empty)."""
    raw = os.environ.get(ENV, "").strip()
    if not raw:
        return None
    try:
        return _positive(raw, ENV)
    except ConfigError:
        raise ConfigError(f"{ENV}={raw!r}: expected a positive integer (the most threads kvreg's "
                          f"kernels may use), e.g. {ENV}=1") from None


def default_threads() -> int:
    """The host's share: torch's intra-op threads if torch is loaded, else
    the CPUs of this process's affinity mask."""
    torch = sys.modules.get("torch")
    if torch is not None:
        try:
            n = int(torch.get_num_threads())
            if n >= 1:
                return n
        except Exception:  # a half-imported or stubbed torch: fall through
            pass
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not on Linux
        return max(1, os.cpu_count() or 1)


def get_num_threads() -> int:
    """The thread budget of kvreg's kernels (see the module docstring)."""
    if _override is not None:
        return _override
    n = env_threads()
    return default_threads() if n is None else n


def threads_for(work_bytes: int) -> int:
    """Threads for a call that reads ``work_bytes`` of K/V rows: 1 below
    :data:`SMALL_WORK_BYTES`, else the budget."""
    if work_bytes < SMALL_WORK_BYTES:
        return 1
    return get_num_threads()
