"""The prefill chunk's attention in registers: register-tiled score and
value products (explicit vector fused multiply-adds), the masked softmax
between them, one compiled call for the whole chunk.

A tile is ``hpk * bt`` panel rows (the group's heads stacked, row ``h*bt +
r`` = query ``i0 + r`` of head ``h``) against the keys any of its rows can
see, from a copy of the group's keys packed :data:`KEYS` at a time as
``[hd, KEYS]`` (a K row block transposed, so a score tile is 2 K loads and
:data:`ROWS` broadcasts per 2 x :data:`ROWS` multiply-adds). Each score is
one fused multiply-add chain over the channels in order, each output
channel one chain over the keys in order, whichever thread runs the tile:
the bits depend on the inputs only (never on a BLAS, a thread count or the
tile), and a tile's scores (``config.CHUNK_TILE_ROWS`` panel rows) stay in
L2 between the three passes. One core of a Xeon (AVX-512): 133-137 GFLOP/s
for the score product against OpenBLAS's 105-113 on the same tiles.

A chunk the tiles cannot take (an hd not a multiple of 16, a non-finite
value row the chunk sees) runs on BLAS GEMMs instead (numpy's matmul, the
reduction sliced so the bits do not follow BLAS's threads, :mod:`.blas`
holding it to one), and both paths share the masked softmax
(:func:`softmax_row`) and the importance column sums defined here; the
prefill entry :func:`attend_chunk` picks the path. The prefill chunk is its
own module because it has nothing of the decode's: no blocks merge, its
work is compute-bound tiles rather than a stream of rows.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange
from numba.core import cgutils, types
from numba.extending import intrinsic

from . import config
from .args import EMPTY_F1, contiguous
from .atomics import claim, claim_of
from .blas import one_blas_thread
from .intrinsics import JIT_CACHE, exp_sum, ir_broadcast, ir_fma, max_nan, target_has
from .threads import thread_budget

_FM = set(config.FASTMATH)
_NEG_INF = np.float32(-np.inf)
_POS_INF = np.float32(np.inf)
_NAN = np.float32(np.nan)
_ZERO = np.float32(0.0)

#: float32 lanes of a vector register: 16 where the target has AVX-512, else
#: 8 (AVX2's ymm; numba's on-disk cache is keyed on the CPU features). The
#: width decides only which products share an instruction, never a bit.
LANES = 16 if target_has("avx512f") else 8
#: Panel rows of one register tile: 6 x 2 score vectors and 6 x :data:`V_VECS`
#: value vectors of accumulators, within the register file (32 zmm, 16 ymm).
ROWS = 6
#: Keys of a packed K block: two vectors of scores per panel row.
KEYS = 2 * LANES
#: Vectors of a value tile's row: 64 output channels at a time on AVX-512,
#: 16 on AVX2.
V_VECS = 4 if LANES == 16 else 2
#: Lanes of a chunk that collects importance: a fixed count (not the
#: thread count), each with its own column sums, so the sums' order and
#: bits do not follow the threads; at most this many workers run it.
IMP_LANES = 8
#: Keys of a value-pass block: their rows stay in L1 while every register
#: tile of the panel runs over them (32 KiB at hd 64).
V_KEYS = 128


def _vec(builder, base, off):
    vt = ir.VectorType(ir.FloatType(), LANES)
    return builder.bitcast(builder.gep(base, [off]), vt.as_pointer())


def _load_vecs(builder, base, nvec):
    intp = ir.IntType(64)
    return [builder.load(_vec(builder, base, ir.Constant(intp, LANES * c)), align=4) for c in range(nvec)]


def _store_vecs(builder, accs, base):
    intp = ir.IntType(64)
    for c, acc in enumerate(accs):
        builder.store(builder.load(acc), _vec(builder, base, ir.Constant(intp, LANES * c)), align=4)


def _outer_fma(builder, accs, rows, k, vecs):
    """``accs[r][c] = fma(rows[r][k], vecs[c], accs[r][c])``: one rank-1
    step of a register tile (a row's scalar broadcast to every vector)."""
    for r, row in enumerate(rows):
        b = ir_broadcast(builder, builder.load(builder.gep(row, [k])), ir.VectorType(ir.FloatType(), LANES))
        for c, x in enumerate(vecs):
            builder.store(ir_fma(builder, b, x, builder.load(accs[r][c])), accs[r][c])


@intrinsic
def _scores(typingctx, P, i, kp, jb, S, c0):
    """``S[i + r, c0 + t] = sum_d P[i + r, d] * kp[jb, d, t]`` for ``r <
    ROWS``, ``t < KEYS``: one fused multiply-add chain over ``d`` in order.
    ``P [rows, hd]``, ``kp [blocks, hd, KEYS]``, ``S`` 2-D, all C-contiguous
    float32; the caller guarantees the bounds."""
    def codegen(context, builder, sig, args):
        pa, ka, sa = (context.make_array(t)(context, builder, v) for t, v in zip(sig.args[::2], args[::2]))
        i_, jb_, c0_ = args[1], args[3], args[5]
        intp = i_.type
        vt = ir.VectorType(ir.FloatType(), LANES)
        hd = builder.extract_value(pa.shape, 1)
        lds = builder.extract_value(sa.shape, 1)
        nvec = KEYS // LANES
        accs = [[cgutils.alloca_once_value(builder, ir.Constant(vt, [0.0] * LANES)) for _ in range(nvec)]
                for _ in range(ROWS)]
        prow = [builder.gep(pa.data, [builder.mul(builder.add(i_, ir.Constant(intp, r)), hd)]) for r in range(ROWS)]
        kblock = builder.gep(ka.data, [builder.mul(builder.mul(jb_, hd), ir.Constant(intp, KEYS))])
        with cgutils.for_range(builder, hd) as loop:
            d = loop.index
            krow = builder.gep(kblock, [builder.mul(d, ir.Constant(intp, KEYS))])
            _outer_fma(builder, accs, prow, d, _load_vecs(builder, krow, nvec))
        for r in range(ROWS):
            row = builder.mul(builder.add(i_, ir.Constant(intp, r)), lds)
            _store_vecs(builder, accs[r], builder.gep(sa.data, [builder.add(row, c0_)]))
        return context.get_dummy_value()

    return types.void(P, i, kp, jb, S, c0), codegen


def _values_kernel(nvec):
    @intrinsic
    def values(typingctx, S, i, j0, j1, V, v0, c0, O, first):
        """``O[i + r, c0 : c0 + 16*nvec] (+)= sum_{j0 <= j < j1} S[i + r, j] *
        V[v0 + j, c0 : ...]`` for ``r < ROWS``, keys in order: from zero when
        ``first``, else continuing the chain stored in ``O`` (a float32 store
        and load are exact, so key blocks do not change a bit)."""
        def codegen(context, builder, sig, args):
            sa, va, oa = (context.make_array(t)(context, builder, v) for t, v in
                          ((sig.args[0], args[0]), (sig.args[4], args[4]), (sig.args[7], args[7])))
            i_, j0_, j1_, v0_, c0_, first = args[1], args[2], args[3], args[5], args[6], args[8]
            intp = i_.type
            vt = ir.VectorType(ir.FloatType(), LANES)
            lds = builder.extract_value(sa.shape, 1)
            hd = builder.extract_value(va.shape, 1)
            ldo = builder.extract_value(oa.shape, 1)
            orow = [builder.gep(oa.data, [builder.add(builder.mul(builder.add(i_, ir.Constant(intp, r)), ldo), c0_)])
                    for r in range(ROWS)]
            zero = ir.Constant(vt, [0.0] * LANES)
            accs = []
            for r in range(ROWS):
                accs.append([])
                for c in range(nvec):
                    old = builder.load(_vec(builder, orow[r], ir.Constant(intp, LANES * c)), align=4)
                    accs[r].append(cgutils.alloca_once_value(builder, builder.select(first, zero, old)))
            srow = [builder.gep(sa.data, [builder.mul(builder.add(i_, ir.Constant(intp, r)), lds)])
                    for r in range(ROWS)]
            with cgutils.for_range_slice(builder, j0_, j1_, ir.Constant(intp, 1)) as (j, _):
                vrow = builder.gep(va.data, [builder.add(builder.mul(builder.add(v0_, j), hd), c0_)])
                _outer_fma(builder, accs, srow, j, _load_vecs(builder, vrow, nvec))
            for r in range(ROWS):
                _store_vecs(builder, accs[r], orow[r])
            return context.get_dummy_value()

        return types.void(S, i, j0, j1, V, v0, c0, O, first), codegen

    return values


_values_wide = _values_kernel(V_VECS)
_values1 = _values_kernel(1)


@njit(nogil=True, cache=JIT_CACHE)
def _pack_keys(k, g, kstart, n, kp):
    """Keys ``[kstart, n)`` of group ``g`` as ``kp [blocks, hd, KEYS]``
    (block ``jb`` holds keys ``kstart + KEYS*jb + t``; zeros past ``n``)."""
    hd = k.shape[2]
    for jb in range(kp.shape[0]):
        blk = kp[jb]
        for t in range(KEYS):
            r = kstart + jb * KEYS + t
            if r < n:
                row = k[g, r]
                for d in range(hd):
                    blk[d, t] = row[d]
            else:
                for d in range(hd):
                    blk[d, t] = 0.0


@njit(nogil=True, cache=JIT_CACHE)
def _tile(q, g, hpk, i0, bt, s0, w, kstart, kp, v, scale, P, S, O, inv, out):
    """One tile: queries ``[i0, i0 + bt)`` of group ``g``'s heads into
    ``out``; ``P``/``S``/``O``/``inv`` the caller's scratch (``ROWS``-padded).
    Returns the tile's first key column ``col0`` and column count: ``S``
    holds the rows' exponentials there, ``inv`` their ``1 / sum``."""
    hd = q.shape[2]
    m = hpk * bt
    mp = -(-m // ROWS) * ROWS
    for h in range(hpk):
        for r in range(bt):
            P[h * bt + r, :] = q[i0 + r, g * hpk + h, :]
    P[m:mp, :] = 0.0    # padded rows: scores 0, never normalized, outputs dropped
    klo = max(0, s0 + i0 + 1 - w) if w > 0 else 0
    jb0 = (klo - kstart) // KEYS
    col0 = kstart + jb0 * KEYS
    ncol = s0 + i0 + bt - col0
    for jb in range((ncol + KEYS - 1) // KEYS):
        for i in range(0, mp, ROWS):
            _scores(P, i, kp, jb0 + jb, S, jb * KEYS)
    for row in range(m):   # exponentials only: the outputs are scaled by 1 / sum once
        inv[row] = softmax_row(S[row, :ncol], scale, s0 + i0 + row % bt, col0, w, False)
    vg = v[g]
    for j0 in range(0, ncol, V_KEYS):
        j1 = min(j0 + V_KEYS, ncol)
        for i in range(0, mp, ROWS):
            c = 0
            while c + V_VECS * LANES <= hd:   # V_VECS vectors of channels at a time, then one
                _values_wide(S, i, j0, j1, vg, col0, c, O, j0 == 0)
                c += V_VECS * LANES
            while c < hd:
                _values1(S, i, j0, j1, vg, col0, c, O, j0 == 0)
                c += LANES
    for h in range(hpk):
        for r in range(bt):
            o = out[i0 + r, g * hpk + h]
            row = O[h * bt + r]
            f = inv[h * bt + r]
            for c in range(hd):
                o[c] = row[c] * f
    return col0, ncol


@njit(parallel=True, nogil=True, cache=JIT_CACHE)
def chunk_kernel(q, k, v, s0, hpk, scale, w, bt, threads, out, imp):
    """Causal (windowed when ``w > 0``) attention of the chunk ``q [b, nh,
    hd]`` at rows ``[s0, s0 + b)`` of ``k``/``v`` (``[nkv, cap, hd]``
    float32, C-contiguous; ``hd`` a multiple of 16) into ``out``; ``imp``
    (length 0 = none) gets each key's probability column sums. ``threads``
    parallel workers claim the tiles one at a time, last (costliest) first;
    with importance they claim lanes instead: the tiles are dealt
    round-robin to ``min(IMP_LANES, tiles)`` lanes whatever the threads
    (tile ``t`` to lane ``t % lanes``), each summing its tiles' columns in
    tile and row order, added to ``imp`` in lane order: the same bits on
    any thread count."""
    b, _, hd = q.shape
    nkv = k.shape[0]
    n = s0 + b
    kstart = max(0, s0 + 1 - w) if w > 0 else 0
    nblk = (n - kstart + KEYS - 1) // KEYS
    kp = np.empty((nblk, hd, KEYS), np.float32)
    mp = -(-(hpk * bt) // ROWS) * ROWS
    ntile = (b + bt - 1) // bt
    ncol_max = n - kstart + KEYS
    ni = min(imp.shape[0], n)
    has_imp = ni > kstart
    # Work is claimed a unit at a time: a tile, costliest (last) first; with
    # importance a lane (tiles lane, lane + lanes, ...: costs interleave
    # along the causal triangle). A worker whose core a busy neighbour
    # shares then takes fewer units instead of holding the chunk back by
    # half. A unit's bits follow from its inputs alone, whoever runs it.
    lanes = min(IMP_LANES, ntile) if has_imp else 0
    units = lanes if has_imp else ntile
    workers = max(1, min(threads, units))
    P = np.empty((workers, mp, hd), np.float32)
    S = np.empty((workers, mp, ncol_max), np.float32)
    O = np.empty((workers, mp, hd), np.float32)
    inv = np.empty((workers, mp), np.float32)
    part = np.zeros((lanes, max(ni - kstart, 0)), np.float32)
    taken = np.zeros(1, np.int64)
    for g in range(nkv):
        _pack_keys(k, g, kstart, n, kp)
        taken[0] = 0
        for wk in prange(workers):
            while True:
                u = claim_of(taken, 0)
                if u >= units:
                    break
                if claim(taken, 0, u, u + 1) != u:
                    continue
                if not has_imp:
                    i0 = (ntile - 1 - u) * bt
                    _tile(q, g, hpk, i0, min(bt, b - i0), s0, w, kstart, kp, v, scale, P[wk], S[wk], O[wk],
                          inv[wk], out)
                    continue
                for t in range(u, ntile, lanes):
                    i0 = t * bt
                    m = hpk * min(bt, b - i0)
                    col0, ncol = _tile(q, g, hpk, i0, min(bt, b - i0), s0, w, kstart, kp, v, scale, P[wk], S[wk],
                                       O[wk], inv[wk], out)
                    c1 = min(ni, col0 + ncol)
                    if c1 > col0:
                        probs = S[wk, :m, :c1 - col0]
                        for row in range(m):
                            probs[row] *= inv[wk, row]
                        column_sums_into(probs, part[u, col0 - kstart:c1 - kstart])
    for lane in range(part.shape[0]):
        dst = imp[kstart:ni]
        src = part[lane]
        for j in range(dst.shape[0]):
            dst[j] += src[j]


def tile_rows(hpk: int, hd: int) -> int:
    """Query rows per tile: ``config.CHUNK_TILE_ROWS`` panel rows per 64
    channels of ``hd`` (a packed K block is reused by every register tile
    of the panel), of ``hpk`` stacked heads; at least one row."""
    return max(1, int(config.CHUNK_TILE_ROWS) * max(1, hd // 64) // hpk)


# ---------------------------------------------------------------------------
# the masked softmax and importance sums both paths share
# ---------------------------------------------------------------------------


@njit(parallel=True, nogil=True, cache=JIT_CACHE, fastmath=_FM)
def chunk_softmax(S, scale, s0, i0, bt, klo, window):
    """Causal (and windowed) softmax in place on a score tile ``S [hpk*bt,
    nk]`` whose row ``h*bt + r`` is query row ``i0 + r`` of the chunk and
    whose column ``j`` is key ``klo + j``; masked entries become exactly 0."""
    for row in prange(S.shape[0]):
        softmax_row(S[row], scale, s0 + i0 + row % bt, klo, window, True)


@njit(nogil=True, cache=JIT_CACHE, fastmath=_FM)
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
    mx = max_nan(seg) * scale
    if not (mx > _NEG_INF and mx < _POS_INF):
        # NaN / +inf score, or all -inf: the row's softmax is NaN at
        # every visible key (docs/kernels.md), 0 at the masked ones.
        for j in range(end - lo):
            seg[j] = _NAN
    else:
        z = exp_sum(seg, scale, mx)   # seg[j] = fexp(seg[j] * scale - mx); lane_sum(seg)
        if z > 0:
            inv = np.float32(1.0) / z
            if normalize:
                for j in range(end - lo):
                    seg[j] *= inv
    tail = x[end:]
    for j in range(nk - end):
        tail[j] = _ZERO
    return inv


@njit(nogil=True, cache=JIT_CACHE)
def _all_finite(a):
    """Whether every element of the 2-D ``a`` is finite (one read, no temporaries)."""
    acc = _ZERO
    for i in range(a.shape[0]):
        r = a[i]
        for j in range(a.shape[1]):
            acc += r[j] - r[j]  # NaN exactly when some element is NaN or inf
    return acc == acc


@njit(nogil=True, cache=JIT_CACHE)
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


@njit(nogil=True, cache=JIT_CACHE, fastmath=_FM)
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
# the entry point, and the BLAS path of a chunk the tiles cannot take
# ---------------------------------------------------------------------------


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


def attend_chunk(q, k: np.ndarray, v: np.ndarray, *, s0: int, b: int, hpk: int, scale: float,
                 window: int | None = None, imp: np.ndarray | None = None, q_tile: int | None = None) -> np.ndarray:
    """Causal attention of a prefill chunk: ``q [b, nh, hd]``; rows
    ``[s0, s0+b)`` of every KV head of ``k``/``v`` (``[nkv, cap, hd]`` f32)
    are the chunk's own rows; row ``i`` sees keys
    ``[max(0, s0+i+1-window), s0+i+1)``. Per KV group and query tile the
    group's heads are stacked into one panel and only the keys some row of
    the tile can see are touched (O(b*(b+w)) for a windowed layer): in
    registers (:func:`chunk_kernel`) when hd is a multiple of 16 and
    every value row the chunk sees is finite, else by BLAS. ``imp`` gets the
    masked column sums. Returns ``[b, nh, hd]`` float32."""
    q = np.asarray(q, dtype=np.float32)
    _, nh, hd = q.shape
    nkv = nh // hpk
    w = int(window or 0)
    n = s0 + b
    kstart = max(0, s0 + 1 - w) if w else 0
    if hd % 16 == 0 and b > 0 and all(_all_finite(v[g, kstart:n]) for g in range(nkv)):
        # The register-tiled kernel; a non-finite value row takes the path
        # below, which sums only the keys a row sees.
        out = np.empty((b, nh, hd), np.float32)
        bt = tile_rows(hpk, hd)
        # Unmeasured: a chunk is long and compute-bound, so even a worker
        # that shares its core with a busy neighbour still adds what it
        # gets, and a one-thread probe cost a 4k SmolLM2 prefill ~80 ms a
        # layer (~175 ms on one thread against ~95 on two, in the model).
        with thread_budget(4 * nh * b * (n - kstart), "chunk", measure=False) as threads:
            # q as it comes (a model's [n, nh, hd] is a transposed view): the
            # kernel gathers each tile's rows itself, so no copy of the chunk
            chunk_kernel(q, contiguous(k, np.float32), contiguous(v, np.float32), s0, hpk, np.float32(scale), w,
                         bt, threads, out, EMPTY_F1 if imp is None else imp[:n])
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
