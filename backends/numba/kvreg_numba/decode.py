"""The layer decode kernel: a call's tasks, who runs them, the finish.

One compiled routine, :func:`attend_groups`, is the decode of every KV
group a call lists (the layer call lists all of them, the per-group call
one): it plans the visible rows and the task grid (one task per block of
:mod:`.blocks`), runs the tasks, merges and adds importance. The tasks may
be shared: with helper threads that claim them (:func:`decode_helper`, run
by :mod:`.pool`; the caller takes back a task a helper holds too long), or
in a numba ``prange`` region (:func:`attend_groups_par`); a task's bits do
not depend on who ran it. The fused decode step
(:func:`append_attend_groups`) stores the new row first (:mod:`.store`).
Separate from :mod:`.blocks` because this is scheduling (claims, patience,
a parallel region) around the block arithmetic, and from :mod:`.dispatch`
because everything here is compiled.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from . import config
from .atomics import claim, claim_of, cycles
from .blocks import block_partial, imp_chunk, merge_row, partial_slabs, sub_rows, task_grid
from .intrinsics import JIT_CACHE
from .store import store_row

_FM = set(config.FASTMATH)
_ZERO = np.float32(0.0)

#: The claims and helper scratch of a call no helper shares
#: (:func:`attend_groups` then runs every task itself).
NO_STATE = np.zeros(0, np.int64)
NO_HELPERS = np.zeros((0, 0), np.float32)


@njit(nogil=True, cache=JIT_CACHE)
def _visible(firsts, ns, window, upto):
    """:func:`attend_groups`' visible rows ``[f, n)`` per group: ``n =
    min(ns, upto)`` (``upto`` < 0: none), ``f = max(firsts, n - window)``
    (``window`` 0: none) clamped below ``n`` (:func:`plan_sizes` in Python)."""
    ng = ns.shape[0]
    fs = np.empty(ng, np.int64)
    out = np.empty(ng, np.int64)
    for i in range(ng):
        n = ns[i] if upto < 0 else min(ns[i], upto)
        f = firsts[i]
        if window > 0:
            f = max(f, n - window)
        fs[i] = min(f, max(n - 1, 0))
        out[i] = n
    return fs, out


#: Claims on a decode task (``state[t]``, :func:`attend_groups`): free, run
#: by the calling thread, taken back by it from a helper; helper ``i``
#: claims with ``HELPER + 2 i`` and marks it done with the next code.
TASK_FREE, TASK_CALLER, TASK_TAKEN_BACK, HELPER = 0, 1, -1, 3


@njit(nogil=True, cache=JIT_CACHE, fastmath=_FM)
def _decode_plan(q, hpk, gids, firsts, ns, kquant, kcol, kcol_set, block, window, upto):
    """``q (x) col_k`` (q8 K; the dots then need no field), the visible rows
    ``[fs, ns)`` per group and the task grid (one task per ``block`` rows
    of a group, block 0 starting at its first row)."""
    ngr = gids.shape[0]
    hd = q.shape[1]
    qc = np.empty((ngr * hpk, hd), np.float32)
    for i in range(ngr):
        g = gids[i]
        use_col = kquant and kcol_set[g]
        for h in range(hpk):
            row = i * hpk + h
            for d in range(hd):
                if use_col:
                    qc[row, d] = q[row, d] * kcol[g, d]
                else:
                    qc[row, d] = q[row, d]
    fs, ns = _visible(firsts, ns, window, upto)
    spans = np.empty(ngr, np.int64)
    for i in range(ngr):
        spans[i] = ns[i] - fs[i] if ns[i] > 0 else 0
    tstart, tgroup = task_grid(spans, block)
    return qc, fs, ns, tstart, tgroup


@njit(nogil=True, _nrt=False, cache=JIT_CACHE, fastmath=_FM)
def _decode_task(t, qc, hpk, gids, fs, ns, tstart, tgroup, kf, kq, ks, vf, vq, vs, kquant, vquant,
                 xk, xv, xlen, thk, thv, b8, scale, softcap, block, E, pm, pl, pacc, kbuf, vbuf):
    """Task ``t``'s partial softmax state into its slots ``E[t]``, ``pm[t]``,
    ``pl[t]``, ``pacc[t]``."""
    i = tgroup[t]
    p0 = fs[i] + (t - tstart[i]) * block
    nr = min(block, ns[i] - p0)
    xl = xlen[gids[i]] if xlen.shape[0] > 0 else 0
    wb = b8[gids[i]] if b8.shape[0] > 0 else ns[i]
    block_partial(qc, i * hpk, hpk, kf, kq, ks, vf, vq, vs, kquant, vquant,
                   gids[i], p0, nr, scale, softcap, E[t], kbuf, vbuf,
                   pm[t], pl[t], pacc[t], xk, xv, xl, thk, thv, wb)


@njit(nogil=True, cache=JIT_CACHE)
def _task_buffers(hd, kquant):
    """A thread's buffers for :func:`_decode_task`: q8 K rows dequantized
    a sub-block at a time; none for V (q8 V rows are read as int8 by
    :func:`_accumulate_q8`)."""
    return np.empty((sub_rows(hd) if kquant else 0, hd), np.float32), np.empty((0, hd), np.float32)


@njit(nogil=True, cache=JIT_CACHE)
def _decode_setup(q, hpk, gids, firsts, ns, kquant, kcol, kcol_set, block, window, upto, scratch):
    """:func:`_decode_plan`, then the tasks' partial states carved from
    ``scratch`` (:func:`partial_slabs`) and the merge's per-block
    coefficients ``coef [ntask, hpk]`` after them."""
    qc, fs, ns, tstart, tgroup = _decode_plan(q, hpk, gids, firsts, ns, kquant, kcol, kcol_set,
                                              block, window, upto)
    ntask = tgroup.shape[0]
    hd = q.shape[1]
    if ntask * hpk * (block + 3 + hd) > scratch.shape[0]:
        raise ValueError("attend_groups: scratch smaller than scratch_floats() of the visible rows")
    E, pm, pl, pacc, o = partial_slabs(scratch, ntask, hpk, block, hd)
    coef = scratch[o:o + ntask * hpk].reshape((ntask, hpk))
    return qc, fs, ns, tstart, tgroup, E, pm, pl, pacc, coef


@njit(nogil=True, cache=JIT_CACHE, fastmath=_FM)
def _run_tasks(state, me, down, qc, hpk, gids, fs, ns, tstart, tgroup, kf, kq, ks, vf, vq, vs, kquant,
               vquant, xk, xv, xlen, thk, thv, b8, scale, softcap, block, E, pm, pl, pacc):
    """Run every task this thread can claim (all of them when ``state`` is
    empty), in order or, ``down``, from the last; a helper (``me`` >=
    :data:`HELPER`) marks each done unless the caller took it back."""
    ntask = tgroup.shape[0]
    kbuf, vbuf = _task_buffers(qc.shape[1], kquant)
    shared = state.shape[0] > 0
    ran = 0
    for j in range(ntask):
        t = ntask - 1 - j if down else j
        if shared and claim(state, t, TASK_FREE, me) != TASK_FREE:
            continue
        _decode_task(t, qc, hpk, gids, fs, ns, tstart, tgroup, kf, kq, ks, vf, vq, vs, kquant, vquant,
                     xk, xv, xlen, thk, thv, b8, scale, softcap, block, E, pm, pl, pacc, kbuf, vbuf)
        ran += 1
        if shared and me >= HELPER:
            claim(state, t, me, me + 1)
    return ran


@njit(nogil=True, cache=JIT_CACHE, fastmath=_FM)
def decode_helper(q, hpk, gids, firsts, ns, kf, kq, ks, kcol, kcol_set,
                  vf, vq, vs, vcol, vcol_set, kquant, vquant, xk, xv, xlen, thk, thv, b8,
                  scale, softcap, sinks, block, window, upto, imp, out, scratch, state, me):
    """A helper thread's share of an :func:`attend_groups` call (the same
    arguments; it writes neither ``out`` nor ``imp``): the tasks of ``state``
    it can claim (as ``me``, from the last), their partial states in its own
    ``scratch`` at the caller's offsets."""
    qc, fs, ns, tstart, tgroup = _decode_plan(q, hpk, gids, firsts, ns, kquant, kcol, kcol_set,
                                              block, window, upto)
    ntask = tgroup.shape[0]
    hd = q.shape[1]
    if ntask != state.shape[0] or ntask * hpk * (block + 3 + hd) > scratch.shape[0]:
        return
    E, pm, pl, pacc, _ = partial_slabs(scratch, ntask, hpk, block, hd)
    _run_tasks(state, me, True, qc, hpk, gids, fs, ns, tstart, tgroup, kf, kq, ks, vf, vq, vs, kquant,
               vquant, xk, xv, xlen, thk, thv, b8, scale, softcap, block, E, pm, pl, pacc)


@njit(nogil=True, cache=JIT_CACHE, fastmath=_FM)
def attend_groups(q, hpk, gids, firsts, ns, kf, kq, ks, kcol, kcol_set,
                  vf, vq, vs, vcol, vcol_set, kquant, vquant, xk, xv, xlen, thk, thv, b8,
                  scale, softcap, sinks, block, window, upto, imp, out, scratch, state, helpers):
    """Decode attention of the KV groups ``gids`` (the layer entry passes all
    of them, the per-group entry one): the only attention routine, so a
    layer call and per-group calls run the same arithmetic.

    ``q``/``out``: ``[len(gids) * hpk, hd]`` (group i owns rows
    ``[i*hpk, (i+1)*hpk)``); ``firsts``/``ns``: rows ``[first, n)`` per
    listed group (read-only arrays: the layer entry passes its row counts and
    shared zeros), narrowed here to the visible rows: ``n = min(n, upto)``
    (``upto`` < 0: none), ``first = max(first, n - window)`` (``window`` 0:
    none), ``first <= n - 1`` (``n == 0`` gives zeros); ``sinks``:
    one logit per q row or empty; ``xk``/``xv``/``xlen``: the q8 exact rows
    (``xlen`` empty = none); ``thk``/``thv``/``b8``: the q8 float16 windows
    (int16 bits of ``[nkv, window, hd]``) and their bounds (``b8`` empty =
    no window: every row of a q8 side is int8); ``imp``: accumulated in place over
    ``[first, min(len(imp), n))``, groups then heads in order.
    ``scratch``: a float32 buffer the kernel may use (see
    :func:`scratch_floats`; a fresh allocation per call would page-fault
    megabytes of scores and partial states on every decode step).

    ``state`` / ``helpers``: the tasks' claims and the helpers' scratch rows
    when :func:`decode_helper` threads share the call (empty: this thread
    runs every task). This thread claims tasks in order, then copies the
    partial states of the tasks helpers finished; a task a helper still
    holds it waits for at most as long as one of its own tasks took, then
    takes it back and runs it (a helper that lost its core costs two blocks,
    not a stall). A task's bits do not depend on who ran it.
    """
    hd = q.shape[1]
    qc, fs, ns, tstart, tgroup, E, pm, pl, pacc, coef = _decode_setup(q, hpk, gids, firsts, ns, kquant, kcol,
                                                                      kcol_set, block, window, upto, scratch)
    ntask = tgroup.shape[0]
    if state.shape[0] > 0 and state.shape[0] != ntask:
        raise ValueError("attend_groups: state must hold one claim per task")
    c0 = cycles()
    ran = _run_tasks(state, TASK_CALLER, False, qc, hpk, gids, fs, ns, tstart, tgroup, kf, kq, ks, vf, vq,
                     vs, kquant, vquant, xk, xv, xlen, thk, thv, b8, scale, softcap, block, E, pm, pl, pacc)
    owner = np.full(ntask if state.shape[0] > 0 else 0, -1, np.int64)
    if state.shape[0] > 0:
        kbuf, vbuf = _task_buffers(hd, kquant)
        # a helper's task in flight is worth waiting for as long as this
        # thread took for one task of its own (then it is taken back)
        patience = (cycles() - c0) // max(ran, 1)
        for t in range(ntask):
            c = claim_of(state, t)
            if c == TASK_CALLER:
                continue
            if c % 2 == 1:
                w0 = cycles()
                while claim_of(state, t) == c and cycles() - w0 < patience:
                    pass
            if c % 2 == 1 and claim(state, t, c, TASK_TAKEN_BACK) == c:
                # a helper still holds it (or lost its core): run it here
                _decode_task(t, qc, hpk, gids, fs, ns, tstart, tgroup, kf, kq, ks, vf, vq, vs, kquant,
                             vquant, xk, xv, xlen, thk, thv, b8, scale, softcap, block, E, pm, pl, pacc,
                             kbuf, vbuf)
                continue
            # done by helper (c - HELPER) // 2: its states, at the same
            # offsets (its scores stay where they are: the importance pass
            # reads them there)
            owner[t] = (claim_of(state, t) - HELPER) // 2
            _, hpm, hpl, hpacc, _ = partial_slabs(helpers[owner[t]], ntask, hpk, block, hd)
            pm[t] = hpm[t]
            pl[t] = hpl[t]
            pacc[t] = hpacc[t]

    _finish(hpk, gids, fs, ns, tstart, vcol, vcol_set, vquant, sinks, block, imp, out, E, pm, pl, pacc, coef,
            owner, helpers)


@njit(nogil=True, cache=JIT_CACHE, fastmath=_FM)
def _finish(hpk, gids, fs, ns, tstart, vcol, vcol_set, vquant, sinks, block, imp, out, E, pm, pl, pacc, coef,
            owner, helpers):
    """The end of a decode call, however its tasks ran: merge the partial
    states in block order (``coef[t, h]`` turns a block's ``exp(s -
    m_block)`` into the final probability), then the importance pass."""
    ngr = gids.shape[0]
    hd = out.shape[1]
    has_sink = sinks.shape[0] > 0
    for row in range(ngr * hpk):
        i = row // hpk
        h = row - i * hpk
        o = out[row]
        if merge_row(o, ns[i], pm, pl, pacc, coef, tstart[i], tstart[i + 1], h, has_sink,
                      sinks[row] if has_sink else _ZERO):
            g = gids[i]
            if vquant and vcol_set[g]:
                for d in range(hd):
                    o[d] *= vcol[g, d]

    ni = imp.shape[0]
    if ni > 0:
        nchunk = (ni + block - 1) // block
        for c in range(nchunk):
            imp_chunk(imp, c * block, min(c * block + block, ni), fs, ns, tstart, 0, ngr, hpk, block,
                       E, coef, owner, helpers)


@njit(parallel=True, nogil=True, cache=JIT_CACHE, fastmath=_FM)
def attend_groups_par(q, hpk, gids, firsts, ns, kf, kq, ks, kcol, kcol_set,
                      vf, vq, vs, vcol, vcol_set, kquant, vquant, xk, xv, xlen, thk, thv, b8,
                      scale, softcap, sinks, block, window, upto, imp, out, scratch, workers):
    """:func:`attend_groups` with its tasks in a numba ``prange`` region
    (every task its own slots, the merge in block order: the same bits).
    Under numba's OpenMP layer the region runs on the OpenMP workers a
    torch host already keeps spinning, where :func:`decode_helper` threads
    would compete with them for the cores (docs/threads.md)."""
    qc, fs, ns, tstart, tgroup, E, pm, pl, pacc, coef = _decode_setup(q, hpk, gids, firsts, ns, kquant, kcol,
                                                                      kcol_set, block, window, upto, scratch)
    ntask = tgroup.shape[0]
    nw = max(1, min(workers, ntask))
    for w in prange(nw):
        kbuf, vbuf = _task_buffers(q.shape[1], kquant)
        for t in range(w, ntask, nw):
            _decode_task(t, qc, hpk, gids, fs, ns, tstart, tgroup, kf, kq, ks, vf, vq, vs, kquant, vquant,
                         xk, xv, xlen, thk, thv, b8, scale, softcap, block, E, pm, pl, pacc, kbuf, vbuf)
    _finish(hpk, gids, fs, ns, tstart, vcol, vcol_set, vquant, sinks, block, imp, out, E, pm, pl, pacc, coef,
            np.full(0, -1, np.int64), np.zeros((0, 0), np.float32))


@njit(nogil=True, cache=JIT_CACHE)
def append_attend_groups(krow, vrow, imp_all, seq, importance, q, hpk, gids, firsts, ns, kf, kq, ks, kcol,
                         kcol_set, vf, vq, vs, vcol, vcol_set, kquant, vquant, xk, xv, xlen, thk, thv, b8,
                         scale, softcap, sinks, block, window, upto, imp, out, scratch, state, helpers):
    """:func:`store_row` into ``kf``/``vf``/``ns``, then :func:`attend_groups`
    over the rows with it, importance into ``imp_all[:seq + 1]`` when
    ``importance`` (``imp`` is not read): a decode step in one dispatch.
    Returns whether it ran (False: :func:`store_row` refused the row)."""
    if not store_row(krow, vrow, kf, vf, ns, imp_all, seq):
        return False
    upto_imp = seq + 1 if importance else 0
    attend_groups(q, hpk, gids, firsts, ns, kf, kq, ks, kcol, kcol_set, vf, vq, vs, vcol, vcol_set, kquant,
                  vquant, xk, xv, xlen, thk, thv, b8, scale, softcap, sinks, block, window, upto,
                  imp_all[:upto_imp], out, scratch, state, helpers)
    return True


@njit(nogil=True, cache=JIT_CACHE)
def append_attend_groups_par(krow, vrow, imp_all, seq, importance, q, hpk, gids, firsts, ns, kf, kq, ks,
                             kcol, kcol_set, vf, vq, vs, vcol, vcol_set, kquant, vquant, xk, xv, xlen, thk,
                             thv, b8, scale, softcap, sinks, block, window, upto, imp, out, scratch, workers):
    """:func:`append_attend_groups` with the attention in
    :func:`attend_groups_par`'s region."""
    if not store_row(krow, vrow, kf, vf, ns, imp_all, seq):
        return False
    upto_imp = seq + 1 if importance else 0
    attend_groups_par(q, hpk, gids, firsts, ns, kf, kq, ks, kcol, kcol_set, vf, vq, vs, vcol, vcol_set, kquant,
                      vquant, xk, xv, xlen, thk, thv, b8, scale, softcap, sinks, block, window, upto,
                      imp_all[:upto_imp], out, scratch, workers)
    return True
