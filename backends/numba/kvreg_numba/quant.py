"""q8_2f quantization, the field freeze and row gathers: the exact class of
docs/kernels.md, bit for bit on every backend. No fast-math anywhere here:
float32 throughout, correctly rounded division, no FMA contraction, round
half away from zero, clamp to +-127, scale floor 1e-12, NaN -> 0.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from . import config

_CACHE = config.CACHE


@njit(nogil=True, cache=_CACHE)
def quant_row(r, group, q, s):
    # r: the row already divided by the field. Rust's f32::max ignores a NaN
    # operand, so a NaN channel does not poison its group's scale; the NaN
    # itself quantizes to 0 (Rust's saturating `as i8`).
    hd = r.shape[0]
    ng = s.shape[0]
    for j in range(ng):
        d0 = j * group
        d1 = min(d0 + group, hd)
        rg = r[d0:d1]
        qg = q[d0:d1]
        amax = np.float32(0.0)
        for d in range(d1 - d0):
            a = abs(rg[d])
            if a > amax:
                amax = a
        sc = amax / np.float32(127.0)
        if sc < np.float32(1e-12):
            sc = np.float32(1e-12)
        s[j] = sc
        for d in range(d1 - d0):
            v = rg[d] / sc
            if v != v:
                qg[d] = 0
                continue
            t = np.trunc(v)
            fr = v - t  # exact: no rounding in the tie test
            if fr >= np.float32(0.5):
                t += np.float32(1.0)
            elif fr <= np.float32(-0.5):
                t -= np.float32(1.0)
            if t > np.float32(127.0):
                t = np.float32(127.0)
            elif t < np.float32(-127.0):
                t = np.float32(-127.0)
            qg[d] = np.int8(t)


@njit(nogil=True, cache=_CACHE)
def quantize_rows(x, col, group):
    """``(q int8 [n, hd], s f32 [n, ceil(hd/group)])`` of rows ``x [n, hd]``
    against the field ``col`` ``[m, hd]``: ``m == 0`` no field, ``m == 1``
    one field for every row, ``m == n`` a field per row (a row per KV head);
    bit for bit the contract of docs/kernels.md."""
    n, hd = x.shape
    ng = (hd + group - 1) // group
    q = np.empty((n, hd), np.int8)
    s = np.empty((n, ng), np.float32)
    r = np.empty(hd, np.float32)
    m = col.shape[0]
    for i in range(n):
        xi = x[i]
        if m == 0:
            for d in range(hd):
                r[d] = xi[d]
        else:
            c = col[i if m > 1 else 0]
            for d in range(hd):
                r[d] = xi[d] / c[d]
        quant_row(r, group, q[i], s[i])
    return q, s


@njit(nogil=True, cache=_CACHE)
def dequantize_rows(q, s, group):
    """``q * s`` per group, float32 ``[n, hd]`` (without the field)."""
    n, hd = q.shape
    out = np.empty((n, hd), np.float32)
    for i in range(n):
        for d in range(hd):
            out[i, d] = np.float32(q[i, d]) * s[i, d // group]
    return out


@njit(nogil=True, cache=_CACHE)
def freeze_field(q, s, group):
    """Freeze the 2f field over one head's ``n`` stored rows: dequantize,
    ``col = max(sqrt(sum_p x^2 / n), 1e-6)`` with the sum in row order, and
    requantize every row against it. Returns ``(col, q2, s2)``."""
    n, hd = q.shape
    rows = dequantize_rows(q, s, group)
    acc = np.zeros(hd, np.float32)
    for p in range(n):
        for d in range(hd):
            acc[d] += rows[p, d] * rows[p, d]
    col = np.empty(hd, np.float32)
    nf = np.float32(n)
    for d in range(hd):
        c = np.sqrt(acc[d] / nf)
        if c < np.float32(1e-6) or c != c:
            c = np.float32(1e-6)
        col[d] = c
    q2, s2 = quantize_rows(rows, col.reshape(1, hd), group)
    return col, q2, s2


@njit(nogil=True, cache=_CACHE)
def gather_rows(rows, kept):
    """``rows[kept]`` of one head's ``[cap, w]`` rows (eviction): bit for bit
    the old rows, in ``kept`` order."""
    w = rows.shape[1]
    m = kept.shape[0]
    out = np.empty((m, w), rows.dtype)
    for i in range(m):
        src = rows[kept[i]]
        dst = out[i]
        for d in range(w):
            dst[d] = src[d]
    return out


@njit(nogil=True, cache=_CACHE)
def fwht_rows(x, scale):
    """:func:`kvreg.quant.fwht` of the rows ``x [n, hd]`` (float32, ``hd`` a
    power of two) into a new array: the same butterflies (``a + b``, ``a -
    b`` at strides 1, 2, 4, ...) and then ``* scale``, each a float32
    operation, so the same bits; one call instead of NumPy's two dozen."""
    n, hd = x.shape
    out = x.copy()
    for r in range(n):
        row = out[r]
        h = 1
        if hd >= 8:
            # Strides 1, 2 and 4 within each block of 8 channels, in
            # registers: the same sums and differences, a third of the loads
            # and stores, and no loops of 1-4 iterations (3.6x faster at
            # 8x128 rows, the rows of a q8 decode append).
            for j in range(0, hd, 8):
                a0, a1, a2, a3 = row[j], row[j + 1], row[j + 2], row[j + 3]
                a4, a5, a6, a7 = row[j + 4], row[j + 5], row[j + 6], row[j + 7]
                b0, b1, b2, b3 = a0 + a1, a0 - a1, a2 + a3, a2 - a3
                b4, b5, b6, b7 = a4 + a5, a4 - a5, a6 + a7, a6 - a7
                c0, c1, c2, c3 = b0 + b2, b1 + b3, b0 - b2, b1 - b3
                c4, c5, c6, c7 = b4 + b6, b5 + b7, b4 - b6, b5 - b7
                row[j], row[j + 1], row[j + 2], row[j + 3] = c0 + c4, c1 + c5, c2 + c6, c3 + c7
                row[j + 4], row[j + 5], row[j + 6], row[j + 7] = c0 - c4, c1 - c5, c2 - c6, c3 - c7
            h = 8
        while h < hd:
            for j in range(0, hd, 2 * h):
                lo = row[j:j + h]
                hi = row[j + h:j + 2 * h]
                for i in range(h):
                    a = lo[i]
                    b = hi[i]
                    lo[i] = a + b
                    hi[i] = a - b
            h *= 2
        for i in range(hd):
            row[i] = row[i] * scale
    return out
