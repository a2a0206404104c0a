"""The decode's Python entry points: a call's plan, and where it runs.

:func:`attend_layer`, :func:`attend_kv`, :func:`attend_group` and the
prepared decode step (:func:`decode_stepper`) turn a call into the few
Python integers of its plan (:func:`plan_sizes`: the bytes it reads, the
scratch it needs) and one dispatch (:func:`_run`): on the calling thread
alone, shared with the helper threads of :mod:`.pool`, or inside a torch
model in a ``prange`` region on torch's spinning OpenMP workers, as
kvreg's thread choice (:func:`kvreg.threads.pick`) decides per size of
call. The compiled decode is :mod:`.decode`; this module is the per-call
Python around it, kept lean because a model pays for every frame and numpy
call on every layer of every token.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable

import numba
import numpy as np

from kvreg.threads import pick, torch_model, torch_spins

from . import config, threads
from .args import EMPTY_F1, frozen_counts, imp_array, kv_args, kv_elem_bytes, sinks_array
from .decode import (
    HELPER,
    NO_HELPERS,
    NO_STATE,
    append_attend_groups,
    append_attend_groups_par,
    attend_groups,
    attend_groups_par,
)
from .pool import helper_scratch, helpers
from .store import store_row
from .threads import in_torch_pool, thread_scratch

_ZERO = np.float32(0.0)


def scratch_floats(nrows: int, hpk: int, hd: int, firsts: np.ndarray, ns: np.ndarray, block: int) -> int:
    """Floats :func:`attend_groups` needs for these groups."""
    span = np.where(ns > 0, ns - firsts, 0)
    ntask = int(((span + block - 1) // block).sum())
    return ntask * hpk * (block + 3 + hd)


def _rows_bytes(firsts, ns, hd, k, v):
    """Bytes of K/V rows a decode reads (``k``/``v``: the f32 or 2-byte
    block, None when that side is int8)."""
    rows = int(np.where(ns > 0, ns - firsts, 0).sum())
    return rows * hd * sum(1 if a is None else np.dtype(a.dtype).itemsize for a in (k, v))


def _run(nbytes, nfloats, *args, row=None, step=None):
    # ``args``: attend_groups' up to ``out``; ``row``: (krow, vrow, imp_all,
    # seq, importance) to store first (decode_stepper); ``step``: (kernel,
    # its leading arguments), a one-thread kernel that stores a row and
    # attends (window.append_window_attend): its answer (whether it stored),
    # or None, having run nothing, where the call would share threads.
    # Every task writes its own slot and the merge runs in block order, so
    # which thread ran a task cannot change a bit. Inline, not
    # thread_budget: inside a model each Python frame costs (a context
    # manager's ~14 µs with the caches flushed, measured), on every layer
    # of every token.
    scratch = thread_scratch(nfloats)
    hpk, hd, block = args[1], args[0].shape[1], args[26]
    ntask = nfloats // (hpk * (block + 3 + hd))
    if step is not None:            # the one-thread kernel and its leading arguments
        one, lead = step
    elif row is not None:
        one, lead = append_attend_groups, row
    else:
        one, lead = attend_groups, ()
    if ntask < 2:
        return one(*lead, *args, scratch, NO_STATE, NO_HELPERS) is not False   # attend_groups answers None
    # The call is shared with helper threads that claim tasks from
    # ``state`` (a helper without a core, beside a busy neighbour, costs the
    # caller one block at most), or inside a torch model's forward
    # (kvreg.threads.torch_model: KvregCache's attention calls) run in a
    # prange region on torch's spinning OpenMP workers (SmolLM2 at 4k rows,
    # 2 cores: ~14-15 ms of attention a token against ~24 with helpers that
    # share cores with those workers). The count is measured per size of
    # call (kvreg.threads.Chooser, "numba.decode"): posting to helpers costs
    # more than it saves at 1.5-2 MB on this project's 2-core Xeon (65-100
    # µs against 58-61 on one thread at 1k rows of 3 KV heads, hd 64), and
    # a region waits for its slowest worker beside a busy neighbour. The
    # numba count is set and put back as thread_budget does, inline.
    n, chooser, budget = pick(nbytes, "numba.decode", numba.config.NUMBA_NUM_THREADS)
    if step is not None and n > 1:
        return None
    t0 = time.perf_counter_ns() if chooser is not None else 0
    done = True
    if n < 2:
        done = one(*lead, *args, scratch, NO_STATE, NO_HELPERS) is not False
    elif torch_model() and torch_spins() and in_torch_pool():
        old = threads.get_threads()
        if n != old:
            threads.set_threads(n)
        try:
            if row is None:
                attend_groups_par(*args, scratch, n)
            else:
                done = append_attend_groups_par(*row, *args, scratch, n)
        finally:
            if n != old:
                threads.set_threads(old)
    else:
        if row is not None:
            # helpers read the rows as soon as they are posted: stored first
            krow, vrow, imp_all, seq, importance = row
            if not store_row(krow, vrow, args[5], args[10], args[4], imp_all, seq):
                return False
            if importance:
                args = (*args[:29], imp_all[:seq + 1], args[30])
        hs = helper_scratch(n - 1, nfloats)
        claims = np.zeros(ntask, np.int64)
        helpers.post([(*args, hs[i], claims, HELPER + 2 * i) for i in range(min(n - 1, ntask - 1))])
        attend_groups(*args, scratch, claims, hs)
    if chooser is not None and done:
        chooser.record(n, budget, nbytes, time.perf_counter_ns() - t0)
    return done


def attend_layer(q, lens, *, k=None, kq=None, ks=None, kcol=None, kcol_set=None,
                 v=None, vq=None, vs=None, vcol=None, vcol_set=None, xk=None, xv=None,
                 xlen=None, thk=None, thv=None, b8=None, scale: float, window: int = 0, softcap: float = 0.0,
                 sinks=None, imp=None, upto: int | None = None, block: int | None = None, out=None) -> np.ndarray:
    """Decode attention of a whole layer in one kernel call.

    ``q [nh, hd]``; K as ``k`` (float32, float16 or bfloat16 bits as uint16:
    read as stored, see :func:`kv_block`) or ``kq, ks, kcol, kcol_set`` (q8), V as
    ``v`` or ``vq, vs, vcol, vcol_set``; ``xk, xv, xlen`` the q8 exact rows
    (see kvreg.storage; None = none); ``thk, thv, b8`` the float16 windows
    of the q8 sides (float16 or its int16 bits, read as stored) and their
    bound per head: rows ``[b8[g], n)`` of a q8 side are window rows
    ``r - b8[g]`` (None = no window); ``window`` 0 = none, else per group
    ``first = max(0, n - window)``. Returns ``out [nh, hd]``.
    """
    kv = kv_args(k, kq, ks, kcol, kcol_set, v, vq, vs, vcol, vcol_set, xk, xv, xlen, thk, thv, b8)
    return attend_kv(q, frozen_counts(lens), kv, kv_elem_bytes(kv), scale=scale, window=window, softcap=softcap,
                     sinks=sinks, imp=imp, upto=upto, block=block, out=out)


def attend_kv(q, lens: np.ndarray, kv: tuple, elem: int, *, scale: float, window: int = 0, softcap: float = 0.0,
              sinks=None, imp=None, upto: int | None = None, block: int | None = None, out=None) -> np.ndarray:
    """:func:`attend_layer` on the kernel's storage arguments ``kv`` (a
    :func:`kv_args` tuple, which a backend may keep per allocation: see
    :func:`kvreg_numba.backend._layer_args`) with ``elem`` bytes of K and V
    per channel of a row; ``lens`` read-only int64 (:func:`frozen_counts`).
    The decode entry: the plan is a few Python integers (Python's arithmetic
    on ``lens.tolist()``; the kernel narrows the rows itself), so a call makes
    one numba dispatch. Each numpy or numba call counts inside a model,
    whose matmuls evict the interpreter's working set between layers:
    measured with the caches flushed before each call, ~10 µs a numpy
    call, ~30 µs a numba dispatch."""
    q = q if type(q) is np.ndarray and q.dtype == np.float32 and q.flags.c_contiguous \
        else np.ascontiguousarray(q, dtype=np.float32)
    nh, hd = q.shape
    nkv = lens.shape[0]
    hpk = nh // nkv
    if out is None:
        out = np.empty((nh, hd), np.float32)
    block = int(block or config.DECODE_BLOCK)
    window, upto = int(window), -1 if upto is None else int(upto)
    nbytes, nfloats = plan_sizes(lens.tolist(), window, upto, block, hpk, hd, elem)
    _run(nbytes, nfloats, q, hpk, _group_ids(nkv), _zeros(nkv), lens, *kv,
         scale if type(scale) is np.float32 else np.float32(scale),
         _ZERO if not softcap else np.float32(softcap), sinks_array(sinks), block, window, upto, imp_array(imp), out)
    return out


def decode_stepper(lens: np.ndarray, kv: tuple, elem: int, shape: tuple[int, int], *, cap: int,
                   window_step: tuple | None = None, importance: bool = False, scale: float, window: int = 0,
                   softcap: float = 0.0, sinks=None, block: int | None = None,
                   out=None) -> Callable[..., np.ndarray | None] | None:
    """A decode step that stores its row first, in one launch, prepared once:
    ``step(k, v, q, imp, seq)`` is :func:`attend_kv` over ``kv`` (a
    :func:`kv_args` tuple of the storage's own, writable arrays; ``lens``
    its writable counts, ``cap`` the rows its blocks hold) with the row
    stored first, its bits, into ``out`` (float32, the queries' ``shape``
    ``(nh, hd)``). Without ``window_step`` (F32, f16, bf16 rows):
    ``k``/``v`` float32 ``[nkv, hd]`` written to slot ``lens[0]`` of every
    head (:func:`store_row`: what
    :meth:`kvreg.storage.LayerStorage.append_row` writes), importance into
    ``imp[:seq + 1]`` when ``importance``. ``window_step``: a q8 layer's
    ``(kernel, before, after)``:
    :func:`kvreg_numba.window.append_window_attend` and its arguments
    around ``(k, v, ...)`` and ``(imp, seq, ...)``, run only where the
    decode runs on one thread.

    The step counts the rows itself: it is valid while the rows change
    through its own calls only. Each call answers ``out``, or None having
    written nothing: no slot left, a finite value a 2-byte block would round
    to inf, or not the window's state, a refused value or work that would
    share threads (``window_step``); the layer's two calls take it (and
    refuse what they refuse). None instead of a step where the heads hold
    different counts. A prepared call is one tuple and :func:`_run`: inside
    a model each Python frame and numpy call costs µs on every layer."""
    counts = lens.tolist()
    if counts.count(counts[0]) != len(counts):
        return None
    nkv = len(counts)
    nh, hd = shape
    hpk = nh // nkv
    if out is None:
        out = np.empty((nh, hd), np.float32)
    block = int(block or config.DECODE_BLOCK)
    window = int(window)
    mid = (hpk, _group_ids(nkv), _zeros(nkv), lens, *kv, np.float32(scale),
           _ZERO if not softcap else np.float32(softcap), sinks_array(sinks), block, window, -1, EMPTY_F1, out)
    importance = bool(importance)
    kernel, before, after = window_step or (None, (), ())
    at = [counts[0]]

    def step(k, v, q, imp, seq):
        n = at[0]
        if n >= cap:
            return None
        nbytes, nfloats = plan_sizes((n + 1,), window, -1, block, hpk, hd, elem)
        if kernel is None:
            done = _run(nbytes * nkv, nfloats * nkv, q, *mid, row=(k, v, imp, seq, importance))
        else:
            done = _run(nbytes * nkv, nfloats * nkv, q, *mid, step=(kernel, (k, v, *before, imp, seq, *after)))
        if not done:
            return None
        at[0] = n + 1
        return out

    return step


def plan_sizes(lens, window: int, upto: int, block: int, hpk: int, hd: int, elem_bytes: int) -> tuple[int, int]:
    """The bytes of K/V rows a decode over the row counts ``lens`` (a list)
    reads (``elem_bytes`` per channel of a row, K and V) and the scratch
    floats :func:`attend_groups` needs, for the rows it sees: ``[max(0, n -
    window), n)``, ``n = min(lens[g], upto)`` (:func:`_visible`)."""
    rows = ntask = 0
    for n in lens:
        if 0 <= upto < n:
            n = upto
        if n > 0:
            seen = window if 0 < window < n else n
            rows += seen
            ntask += (seen + block - 1) // block
    return rows * hd * elem_bytes, ntask * hpk * (block + 3 + hd)


@functools.lru_cache(maxsize=64)
def _zeros(nkv):
    return frozen_counts(np.zeros(nkv, np.int64))


@functools.lru_cache(maxsize=64)
def _group_ids(nkv):
    return np.arange(nkv, dtype=np.int64)  # never written (a read-only array would be another compile)


def attend_group(q_group, g: int, lens, *, first: int = 0, upto: int | None = None, k=None, kq=None, ks=None,
                 kcol=None, kcol_set=None, v=None, vq=None, vs=None, vcol=None,
                 vcol_set=None, xk=None, xv=None, xlen=None, thk=None, thv=None, b8=None,
                 scale: float, softcap: float = 0.0, sinks=None,
                 imp=None, block: int | None = None, out=None) -> np.ndarray:
    """Decode attention of the heads ``q_group [nheads, hd]`` of KV group
    ``g`` over rows ``[first, min(lens[g], upto))``: the same kernel as
    :func:`attend_layer`, restricted to one group."""
    q_group = np.ascontiguousarray(q_group, dtype=np.float32)
    nheads, hd = q_group.shape
    n = int(lens[g]) if upto is None else min(int(lens[g]), int(upto))
    f = min(int(first), max(n - 1, 0))
    if out is None:
        out = np.empty((nheads, hd), np.float32)
    firsts = frozen_counts(np.array([f], np.int64))
    ns = frozen_counts(np.array([n], np.int64))
    block = int(block or config.DECODE_BLOCK)
    _run(_rows_bytes(firsts, ns, hd, k, v), scratch_floats(nheads, nheads, hd, firsts, ns, block), q_group,
         nheads, np.array([g], np.int64), firsts, ns,
         *kv_args(k, kq, ks, kcol, kcol_set, v, vq, vs, vcol, vcol_set, xk, xv, xlen, thk, thv, b8),
         np.float32(scale), np.float32(softcap), sinks_array(sinks), block, 0, -1, imp_array(imp), out)
    return out
