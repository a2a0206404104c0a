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

import threading

import numpy as np
from llvmlite import ir
from numba import njit, prange, set_parallel_chunksize
from numba.core import types
from numba.extending import intrinsic

from . import config
from .quant import dequantize_rows, freeze_field, gather_rows, quantize_rows  # noqa: F401  (re-exported)

_FM = set(config.FASTMATH)
_CACHE = config.CACHE

#: Channels per K scale (kvreg.modes.KV_K_GROUP; the backend checks they agree).
K_GROUP = 32
#: q8 rows dequantized at a time: 16 x 128 x 4 B = 8 KiB per buffer, K and V
#: together well inside L1 (32 rows measured 15% slower at 16k rows), and
#: far below malloc's mmap threshold (no page faults per task). A multiple
#: of 4 (the 4-row score/value sweeps).
SUB_ROWS = 16

_NEG_INF = np.float32(-np.inf)
_POS_INF = np.float32(np.inf)
_NAN = np.float32(np.nan)
_ZERO = np.float32(0.0)


# ---------------------------------------------------------------------------
# a vectorizable exp (no SVML here: Numba's np.exp is a scalar libm call per
# element, ~2.5 ns, a fifth of a decode row's compute)
# ---------------------------------------------------------------------------


@intrinsic
def _f32_from_bits(typingctx, x):
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())

    return sig, codegen


_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
_EXP_LO = np.float32(-87.0)


@njit(nogil=True, cache=_CACHE, fastmath=_FM, inline="always")
def fexp(x):
    """exp(x) for float32 ``x <= 0`` (softmax arguments): Cody-Waite range
    reduction, a degree-6 polynomial and 2^n built from its bits; within
    3e-7 relative of exp. Results below 2^-126 (x < -87) flush to 0, -inf
    gives exactly 0. Pure arithmetic and selects, so LLVM vectorizes it."""
    xc = max(x, _EXP_LO)
    n = np.floor(xc * _LOG2E + np.float32(0.5))
    r = xc - n * _LN2_HI - n * _LN2_LO
    p = np.float32(1.9875691500e-4)
    p = p * r + np.float32(1.3981999507e-3)
    p = p * r + np.float32(8.3334519073e-3)
    p = p * r + np.float32(4.1665795894e-2)
    p = p * r + np.float32(1.6666665459e-1)
    p = p * r + np.float32(5.0000001201e-1)
    p = p * r * r + r + np.float32(1.0)
    y = p * _f32_from_bits((np.int32(n) + np.int32(127)) << 23)
    return y if x >= _EXP_LO else _ZERO


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
    if hd == ngk * K_GROUP and ngk % 4 == 0:
        # hd = 128, 256, ...: four groups per loop of constant trip count 32,
        # one long vector stream each (short per-group loops cost more in
        # loop overhead than the conversion itself).
        for r in range(nr):
            a = src[p0 + r]
            b = buf[r]
            s = sc[p0 + r]
            for j0 in range(0, ngk, 4):
                s0 = s[j0]
                s1 = s[j0 + 1]
                s2 = s[j0 + 2]
                s3 = s[j0 + 3]
                a4 = a[j0 * K_GROUP:(j0 + 4) * K_GROUP]
                b4 = b[j0 * K_GROUP:(j0 + 4) * K_GROUP]
                for d in range(K_GROUP):
                    b4[d] = np.float32(a4[d]) * s0
                    b4[K_GROUP + d] = np.float32(a4[K_GROUP + d]) * s1
                    b4[2 * K_GROUP + d] = np.float32(a4[2 * K_GROUP + d]) * s2
                    b4[3 * K_GROUP + d] = np.float32(a4[3 * K_GROUP + d]) * s3
        return
    # Any other hd (a short last group too). Unsigned indices: numba's
    # wraparound of a possibly negative signed index on every access keeps
    # LLVM from vectorizing this loop (4x).
    for r in range(nr):
        p = np.uint64(p0 + r)
        for j in range(ngk):
            s = sc[p, j]
            for d in range(np.uint64(j * K_GROUP), np.uint64(min(hd, (j + 1) * K_GROUP))):
                buf[r, d] = np.float32(src[p, d]) * s


@njit(nogil=True, cache=_CACHE, fastmath=_FM)
def _scores(qg, row0, nheads, kb, nr, scale, E, col):
    """``E[h, col+r] = scale * <qg[row0+h], kb[r]>`` for ``r < nr``.

    Four rows per head per sweep: q is loaded once for four independent FMA
    chains. Whether a row takes the 4-row or the 1-row form depends only on
    its place in its block (sub-blocks are multiples of 4 rows), and blocks
    are anchored at `first`, so every invariant call pair computes each
    score with the same code."""
    hd = qg.shape[1]
    r = 0
    while r + 4 <= nr:
        k0 = kb[r]
        k1 = kb[r + 1]
        k2 = kb[r + 2]
        k3 = kb[r + 3]
        for h in range(nheads):
            qh = qg[row0 + h]
            a0 = _ZERO
            a1 = _ZERO
            a2 = _ZERO
            a3 = _ZERO
            for d in range(hd):
                x = qh[d]
                a0 += x * k0[d]
                a1 += x * k1[d]
                a2 += x * k2[d]
                a3 += x * k3[d]
            e = E[h, col + r:col + r + 4]
            e[0] = a0 * scale
            e[1] = a1 * scale
            e[2] = a2 * scale
            e[3] = a3 * scale
        r += 4
    while r < nr:
        k0 = kb[r]
        for h in range(nheads):
            qh = qg[row0 + h]
            a0 = _ZERO
            for d in range(hd):
                a0 += qh[d] * k0[d]
            E[h, col + r] = a0 * scale
        r += 1


@njit(nogil=True, cache=_CACHE, fastmath=_FM)
def _accumulate(E, nheads, col, vb, nr, acc_out):
    """``acc_out[h] += sum_r E[h, col+r] * vb[r]``, four rows per sweep
    of the accumulator (a quarter of its load/store traffic)."""
    hd = vb.shape[1]
    r = 0
    while r + 4 <= nr:
        v0 = vb[r]
        v1 = vb[r + 1]
        v2 = vb[r + 2]
        v3 = vb[r + 3]
        for h in range(nheads):
            e = E[h, col + r:col + r + 4]
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
            w0 = E[h, col + r]
            a = acc_out[h]
            for d in range(hd):
                a[d] += w0 * v0[d]
        r += 1


@njit(nogil=True, cache=_CACHE, fastmath=_FM)
def _scores_h4(qg, row0, nheads, kb, nr, scale, E, col):
    """``E[h, col+r] = scale * <qg[row0+h], kb[r]>`` for ``r < nr``.

    Four heads by four rows per sweep: each K and q vector is loaded once
    for sixteen independent FMA chains. A short last chunk of heads repeats
    its last head (the duplicate dots are written twice, same value), so
    every head's dot always comes out of the same compiled loop, in the same
    accumulator layout, whatever the head count of the call (grouped ==
    per-head bit for bit). Whether a row takes the 4-row or the 1-row form
    depends only on its place in its block (sub-blocks are multiples of 4
    rows), and blocks are anchored at `first`, so every invariant call pair
    computes each score with the same code."""
    hd = qg.shape[1]
    last = nheads - 1
    for h0 in range(0, nheads, 4):
        ha = h0
        hb = min(h0 + 1, last)
        hc = min(h0 + 2, last)
        hx = min(h0 + 3, last)
        qa = qg[row0 + ha]
        qb = qg[row0 + hb]
        qc = qg[row0 + hc]
        qx = qg[row0 + hx]
        r = 0
        while r + 4 <= nr:
            k0 = kb[r]
            k1 = kb[r + 1]
            k2 = kb[r + 2]
            k3 = kb[r + 3]
            a0 = _ZERO
            a1 = _ZERO
            a2 = _ZERO
            a3 = _ZERO
            b0 = _ZERO
            b1 = _ZERO
            b2 = _ZERO
            b3 = _ZERO
            c0 = _ZERO
            c1 = _ZERO
            c2 = _ZERO
            c3 = _ZERO
            x0 = _ZERO
            x1 = _ZERO
            x2 = _ZERO
            x3 = _ZERO
            for d in range(hd):
                y0 = k0[d]
                y1 = k1[d]
                y2 = k2[d]
                y3 = k3[d]
                u = qa[d]
                a0 += u * y0
                a1 += u * y1
                a2 += u * y2
                a3 += u * y3
                u = qb[d]
                b0 += u * y0
                b1 += u * y1
                b2 += u * y2
                b3 += u * y3
                u = qc[d]
                c0 += u * y0
                c1 += u * y1
                c2 += u * y2
                c3 += u * y3
                u = qx[d]
                x0 += u * y0
                x1 += u * y1
                x2 += u * y2
                x3 += u * y3
            e = E[hx, col + r:col + r + 4]
            e[0] = x0 * scale
            e[1] = x1 * scale
            e[2] = x2 * scale
            e[3] = x3 * scale
            e = E[hc, col + r:col + r + 4]
            e[0] = c0 * scale
            e[1] = c1 * scale
            e[2] = c2 * scale
            e[3] = c3 * scale
            e = E[hb, col + r:col + r + 4]
            e[0] = b0 * scale
            e[1] = b1 * scale
            e[2] = b2 * scale
            e[3] = b3 * scale
            e = E[ha, col + r:col + r + 4]
            e[0] = a0 * scale
            e[1] = a1 * scale
            e[2] = a2 * scale
            e[3] = a3 * scale
            r += 4
        while r < nr:
            k0 = kb[r]
            a0 = _ZERO
            b0 = _ZERO
            c0 = _ZERO
            x0 = _ZERO
            for d in range(hd):
                y0 = k0[d]
                a0 += qa[d] * y0
                b0 += qb[d] * y0
                c0 += qc[d] * y0
                x0 += qx[d] * y0
            E[hx, col + r] = x0 * scale
            E[hc, col + r] = c0 * scale
            E[hb, col + r] = b0 * scale
            E[ha, col + r] = a0 * scale
            r += 1


#: The value pass is elementwise over channels: it vectorizes without
#: reassociation, and without it every output element's arithmetic is the
#: source expression, so the four-head sweep and the one-head sweep give a
#: head the same bits.
_FM_ACC = _FM - {"reassoc"}


@njit(nogil=True, cache=_CACHE, fastmath=_FM_ACC)
def _acc1(a, ea, col, vb, nr, vsc, vrow0):
    """One head's ``a += sum_r w_r * vb[r]`` (see :func:`_accumulate_q8`)."""
    hd = a.shape[0]
    r = 0
    while r + 4 <= nr:
        v0 = vb[r]
        v1 = vb[r + 1]
        v2 = vb[r + 2]
        v3 = vb[r + 3]
        wa0 = ea[col + r]
        wa1 = ea[col + r + 1]
        wa2 = ea[col + r + 2]
        wa3 = ea[col + r + 3]
        if vsc.shape[0] > 0:
            wa0 *= vsc[vrow0 + r]
            wa1 *= vsc[vrow0 + r + 1]
            wa2 *= vsc[vrow0 + r + 2]
            wa3 *= vsc[vrow0 + r + 3]
        for d in range(hd):
            y0 = np.float32(v0[d])
            y1 = np.float32(v1[d])
            y2 = np.float32(v2[d])
            y3 = np.float32(v3[d])
            a[d] = a[d] + (((wa0 * y0 + wa1 * y1) + wa2 * y2) + wa3 * y3)
        r += 4
    while r < nr:
        v0 = vb[r]
        wa0 = ea[col + r]
        if vsc.shape[0] > 0:
            wa0 *= vsc[vrow0 + r]
        for d in range(hd):
            a[d] = a[d] + wa0 * np.float32(v0[d])
        r += 1


@njit(nogil=True, cache=_CACHE, fastmath=_FM_ACC)
def _accumulate_q8(E, nheads, col, vb, nr, acc_out, vsc, vrow0):
    """``acc_out[h] += sum_r w[h, r] * vb[r]`` with ``w[h, r] = E[h, col+r]``
    (times ``vsc[vrow0+r]`` when ``vsc`` is not empty: q8 V rows, int8 ``vb``, converted
    inline, their per-row scale folded into the weight). Four rows per sweep
    of the accumulator, four heads per loaded V vector."""
    hd = vb.shape[1]
    h0 = 0
    hasvs = vsc.shape[0] > 0
    while h0 + 4 <= nheads:
        aa = acc_out[h0]
        ab = acc_out[h0 + 1]
        ac = acc_out[h0 + 2]
        ax = acc_out[h0 + 3]
        ea = E[h0]
        eb = E[h0 + 1]
        ec = E[h0 + 2]
        ex = E[h0 + 3]
        r = 0
        while r + 4 <= nr:
            v0 = vb[r]
            v1 = vb[r + 1]
            v2 = vb[r + 2]
            v3 = vb[r + 3]
            wa0 = ea[col + r]
            wa1 = ea[col + r + 1]
            wa2 = ea[col + r + 2]
            wa3 = ea[col + r + 3]
            wb0 = eb[col + r]
            wb1 = eb[col + r + 1]
            wb2 = eb[col + r + 2]
            wb3 = eb[col + r + 3]
            wc0 = ec[col + r]
            wc1 = ec[col + r + 1]
            wc2 = ec[col + r + 2]
            wc3 = ec[col + r + 3]
            wx0 = ex[col + r]
            wx1 = ex[col + r + 1]
            wx2 = ex[col + r + 2]
            wx3 = ex[col + r + 3]
            if hasvs:
                s0 = vsc[vrow0 + r]
                s1 = vsc[vrow0 + r + 1]
                s2 = vsc[vrow0 + r + 2]
                s3 = vsc[vrow0 + r + 3]
                wa0 *= s0
                wa1 *= s1
                wa2 *= s2
                wa3 *= s3
                wb0 *= s0
                wb1 *= s1
                wb2 *= s2
                wb3 *= s3
                wc0 *= s0
                wc1 *= s1
                wc2 *= s2
                wc3 *= s3
                wx0 *= s0
                wx1 *= s1
                wx2 *= s2
                wx3 *= s3
            for d in range(hd):
                y0 = np.float32(v0[d])
                y1 = np.float32(v1[d])
                y2 = np.float32(v2[d])
                y3 = np.float32(v3[d])
                aa[d] = aa[d] + (((wa0 * y0 + wa1 * y1) + wa2 * y2) + wa3 * y3)
                ab[d] = ab[d] + (((wb0 * y0 + wb1 * y1) + wb2 * y2) + wb3 * y3)
                ac[d] = ac[d] + (((wc0 * y0 + wc1 * y1) + wc2 * y2) + wc3 * y3)
                ax[d] = ax[d] + (((wx0 * y0 + wx1 * y1) + wx2 * y2) + wx3 * y3)
            r += 4
        while r < nr:
            v0 = vb[r]
            wa0 = ea[col + r]
            wb0 = eb[col + r]
            wc0 = ec[col + r]
            wx0 = ex[col + r]
            if hasvs:
                s0 = vsc[vrow0 + r]
                wa0 *= s0
                wb0 *= s0
                wc0 *= s0
                wx0 *= s0
            for d in range(hd):
                y0 = np.float32(v0[d])
                aa[d] = aa[d] + wa0 * y0
                ab[d] = ab[d] + wb0 * y0
                ac[d] = ac[d] + wc0 * y0
                ax[d] = ax[d] + wx0 * y0
            r += 1
        h0 += 4
    for h in range(h0, nheads):
        _acc1(acc_out[h], E[h], col, vb, nr, vsc, vrow0)


@njit(nogil=True, cache=_CACHE)
def _add_probs(dst, src, cf):
    """``dst += src * cf``, each product rounded to float32 first. A fused
    multiply-add would make a group's importance differ in the last bit from
    the sum of its heads' own probabilities; the products go through a buffer
    in a loop of their own so no multiply meets its add in one block."""
    n = dst.shape[0]
    prob = np.empty(n, np.float32)
    for j in range(n):
        prob[j] = src[j] * cf
    for j in range(n):
        dst[j] = dst[j] + prob[j]


@njit(nogil=True, cache=_CACHE, fastmath=_FM)
def _block_partial(qg, row0, nheads, kf, kq, ks, vf, vq, vs, kquant, vquant, g,
                   p0, nr, scale, softcap, E, kbuf, vbuf, m_out, l_out, acc_out, xk, xv, xl):
    """Partial softmax state of rows ``[p0, p0+nr)`` of KV head ``g`` for the
    heads ``qg[row0 : row0+nheads]``. Unnormalized ``exp(s - m_block)`` land
    in ``E[h, :nr]`` (this block's own slab, kept for the importance pass). q8
    K rows are dequantized ``SUB_ROWS`` at a time into ``kbuf`` (L1-sized) and
    scored four heads per loaded row; q8 V rows are read as int8 by
    :func:`_accumulate_q8` (``vbuf`` is unused, empty). Rows ``< xl`` are the
    head's exact rows: their float32 copies ``xk``/``xv`` (field space) stand
    in for the int8 ones."""
    hd = qg.shape[1]
    if kquant:
        for s0 in range(0, nr, SUB_ROWS):
            m = min(SUB_ROWS, nr - s0)
            _dequant_k_rows(kq, ks, g, p0 + s0, m, kbuf)
            for r in range(max(min(m, xl - p0 - s0), 0)):
                for d in range(hd):
                    kbuf[r, d] = xk[g, p0 + s0 + r, d]
            _scores_h4(qg, row0, nheads, kbuf, m, scale, E, s0)
    else:
        _scores(qg, row0, nheads, kf[g, p0:p0 + nr], nr, scale, E, 0)
    for h in range(nheads):
        e = E[h, :nr]
        if softcap > 0:
            for r in range(nr):
                e[r] = softcap * np.tanh(e[r] / softcap)
        # NaN-propagating max (a NaN score must reach the merge, which
        # poisons the head: docs/kernels.md, non-finite values). A plain
        # `x > m` would drop the NaN row silently.
        m = _NEG_INF
        nan = False
        for r in range(nr):
            x = e[r]
            if x > m:
                m = x
            nan |= x != x
        if nan:
            m = np.float32(np.nan)
        lsum = _ZERO
        for r in range(nr):
            x = fexp(e[r] - m)
            e[r] = x
            lsum += x
        m_out[h] = m
        l_out[h] = lsum
        for d in range(hd):
            acc_out[h, d] = _ZERO
    if vquant:
        nx = max(min(nr, xl - p0), 0)
        if nx > 0:
            _accumulate(E, nheads, 0, xv[g, p0:p0 + nx], nx, acc_out)
        _accumulate_q8(E, nheads, nx, vq[g, p0 + nx:p0 + nr], nr - nx, acc_out, vs[g], p0 + nx)
    else:
        _accumulate(E, nheads, 0, vf[g, p0:p0 + nr], nr, acc_out)


@njit(nogil=True, cache=_CACHE)
def partial_slabs(scratch, ntask, hpk, block, hd):
    """The per-task partial softmax states of a decode, carved from
    ``scratch``: ``E [ntask, hpk, block]`` (block-major scores: each block's
    are one small contiguous slab; a row-major ``[head, span]`` array would
    put a block's heads ``4·span`` bytes apart, often a power of two),
    ``pm``/``pl [ntask, hpk]`` (block max and sum), ``pacc [ntask, hpk, hd]``
    (block numerators), and the offset of the first float after them."""
    o = 0
    E = scratch[o:o + ntask * hpk * block].reshape((ntask, hpk, block))
    o += ntask * hpk * block
    pm = scratch[o:o + ntask * hpk].reshape((ntask, hpk))
    o += ntask * hpk
    pl = scratch[o:o + ntask * hpk].reshape((ntask, hpk))
    o += ntask * hpk
    pacc = scratch[o:o + ntask * hpk * hd].reshape((ntask, hpk, hd))
    return E, pm, pl, pacc, o + ntask * hpk * hd


@njit(nogil=True, cache=_CACHE)
def task_grid(spans, block):
    """The parallel task list of a decode: one task per ``block`` rows of each
    group's ``spans[g]`` visible rows. Returns ``(tstart [ng + 1], tgroup
    [ntask])``: group ``g`` owns tasks ``[tstart[g], tstart[g+1])``, task
    ``t`` belongs to group ``tgroup[t]``."""
    ng = spans.shape[0]
    tstart = np.zeros(ng + 1, np.int64)
    for g in range(ng):
        tstart[g + 1] = tstart[g] + (spans[g] + block - 1) // block
    tgroup = np.empty(tstart[ng], np.int64)
    for g in range(ng):
        for t in range(tstart[g], tstart[g + 1]):
            tgroup[t] = g
    return tstart, tgroup


@njit(parallel=True, nogil=True, cache=_CACHE, fastmath=_FM)
def attend_groups(q, hpk, gids, firsts, ns, kf, kq, ks, kcol, kcol_set,
                  vf, vq, vs, vcol, vcol_set, kquant, vquant, xk, xv, xlen, scale, softcap,
                  sinks, block, imp, out, scratch):
    """Decode attention of the KV groups ``gids`` (the layer entry passes all
    of them, the per-group entry one): the only attention routine, so a
    layer call and per-group calls run the same arithmetic.

    ``q``/``out``: ``[len(gids) * hpk, hd]`` (group i owns rows
    ``[i*hpk, (i+1)*hpk)``); ``firsts``/``ns``: visible rows ``[first, n)``
    per listed group (already clamped, ``n == 0`` gives zeros); ``sinks``:
    one logit per q row or empty; ``xk``/``xv``/``xlen``: the q8 exact rows
    (``xlen`` empty = none); ``imp``: accumulated in place over
    ``[first, min(len(imp), n))``, groups then heads in order.
    ``scratch``: a float32 buffer the kernel may use (see
    :func:`scratch_floats`; a fresh allocation per call would page-fault
    megabytes of scores and partial states on every decode step).
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
    spans = np.empty(ngr, np.int64)
    for i in range(ngr):
        spans[i] = ns[i] - firsts[i] if ns[i] > 0 else 0
    tstart, tgroup = task_grid(spans, block)
    ntask = tstart[ngr]

    # the blocks' partial states, then the merge's per-block coefficients
    E, pm, pl, pacc, o = partial_slabs(scratch, ntask, hpk, block, hd)
    coef = scratch[o:o + ntask * hpk].reshape((ntask, hpk))
    bk = SUB_ROWS if kquant else 0
    bv = 0  # q8 V rows are read as int8 by _accumulate_q8 (no dequant buffer)

    for t in prange(ntask):
        i = tgroup[t]
        b = t - tstart[i]
        p0 = firsts[i] + b * block
        nr = min(block, ns[i] - p0)
        kbuf = np.empty((bk, hd), np.float32)
        vbuf = np.empty((bv, hd), np.float32)
        xl = xlen[gids[i]] if xlen.shape[0] > 0 else 0
        _block_partial(qc, i * hpk, hpk, kf, kq, ks, vf, vq, vs, kquant, vquant,
                       gids[i], p0, nr, scale, softcap, E[t], kbuf, vbuf,
                       pm[t], pl[t], pacc[t], xk, xv, xl)

    # Merge the partial states in block order; coef[t, h] turns a block's
    # exp(s - m_block) into the final probability (used for importance).
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
            x = pm[t, h]
            if x > mx or x != x:  # NaN-propagating: a NaN block max poisons
                mx = x
        if has_sink and sinks[row] > mx:
            mx = sinks[row]
        if has_sink and sinks[row] != sinks[row]:
            mx = sinks[row]
        if not (mx > _NEG_INF and mx < _POS_INF):
            # A NaN or +inf score, or every visible score -inf with no sink:
            # the softmax is NaN (IEEE, as the reference computes it), so
            # is every channel of the output and every visible probability.
            for d in range(hd):
                o[d] = _NAN
            for t in range(t0, t1):
                coef[t, h] = _NAN
            continue
        z = _ZERO
        for t in range(t0, t1):
            w = fexp(pm[t, h] - mx)
            coef[t, h] = w
            z += w * pl[t, h]
        if has_sink:
            z += fexp(sinks[row] - mx)
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
                    p = lo
                    while p < hi:
                        # Segment of [lo, hi) inside one decode block.
                        b = (p - f) // block
                        t = tstart[i] + b
                        seg_end = min(hi, f + (b + 1) * block)
                        _add_probs(imp[p:seg_end], E[t, h, p - f - b * block:seg_end - f - b * block],
                                   coef[t, h])
                        p = seg_end


# ---------------------------------------------------------------------------
# prefill chunk: the GEMMs run in BLAS (numpy matmul), the masked softmax and
# the importance column sums here, fused, in place on the score tile
# ---------------------------------------------------------------------------


@njit(parallel=True, nogil=True, cache=_CACHE, fastmath=_FM)
def chunk_softmax(S, scale, s0, i0, bt, klo, window):
    """Causal (and windowed) softmax in place on a score tile ``S [hpk*bt,
    nk]`` whose row ``h*bt + r`` is query row ``i0 + r`` of the chunk and
    whose column ``j`` is key ``klo + j``; masked entries become exactly 0."""
    m_rows, nk = S.shape
    for row in prange(m_rows):
        i = i0 + row % bt
        end = s0 + i + 1 - klo
        lo = 0
        if window > 0:
            lo = max(0, s0 + i + 1 - window) - klo
        x = S[row]
        for j in range(lo):
            x[j] = _ZERO
        seg = x[lo:end]
        mx = _NEG_INF
        nan = False
        for j in range(end - lo):
            v = seg[j] * scale
            seg[j] = v
            if v > mx:
                mx = v
            nan |= v != v
        if nan or not (mx > _NEG_INF and mx < _POS_INF):
            # NaN / +inf score, or all -inf: the row's softmax is NaN at
            # every visible key (docs/kernels.md), 0 at the masked ones.
            for j in range(end - lo):
                seg[j] = _NAN
            tail = x[end:]
            for j in range(nk - end):
                tail[j] = _ZERO
            continue
        z = _ZERO
        for j in range(end - lo):
            e = fexp(seg[j] - mx)
            seg[j] = e
            z += e
        if z > 0:
            inv = np.float32(1.0) / z
            for j in range(end - lo):
                seg[j] *= inv
        tail = x[end:]
        for j in range(nk - end):
            tail[j] = _ZERO


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


def _f3(a):
    return _EMPTY_F3 if a is None else np.ascontiguousarray(a, dtype=np.float32)


def _kv_args(k, kq, ks, kcol, kcol_set, v, vq, vs, vcol, vcol_set, xk, xv, xlen):
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
        _f3(xk),
        _f3(xv),
        _EMPTY_I1 if xlen is None else np.ascontiguousarray(xlen, dtype=np.int64),
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


_tls = threading.local()


def scratch_floats(nrows, hpk, hd, firsts, ns, block):
    """Floats :func:`attend_groups` needs for these groups."""
    span = np.where(ns > 0, ns - firsts, 0)
    ntask = int(((span + block - 1) // block).sum())
    return ntask * hpk * (block + 3 + hd)


def _scratch(nfloats):
    # Per thread (kernels release the GIL), grown by doubling, never shrunk.
    buf = getattr(_tls, "buf", None)
    if buf is None or buf.shape[0] < nfloats:
        buf = np.empty(max(nfloats, 2 * (0 if buf is None else buf.shape[0]), 1024), np.float32)
        _tls.buf = buf
    return buf


def _run(*args):
    # Dynamic scheduling (config.TASK_CHUNK tasks at a time): a thread that
    # loses its core on a shared machine, or draws a short group, no longer
    # stalls the others. Every task writes its own slot and the merge runs
    # in block order, so the schedule cannot change a bit. Set from Python:
    # inside a kernel it would make the kernel uncacheable.
    old = set_parallel_chunksize(config.TASK_CHUNK)
    try:
        attend_groups(*args)
    finally:
        set_parallel_chunksize(old)


def attend_layer(q, lens, *, k=None, kq=None, ks=None, kcol=None, kcol_set=None,
                 v=None, vq=None, vs=None, vcol=None, vcol_set=None, xk=None, xv=None,
                 xlen=None, scale, window=0, softcap=0.0, sinks=None, imp=None, upto=None,
                 block=None, out=None):
    """Decode attention of a whole layer in one kernel call.

    ``q [nh, hd]``; K as ``k`` (f32) or ``kq, ks, kcol, kcol_set`` (q8), V as
    ``v`` or ``vq, vs, vcol, vcol_set``; ``xk, xv, xlen`` the q8 exact rows
    (see kvreg.storage; None = none); ``window`` 0 = none, else per group
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
    n = n.astype(np.int64)
    block = int(block or config.DECODE_BLOCK)
    _run(q, hpk, np.arange(nkv, dtype=np.int64), firsts, n,
                  *_kv_args(k, kq, ks, kcol, kcol_set, v, vq, vs, vcol, vcol_set, xk, xv, xlen),
                  np.float32(scale), np.float32(softcap), _sinks(sinks),
                  block, _imp(imp), out, _scratch(scratch_floats(nh, hpk, hd, firsts, n, block)))
    return out


def attend_group(q_group, g, lens, *, first=0, upto=None, k=None, kq=None, ks=None,
                 kcol=None, kcol_set=None, v=None, vq=None, vs=None, vcol=None,
                 vcol_set=None, xk=None, xv=None, xlen=None, scale, softcap=0.0, sinks=None,
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
    firsts = np.array([f], np.int64)
    ns = np.array([n], np.int64)
    block = int(block or config.DECODE_BLOCK)
    _run(q_group, nheads, np.array([g], np.int64), firsts, ns,
                  *_kv_args(k, kq, ks, kcol, kcol_set, v, vq, vs, vcol, vcol_set, xk, xv, xlen),
                  np.float32(scale), np.float32(softcap), _sinks(sinks),
                  block, _imp(imp), out, _scratch(scratch_floats(nheads, nheads, hd, firsts, ns, block)))
    return out


def attend_chunk(q, k, v, *, s0, b, hpk, scale, window=None, imp=None, q_tile=None):
    """Causal attention of a prefill chunk: ``q [b, nh, hd]``; rows
    ``[s0, s0+b)`` of every KV head of ``k``/``v`` (``[nkv, cap, hd]`` f32)
    are the chunk's own rows; row ``i`` sees keys
    ``[max(0, s0+i+1-window), s0+i+1)``. Per KV group and query tile the
    group's heads are stacked into one GEMM panel and only the keys some row
    of the tile can see are touched (O(b*(b+w)) for a windowed layer).
    ``imp`` gets the masked column sums. Returns ``[b, nh, hd]`` float32."""
    q = np.asarray(q, dtype=np.float32)
    _, nh, hd = q.shape
    nkv = nh // hpk
    w = int(window or 0)
    n = s0 + b
    nk_max = n - (max(0, s0 + 1 - w) if w else 0)
    bt_max = int(q_tile or config.CHUNK_Q_TILE)
    bt_max = max(1, min(bt_max, config.CHUNK_TILE_BYTES // (4 * hpk * max(nk_max, 1))))
    ntile = -(-b // bt_max)
    bt_max = -(-b // ntile)  # even tiles
    out = np.empty((b, nh, hd), np.float32)
    scale = np.float32(scale)
    ni = 0 if imp is None else min(imp.shape[0], n)
    for g in range(nkv):
        qg = np.ascontiguousarray(q[:, g * hpk:(g + 1) * hpk, :].transpose(1, 0, 2))
        for i0 in range(0, b, bt_max):
            bt = min(bt_max, b - i0)
            klo = max(0, s0 + i0 + 1 - w) if w else 0
            khi = s0 + i0 + bt
            panel = qg[:, i0:i0 + bt].reshape(hpk * bt, hd)
            S = panel @ k[g, klo:khi].T
            chunk_softmax(S, scale, s0, i0, bt, klo, w)
            vt = v[g, klo:khi]
            if _all_finite(vt):
                o = S @ vt
            else:
                # 0 * NaN: a NaN/inf value row would reach through the GEMM
                # the tile rows that cannot see it; sum visible keys only.
                o = _visible_values(S, vt, s0, i0, bt, klo, w)
            out[i0:i0 + bt, g * hpk:(g + 1) * hpk] = o.reshape(hpk, bt, hd).transpose(1, 0, 2)
            if ni > klo:
                column_sums_into(S[:, :ni - klo] if ni < khi else S, imp[klo:min(ni, khi)])
    return out
