"""What a call costs this process, for the bounds the wire tests put on an
import.

An import's cost is a property of its bytes, so the bounds count this
process's CPU seconds, not the wall clock (a neighbour's load or a paused
machine does not count), with the cyclic collector held off during the
call (a collection walks the heap every earlier test left, not the
import's work). A call over its bound runs once more: a cost its input
causes recurs, a stall of the machine does not."""

from __future__ import annotations

import gc
import time
import tracemalloc
from collections.abc import Callable


def measured(fn: Callable[[], object]) -> tuple[float, int, Exception | None]:
    """(CPU seconds, peak bytes traced, the exception raised or None) of ``fn()``."""
    collecting = gc.isenabled()
    gc.disable()
    tracemalloc.start()
    t = time.process_time()
    error = None
    try:
        fn()
    except Exception as e:   # noqa: BLE001  (returned: the caller says which are expected)
        error = e
    finally:
        dt = time.process_time() - t
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        if collecting:
            gc.enable()
    return dt, peak, error


def settled(seconds: float, bound: float, fn: Callable[[], object]) -> float:
    """``seconds`` when within ``bound``; else the lesser of it and a second
    run of ``fn``, the same call."""
    return seconds if seconds < bound else min(seconds, measured(fn)[0])
