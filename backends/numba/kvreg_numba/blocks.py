"""A decode block's partial softmax state, the merge, the importance pass.

Decode attention is flash-decoding: the visible rows ``[first, n)`` of a KV
group are cut into blocks of ``block`` rows ANCHORED AT ``first``; a block
computes the scores of all heads of its group (each K row read once), a
partial softmax (block max, sum, unnormalized V accumulator), and the
partial states of a group are merged in block order. Every head's arithmetic
is independent of the other heads and of the thread count, and depends on
the visible rows only, which is what makes the kernel contract's invariants
(grouped == per-head, windowed == masked full row, trimmed == untrimmed,
``upto`` == sequential, layer == per-group) hold bit for bit.

This module holds that arithmetic once, for every kernel that runs it: the
layer decode (:mod:`.decode`), the batched decode (:mod:`.batch`) and the
bounded ring (:mod:`.ring`) call the same :func:`block_partial`,
:func:`merge_row` and :func:`imp_chunk`, which is why a batched row or a
helper-run task gives the layer call's bits. How the blocks are scheduled
(threads, task claims) lives with each caller.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from . import config
from .intrinsics import JIT_CACHE, LANES, fexp, lane_sum, max_nan, widen
from .sweeps import K_GROUP, QK_CHUNKS, QK_WIDE, qk, qk8, wsum

_FM = set(config.FASTMATH)
_NEG_INF = np.float32(-np.inf)
_POS_INF = np.float32(np.inf)
_NAN = np.float32(np.nan)
_ZERO = np.float32(0.0)

# The decode's leaf kernels (a task's scores, values, merge: no allocation,
# no array returned) compile with ``_nrt=False``: no reference counting of
# the arrays they are passed and slice, which their caller keeps alive.
# numba otherwise increments and decrements every array's count at every
# call and slice: measured (perf, JIT symbols through gdb), 70% of a 16-row
# decode's compiled time; that call went from 12.5-13.2 to 8.4-9.8 µs.

#: q8 rows dequantized at a time: 16 x 128 x 4 B = 8 KiB per buffer, K and V
#: together well inside L1 (32 rows measured 15% slower at 16k rows), and
#: far below malloc's mmap threshold (no page faults per task). A multiple
#: of 4 (the 4-row score/value sweeps).
SUB_ROWS = 16
#: Floats of that buffer at any hd (:func:`sub_rows`): hd 64 takes 32 rows
#: (4k rows, 3 KV / 9 Q heads, one thread, shared machine: q8 / F32 time
#: 1.35-1.39 against 1.52-1.93 for 16 rows, three runs each; 64 rows no
#: better).
SUB_FLOATS = SUB_ROWS * 128


@njit(nogil=True, cache=JIT_CACHE, inline="always")
def sub_rows(hd):
    """Rows of the q8 K dequant buffer for rows of ``hd`` channels: at least
    :data:`SUB_ROWS`, more for a short hd (fewer calls per block)."""
    return max(SUB_ROWS, SUB_FLOATS // hd // 4 * 4)


@njit(nogil=True, _nrt=False, cache=JIT_CACHE, fastmath=_FM)
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
    if hd == ngk * K_GROUP and ngk % 2 == 0:
        # hd = 192, 320, ...: the same, two groups per loop (at hd 64, before
        # it was scored as stored: q8 decode of 4k rows 351 against 429 us
        # through the loop below)
        for r in range(nr):
            a = src[p0 + r]
            b = buf[r]
            s = sc[p0 + r]
            for j0 in range(0, ngk, 2):
                s0 = s[j0]
                s1 = s[j0 + 1]
                a2 = a[j0 * K_GROUP:(j0 + 2) * K_GROUP]
                b2 = b[j0 * K_GROUP:(j0 + 2) * K_GROUP]
                for d in range(K_GROUP):
                    b2[d] = np.float32(a2[d]) * s0
                    b2[K_GROUP + d] = np.float32(a2[K_GROUP + d]) * s1
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


@njit(nogil=True, _nrt=False, cache=JIT_CACHE, fastmath=_FM)
def scores(qg, row0, nheads, kb, nr, scale, E, col):
    """``E[h, col+r] = scale * <qg[row0+h], kb[r]>`` for ``r < nr``, four
    heads at a time (:func:`qk`).

    Every dot takes the same fixed-order lane arithmetic whichever form
    computes it (:func:`_lane_reduce`), so a head's score is the same bits
    whatever the head count, the row's place in its block, the thread count
    or the compile (grouped == per-head, cold == warm)."""
    for h in range(0, nheads, 4):
        h1 = min(nheads, h + 4)
        qk(qg[row0 + h:row0 + h1], E[h:h1], col, kb, nr, scale)


@njit(nogil=True, _nrt=False, cache=JIT_CACHE, fastmath=_FM)
def _scores8(qg, row0, nheads, kq, ks, nr, scale, E, col):
    """:func:`scores` of q8 K rows read as stored (:func:`qk8`): the same
    bits as :func:`_dequant_k_rows` then :func:`scores`."""
    for h in range(0, nheads, 4):
        h1 = min(nheads, h + 4)
        qk8(qg[row0 + h:row0 + h1], E[h:h1], col, kq, ks, nr, scale)


#: No row scales (:func:`_accumulate_q8` on float rows).
_NO_SCALES = np.empty(0, np.float32)
#: No helper-run tasks (:func:`imp_chunk` reads every task's scores in ``E``).
NO_OWNER = np.empty(0, np.int64)
NO_SLABS = np.empty((0, 0), np.float32)


@njit(nogil=True, _nrt=False, cache=JIT_CACHE, fastmath=_FM)
def accumulate(E, nheads, col, vb, nr, acc_out):
    """``acc_out[h] += sum_r E[h, col+r] * vb[r]`` (float32 or 2-byte rows):
    :func:`_accumulate_q8` without row scales."""
    _accumulate_q8(E, nheads, col, vb, nr, acc_out, _NO_SCALES, 0)


@njit(nogil=True, _nrt=False, cache=JIT_CACHE, fastmath=_FM)
def _accumulate_q8(E, nheads, col, vb, nr, acc_out, vsc, vrow0):
    """``acc_out[h] += sum_r w[h, r] * vb[r]`` with ``w[h, r] = E[h, col+r]``
    (times ``vsc[vrow0+r]`` when ``vsc`` is not empty: q8 V rows, int8 ``vb``,
    converted inline, their per-row scale folded into the weight; float32 and
    2-byte rows widened as read): :func:`wsum`, four heads at a time, one
    fused multiply-add per row in row order for every output element.
    Measured on one AVX-512 core, 4 heads, hd 128, rows from memory: 24-26
    ns a row against 40-50 ns for the loop it replaced, which swept four
    rows at a time and reloaded every head's accumulator."""
    for h in range(0, nheads, 4):
        h1 = min(nheads, h + 4)
        wsum(E[h:h1], col, vb, nr, acc_out[h:h1], vsc, vrow0)


@njit(nogil=True, _nrt=False, cache=JIT_CACHE)
def _add_probs(dst, src, cf, prob):
    """``dst += src * cf``, each product rounded to float32 first. A fused
    multiply-add would make a group's importance differ in the last bit from
    the sum of its heads' own probabilities; the products go through
    ``prob`` (at least ``len(dst)`` floats) in a loop of their own so no
    multiply meets its add in one block."""
    n = dst.shape[0]
    for j in range(n):
        prob[j] = src[j] * cf
    for j in range(n):
        dst[j] = dst[j] + prob[j]


@njit(nogil=True, _nrt=False, cache=JIT_CACHE, fastmath=_FM)
def block_partial(qg, row0, nheads, kf, kq, ks, vf, vq, vs, kquant, vquant, g,
                   p0, nr, scale, softcap, E, kbuf, vbuf, m_out, l_out, acc_out, xk, xv, xl,
                   thk, thv, wb):
    """Partial softmax state of rows ``[p0, p0+nr)`` of KV head ``g`` for the
    heads ``qg[row0 : row0+nheads]``. Unnormalized ``exp(s - m_block)`` land
    in ``E[h, :nr]`` (this block's own slab, kept for the importance pass). q8
    K rows of hd 64 and 128, and of hd 256 in fours of heads, are scored as
    stored (:func:`_scores8`); of any other hd dequantized ``SUB_ROWS`` at a
    time into ``kbuf`` (L1-sized) and scored four heads per loaded row (the
    same bits); q8 V rows are read as int8 by
    :func:`_accumulate_q8` (``vbuf`` is unused, empty). Rows ``< xl`` are the
    head's exact rows: their float32 copies ``xk``/``xv`` (field space) stand
    in for the int8 ones. Rows ``>= wb`` of a q8 side are its float16 window
    (``thk``/``thv [nkv, window, hd]`` as int16 bits, row ``p`` at ``p - wb``),
    widened in registers; the exact rows still take precedence. A head with
    no window passes ``wb >= n``."""
    hd = qg.shape[1]
    if kquant and hd == ks.shape[2] * K_GROUP and hd % LANES == 0 and (
            hd // LANES in QK_CHUNKS or (hd // LANES == QK_WIDE and nheads % 4 == 0)):
        # in row order: exact rows [p0, xe), int8 [xe, we), float16 window
        # [we, p0 + nr); the int8 rows scored as stored (no buffer)
        end = p0 + nr
        xe = min(max(xl, p0), end)
        we = max(min(wb, end), xe)
        if xe > p0:
            scores(qg, row0, nheads, xk[g, p0:xe], xe - p0, scale, E, 0)
        if we > xe:
            _scores8(qg, row0, nheads, kq[g, xe:we], ks[g, xe:we], we - xe, scale, E, xe - p0)
        if end > we:
            scores(qg, row0, nheads, thk[g, we - wb:end - wb], end - we, scale, E, we - p0)
    elif kquant:
        sub = kbuf.shape[0]
        for s0 in range(0, nr, sub):
            m = min(sub, nr - s0)
            pa = p0 + s0
            # rows [pa, pa+mq) are int8; [pa+mq, pa+m) the float16 window
            # (rows >= wb), widened exactly as they are read
            mq = max(min(m, wb - pa), 0)
            _dequant_k_rows(kq, ks, g, pa, mq, kbuf)
            for r in range(mq, m):
                src = thk[g, pa + r - wb]
                dst = kbuf[r]
                for d in range(hd):
                    dst[d] = widen(src[d])
            for r in range(max(min(m, xl - pa), 0)):  # exact rows take precedence
                for d in range(hd):
                    kbuf[r, d] = xk[g, pa + r, d]
            scores(qg, row0, nheads, kbuf, m, scale, E, s0)
    else:
        scores(qg, row0, nheads, kf[g, p0:p0 + nr], nr, scale, E, 0)
    for h in range(nheads):
        e = E[h, :nr]
        if softcap > 0:
            for r in range(nr):
                e[r] = softcap * np.tanh(e[r] / softcap)
        # NaN-propagating max (a NaN score must reach the merge, which
        # poisons the head: docs/kernels.md, non-finite values). A plain
        # `x > m` would drop the NaN row silently.
        m = max_nan(e)
        # exp elementwise (vectorizes without fast-math), then a
        # fixed-order sum
        for r in range(nr):
            e[r] = fexp(e[r] - m)
        m_out[h] = m
        l_out[h] = lane_sum(e)
        for d in range(hd):
            acc_out[h, d] = _ZERO
    if vquant:
        # in row order: exact rows [0, nx), int8 [nx, nw), float16 window [nw, nr)
        nx = max(min(nr, xl - p0), 0)
        nw = max(min(nr, wb - p0), nx)
        if nx > 0:
            accumulate(E, nheads, 0, xv[g, p0:p0 + nx], nx, acc_out)
        _accumulate_q8(E, nheads, nx, vq[g, p0 + nx:p0 + nw], nw - nx, acc_out, vs[g], p0 + nx)
        if nw < nr:
            accumulate(E, nheads, nw, thv[g, p0 + nw - wb:p0 + nr - wb], nr - nw, acc_out)
    else:
        accumulate(E, nheads, 0, vf[g, p0:p0 + nr], nr, acc_out)


@njit(nogil=True, cache=JIT_CACHE)
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


@njit(nogil=True, cache=JIT_CACHE)
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


@njit(nogil=True, _nrt=False, cache=JIT_CACHE, fastmath=_FM)
def merge_row(o, n, pm, pl, pacc, coef, t0, t1, h, has_sink, sink):
    """Merge head ``h``'s partial states of tasks ``[t0, t1)`` (its KV
    group's blocks, in block order) into ``o [hd]``, and leave in
    ``coef[t, h]`` the factor that turns a block's ``exp(s - m_block)`` into
    the final probability (the importance pass). ``n``: the group's visible
    row bound (0: zeros). Returns False when the row is zeros or poisoned
    (NaN) and needs no value field. The one merge of every decode kernel
    (:func:`attend_groups`, :func:`attend_batch_kernel`), so a batched row
    takes the arithmetic of the layer call."""
    hd = o.shape[0]
    for d in range(hd):
        o[d] = _ZERO
    if n == 0:
        return False
    mx = _NEG_INF
    for t in range(t0, t1):
        x = pm[t, h]
        if x > mx or x != x:  # NaN-propagating: a NaN block max poisons
            mx = x
    if has_sink and sink > mx:
        mx = sink
    if has_sink and sink != sink:
        mx = sink
    if not (mx > _NEG_INF and mx < _POS_INF):
        # A NaN or +inf score, or every visible score -inf with no sink:
        # the softmax is NaN (IEEE, as the reference computes it), so
        # is every channel of the output and every visible probability.
        for d in range(hd):
            o[d] = _NAN
        for t in range(t0, t1):
            coef[t, h] = _NAN
        return False
    z = _ZERO
    for t in range(t0, t1):
        w = fexp(pm[t, h] - mx)
        coef[t, h] = w
        z += w * pl[t, h]
    if has_sink:
        z += fexp(sink - mx)
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
    return True


@njit(nogil=True, cache=JIT_CACHE)
def imp_chunk(imp, a0, a1, firsts, ns, tstart, i0, ngr, hpk, block, E, coef, owner, slabs):
    """``imp[a0:a1] +=`` the probabilities of groups ``[i0, i0 + ngr)`` of
    the task grid (``firsts``/``ns``/``tstart`` indexed by group), groups
    then heads in order: the importance pass of every decode kernel. A
    task's scores are ``E[t]``, or, where ``owner[t] >= 0`` (``owner`` may
    be empty), ``E[t]`` of :func:`partial_slabs` over ``slabs[owner[t]]``:
    the helper thread that ran it (read where it lies, not copied)."""
    ni = imp.shape[0]
    ntask = E.shape[0]
    prob = np.empty(block, np.float32)
    for i in range(i0, i0 + ngr):
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
                Et = E
                if owner.shape[0] > 0 and owner[t] >= 0:
                    Et = slabs[owner[t], :ntask * hpk * block].reshape((ntask, hpk, block))
                _add_probs(imp[p:seg_end], Et[t, h, p - f - b * block:seg_end - f - b * block],
                           coef[t, h], prob)
                p = seg_end
