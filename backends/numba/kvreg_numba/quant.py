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
def _quant_row(r, group, q, s):
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
        _quant_row(r, group, q[i], s[i])
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
        while h < hd:
            for j in range(0, hd, 2 * h):
                for i in range(j, j + h):
                    a = row[i]
                    b = row[i + h]
                    row[i] = a + b
                    row[i + h] = a - b
            h *= 2
        for i in range(hd):
            row[i] = row[i] * scale
    return out


@njit(nogil=True, cache=_CACHE)
def half_bits(x, out):
    """IEEE binary16 bits (int16) of the float32 row ``x`` into ``out``,
    rounded to nearest even as numpy's ``astype(np.float16)``: overflow to
    inf, subnormals, signed zeros; a NaN keeps its payload's top bits
    (quiet). Integer arithmetic only, the same bits on every CPU."""
    bits = x.view(np.uint32)
    for i in range(x.shape[0]):
        b = np.int64(bits[i])
        sign = (b >> 16) & 0x8000
        a = b & 0x7FFFFFFF
        if a >= 0x7F800000:                      # inf, NaN
            h = 0x7C00 + (a & 0x7FFFFF) // 8192
            if a > 0x7F800000 and h == 0x7C00:
                h += 1
        elif a >= 0x477FF000:                    # rounds past 65504
            h = 0x7C00
        elif a >= 0x38800000:                    # a normal half
            a -= 0x38000000                      # exponent rebiased 127 -> 15
            h = (a + 0xFFF + ((a >> 13) & 1)) >> 13
        elif a > 0x33000000:                     # a subnormal half (or its rounding up to 2^-14)
            m = (a & 0x7FFFFF) | 0x800000
            sh = 126 - (a >> 23)
            h = m >> sh
            rem = m - (h << sh)
            half = np.int64(1) << (sh - 1)
            if rem > half or (rem == half and (h & 1) == 1):
                h += 1
        else:                                    # at most 2^-25: zero
            h = 0
        h |= sign
        out[i] = np.int16(h - 0x10000 if h >= 0x8000 else h)


@njit(nogil=True, cache=_CACHE)
def half_to_float(h, out):
    """The float32 values of the binary16 bits ``h`` (int16 row): exact."""
    bits = out.view(np.uint32)
    for i in range(h.shape[0]):
        b = np.int64(h[i]) & 0xFFFF
        sign = (b & 0x8000) << 16
        e = (b >> 10) & 0x1F
        m = b & 0x3FF
        if e == 0:
            v = np.float32(m) * np.float32(2.0 ** -24)   # exact: a normal float32
            out[i] = -v if sign else v
            continue
        bits[i] = np.uint32(sign | (((e + 112) if e < 31 else 255) << 23) | (m << 13))


@njit(nogil=True, cache=_CACHE)
def _within(x, bound):
    for i in range(x.shape[0]):
        for d in range(x.shape[1]):
            if not abs(x[i, d]) <= bound:   # NaN compares false
                return False
    return True


@njit(nogil=True, cache=_CACHE)
def _window_side(x, th, q, s, group, row):
    # One quantized side of every head: the window's oldest row into the
    # integer slot (q [nkv, hd], s [nkv, groups]: the slot's rows), the
    # window moved up a row, x (stored basis) its newest.
    nkv, w, hd = th.shape
    for h in range(nkv):
        t = th[h]
        half_to_float(t[0], row)
        _quant_row(row, group, q[h], s[h])
        for i in range(w - 1):
            t[i] = t[i + 1]
        half_bits(x[h], t[w - 1])


@njit(nogil=True, cache=_CACHE)
def window_row_step(k, v, rot_k, rot_v, thk, thv, kq, ks, vq, vs, kf, vf, lens, b8, imp, seq, exact_cap, kgroup,
                    bound):
    """The decode append of a q8 storage whose float16 window is full
    (:meth:`kvreg.storage.LayerStorage.append_window_row`'s bits in one
    call): ``k``/``v`` ``[nkv, hd]`` float32 as given; a side whose window
    ``thk``/``thv`` (int16 bits ``[nkv, w, hd]``) is empty is stored as
    float32 rows ``kf``/``vf`` instead. Returns False, having written
    nothing, when the storage is not in that state (heads at one count ``n
    >= exact_cap``, ``b8 == n - w`` on each) or a quantized side holds a
    value beyond ``bound`` (or NaN): the caller's other paths then take the
    row, or raise."""
    qk = thk.shape[2] > 0
    qv = thv.shape[2] > 0
    nkv, hd = k.shape
    at = lens[0]
    p = at - (thk.shape[1] if qk else thv.shape[1])
    if at < exact_cap:
        return False
    for h in range(nkv):
        if lens[h] != at or b8[h] != p:
            return False
    if (qk and not _within(k, bound)) or (qv and not _within(v, bound)):
        return False
    scale = np.float32(1.0 / np.sqrt(hd))
    kr = fwht_rows(k, scale) if rot_k else k
    vr = fwht_rows(v, scale) if rot_v else v
    row = np.empty(hd, np.float32)
    if qk:
        _window_side(kr, thk, kq[:, p], ks[:, p], kgroup, row)
    else:
        kf[:, at] = kr
    if qv:
        _window_side(vr, thv, vq[:, p], vs[:, p:p + 1], hd, row)
    else:
        vf[:, at] = vr
    for h in range(nkv):
        lens[h] = at + 1
        b8[h] = p + 1
    imp[seq] = 0.0
    return True
