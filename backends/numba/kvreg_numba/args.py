"""The kernels' arguments: a layer's storage arrays as the kernels take them.

Nothing compiled knows about kvreg's objects: every kernel takes the storage
arrays of one layer (head-major ``[nkv, cap, hd]`` blocks, see the table in
docs/kernels.md) and plain scalars. Absent storages are passed as empty
arrays of the same dtype and rank, so one compiled specialization serves
every mode (F32, Q8, Q8K, Q8V) and the first call compiles once; the 2-byte
modes (F16, BF16) are one more specialization each of the same code, their
blocks read as stored and widened in registers
(:func:`kvreg_numba.intrinsics.ir_widen`). This module turns a layer's
arrays (None = absent) into those forms, without copying a C-contiguous
storage block, and checks what the kernels cannot (a missing side, a window
bound without its window) before any launch. It is plain Python and NumPy:
every entry point of the backend (decode, batch, chunk) normalizes here,
and the kernels trust what it gives them.
"""

from __future__ import annotations

import numpy as np

#: numpy dtype of the array a kernel receives per storage dtype.
KV_KERNEL_DTYPES = {np.dtype(np.float32): np.float32, np.dtype(np.float16): np.int16,
                    np.dtype(np.uint16): np.uint16}

#: Absent arrays, by dtype and rank (one compiled specialization whether
#: an array is there or not).
EMPTY_F3 = np.empty((0, 0, 0), np.float32)
EMPTY_I3 = np.empty((0, 0, 0), np.int8)
EMPTY_F2 = np.empty((0, 0), np.float32)
EMPTY_F1 = np.empty(0, np.float32)
EMPTY_B1 = np.empty(0, np.bool_)
EMPTY_I1 = np.empty(0, np.int64)
_I64 = np.dtype(np.int64)
EMPTY_H3 = np.empty((0, 0, 0), np.int16)


def _f3(a):
    return EMPTY_F3 if a is None else np.ascontiguousarray(a, dtype=np.float32)


def kv_block(a: np.ndarray | None) -> np.ndarray:
    """An unquantized K/V block as the kernels take it, never a copy of a
    C-contiguous one: float32 as is, float16 viewed as its int16 bits,
    uint16 (bfloat16 bits) as is (see :data:`KV_KERNEL_DTYPES`)."""
    if a is None:
        return EMPTY_F3
    a = np.asarray(a)
    kdt = KV_KERNEL_DTYPES.get(a.dtype)
    if kdt is None:  # not a storage dtype (a caller's float64 array, say): float32
        return np.ascontiguousarray(a, dtype=np.float32)
    return np.ascontiguousarray(a).view(kdt)


def window_block(a: np.ndarray | None) -> np.ndarray:
    """A q8 float16 window (``[nkv, window, hd]`` float16) as the kernels
    take it: its int16 bits, a view of a C-contiguous array (never a copy of
    one); None gives an empty block."""
    if a is None:
        return EMPTY_H3
    a = np.asarray(a)
    if a.dtype == np.int16:
        return np.ascontiguousarray(a)
    if a.dtype != np.float16:
        raise ValueError(f"a float16 window must be float16 (or its int16 bits), not {a.dtype}")
    return np.ascontiguousarray(a).view(np.int16)


def kv_elem_bytes(kv: tuple) -> int:
    """Bytes of K and V per channel of a row for a :func:`kv_args` tuple
    (an int8 side counts 1; ``kquant``/``vquant`` are its items 10 and 11)."""
    return (1 if kv[10] else kv[0].dtype.itemsize) + (1 if kv[11] else kv[5].dtype.itemsize)


#: Where each per-head count sits in :func:`kv_args`' tuple (a backend that
#: keeps the tuple per allocation puts each version's counts there).
KV_COUNT_AT = {"kcol_set": 4, "vcol_set": 9, "xlen": 14, "b8": 17}


def kv_args(k, kq, ks, kcol, kcol_set, v, vq, vs, vcol, vcol_set, xk, xv, xlen,
            thk=None, thv=None, b8=None) -> tuple:
    """A layer's storage arrays (None = absent; K as ``k`` or q8's ``kq, ks,
    kcol, kcol_set``, V likewise) as the decode kernels take them, in their
    order: ``(kf, kq, ks, kcol, kcol_set, vf, vq, vs, vcol, vcol_set,
    kquant, vquant, xk, xv, xlen, thk, thv, b8)``."""
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
        EMPTY_I3 if kq is None else np.ascontiguousarray(kq, dtype=np.int8),
        EMPTY_F3 if ks is None else np.ascontiguousarray(ks, dtype=np.float32),
        EMPTY_F2 if kcol is None else np.ascontiguousarray(kcol, dtype=np.float32),
        EMPTY_B1 if kcol_set is None else np.ascontiguousarray(kcol_set, dtype=np.bool_),
        vf,
        EMPTY_I3 if vq is None else np.ascontiguousarray(vq, dtype=np.int8),
        EMPTY_F2 if vs is None else np.ascontiguousarray(vs, dtype=np.float32),
        EMPTY_F2 if vcol is None else np.ascontiguousarray(vcol, dtype=np.float32),
        EMPTY_B1 if vcol_set is None else np.ascontiguousarray(vcol_set, dtype=np.bool_),
        kquant,
        vquant,
        _f3(xk),
        _f3(xv),
        EMPTY_I1 if xlen is None else np.ascontiguousarray(xlen, dtype=np.int64),
        window_block(thk if kquant and b8 is not None else None),
        window_block(thv if vquant and b8 is not None else None),
        EMPTY_I1 if b8 is None else np.ascontiguousarray(b8, dtype=np.int64),
    )


def sinks_array(sinks: np.ndarray | None) -> np.ndarray:
    """Sinks as the kernels take them: one float32 logit per q row, or empty."""
    if sinks is None:
        return EMPTY_F1
    return np.ascontiguousarray(sinks, dtype=np.float32)


def imp_array(imp: np.ndarray | None) -> np.ndarray:
    """An importance accumulator as the kernels take it: written in place,
    so never a copy (a wrong one is refused), or empty."""
    if imp is None:
        return EMPTY_F1
    if imp.dtype != np.float32 or not imp.flags.c_contiguous:
        raise ValueError("imp must be a contiguous float32 array (accumulated in place)")
    return imp


def frozen_counts(a) -> np.ndarray:
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


def contiguous(a: np.ndarray, dtype) -> np.ndarray:
    """``a`` as a C-contiguous array of ``dtype``: itself when it already is one."""
    if a.dtype == dtype and a.flags.c_contiguous:
        return a
    return np.ascontiguousarray(a, dtype=dtype)
