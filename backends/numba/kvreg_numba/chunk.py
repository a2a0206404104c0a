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
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import njit, prange
from numba.core import cgutils, types
from numba.extending import intrinsic

from . import config
from .kernels import _CACHE, _broadcast, _claim, _claim_of, _ir_fma, _target_has, column_sums_into, softmax_row

#: float32 lanes of a vector register: 16 where the target has AVX-512, else
#: 8 (AVX2's ymm; numba's on-disk cache is keyed on the CPU features). The
#: width decides only which products share an instruction, never a bit.
LANES = 16 if _target_has("avx512f") else 8
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
        b = _broadcast(builder, builder.load(builder.gep(row, [k])), ir.VectorType(ir.FloatType(), LANES))
        for c, x in enumerate(vecs):
            builder.store(_ir_fma(builder, b, x, builder.load(accs[r][c])), accs[r][c])


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
            _store_vecs(builder, accs[r],
                        builder.gep(sa.data, [builder.add(builder.mul(builder.add(i_, ir.Constant(intp, r)), lds), c0_)]))
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
            srow = [builder.gep(sa.data, [builder.mul(builder.add(i_, ir.Constant(intp, r)), lds)]) for r in range(ROWS)]
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


@njit(nogil=True, cache=_CACHE)
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


@njit(nogil=True, cache=_CACHE)
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


@njit(parallel=True, nogil=True, cache=_CACHE)
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
                u = _claim_of(taken, 0)
                if u >= units:
                    break
                if _claim(taken, 0, u, u + 1) != u:
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
