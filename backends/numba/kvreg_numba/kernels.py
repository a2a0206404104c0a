"""Numba kernels over plain arrays, following docs/kernels.md.

Nothing here knows about kvreg's objects: every kernel takes the storage
arrays of one layer (head-major ``[nkv, cap, hd]`` blocks, see the table in
docs/kernels.md) and plain scalars. Absent storages are passed as empty
arrays of the same dtype and rank, so one compiled specialization serves
every mode (F32, Q8, Q8K, Q8V) and the first call compiles once.

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

import numpy as np
from numba import njit, prange

from . import config

_FM = set(config.FASTMATH)
_CACHE = config.CACHE

#: Channels per K scale (kvreg.modes.KV_K_GROUP; the backend checks they agree).
K_GROUP = 32

_NEG_INF = np.float32(-np.inf)
_ZERO = np.float32(0.0)


# ---------------------------------------------------------------------------
# decode attention
# ---------------------------------------------------------------------------


@njit(nogil=True, cache=_CACHE, fastmath=_FM)
def _dequant_k_rows(kq, ks, g, p0, nr, buf):
    # One int8->f32 conversion per K element shared by every head of the
    # group; the per-head dots then run on contiguous f32 rows in L1/L2.
    hd = kq.shape[2]
    ngk = ks.shape[2]
    # Loops index slices from 0 throughout this module: numba's wraparound
    # of a possibly negative index (range(lo, hi)) defeats the vectorizer.
    src = kq[g]
    sc = ks[g]
    # Unsigned indices: numba's wraparound of a possibly negative signed
    # index on every access keeps LLVM from vectorizing this loop (4x).
    for r in range(nr):
        p = np.uint64(p0 + r)
        for j in range(ngk):
            s = sc[p, j]
            for d in range(np.uint64(j * K_GROUP), np.uint64(min(hd, (j + 1) * K_GROUP))):
                buf[r, d] = np.float32(src[p, d]) * s


@njit(nogil=True, cache=_CACHE, fastmath=_FM)
def _dequant_v_rows(vq, vs, g, p0, nr, buf):
    hd = vq.shape[2]
    for r in range(nr):
        src = vq[g, p0 + r]
        s = vs[g, p0 + r]
        dst = buf[r]
        for d in range(hd):
            dst[d] = np.float32(src[d]) * s


@njit(nogil=True, cache=_CACHE, fastmath=_FM)
def _block_partial(qg, row0, nheads, kf, kq, ks, vf, vq, vs, kquant, vquant, g,
                   p0, nr, col0, scale, softcap, E, kbuf, vbuf, m_out, l_out, acc_out):
    """Partial softmax state of rows ``[p0, p0+nr)`` of KV head ``g`` for the
    heads ``qg[row0 : row0+nheads]``. Unnormalized ``exp(s - m_block)`` land
    in ``E[row, col0 : col0+nr]`` (kept for the importance pass)."""
    hd = qg.shape[1]
    if kquant:
        _dequant_k_rows(kq, ks, g, p0, nr, kbuf)
    for r in range(nr):
        if kquant:
            krow = kbuf[r]
        else:
            krow = kf[g, p0 + r]
        for h in range(nheads):
            qh = qg[row0 + h]
            acc = _ZERO
            for d in range(hd):
                acc += qh[d] * krow[d]
            E[row0 + h, col0 + r] = acc * scale
    for h in range(nheads):
        e = E[row0 + h, col0:col0 + nr]
        if softcap > 0:
            for r in range(nr):
                e[r] = softcap * np.tanh(e[r] / softcap)
        m = _NEG_INF
        for r in range(nr):
            x = e[r]
            if x > m:
                m = x
        lsum = _ZERO
        for r in range(nr):
            x = np.exp(e[r] - m)
            e[r] = x
            lsum += x
        m_out[h] = m
        l_out[h] = lsum
        for d in range(hd):
            acc_out[h, d] = _ZERO
    if vquant:
        _dequant_v_rows(vq, vs, g, p0, nr, vbuf)
    if vquant:
        vb = vbuf[:nr]
    else:
        vb = vf[g, p0:p0 + nr]
    # Four rows per sweep of the accumulator: a quarter of the load/store
    # traffic on acc, which otherwise bounds this loop rather than memory.
    r = 0
    while r + 4 <= nr:
        v0 = vb[r]
        v1 = vb[r + 1]
        v2 = vb[r + 2]
        v3 = vb[r + 3]
        for h in range(nheads):
            e = E[row0 + h, col0 + r:col0 + r + 4]
            w0 = e[0]
            w1 = e[1]
            w2 = e[2]
            w3 = e[3]
            a = acc_out[h]
            for d in range(hd):
                a[d] += w0 * v0[d] + w1 * v1[d] + w2 * v2[d] + w3 * v3[d]
        r += 4
    while r < nr:
        v0 = vb[r]
        for h in range(nheads):
            w0 = E[row0 + h, col0 + r]
            a = acc_out[h]
            for d in range(hd):
                a[d] += w0 * v0[d]
        r += 1


@njit(parallel=True, nogil=True, cache=_CACHE, fastmath=_FM)
def attend_groups(q, hpk, gids, firsts, ns, kf, kq, ks, kcol, kcol_set,
                  vf, vq, vs, vcol, vcol_set, kquant, vquant, scale, softcap,
                  sinks, block, imp, out):
    """Decode attention of the KV groups ``gids`` (the layer entry passes all
    of them, the per-group entry one): the only attention routine, so a
    layer call and per-group calls run the same arithmetic.

    ``q``/``out``: ``[len(gids) * hpk, hd]`` (group i owns rows
    ``[i*hpk, (i+1)*hpk)``); ``firsts``/``ns``: visible rows ``[first, n)``
    per listed group (already clamped, ``n == 0`` gives zeros); ``sinks``:
    one logit per q row or empty; ``imp``: accumulated in place over
    ``[first, min(len(imp), n))``, groups then heads in order.
    """
    ngr = gids.shape[0]
    hd = q.shape[1]
    nrows = ngr * hpk
    has_sink = sinks.shape[0] > 0

    # q (x) col_k once per call (q8 K); the dots then need no field.
    qc = np.empty((nrows, hd), np.float32)
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

    # The task list: one task per (group, block), block 0 starting at first.
    tstart = np.zeros(ngr + 1, np.int64)
    maxspan = 0
    for i in range(ngr):
        span = ns[i] - firsts[i] if ns[i] > 0 else 0
        if span > maxspan:
            maxspan = span
        tstart[i + 1] = tstart[i] + (span + block - 1) // block
    ntask = tstart[ngr]
    tgroup = np.empty(ntask, np.int64)
    for i in range(ngr):
        for t in range(tstart[i], tstart[i + 1]):
            tgroup[t] = i

    E = np.empty((nrows, maxspan), np.float32)
    pm = np.empty((ntask, hpk), np.float32)
    pl = np.empty((ntask, hpk), np.float32)
    pacc = np.empty((ntask, hpk, hd), np.float32)
    bk = block if kquant else 0
    bv = block if vquant else 0

    for t in prange(ntask):
        i = tgroup[t]
        b = t - tstart[i]
        p0 = firsts[i] + b * block
        nr = min(block, ns[i] - p0)
        kbuf = np.empty((bk, hd), np.float32)
        vbuf = np.empty((bv, hd), np.float32)
        _block_partial(qc, i * hpk, hpk, kf, kq, ks, vf, vq, vs, kquant, vquant,
                       gids[i], p0, nr, b * block, scale, softcap, E, kbuf, vbuf,
                       pm[t], pl[t], pacc[t])

    # Merge the partial states in block order; coef[t, h] turns a block's
    # exp(s - m_block) into the final probability (used for importance).
    coef = np.empty((ntask, hpk), np.float32)
    for row in prange(nrows):
        i = row // hpk
        h = row - i * hpk
        o = out[row]
        for d in range(hd):
            o[d] = _ZERO
        if ns[i] == 0:
            continue
        t0 = tstart[i]
        t1 = tstart[i + 1]
        mx = _NEG_INF
        for t in range(t0, t1):
            if pm[t, h] > mx:
                mx = pm[t, h]
        if has_sink and sinks[row] > mx:
            mx = sinks[row]
        z = _ZERO
        for t in range(t0, t1):
            w = np.exp(pm[t, h] - mx)
            coef[t, h] = w
            z += w * pl[t, h]
        if has_sink:
            z += np.exp(sinks[row] - mx)
        for t in range(t0, t1):
            w = coef[t, h]
            a = pacc[t, h]
            for d in range(hd):
                o[d] += w * a[d]
        if z > 0:
            for d in range(hd):
                o[d] = o[d] / z
            for t in range(t0, t1):
                coef[t, h] = coef[t, h] / z
        g = gids[i]
        if vquant and vcol_set[g]:
            for d in range(hd):
                o[d] *= vcol[g, d]

    ni = imp.shape[0]
    if ni > 0:
        nchunk = (ni + block - 1) // block
        for c in prange(nchunk):
            a0 = c * block
            a1 = min(a0 + block, ni)
            for i in range(ngr):
                f = firsts[i]
                lo = max(a0, f)
                hi = min(a1, min(ns[i], ni))
                if ns[i] == 0 or lo >= hi:
                    continue
                for h in range(hpk):
                    row = i * hpk + h
                    e = E[row]
                    p = lo
                    while p < hi:
                        # Segment of [lo, hi) inside one decode block.
                        t = tstart[i] + (p - f) // block
                        seg_end = min(hi, f + ((p - f) // block + 1) * block)
                        cf = coef[t, h]
                        dst = imp[p:seg_end]
                        src = e[p - f:seg_end - f]
                        for j in range(seg_end - p):
                            dst[j] += src[j] * cf
                        p = seg_end


# ---------------------------------------------------------------------------
# q8_2f quantization (exact class: no fast-math anywhere below)
# ---------------------------------------------------------------------------


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


# ---------------------------------------------------------------------------
# Python entry points (argument normalisation; the kernels trust them)
# ---------------------------------------------------------------------------

_EMPTY_F3 = np.empty((0, 0, 0), np.float32)
_EMPTY_I3 = np.empty((0, 0, 0), np.int8)
_EMPTY_F2 = np.empty((0, 0), np.float32)
_EMPTY_F1 = np.empty(0, np.float32)
_EMPTY_B1 = np.empty(0, np.bool_)


def _f3(a):
    return _EMPTY_F3 if a is None else np.ascontiguousarray(a, dtype=np.float32)


def _kv_args(k, kq, ks, kcol, kcol_set, v, vq, vs, vcol, vcol_set):
    kquant = k is None
    vquant = v is None
    if kquant and kq is None:
        raise ValueError("attend: neither k nor kq given")
    if vquant and vq is None:
        raise ValueError("attend: neither v nor vq given")
    return (
        _f3(k),
        _EMPTY_I3 if kq is None else np.ascontiguousarray(kq, dtype=np.int8),
        _EMPTY_F3 if ks is None else np.ascontiguousarray(ks, dtype=np.float32),
        _EMPTY_F2 if kcol is None else np.ascontiguousarray(kcol, dtype=np.float32),
        _EMPTY_B1 if kcol_set is None else np.ascontiguousarray(kcol_set, dtype=np.bool_),
        _f3(v),
        _EMPTY_I3 if vq is None else np.ascontiguousarray(vq, dtype=np.int8),
        _EMPTY_F2 if vs is None else np.ascontiguousarray(vs, dtype=np.float32),
        _EMPTY_F2 if vcol is None else np.ascontiguousarray(vcol, dtype=np.float32),
        _EMPTY_B1 if vcol_set is None else np.ascontiguousarray(vcol_set, dtype=np.bool_),
        kquant,
        vquant,
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


def attend_layer(q, lens, *, k=None, kq=None, ks=None, kcol=None, kcol_set=None,
                 v=None, vq=None, vs=None, vcol=None, vcol_set=None, scale,
                 window=0, softcap=0.0, sinks=None, imp=None, upto=None,
                 block=None, out=None):
    """Decode attention of a whole layer in one kernel call.

    ``q [nh, hd]``; K as ``k`` (f32) or ``kq, ks, kcol, kcol_set`` (q8), V as
    ``v`` or ``vq, vs, vcol, vcol_set``; ``window`` 0 = none, else per group
    ``first = max(0, n - window)``. Returns ``out [nh, hd]``.
    """
    q = np.ascontiguousarray(q, dtype=np.float32)
    lens = np.asarray(lens, dtype=np.int64)
    nkv = lens.shape[0]
    nh, hd = q.shape
    hpk = nh // nkv
    n = lens if upto is None else np.minimum(lens, upto)
    if window > 0:
        firsts = np.maximum(n - window, 0)
    else:
        firsts = np.zeros(nkv, np.int64)
    firsts = np.minimum(firsts, np.maximum(n - 1, 0)).astype(np.int64)
    if out is None:
        out = np.empty((nh, hd), np.float32)
    attend_groups(q, hpk, np.arange(nkv, dtype=np.int64), firsts, n.astype(np.int64),
                  *_kv_args(k, kq, ks, kcol, kcol_set, v, vq, vs, vcol, vcol_set),
                  np.float32(scale), np.float32(softcap), _sinks(sinks),
                  int(block or config.DECODE_BLOCK), _imp(imp), out)
    return out


def attend_group(q_group, g, lens, *, first=0, upto=None, k=None, kq=None, ks=None,
                 kcol=None, kcol_set=None, v=None, vq=None, vs=None, vcol=None,
                 vcol_set=None, scale, softcap=0.0, sinks=None, imp=None,
                 block=None, out=None):
    """Decode attention of the heads ``q_group [nheads, hd]`` of KV group
    ``g`` over rows ``[first, min(lens[g], upto))``: the same kernel as
    :func:`attend_layer`, restricted to one group."""
    q_group = np.ascontiguousarray(q_group, dtype=np.float32)
    nheads, hd = q_group.shape
    n = int(lens[g]) if upto is None else min(int(lens[g]), int(upto))
    f = min(int(first), max(n - 1, 0))
    if out is None:
        out = np.empty((nheads, hd), np.float32)
    attend_groups(q_group, nheads, np.array([g], np.int64), np.array([f], np.int64),
                  np.array([n], np.int64),
                  *_kv_args(k, kq, ks, kcol, kcol_set, v, vq, vs, vcol, vcol_set),
                  np.float32(scale), np.float32(softcap), _sinks(sinks),
                  int(block or config.DECODE_BLOCK), _imp(imp), out)
    return out
