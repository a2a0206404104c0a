"""Numba kernels over plain arrays, following docs/kernels.md.

Nothing here knows about kvreg's objects: every kernel takes the storage
arrays of one layer (head-major ``[nkv, cap, hd]`` blocks, see the table in
docs/kernels.md) and plain scalars. Absent storages are passed as empty
arrays of the same dtype and rank, so one compiled specialization serves
every mode (F32, Q8, Q8K, Q8V) and the first call compiles once; the 2-byte
modes (F16, BF16) are one more specialization each of the same code, their
blocks read as stored and widened in registers (:func:`_ir_widen`).

Decode attention is flash-decoding: the visible rows ``[first, n)`` of a KV
group are cut into blocks of ``block`` rows ANCHORED AT ``first``; a block
computes the scores of all heads of its group (each K row read once), a
partial softmax (block max, sum, unnormalized V accumulator), and the
partial states of a group are merged in block order. Every head's arithmetic
is independent of the other heads and of the thread count, and depends on
the visible rows only, which is what makes the kernel contract's invariants
(grouped == per-head, windowed == masked full row, trimmed == untrimmed,
``upto`` == sequential, layer == per-group) hold bit for bit.
"""

from __future__ import annotations

import atexit
import functools
import os
import threading
import time
from contextlib import contextmanager

import numba
import numpy as np
from llvmlite import ir
from numba import njit, prange, set_parallel_chunksize
from numba.core import cgutils, types
from numba.extending import intrinsic, overload

from kvreg.quant import HALF_OVERFLOW
from kvreg.threads import pick, torch_model, torch_spins

from . import config
from .blas import one_blas_thread
from .quant import dequantize_rows, freeze_field, gather_rows, quantize_rows  # noqa: F401  (re-exported)
from .intrinsics import target_has as _target_has, F16_FPEXT, ir_widen as _ir_widen, widen as _widen, ir_fma as _ir_fma, lane_dot as _dot, lane_sum as _sum, ir_broadcast as _broadcast, max_nan as _max_nan, fexp, exp_sum as _exp_sum  # noqa: F401
from .atomics import claim as _claim, claim_of as _claim_of  # noqa: F401
from .sweeps import K_GROUP  # noqa: F401
from .blocks import SUB_ROWS, sub_rows, _NEG_INF, _POS_INF, _NAN, _ZERO, _dequant_k_rows, scores as _scores, _scores8, NO_OWNER as _NO_OWNER, NO_SLABS as _NO_SLABS, accumulate as _accumulate, block_partial as _block_partial, partial_slabs, task_grid, merge_row as _merge_row, imp_chunk as _imp_chunk  # noqa: F401
from .store import half_bits, bf16_bits, store_row  # noqa: F401
from .decode import NO_STATE as _NO_STATE, NO_HELPERS as _NO_HELPERS, TASK_FREE, TASK_CALLER, TASK_TAKEN_BACK, HELPER, decode_helper, attend_groups, attend_groups_par, append_attend_groups, append_attend_groups_par  # noqa: F401
from .threads import thread_scratch as _scratch, in_torch_pool as _in_torch_pool, thread_budget  # noqa: F401
from . import threads as _threads
from .pool import helpers as _helpers, helper_scratch as _helper_scratch  # noqa: F401

_FM = set(config.FASTMATH)
# The on-disk cache does not see how binary16 rows are widened (an
# intrinsic's codegen): a forced integer decode compiles in memory only.
_CACHE = config.CACHE and config.F16_FPEXT == "auto"


# ---------------------------------------------------------------------------


#: numpy dtype of the array a kernel receives per storage dtype.
KV_KERNEL_DTYPES = {np.dtype(np.float32): np.float32, np.dtype(np.float16): np.int16,
                    np.dtype(np.uint16): np.uint16}


# ---------------------------------------------------------------------------
# decode attention
# ---------------------------------------------------------------------------


# ---------------------------------------------------------------------------
# batched decode: one launch for the same layer of B sequences
# ---------------------------------------------------------------------------
#
# Each sequence's arrays are its own storage's (their capacities differ), so
# the launch cannot take them as a few arrays. It takes them as addresses: a
# table ``tab [B, BT_COLS]`` int64 holding, per array, its address and its
# three dims (:data:`BT_SLOTS`), rebuilt inside the kernel with
# ``numba.carray``; the caller keeps the arrays alive for the call. A row
# depends only on which arrays the sequence's storage holds, which changes
# when it reallocates (growth, clear, a fork's first write), not at every
# version, so the backend caches rows (:func:`batch_row` builds one). The
# per-head counts change at every version: they come as ``[B * nkv]``
# arrays (one ``np.concatenate`` per field for the batch). Measured: an
# njit call per array to read its address costs ~0.2 µs, a
# ``numba.typed.List`` ~2 µs an element, a reflected list of arrays ~70 µs
# an element; a row lookup a fraction of a microsecond.

#: Array slots of a batch row, in order: each takes four columns (address,
#: dim 0, dim 1, dim 2).
BT_SLOTS = ("kf", "kq", "ks", "kcol", "vf", "vq", "vs", "vcol", "xk", "xv", "thk", "thv")
_BT_KF, _BT_KQ, _BT_KS, _BT_KCOL, _BT_VF, _BT_VQ, _BT_VS, _BT_VCOL, _BT_XK, _BT_XV, _BT_THK, _BT_THV = \
    range(0, 4 * len(BT_SLOTS), 4)
BT_COLS = 4 * len(BT_SLOTS)


@intrinsic
def _ptr_as(typingctx, addr, like):
    """The address ``addr`` as a pointer to ``like``'s dtype (for ``numba.carray``)."""
    if not (isinstance(addr, types.Integer) and isinstance(like, types.Array)):
        return None
    ptrty = types.CPointer(like.dtype)

    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], context.get_value_type(ptrty))

    return ptrty(addr, like), codegen


@njit(nogil=True, cache=_CACHE, inline="always")
def _slot1(tab, b, c, like):
    return numba.carray(_ptr_as(tab[b, c], like), (tab[b, c + 1],))


@njit(nogil=True, cache=_CACHE, inline="always")
def _slot2(tab, b, c, like):
    return numba.carray(_ptr_as(tab[b, c], like), (tab[b, c + 1], tab[b, c + 2]))


@njit(nogil=True, cache=_CACHE, inline="always")
def _slot3(tab, b, c, like):
    return numba.carray(_ptr_as(tab[b, c], like), (tab[b, c + 1], tab[b, c + 2], tab[b, c + 3]))


@njit(nogil=True, cache=_CACHE, inline="always")
def _put(row, c, a):
    row[c] = a.ctypes.data
    for j in range(a.ndim):
        row[c + 1 + j] = a.shape[j]


@njit(nogil=True, cache=_CACHE)
def batch_row(kf, kq, ks, kcol, vf, vq, vs, vcol, xk, xv, thk, thv):
    """One sequence's row of the batch table from its arrays in the forms
    :func:`batch_arrays` gives (absent ones empty)."""
    row = np.zeros(BT_COLS, np.int64)
    _put(row, _BT_KF, kf)
    _put(row, _BT_KQ, kq)
    _put(row, _BT_KS, ks)
    _put(row, _BT_KCOL, kcol)
    _put(row, _BT_VF, vf)
    _put(row, _BT_VQ, vq)
    _put(row, _BT_VS, vs)
    _put(row, _BT_VCOL, vcol)
    _put(row, _BT_XK, xk)
    _put(row, _BT_XV, xv)
    _put(row, _BT_THK, thk)
    _put(row, _BT_THV, thv)
    return row


@njit(nogil=True, cache=_CACHE)
def _imp_addr(imptab, b, imp):
    imptab[b, 0] = imp.ctypes.data
    imptab[b, 1] = imp.shape[0]


@njit(parallel=True, nogil=True, cache=_CACHE, fastmath=_FM)
def attend_batch_kernel(q, hpk, tab, imptab, lens, xlen, b8, kset, vset, window, kf_like, vf_like,
                        kquant, vquant, scale, softcap, sinks, block, out, scratch):
    """Decode attention of one layer of ``B`` sequences in one launch:
    ``q``/``out [B, nh, hd]``; ``tab [B, BT_COLS]`` the sequences' arrays
    (above); ``imptab [B, 2]`` each importance accumulator's address and
    length (0: none); ``lens``, ``xlen``, ``b8``, ``kset``, ``vset`` the
    per-head counts of every sequence, ``[B * nkv]`` (``xlen``/``b8``/the
    flags empty when the mode has none); ``window`` as
    :func:`attend_layer`; ``kf_like``/``vf_like`` empty arrays of the
    unquantized blocks' kernel dtype; ``sinks [B, nh]`` or empty.

    Sequence ``b``'s tasks are :func:`attend_groups`'s over its groups
    (blocks of ``block`` rows anchored at ``first``, :func:`_block_partial`
    on its own arrays), its rows merged by the same :func:`_merge_row` and
    its importance added by the same :func:`_imp_chunk`, so row ``b`` is
    the bits of the layer call on sequence ``b``; the tasks of every
    sequence share one parallel loop (the merge rows and the importance
    chunks theirs)."""
    B = q.shape[0]
    nh = q.shape[1]
    hd = q.shape[2]
    ngr = lens.shape[0]
    nkv = ngr // B
    has_sink = sinks.shape[0] > 0
    has_x = xlen.shape[0] > 0
    has_w = b8.shape[0] > 0
    f_like = np.empty(0, np.float32)
    i8_like = np.empty(0, np.int8)
    h_like = np.empty(0, np.int16)

    # visible rows per group of the batch (group i = b * nkv + g), as
    # attend_layer computes them
    firsts = np.empty(ngr, np.int64)
    ns = np.empty(ngr, np.int64)
    spans = np.empty(ngr, np.int64)
    for i in range(ngr):
        n = lens[i]
        f = max(n - window, 0) if window > 0 else 0
        firsts[i] = min(f, max(n - 1, 0))
        ns[i] = n
        spans[i] = n - firsts[i] if n > 0 else 0
    tstart, tgroup = task_grid(spans, block)
    ntask = tstart[ngr]

    # q (x) col_k (q8 K), as attend_groups; from the scratch buffer, after
    # the partial states (a fresh [B * nh, hd] array is megabytes of
    # page faults per call at a large batch)
    E, pm, pl, pacc, o = partial_slabs(scratch, ntask, hpk, block, hd)
    coef = scratch[o:o + ntask * hpk].reshape((ntask, hpk))
    o += ntask * hpk
    qc = scratch[o:o + B * nh * hd].reshape((B * nh, hd))
    for i in prange(ngr):
        b = i // nkv
        g = i - b * nkv
        use_col = kquant and kset.shape[0] > 0 and kset[i]
        kcol = _slot2(tab, b, _BT_KCOL, f_like)
        for h in range(hpk):
            row = i * hpk + h
            qr = q[b, g * hpk + h]
            for d in range(hd):
                if use_col:
                    qc[row, d] = qr[d] * kcol[g, d]
                else:
                    qc[row, d] = qr[d]

    bk = sub_rows(hd) if kquant else 0

    for t in prange(ntask):
        i = tgroup[t]
        b = i // nkv
        g = i - b * nkv
        blk = t - tstart[i]
        p0 = firsts[i] + blk * block
        nr = min(block, ns[i] - p0)
        kbuf = np.empty((bk, hd), np.float32)
        vbuf = np.empty((0, hd), np.float32)
        xl = xlen[i] if has_x else 0
        wb = b8[i] if has_w else ns[i]
        _block_partial(qc, i * hpk, hpk, _slot3(tab, b, _BT_KF, kf_like), _slot3(tab, b, _BT_KQ, i8_like),
                       _slot3(tab, b, _BT_KS, f_like), _slot3(tab, b, _BT_VF, vf_like),
                       _slot3(tab, b, _BT_VQ, i8_like), _slot2(tab, b, _BT_VS, f_like), kquant, vquant,
                       g, p0, nr, scale, softcap, E[t], kbuf, vbuf, pm[t], pl[t], pacc[t],
                       _slot3(tab, b, _BT_XK, f_like), _slot3(tab, b, _BT_XV, f_like), xl,
                       _slot3(tab, b, _BT_THK, h_like), _slot3(tab, b, _BT_THV, h_like), wb)

    for r in prange(B * nh):
        b = r // nh
        j = r - b * nh
        i = r // hpk
        h = r - i * hpk
        g = i - b * nkv
        o = out[b, j]
        if _merge_row(o, ns[i], pm, pl, pacc, coef, tstart[i], tstart[i + 1], h, has_sink,
                      sinks[b, j] if has_sink else _ZERO):
            if vquant and vset.shape[0] > 0 and vset[i]:
                vcol = _slot2(tab, b, _BT_VCOL, f_like)
                for d in range(hd):
                    o[d] *= vcol[g, d]

    # importance: chunks of ``block`` rows of every sequence's accumulator
    cstart = np.zeros(B + 1, np.int64)
    for b in range(B):
        cstart[b + 1] = cstart[b] + (imptab[b, 1] + block - 1) // block
    cseq = np.empty(cstart[B], np.int64)
    for b in range(B):
        for c in range(cstart[b], cstart[b + 1]):
            cseq[c] = b
    for c in prange(cstart[B]):
        b = cseq[c]
        imp = numba.carray(_ptr_as(imptab[b, 0], f_like), (imptab[b, 1],))
        a0 = (c - cstart[b]) * block
        _imp_chunk(imp, a0, min(a0 + block, imp.shape[0]), firsts, ns, tstart, b * nkv, nkv, hpk, block,
                   E, coef, _NO_OWNER, _NO_SLABS)


# ---------------------------------------------------------------------------
# prefill chunk: the register-tiled kernel is kvreg_numba.chunk; here the
# masked softmax it shares and the BLAS path (numpy matmul) that takes a
# chunk with a non-finite value row or an hd not a multiple of 16
# ---------------------------------------------------------------------------


@njit(parallel=True, nogil=True, cache=_CACHE, fastmath=_FM)
def chunk_softmax(S, scale, s0, i0, bt, klo, window):
    """Causal (and windowed) softmax in place on a score tile ``S [hpk*bt,
    nk]`` whose row ``h*bt + r`` is query row ``i0 + r`` of the chunk and
    whose column ``j`` is key ``klo + j``; masked entries become exactly 0."""
    for row in prange(S.shape[0]):
        softmax_row(S[row], scale, s0 + i0 + row % bt, klo, window, True)


@njit(nogil=True, cache=_CACHE, fastmath=_FM)
def softmax_row(x, scale, p, klo, window, normalize):
    """:func:`chunk_softmax` of one score row ``x`` (column ``j`` = key
    ``klo + j``) of the query at position ``p``: keys ``[max(0, p + 1 -
    window), p + 1)`` visible. Returns the row's ``1 / sum``, by which the
    exponentials are multiplied when ``normalize`` (1 when there is none
    to apply: a NaN row)."""
    nk = x.shape[0]
    end = p + 1 - klo
    lo = 0
    if window > 0:
        lo = max(0, p + 1 - window) - klo
    for j in range(lo):
        x[j] = _ZERO
    seg = x[lo:end]
    inv = np.float32(1.0)
    # max of the raw scores, then scaled: rounding x * scale (> 0) is
    # monotonic, so this is the max of the scaled scores exactly
    mx = _max_nan(seg) * scale
    if not (mx > _NEG_INF and mx < _POS_INF):
        # NaN / +inf score, or all -inf: the row's softmax is NaN at
        # every visible key (docs/kernels.md), 0 at the masked ones.
        for j in range(end - lo):
            seg[j] = _NAN
    else:
        z = _exp_sum(seg, scale, mx)   # seg[j] = fexp(seg[j] * scale - mx); _sum(seg)
        if z > 0:
            inv = np.float32(1.0) / z
            if normalize:
                for j in range(end - lo):
                    seg[j] *= inv
    tail = x[end:]
    for j in range(nk - end):
        tail[j] = _ZERO
    return inv


@njit(nogil=True, cache=_CACHE)
def _all_finite(a):
    """Whether every element of the 2-D ``a`` is finite (one read, no temporaries)."""
    acc = _ZERO
    for i in range(a.shape[0]):
        r = a[i]
        for j in range(a.shape[1]):
            acc += r[j] - r[j]  # NaN exactly when some element is NaN or inf
    return acc == acc


@njit(nogil=True, cache=_CACHE)
def _visible_values(S, vt, s0, i0, bt, klo, window):
    """``S @ vt`` with row ``h*bt + r`` summing only the keys query ``i0 + r``
    sees, in key order (the slow path of a tile holding non-finite values)."""
    m_rows = S.shape[0]
    hd = vt.shape[1]
    o = np.zeros((m_rows, hd), np.float32)
    for row in range(m_rows):
        i = i0 + row % bt
        end = s0 + i + 1 - klo
        lo = 0
        if window > 0:
            lo = max(0, s0 + i + 1 - window) - klo
        for j in range(lo, end):
            p = S[row, j]
            for d in range(hd):
                o[row, d] += p * vt[j, d]
    return o


@njit(nogil=True, cache=_CACHE, fastmath=_FM)
def column_sums_into(S, dst):
    """``dst[j] += sum_rows S[row, j]``, rows in order. Serial on purpose:
    it is one streaming pass (a fraction of a GEMM's time), and a parallel
    region here costs more in synchronisation than it saves."""
    m_rows, nk = S.shape
    for row in range(m_rows):
        x = S[row]
        for j in range(nk):
            dst[j] += x[j]


# ---------------------------------------------------------------------------
# Python entry points (argument normalisation; the kernels trust them)
# ---------------------------------------------------------------------------

_EMPTY_F3 = np.empty((0, 0, 0), np.float32)
_EMPTY_I3 = np.empty((0, 0, 0), np.int8)
_EMPTY_F2 = np.empty((0, 0), np.float32)
_EMPTY_F1 = np.empty(0, np.float32)
_EMPTY_B1 = np.empty(0, np.bool_)
_EMPTY_I1 = np.empty(0, np.int64)
_I64 = np.dtype(np.int64)
_EMPTY_H3 = np.empty((0, 0, 0), np.int16)


def _f3(a):
    return _EMPTY_F3 if a is None else np.ascontiguousarray(a, dtype=np.float32)


def kv_block(a):
    """An unquantized K/V block as the kernels take it, never a copy of a
    C-contiguous one: float32 as is, float16 viewed as its int16 bits,
    uint16 (bfloat16 bits) as is (see :data:`KV_KERNEL_DTYPES`)."""
    if a is None:
        return _EMPTY_F3
    a = np.asarray(a)
    kdt = KV_KERNEL_DTYPES.get(a.dtype)
    if kdt is None:  # not a storage dtype (a caller's float64 array, say): float32
        return np.ascontiguousarray(a, dtype=np.float32)
    return np.ascontiguousarray(a).view(kdt)


def window_block(a):
    """A q8 float16 window (``[nkv, window, hd]`` float16) as the kernels
    take it: its int16 bits, a view of a C-contiguous array (never a copy of
    one); None gives an empty block."""
    if a is None:
        return _EMPTY_H3
    a = np.asarray(a)
    if a.dtype == np.int16:
        return np.ascontiguousarray(a)
    if a.dtype != np.float16:
        raise ValueError(f"a float16 window must be float16 (or its int16 bits), not {a.dtype}")
    return np.ascontiguousarray(a).view(np.int16)


def kv_elem_bytes(kv):
    """Bytes of K and V per channel of a row for a :func:`_kv_args` tuple
    (an int8 side counts 1; ``kquant``/``vquant`` are its items 10 and 11)."""
    return (1 if kv[10] else kv[0].dtype.itemsize) + (1 if kv[11] else kv[5].dtype.itemsize)


#: Where each per-head count sits in :func:`_kv_args`' tuple (a backend that
#: keeps the tuple per allocation puts each version's counts there).
KV_COUNT_AT = {"kcol_set": 4, "vcol_set": 9, "xlen": 14, "b8": 17}


def _kv_args(k, kq, ks, kcol, kcol_set, v, vq, vs, vcol, vcol_set, xk, xv, xlen,
             thk=None, thv=None, b8=None):
    kquant = k is None
    vquant = v is None
    if kquant and kq is None:
        raise ValueError("attend: neither k nor kq given")
    if vquant and vq is None:
        raise ValueError("attend: neither v nor vq given")
    if b8 is not None and ((kquant and thk is None) or (vquant and thv is None)):
        # the kernel would index an empty window: refuse before any launch
        raise ValueError("attend: a window bound b8 needs the float16 window of every q8 side")
    kf, vf = kv_block(k), kv_block(v)
    if not kquant and not vquant and kf.dtype != vf.dtype:
        # one specialization per storage dtype; mixed blocks are no storage mode
        kf, vf = np.ascontiguousarray(k, dtype=np.float32), np.ascontiguousarray(v, dtype=np.float32)
    return (
        kf,
        _EMPTY_I3 if kq is None else np.ascontiguousarray(kq, dtype=np.int8),
        _EMPTY_F3 if ks is None else np.ascontiguousarray(ks, dtype=np.float32),
        _EMPTY_F2 if kcol is None else np.ascontiguousarray(kcol, dtype=np.float32),
        _EMPTY_B1 if kcol_set is None else np.ascontiguousarray(kcol_set, dtype=np.bool_),
        vf,
        _EMPTY_I3 if vq is None else np.ascontiguousarray(vq, dtype=np.int8),
        _EMPTY_F2 if vs is None else np.ascontiguousarray(vs, dtype=np.float32),
        _EMPTY_F2 if vcol is None else np.ascontiguousarray(vcol, dtype=np.float32),
        _EMPTY_B1 if vcol_set is None else np.ascontiguousarray(vcol_set, dtype=np.bool_),
        kquant,
        vquant,
        _f3(xk),
        _f3(xv),
        _EMPTY_I1 if xlen is None else np.ascontiguousarray(xlen, dtype=np.int64),
        window_block(thk if kquant and b8 is not None else None),
        window_block(thv if vquant and b8 is not None else None),
        _EMPTY_I1 if b8 is None else np.ascontiguousarray(b8, dtype=np.int64),
    )


def _sinks(sinks):
    if sinks is None:
        return _EMPTY_F1
    return np.ascontiguousarray(sinks, dtype=np.float32)


def _imp(imp):
    if imp is None:
        return _EMPTY_F1
    if imp.dtype != np.float32 or not imp.flags.c_contiguous:
        raise ValueError("imp must be a contiguous float32 array (accumulated in place)")
    return imp


def scratch_floats(nrows, hpk, hd, firsts, ns, block):
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
    scratch = _scratch(nfloats)
    hpk, hd, block = args[1], args[0].shape[1], args[26]
    ntask = nfloats // (hpk * (block + 3 + hd))
    if step is not None:            # the one-thread kernel and its leading arguments
        one, lead = step
    elif row is not None:
        one, lead = append_attend_groups, row
    else:
        one, lead = attend_groups, ()
    if ntask < 2:
        return one(*lead, *args, scratch, _NO_STATE, _NO_HELPERS) is not False   # attend_groups answers None
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
        done = one(*lead, *args, scratch, _NO_STATE, _NO_HELPERS) is not False
    elif torch_model() and torch_spins() and _in_torch_pool():
        old = _threads.get_threads()
        if n != old:
            _threads.set_threads(n)
        try:
            if row is None:
                attend_groups_par(*args, scratch, n)
            else:
                done = append_attend_groups_par(*row, *args, scratch, n)
        finally:
            if n != old:
                _threads.set_threads(old)
    else:
        if row is not None:
            # helpers read the rows as soon as they are posted: stored first
            krow, vrow, imp_all, seq, importance = row
            if not store_row(krow, vrow, args[5], args[10], args[4], imp_all, seq):
                return False
            if importance:
                args = (*args[:29], imp_all[:seq + 1], args[30])
        hs = _helper_scratch(n - 1, nfloats)
        claims = np.zeros(ntask, np.int64)
        _helpers.post([(*args, hs[i], claims, HELPER + 2 * i) for i in range(min(n - 1, ntask - 1))])
        attend_groups(*args, scratch, claims, hs)
    if chooser is not None and done:
        chooser.record(n, budget, nbytes, time.perf_counter_ns() - t0)
    return done


def attend_layer(q, lens, *, k=None, kq=None, ks=None, kcol=None, kcol_set=None,
                 v=None, vq=None, vs=None, vcol=None, vcol_set=None, xk=None, xv=None,
                 xlen=None, thk=None, thv=None, b8=None, scale, window=0, softcap=0.0, sinks=None, imp=None, upto=None,
                 block=None, out=None):
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
    kv = _kv_args(k, kq, ks, kcol, kcol_set, v, vq, vs, vcol, vcol_set, xk, xv, xlen, thk, thv, b8)
    return attend_kv(q, frozen_counts(lens), kv, kv_elem_bytes(kv), scale=scale, window=window, softcap=softcap, sinks=sinks,
                     imp=imp, upto=upto, block=block, out=out)


def attend_kv(q, lens, kv, elem, *, scale, window=0, softcap=0.0, sinks=None, imp=None, upto=None, block=None,
              out=None):
    """:func:`attend_layer` on the kernel's storage arguments ``kv`` (a
    :func:`_kv_args` tuple, which a backend may keep per allocation: see
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
         _ZERO if not softcap else np.float32(softcap), _sinks(sinks), block, window, upto, _imp(imp), out)
    return out


def decode_stepper(lens, kv, elem, shape, *, cap, window_step=None, importance=False, scale, window=0, softcap=0.0,
                   sinks=None, block=None, out=None):
    """A decode step that stores its row first, in one launch, prepared once:
    ``step(k, v, q, imp, seq)`` is :func:`attend_kv` over ``kv`` (a
    :func:`_kv_args` tuple of the storage's own, writable arrays; ``lens``
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
           _ZERO if not softcap else np.float32(softcap), _sinks(sinks), block, window, -1, _EMPTY_F1, out)
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


def plan_sizes(lens, window, upto, block, hpk, hd, elem_bytes):
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


def frozen_counts(a):
    """Per-head counts as :func:`attend_groups` takes them: a read-only
    int64 array (a :class:`kvreg.KvView`'s own counts pass as they are, with
    no numpy call; one compiled kernel for every caller)."""
    if type(a) is np.ndarray and a.dtype is _I64 and not a.flags.writeable:
        return a
    a = np.asarray(a, dtype=np.int64)
    if a.flags.writeable:
        a = a.view()
        a.flags.writeable = False
    return a


@functools.lru_cache(maxsize=64)
def _zeros(nkv):
    return frozen_counts(np.zeros(nkv, np.int64))


@functools.lru_cache(maxsize=64)
def _group_ids(nkv):
    return np.arange(nkv, dtype=np.int64)  # never written (a read-only array would be another compile)


def attend_group(q_group, g, lens, *, first=0, upto=None, k=None, kq=None, ks=None,
                 kcol=None, kcol_set=None, v=None, vq=None, vs=None, vcol=None,
                 vcol_set=None, xk=None, xv=None, xlen=None, thk=None, thv=None, b8=None,
                 scale, softcap=0.0, sinks=None,
                 imp=None, block=None, out=None):
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
         *_kv_args(k, kq, ks, kcol, kcol_set, v, vq, vs, vcol, vcol_set, xk, xv, xlen, thk, thv, b8),
         np.float32(scale), np.float32(softcap), _sinks(sinks), block, 0, -1, _imp(imp), out)
    return out


_KIND_LIKE = {np.dtype(np.float32): np.empty((0, 0, 0), np.float32),
              np.dtype(np.int16): np.empty((0, 0, 0), np.int16),
              np.dtype(np.uint16): np.empty((0, 0, 0), np.uint16)}


def _c(a, dtype):
    """``a`` as a C-contiguous array of ``dtype``: itself when it already is one."""
    if a.dtype == dtype and a.flags.c_contiguous:
        return a
    return np.ascontiguousarray(a, dtype=dtype)


def batch_arrays(*, k=None, kq=None, ks=None, kcol=None, v=None, vq=None, vs=None, vcol=None, xk=None, xv=None,
                 thk=None, thv=None):
    """One sequence's arrays as :func:`batch_row` takes them (the storage
    arrays of :func:`attend_layer`, None = absent), normalized as
    :func:`_kv_args` normalizes them (no copy of a C-contiguous storage
    block): ``(kf, kq, ks, kcol, vf, vq, vs, vcol, xk, xv, thk, thv)``. The
    caller keeps them alive while their row is used."""
    kquant = k is None
    vquant = v is None
    if kquant and kq is None or vquant and vq is None:
        raise ValueError("attend_batch: a sequence needs k or kq, and v or vq")
    return (
        _EMPTY_F3 if kquant else kv_block(k),
        _c(kq, np.int8) if kquant else _EMPTY_I3,
        _c(ks, np.float32) if kquant else _EMPTY_F3,
        _c(kcol, np.float32) if kquant and kcol is not None else _EMPTY_F2,
        _EMPTY_F3 if vquant else kv_block(v),
        _c(vq, np.int8) if vquant else _EMPTY_I3,
        _c(vs, np.float32) if vquant else _EMPTY_F2,
        _c(vcol, np.float32) if vquant and vcol is not None else _EMPTY_F2,
        _EMPTY_F3 if xk is None else _c(xk, np.float32),
        _EMPTY_F3 if xv is None else _c(xv, np.float32),
        window_block(thk) if kquant and thk is not None else _EMPTY_H3,
        window_block(thv) if vquant and thv is not None else _EMPTY_H3,
    )


#: The row of a sequence with no storage: no arrays (its heads have no rows).
EMPTY_ROW = np.zeros(BT_COLS, np.int64)

#: The batch-row slot of each storage array name (:func:`batch_arrays`' keywords).
BT_SLOTS_OF = {"k": _BT_KF, "kq": _BT_KQ, "ks": _BT_KS, "kcol": _BT_KCOL, "v": _BT_VF, "vq": _BT_VQ,
               "vs": _BT_VS, "vcol": _BT_VCOL, "xk": _BT_XK, "xv": _BT_XV, "thk": _BT_THK, "thv": _BT_THV}


def batch_row_address(row, name):
    """The address a batch row holds for the storage array ``name``."""
    return int(row[BT_SLOTS_OF[name]])


def attend_batch(q, tab, *, lens, kquant, vquant, kv_dtype=np.float32, xlen=None, b8=None, kcol_set=None,
                 vcol_set=None, imps=None, scale, window=0, softcap=0.0, sinks=None, block=None, out=None):
    """Decode attention of one layer of ``B`` sequences in one kernel launch
    (:func:`attend_batch_kernel`): ``q [B, nh, hd]``; ``tab [B, BT_COLS]``
    the sequences' rows (:func:`batch_row`, :data:`EMPTY_ROW`); ``lens``
    ``[B * nkv]`` and, where the mode has them, ``xlen`` (exact rows),
    ``b8`` (window bounds), ``kcol_set``/``vcol_set`` (q8 K / V fields), all
    ``[B * nkv]``; ``kquant``/``vquant`` whether K / V are q8, ``kv_dtype``
    the unquantized blocks' kernel dtype (:data:`KV_KERNEL_DTYPES`);
    ``imps`` one float32 accumulator (or None) per sequence; ``sinks [B,
    nh]`` or None; ``window`` as :func:`attend_layer`. Row ``b`` of the
    result is :func:`attend_layer` on sequence ``b``, bit for bit."""
    q = _c(q, np.float32)
    B, nh, hd = q.shape
    lens = _c(lens, np.int64)
    nkv = lens.shape[0] // max(B, 1)
    if out is None:
        out = np.empty((B, nh, hd), np.float32)
    if B == 0:
        return out
    block = int(block or config.DECODE_BLOCK)
    window = int(window or 0)
    imptab = np.zeros((B, 2), np.int64)
    if imps is not None:
        for b, imp in enumerate(imps):
            if imp is not None:
                _imp_addr(imptab, b, _imp(imp))
    n = lens
    f = np.maximum(n - window, 0) if window > 0 else 0
    spans = np.where(n > 0, n - np.minimum(f, np.maximum(n - 1, 0)), 0)
    rows = int(spans.sum())
    ntask = int(((spans + block - 1) // block).sum())
    hpk = nh // nkv
    kdt = np.dtype(KV_KERNEL_DTYPES.get(np.dtype(kv_dtype), kv_dtype))
    isz = (1 if kquant else kdt.itemsize) + (1 if vquant else kdt.itemsize)
    like = _KIND_LIKE[kdt]
    sk = _EMPTY_F2 if sinks is None else _c(sinks, np.float32).reshape(B, nh)
    buf = _scratch(ntask * hpk * (block + 3 + hd) + B * nh * hd)
    with thread_budget(rows * hd * isz, "batch"):
        old = set_parallel_chunksize(config.TASK_CHUNK)
        try:
            attend_batch_kernel(q, hpk, tab, imptab, lens,
                                _EMPTY_I1 if xlen is None else _c(xlen, np.int64),
                                _EMPTY_I1 if b8 is None else _c(b8, np.int64),
                                _EMPTY_B1 if kcol_set is None else _c(kcol_set, np.bool_),
                                _EMPTY_B1 if vcol_set is None else _c(vcol_set, np.bool_),
                                window, _EMPTY_F3 if kquant else like, _EMPTY_F3 if vquant else like,
                                bool(kquant), bool(vquant), np.float32(scale), np.float32(softcap), sk, block,
                                out, buf)
        finally:
            set_parallel_chunksize(old)
    return out


def _gemm_fixed(a, b):
    """``a @ b`` (float32 BLAS) with the reduction cut into
    ``config.GEMM_K_BLOCK``-long slices whose products are added in order.
    OpenBLAS sums a long reduction in a thread-count dependent order (its
    single-threaded small-matrix path and its threaded path split it
    differently): at ``a [1200, 1000] @ b [1000, 128]`` one and two threads
    differed in the last bits. The slices were once enough for the same
    bits on any thread count; on a Zen 5 short reductions differ too, so
    :func:`attend_chunk` also holds BLAS to one thread (:mod:`.blas`)."""
    kb = int(config.GEMM_K_BLOCK)
    n = a.shape[1]
    if n <= kb:
        return a @ b
    out = a[:, :kb] @ b[:kb]
    part = np.empty_like(out)
    for c in range(kb, n, kb):
        np.matmul(a[:, c:c + kb], b[c:c + kb], out=part)
        out += part
    return out


def attend_chunk(q, k, v, *, s0, b, hpk, scale, window=None, imp=None, q_tile=None):
    """Causal attention of a prefill chunk: ``q [b, nh, hd]``; rows
    ``[s0, s0+b)`` of every KV head of ``k``/``v`` (``[nkv, cap, hd]`` f32)
    are the chunk's own rows; row ``i`` sees keys
    ``[max(0, s0+i+1-window), s0+i+1)``. Per KV group and query tile the
    group's heads are stacked into one panel and only the keys some row of
    the tile can see are touched (O(b*(b+w)) for a windowed layer): in
    registers (:mod:`kvreg_numba.chunk`) when hd is a multiple of 16 and
    every value row the chunk sees is finite, else by BLAS. ``imp`` gets the
    masked column sums. Returns ``[b, nh, hd]`` float32."""
    q = np.asarray(q, dtype=np.float32)
    _, nh, hd = q.shape
    nkv = nh // hpk
    w = int(window or 0)
    n = s0 + b
    kstart = max(0, s0 + 1 - w) if w else 0
    if hd % 16 == 0 and b > 0 and all(_all_finite(v[g, kstart:n]) for g in range(nkv)):
        # The register-tiled kernel (kvreg_numba.chunk); a non-finite value
        # row takes the path below, which sums only the keys a row sees.
        from .chunk import chunk_kernel, tile_rows
        out = np.empty((b, nh, hd), np.float32)
        bt = tile_rows(hpk, hd)
        # Unmeasured: a chunk is long and compute-bound, so even a worker
        # that shares its core with a busy neighbour still adds what it
        # gets, and a one-thread probe cost a 4k SmolLM2 prefill ~80 ms a
        # layer (~175 ms on one thread against ~95 on two, in the model).
        with thread_budget(4 * nh * b * (n - kstart), "chunk", measure=False) as threads:
            # q as it comes (a model's [n, nh, hd] is a transposed view): the
            # kernel gathers each tile's rows itself, so no copy of the chunk
            chunk_kernel(q, _c(k, np.float32), _c(v, np.float32), s0, hpk, np.float32(scale), w,
                         bt, threads, out, _EMPTY_F1 if imp is None else imp[:n])
        return out
    nk_max = n - (max(0, s0 + 1 - w) if w else 0)
    bt_max = int(q_tile or config.CHUNK_Q_TILE)
    bt_max = max(1, min(bt_max, config.CHUNK_TILE_BYTES // (4 * hpk * max(nk_max, 1))))
    ntile = -(-b // bt_max)
    bt_max = -(-b // ntile)  # even tiles
    out = np.empty((b, nh, hd), np.float32)
    scale = np.float32(scale)
    ni = 0 if imp is None else min(imp.shape[0], n)
    with one_blas_thread():   # the bits must not follow the host's BLAS threads (kvreg_numba.blas)
        for g in range(nkv):
            qg = np.ascontiguousarray(q[:, g * hpk:(g + 1) * hpk, :].transpose(1, 0, 2))
            # One read of every value row the chunk sees (the first tile's keys
            # start lowest); only a group holding a non-finite one checks per tile.
            finite = _all_finite(v[g, max(0, s0 + 1 - w) if w else 0:n])
            for i0 in range(0, b, bt_max):
                bt = min(bt_max, b - i0)
                klo = max(0, s0 + i0 + 1 - w) if w else 0
                khi = s0 + i0 + bt
                panel = qg[:, i0:i0 + bt].reshape(hpk * bt, hd)
                S = _gemm_fixed(panel, k[g, klo:khi].T)
                with thread_budget(S.nbytes, "chunk"):
                    chunk_softmax(S, scale, s0, i0, bt, klo, w)
                vt = v[g, klo:khi]
                if finite or _all_finite(vt):
                    o = _gemm_fixed(S, vt)
                else:
                    # 0 * NaN: a NaN/inf value row would reach through the GEMM
                    # the tile rows that cannot see it; sum visible keys only.
                    o = _visible_values(S, vt, s0, i0, bt, klo, w)
                out[i0:i0 + bt, g * hpk:(g + 1) * hpk] = o.reshape(hpk, bt, hd).transpose(1, 0, 2)
                if ni > klo:
                    column_sums_into(S[:, :ni - klo] if ni < khi else S, imp[klo:min(ni, khi)])
    return out
