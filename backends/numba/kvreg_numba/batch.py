"""Batched decode: one launch for the same layer of B sequences.

Each sequence's arrays are its own storage's (their capacities differ), so
the launch cannot take them as a few arrays. It takes them as addresses: a
table ``tab [B, BT_COLS]`` int64 holding, per array, its address and its
three dims (:data:`BT_SLOTS`), rebuilt inside the kernel with
``numba.carray``; the caller keeps the arrays alive for the call. A row
depends only on which arrays the sequence's storage holds, which changes
when it reallocates (growth, clear, a fork's first write), not at every
version, so the backend caches rows (:func:`batch_row` builds one). The
per-head counts change at every version: they come as ``[B * nkv]``
arrays (one ``np.concatenate`` per field for the batch). Measured: an
njit call per array to read its address costs ~0.2 µs, a
``numba.typed.List`` ~2 µs an element, a reflected list of arrays ~70 µs
an element; a row lookup a fraction of a microsecond.

Every sequence's tasks run the layer decode's own block arithmetic
(:mod:`.blocks`), so row ``b`` is :func:`kvreg_numba.dispatch.attend_layer`
on sequence ``b``, bit for bit; what is this module's own is the table of
addresses and the one parallel task list over every sequence.
"""

from __future__ import annotations

from collections.abc import Sequence

import numba
import numpy as np
from numba import njit, prange, set_parallel_chunksize
from numba.core import types
from numba.extending import intrinsic

from . import config
from .args import (
    EMPTY_B1,
    EMPTY_F2,
    EMPTY_F3,
    EMPTY_H3,
    EMPTY_I1,
    EMPTY_I3,
    KV_KERNEL_DTYPES,
    contiguous,
    imp_array,
    kv_block,
    window_block,
)
from .blocks import NO_OWNER, NO_SLABS, block_partial, imp_chunk, merge_row, partial_slabs, sub_rows, task_grid
from .intrinsics import JIT_CACHE
from .threads import thread_budget, thread_scratch

_FM = set(config.FASTMATH)
_ZERO = np.float32(0.0)

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


@njit(nogil=True, cache=JIT_CACHE, inline="always")
def _slot1(tab, b, c, like):
    return numba.carray(_ptr_as(tab[b, c], like), (tab[b, c + 1],))


@njit(nogil=True, cache=JIT_CACHE, inline="always")
def _slot2(tab, b, c, like):
    return numba.carray(_ptr_as(tab[b, c], like), (tab[b, c + 1], tab[b, c + 2]))


@njit(nogil=True, cache=JIT_CACHE, inline="always")
def _slot3(tab, b, c, like):
    return numba.carray(_ptr_as(tab[b, c], like), (tab[b, c + 1], tab[b, c + 2], tab[b, c + 3]))


@njit(nogil=True, cache=JIT_CACHE, inline="always")
def _put(row, c, a):
    row[c] = a.ctypes.data
    for j in range(a.ndim):
        row[c + 1 + j] = a.shape[j]


@njit(nogil=True, cache=JIT_CACHE)
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


@njit(nogil=True, cache=JIT_CACHE)
def _imp_addr(imptab, b, imp):
    imptab[b, 0] = imp.ctypes.data
    imptab[b, 1] = imp.shape[0]


@njit(parallel=True, nogil=True, cache=JIT_CACHE, fastmath=_FM)
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
    (blocks of ``block`` rows anchored at ``first``, :func:`block_partial`
    on its own arrays), its rows merged by the same :func:`merge_row` and
    its importance added by the same :func:`imp_chunk`, so row ``b`` is
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
        block_partial(qc, i * hpk, hpk, _slot3(tab, b, _BT_KF, kf_like), _slot3(tab, b, _BT_KQ, i8_like),
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
        if merge_row(o, ns[i], pm, pl, pacc, coef, tstart[i], tstart[i + 1], h, has_sink,
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
        imp_chunk(imp, a0, min(a0 + block, imp.shape[0]), firsts, ns, tstart, b * nkv, nkv, hpk, block,
                   E, coef, NO_OWNER, NO_SLABS)


_KIND_LIKE = {np.dtype(np.float32): np.empty((0, 0, 0), np.float32),
              np.dtype(np.int16): np.empty((0, 0, 0), np.int16),
              np.dtype(np.uint16): np.empty((0, 0, 0), np.uint16)}


def batch_arrays(*, k=None, kq=None, ks=None, kcol=None, v=None, vq=None, vs=None, vcol=None, xk=None, xv=None,
                 thk=None, thv=None) -> tuple[np.ndarray, ...]:
    """One sequence's arrays as :func:`batch_row` takes them (the storage
    arrays of :func:`kvreg_numba.dispatch.attend_layer`, None = absent), normalized as
    :func:`kv_args` normalizes them (no copy of a C-contiguous storage
    block): ``(kf, kq, ks, kcol, vf, vq, vs, vcol, xk, xv, thk, thv)``. The
    caller keeps them alive while their row is used."""
    kquant = k is None
    vquant = v is None
    if kquant and kq is None or vquant and vq is None:
        raise ValueError("attend_batch: a sequence needs k or kq, and v or vq")
    return (
        EMPTY_F3 if kquant else kv_block(k),
        contiguous(kq, np.int8) if kquant else EMPTY_I3,
        contiguous(ks, np.float32) if kquant else EMPTY_F3,
        contiguous(kcol, np.float32) if kquant and kcol is not None else EMPTY_F2,
        EMPTY_F3 if vquant else kv_block(v),
        contiguous(vq, np.int8) if vquant else EMPTY_I3,
        contiguous(vs, np.float32) if vquant else EMPTY_F2,
        contiguous(vcol, np.float32) if vquant and vcol is not None else EMPTY_F2,
        EMPTY_F3 if xk is None else contiguous(xk, np.float32),
        EMPTY_F3 if xv is None else contiguous(xv, np.float32),
        window_block(thk) if kquant and thk is not None else EMPTY_H3,
        window_block(thv) if vquant and thv is not None else EMPTY_H3,
    )


#: The row of a sequence with no storage: no arrays (its heads have no rows).
EMPTY_ROW = np.zeros(BT_COLS, np.int64)

#: The batch-row slot of each storage array name (:func:`batch_arrays`' keywords).
BT_SLOTS_OF = {"k": _BT_KF, "kq": _BT_KQ, "ks": _BT_KS, "kcol": _BT_KCOL, "v": _BT_VF, "vq": _BT_VQ,
               "vs": _BT_VS, "vcol": _BT_VCOL, "xk": _BT_XK, "xv": _BT_XV, "thk": _BT_THK, "thv": _BT_THV}


def batch_row_address(row: np.ndarray, name: str) -> int:
    """The address a batch row holds for the storage array ``name``."""
    return int(row[BT_SLOTS_OF[name]])


def attend_batch(q, tab: np.ndarray, *, lens, kquant: bool, vquant: bool, kv_dtype=np.float32, xlen=None, b8=None,
                 kcol_set=None, vcol_set=None, imps: Sequence[np.ndarray | None] | None = None, scale: float,
                 window: int = 0, softcap: float = 0.0, sinks=None, block: int | None = None,
                 out=None) -> np.ndarray:
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
    q = contiguous(q, np.float32)
    B, nh, hd = q.shape
    lens = contiguous(lens, np.int64)
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
                _imp_addr(imptab, b, imp_array(imp))
    n = lens
    f = np.maximum(n - window, 0) if window > 0 else 0
    spans = np.where(n > 0, n - np.minimum(f, np.maximum(n - 1, 0)), 0)
    rows = int(spans.sum())
    ntask = int(((spans + block - 1) // block).sum())
    hpk = nh // nkv
    kdt = np.dtype(KV_KERNEL_DTYPES.get(np.dtype(kv_dtype), kv_dtype))
    isz = (1 if kquant else kdt.itemsize) + (1 if vquant else kdt.itemsize)
    like = _KIND_LIKE[kdt]
    sk = EMPTY_F2 if sinks is None else contiguous(sinks, np.float32).reshape(B, nh)
    buf = thread_scratch(ntask * hpk * (block + 3 + hd) + B * nh * hd)
    with thread_budget(rows * hd * isz, "batch"):
        old = set_parallel_chunksize(config.TASK_CHUNK)
        try:
            attend_batch_kernel(q, hpk, tab, imptab, lens,
                                EMPTY_I1 if xlen is None else contiguous(xlen, np.int64),
                                EMPTY_I1 if b8 is None else contiguous(b8, np.int64),
                                EMPTY_B1 if kcol_set is None else contiguous(kcol_set, np.bool_),
                                EMPTY_B1 if vcol_set is None else contiguous(vcol_set, np.bool_),
                                window, EMPTY_F3 if kquant else like, EMPTY_F3 if vquant else like,
                                bool(kquant), bool(vquant), np.float32(scale), np.float32(softcap), sk, block,
                                out, buf)
        finally:
            set_parallel_chunksize(old)
    return out
