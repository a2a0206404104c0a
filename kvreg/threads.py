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

Under the default budget a backend's parallel calls go through
:func:`chosen_threads`, which measures: each kind of call keeps the time per
byte it took on one thread and on the budget, runs the faster, and now and
then tries the other again (:class:`Chooser`). On a quiet machine that is
the budget; beside a busy process, whose threads take the cores a parallel
region's barrier waits for, it is one thread (measured on 2 cores with two
busy neighbours: a 2-thread decode of 4k rows took 36 ms against 0.4 ms on
one thread). kvreg-numba's decode measures only inside a torch host on
several threads (:func:`torch_spins`): its helper threads claim tasks and
the caller never waits long for one that lost its core, but torch's
spinning OpenMP workers take the core a helper needs; inside a torch
model's forward (:func:`set_torch_model`) it runs on those workers instead
(docs/threads.md). The prefill chunk runs the budget unmeasured. An explicit budget (``set_num_threads``,
``KVREG_THREADS``) is used as given. The bits never depend on the count, so
neither does the answer.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import contextmanager

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


# ``os.environ``'s own mapping, read without its encode/decode frames: the
# variable is read on every kernel call, and inside a model each Python frame
# costs (~35 µs for os.environ.get with the caches flushed, measured). Updated
# by every os.environ write (monkeypatch.setenv included).
_ENV_DATA = getattr(os.environ, "_data", None)
_ENV_KEY = os.environ.encodekey(ENV) if _ENV_DATA is not None else None
_env_parsed: tuple = (None, None)   # (raw value, what it parsed to)


def env_threads() -> int | None:
    """``KVREG_THREADS`` parsed (None when unset or empty)."""
    global _env_parsed
    raw = _ENV_DATA.get(_ENV_KEY) if _ENV_DATA is not None else os.environ.get(ENV)
    last = _env_parsed
    if raw is not None and raw == last[0]:
        return last[1]
    text = ("" if raw is None else os.fsdecode(raw)).strip()
    if not text:
        return None
    try:
        n = _positive(text, ENV)
    except ConfigError:
        raise ConfigError(f"{ENV}={text!r}: expected a positive integer (the most threads kvreg's "
                          f"kernels may use), e.g. {ENV}=1") from None
    _env_parsed = (raw, n)
    return n


def cpu_threads() -> int:
    """The CPUs this process may run on (its affinity mask): more threads
    than that only take turns. A backend whose thread pool has no bound of
    its own (PoCL's) is handed at most this many."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # not on Linux
        return max(1, os.cpu_count() or 1)


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
    return cpu_threads()


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


def torch_spins() -> bool:
    """Whether torch is loaded with more than one intra-op thread: its
    OpenMP workers spin after each op (libgomp's default wait policy), so
    a kernel's extra threads share cores with them (docs/threads.md)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return False
    try:
        return int(torch.get_num_threads()) > 1
    except Exception:  # a half-imported or stubbed torch
        return False


#: Per thread: whether the calling thread is inside a torch model's forward.
_model = threading.local()


def set_torch_model(on: bool) -> bool:
    """Say whether the calling thread is inside a torch model's forward pass
    (:class:`kvreg.integrations.transformers.KvregCache` says so for the span
    of each of its attention calls). There, with torch on several threads
    (:func:`torch_spins`), torch's OpenMP workers spin between its ops, and
    kvreg-numba's decode runs its parallel work on them (a ``prange``
    region) instead of on threads of its own that would compete with them
    for the cores. Outside a model those workers sleep, and its own helper
    threads ride out a busy neighbour better (docs/threads.md). Returns the
    previous value, to put back."""
    if on is not True and on is not False:
        raise ConfigError(f"kvreg.threads.set_torch_model(on) takes True or False, got {on!r}")
    prev = getattr(_model, "on", False)
    _model.on = on
    return prev


def torch_model() -> bool:
    """Whether the calling thread is inside a torch model's forward
    (:func:`set_torch_model`; False by default)."""
    return getattr(_model, "on", False)


def explicit_threads() -> int | None:
    """The budget a caller set (:func:`set_num_threads`, ``KVREG_THREADS``), or None."""
    return _override if _override is not None else env_threads()


class Chooser:
    """One thread or the budget, for one kind of call, by measurement.

    Keeps an average of the time per byte each count took (the most recent
    calls weigh most; a probe's sample replaces it), runs the count whose
    average is lower, and retries the other once its probe interval has
    passed: half the previous interval (at least :data:`PROBE_MIN` seconds)
    after a probe that came within :data:`PROBE_SLACK` of the chosen count,
    twice it (up to :data:`PROBE_MAX`) after one that did not. So a machine
    that turns quiet again gets its threads back within seconds, and a busy
    one pays for at most one slow probe every few seconds, even when a
    probe now and then runs fast.

    The first call after a switch to several threads, or to one thread
    never measured, only warms the count up and is not measured; the count
    runs once more for the sample. That call pays what the steady state does
    not: helper threads asleep since the last switch (kvreg-numba's decode:
    ~60 µs to wake), a first compile (163 ms for its first two-thread call,
    which kept a 1.5 MB decode on one thread for seconds: a small call
    1.7-1.9x its bytes' time + 10 µs against 1.5-1.6x). A probe of one
    thread, already compiled, wakes nothing: it is one measured call (a 4k
    SmolLM2 prefill's layer takes ~175 ms on one thread, ~95 on two: each
    probe's warm-up call cost another 80 ms)."""

    PROBE_MIN = 0.25
    PROBE_MAX = 8.0
    PROBE_SLACK = 1.5
    WEIGHT = 0.25
    #: One thread runs only when measured at most this fraction of the
    #: budget's cost: between two close counts one noisy probe would
    #: otherwise hand a quiet machine's calls to one thread until the next
    #: probe (kvreg-numba's decode at 1k rows: one thread ran 41% of the
    #: calls, averaging 435 µs against the budget's 387).
    PREFER_BUDGET = 0.9

    def __init__(self, clock=time.monotonic):
        self.clock = clock
        self.cost: dict[int, float] = {}        # threads -> average ns per byte
        self.interval: dict[int, float] = {}    # threads -> seconds between probes
        self.last: dict[int, float] = {}        # threads -> when last run
        self._now = None                        # the count of the last choice
        self._warm = None                       # a count whose next sample is a warm-up
        self._again = None                      # the count the next choice repeats
        self._lock = threading.Lock()

    def choose(self, budget: int) -> int:
        if budget <= 1:
            return 1
        with self._lock:
            if self._again is not None:         # after a warm-up call: the measured one
                n, self._again = self._again, None
                return n
            n = self._pick(budget)
            if n != self._now and (n > 1 or n not in self.cost):
                self._warm = n
            self._now = n
            return n

    def _pick(self, budget: int) -> int:
        for n in (budget, 1):                   # measure each once, the budget first
            if n not in self.cost:
                return n
        best = 1 if self.cost[1] < self.PREFER_BUDGET * self.cost[budget] else budget
        other = 1 if best == budget else budget
        if self.clock() - self.last[other] >= self.interval.get(other, self.PROBE_MIN):
            return other
        return best

    def record(self, n: int, budget: int, work_bytes: int, ns: int) -> None:
        if budget <= 1 or work_bytes <= 0:
            return
        c = ns / work_bytes
        with self._lock:
            if n == self._warm:                 # a switch's first call: not a sample
                self._warm, self._again = None, n
                return
            other = 1 if n == budget else budget
            old = self.cost.get(n)
            probe = old is not None and other in self.cost and self.cost[other] < old
            # a probe's sample replaces the stale average: a quiet machine's
            # threads come back at the first good probe
            self.cost[n] = c if old is None or probe else (1 - self.WEIGHT) * old + self.WEIGHT * c
            if probe:   # the count not chosen, tried again
                # half the wait, not PROBE_MIN, after one that won: beside a
                # busy neighbour a lucky probe brings the count back for one
                # slow call and must not start the backing off over
                iv = self.interval.get(n, self.PROBE_MIN)
                slow = c > self.PROBE_SLACK * self.cost[other]
                self.interval[n] = min(2 * iv, self.PROBE_MAX) if slow else max(iv / 2, self.PROBE_MIN)
            self.last[n] = self.clock()


_choosers: dict[tuple, Chooser] = {}


def chooser(kind: str, work_bytes: int | None = None) -> Chooser:
    """The process's :class:`Chooser` for ``kind`` of call (e.g.
    ``"numba.decode"``) reading ``work_bytes``: one per power of two of the
    bytes, since where threads start to pay depends on the size (a call's
    fixed costs, posting to helpers, weigh less as it grows: numba's decode
    on this project's 2-core Xeon ran 1.5-2 MB calls slower on two threads
    than on one, 16 MB ones 1.5x faster)."""
    key = (kind, None if work_bytes is None else int(work_bytes).bit_length())
    c = _choosers.get(key)
    if c is None:
        c = _choosers.setdefault(key, Chooser())
    return c


def pick(work_bytes: int, kind: str, cap: int | None = None, *, measure: bool = True
         ) -> tuple[int, Chooser | None, int]:
    """:func:`chosen_threads`' choice as a plain call, for a backend's
    per-call hot path: ``(threads, chooser, budget)``. When ``chooser`` is
    not None (the default budget, work past :data:`SMALL_WORK_BYTES`,
    ``measure``), time the call and hand it ``chooser.record(threads,
    budget, work_bytes, ns)``; ``measure=False``: the budget, unmeasured."""
    if work_bytes < SMALL_WORK_BYTES:
        return 1, None, 1
    budget = explicit_threads()
    if budget is not None:
        return (budget if cap is None else max(1, min(budget, cap))), None, budget
    budget = default_threads() if cap is None else max(1, min(default_threads(), cap))
    if not measure:
        return budget, None, budget
    c = chooser(kind, work_bytes)
    return c.choose(budget), c, budget


@contextmanager
def chosen_threads(work_bytes: int, kind: str, cap: int | None = None):
    """Threads for one parallel call reading ``work_bytes`` of rows: yields
    the count to run it on and, under the default budget, times the call
    for ``kind``'s :class:`Chooser`. ``cap``: the most the backend can run."""
    n, c, budget = pick(work_bytes, kind, cap)
    if c is None:
        yield n
        return
    t0 = time.perf_counter_ns()
    yield n
    c.record(n, budget, work_bytes, time.perf_counter_ns() - t0)
