"""The two sweeps of a decode block over its K/V rows, emitted as IR.

:func:`qk` scores 1-4 heads against a block's K rows (each K chunk loaded
and widened once for every head, q in registers) and :func:`wsum` adds the
block's value rows into 1-4 heads' accumulators (one fused multiply-add per
row in row order, accumulators in registers across rows); :func:`qk8` scores
q8 K rows as stored. Every output takes the fixed-order lane arithmetic of
:mod:`.intrinsics`, so a head's bits do not depend on how many heads share
the sweep, the vector width or the compile. These are the decode's hot
loops, unrolled per head count and hd with their own measured tunings
(prefetch distance, rows per sub-block): a module of their own so those
choices sit beside the code they tune, apart from the block logic that
calls them (:mod:`.blocks`).
"""

from __future__ import annotations

import functools

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from .intrinsics import (
    ESIZE,
    KV_KINDS,
    LANES,
    V_KINDS,
    ir_arrays,
    ir_broadcast,
    ir_fma,
    ir_prefetch,
    ir_prefetch_l2,
    ir_tree_sums,
    ir_widen,
    target_has,
)

#: Channels per K scale (kvreg.modes.KV_K_GROUP; the backend checks they agree).
K_GROUP = 32


#: Rows of a value-pass sub-block (:func:`wsum`): 8 float32 rows of hd 128
#: are 4 KiB, so a pass after the first over a sub-block reads L1 (8 rows
#: measured faster from memory than 4, 16 or 32).
WSUM_ROWS = 8
#: Rows ahead of the one read that the hd-256 passes hint into L2, line by
#: line (the windowed value pass, :func:`_ir_wsum`, and the 4-head score
#: loop, :data:`QK_WIDE`): 8 KiB of float32 rows at hd 256. A burst of
#: hints per row (:func:`ir_prefetch`) did not keep up with rows of ~30 ns
#: of arithmetic; on a Zen 4 core the score loop read fastest 8 KiB ahead
#: (``kvreg bench kernels``).
HINT_ROWS = 8
#: ``LANES``-wide chunks of channels a value pass holds for each of up to
#: four heads in registers: 16 accumulators, half of AVX-512's 32 vector
#: registers; elsewhere a 16-lane vector is two 256-bit registers, so 8 of
#: them in half of 16. The width only decides which channels share a pass
#: over the rows, never an element's arithmetic.
WSUM_WINDOW = 4 if target_has("avx512f") else 2
#: Accumulators of an unrolled pass (hd in ``LANES`` x :data:`WSUM_CHUNKS`):
#: as many heads' whole rows as fit, else one head's channels in windows.
WSUM_ACCS = 4 * WSUM_WINDOW
#: Chunk counts with an unrolled value pass: hd 64 and 128. hd 256 runs in
#: windows of :data:`WSUM_WINDOW` chunks over every head (each row's chunk
#: loaded once for four heads, not once per head: one thread, 4 heads, 4k
#: rows, 0.19-0.23 ms against 0.26-0.31 ms unrolled per head).
WSUM_CHUNKS = (4, 8)


def _elem_ptr(builder, arr, i, j, elty):
    """Pointer to ``arr[i, j]`` of a 2-D array (strides in bytes) as ``elty*``."""
    off = builder.add(builder.mul(i, builder.extract_value(arr.strides, 0)),
                      builder.mul(j, builder.extract_value(arr.strides, 1)))
    raw = builder.gep(builder.bitcast(arr.data, ir.IntType(8).as_pointer()), [off])
    return builder.bitcast(raw, elty.as_pointer())


def _raw_vector(kind):
    """The ``LANES``-wide vector type a row of numba dtype ``kind`` is loaded as."""
    elt = {types.float32: ir.FloatType(), types.int8: ir.IntType(8)}.get(kind, ir.IntType(16))
    return ir.VectorType(elt, LANES)


def _per_head_count(builder, nh, body):
    """Emit ``body(h)`` for the run-time head count ``nh`` in 1-4 (the
    accumulators of a pass are per head, so each count is its own code)."""
    for h in range(1, 5):
        with builder.if_then(builder.icmp_signed("==", nh, ir.Constant(nh.type, h))):
            body(h)


def _ir_wsum(builder, E, col, vb, nr, acc, vsc, vrow0, vkind):
    """IR of :func:`wsum`. Per sub-block of :data:`WSUM_ROWS` rows: the
    weights (times the row's scale when ``vsc`` is not empty, one float32
    rounding as the scalar loop does) into a stack buffer, then one pass over
    the sub-block per window of :data:`WSUM_WINDOW` chunks, its heads x
    window accumulators in registers for every row, and the channels past
    the last window one at a time.

    Prefetch: an unrolled pass reads whole rows in order, so the hardware
    prefetcher follows it (plus :func:`ir_prefetch`'s hints per CPU). The
    windows read a sub-block's rows once per window, a slice of each row at
    a time, which no hardware prefetcher follows: each chunk that starts a
    line hints the same chunk :data:`HINT_ROWS` rows ahead into L2, one hint
    per few FMAs rather than a burst per row. hd 256, 4 Q / 1 KV heads, one
    AMD Zen 4 core, rows from memory: the value pass alone read 9.4-9.7 GB/s
    with the burst, 22.8 with these hints (hd 128's unrolled pass 20-28)."""
    f32 = ir.FloatType()
    vt = ir.VectorType(f32, LANES)
    intp = nr.type

    def c(x):
        return ir.Constant(intp, x)

    nh = builder.extract_value(E.shape, 0)
    hd = builder.extract_value(vb.shape, 1)
    nwin = builder.sdiv(hd, c(LANES * WSUM_WINDOW))
    hasvs = builder.icmp_signed(">", builder.extract_value(vsc.shape, 0), c(0))
    wbuf = cgutils.alloca_once(builder, f32, size=4 * WSUM_ROWS)
    ahead = builder.mul(builder.extract_value(vb.strides, 0), c(HINT_ROWS))
    # hd 64 / 128: unrolled; any other hd: windows, then the tail
    exact = builder.icmp_signed("==", builder.srem(hd, c(LANES)), c(0))
    chunks = builder.sdiv(hd, c(LANES))
    built = [builder.and_(exact, builder.icmp_signed("==", chunks, c(k))) for k in WSUM_CHUNKS]
    is_unrolled = functools.reduce(builder.or_, built)
    nsb = builder.sdiv(builder.add(nr, c(WSUM_ROWS - 1)), c(WSUM_ROWS))
    with cgutils.for_range(builder, nsb) as sbl:
        r0 = builder.mul(sbl.index, c(WSUM_ROWS))
        end = builder.add(r0, c(WSUM_ROWS))
        m = builder.sub(builder.select(builder.icmp_signed("<", end, nr), end, nr), r0)
        with cgutils.for_range(builder, m) as rl:
            r = builder.add(r0, rl.index)
            with builder.if_then(is_unrolled):
                ir_prefetch(builder, _elem_ptr(builder, vb, r, c(0), ir.IntType(8)), builder.mul(hd, c(ESIZE[vkind])))
            for h in range(4):
                with builder.if_then(builder.icmp_signed(">", nh, c(h))):
                    w = builder.load(_elem_ptr(builder, E, c(h), builder.add(col, r), f32))
                    slot = builder.gep(wbuf, [builder.add(c(h * WSUM_ROWS), rl.index)])
                    with builder.if_else(hasvs) as (scaled, plain):
                        with scaled:
                            s = builder.load(builder.gep(vsc.data, [builder.add(vrow0, r)]))
                            builder.store(builder.fmul(w, s), slot)
                        with plain:
                            builder.store(w, slot)

        def one_pass(h0, nheads, d0, width, hint_next=False):
            # heads [h0, h0 + nheads) x chunks [d0, d0 + width * LANES) in
            # registers across the sub-block's rows; `hint_next`: the same
            # lines HINT_ROWS rows ahead into L2
            ptrs = [[_elem_ptr(builder, acc, builder.add(h0, c(h)), builder.add(d0, c(k * LANES)), vt)
                     for k in range(width)] for h in range(nheads)]
            accs = [[cgutils.alloca_once_value(builder, builder.load(p, align=4)) for p in row] for row in ptrs]
            with cgutils.for_range(builder, m) as rl:
                ws = [ir_broadcast(builder, builder.load(builder.gep(
                    wbuf, [builder.add(builder.mul(builder.add(h0, c(h)), c(WSUM_ROWS)), rl.index)])), vt)
                    for h in range(nheads)]
                r = builder.add(r0, rl.index)
                for k in range(width):
                    at = _elem_ptr(builder, vb, r, builder.add(d0, c(k * LANES)), _raw_vector(vkind))
                    if hint_next and k * LANES * ESIZE[vkind] % 64 == 0:
                        ir_prefetch_l2(builder, at, ahead)
                    raw = builder.load(at, align=1)
                    v = ir_widen(builder, raw, vkind)
                    for h in range(nheads):
                        builder.store(ir_fma(builder, ws[h], v, builder.load(accs[h][k])), accs[h][k])
            for row, arow in zip(ptrs, accs):
                for p, a in zip(row, arow):
                    builder.store(builder.load(a), p, align=4)

        def passes(nheads):
            with cgutils.for_range(builder, nwin) as wl:
                one_pass(c(0), nheads, builder.mul(wl.index, c(LANES * WSUM_WINDOW)), WSUM_WINDOW, hint_next=True)

        def unrolled(nch):
            # every chunk of a row in one pass: rows read in order, once
            per = max(1, WSUM_ACCS // nch)
            cw = min(nch, WSUM_ACCS)

            def group(h0, nheads):
                for k0 in range(0, nch, cw):
                    one_pass(h0, nheads, c(k0 * LANES), cw)

            full = builder.sdiv(nh, c(per))
            with cgutils.for_range(builder, full) as gl:
                group(builder.mul(gl.index, c(per)), per)
            rest = builder.sub(nh, builder.mul(full, c(per)))
            for n in range(1, per):
                with builder.if_then(builder.icmp_signed("==", rest, c(n))):
                    group(builder.mul(full, c(per)), n)

        for k, cond in zip(WSUM_CHUNKS, built):
            with builder.if_then(cond):
                unrolled(k)
        with builder.if_then(builder.not_(is_unrolled)):
            _per_head_count(builder, nh, passes)
        # channels past the last window, one at a time
        with cgutils.for_range_slice(builder, builder.mul(nwin, c(LANES * WSUM_WINDOW)), hd, c(1)) as (d, _):
            with cgutils.for_range(builder, nh) as hl:
                ap = _elem_ptr(builder, acc, hl.index, d, f32)
                a = cgutils.alloca_once_value(builder, builder.load(ap))
                with cgutils.for_range(builder, m) as rl:
                    x = ir_widen(builder, builder.load(_elem_ptr(builder, vb, builder.add(r0, rl.index), d,
                                                                  _raw_vector(vkind).element)), vkind)
                    w = builder.load(builder.gep(wbuf, [builder.add(builder.mul(hl.index, c(WSUM_ROWS)), rl.index)]))
                    builder.store(ir_fma(builder, w, x, builder.load(a)), a)
                builder.store(builder.load(a), ap)


@intrinsic
def wsum(typingctx, E, col, vb, nr, acc, vsc, vrow0):
    """``acc[h] += sum_r w[h, r] * vb[r]`` for ``r < nr``, ``w[h, r] =
    E[h, col + r]`` (times ``vsc[vrow0 + r]`` when ``vsc`` is not empty),
    one fused multiply-add per row in row order for every output element
    (so the bits do not depend on the window, the vector width or the head
    count), with the accumulators in registers across rows. ``E``/``acc``:
    1-4 heads; ``vb [nr, hd]`` float32, binary16 or bfloat16 bits, or int8
    codes, its rows contiguous."""
    arrays = (E, vb, acc, vsc)
    if not (all(isinstance(a, types.Array) for a in arrays) and E.ndim == 2 and acc.ndim == 2
            and vb.ndim == 2 and vsc.ndim == 1 and E.dtype == acc.dtype == vsc.dtype == types.float32
            and vb.dtype in V_KINDS):
        return None

    def codegen(context, builder, sig, args):
        Ea, vba, acca, vsca = ir_arrays(context, builder, [sig.args[i] for i in (0, 2, 4, 5)],
                                      [args[i] for i in (0, 2, 4, 5)])
        col_, nr_, vrow0_ = (context.cast(builder, args[i], sig.args[i], types.intp) for i in (1, 3, 6))
        _ir_wsum(builder, Ea, col_, vba, nr_, acca, vsca, vrow0_, sig.args[2].dtype)
        return context.get_dummy_value()

    return types.void(E, col, vb, nr, acc, vsc, vrow0), codegen


#: K rows per load of q's chunks in :func:`qk`'s unrolled loop.
QK_SUB = 32
#: K rows scored side by side in :func:`qk`'s unrolled loop at hd 64 (one
#: q load and one packed tree of lane sums for both rows). A decode of 1k
#: rows at 9 / 3 heads (SmolLM2), two AMD Zen 4 cores: 60-68 against 68-71
#: us (f32), 82-83 against 84-86 us (q8). At hd 128 the rows go one at a
#: time: with 4 heads q takes every AVX-512 register and one core's scores
#: slowed (11.8 to 13.1-13.5 ns a row), and no decode measured a gain.
QK_STEP = 2
QK_STEP_CHUNKS = 4
#: Chunk counts with an unrolled score loop: hd 64 and 128, any 1-4 heads.
QK_CHUNKS = (4, 8)
#: The chunk count unrolled for four heads only: hd 256 (Gemma 3's 4 Q / 1 KV
#: heads), q spilled. With the windowed value pass (:data:`WSUM_CHUNKS`), one
#: thread, 4 heads, 576 / 4k / 16k rows: 40-43 us / 0.17 ms / 0.92-1.37 ms
#: against 47-51 us / 0.19-0.23 ms / 1.22-1.37 ms for the per-row loop (three
#: runs each). For every head count it compiled 18 s slower (three modes).
#: q8 K rows of hd 256 are scored as stored here too when the heads come in
#: fours (:func:`qk8`): one thread, rows from memory, 4k / 32k rows: 386-410
#: us / 2.16-2.20 ms against 524-759 us / 3.12-3.22 ms dequantized into a
#: buffer first (two interleaved pairs).
QK_WIDE = 16


def _ir_qk_unrolled(builder, qa, Ea, col, kba, nr, scale, nheads, nch, kkind, ksa=None):
    """IR of :func:`qk`'s rows for ``nheads`` heads and ``nch`` chunks of
    a row (hd ``nch * LANES``): ``E[h, col + r] = scale * <q[h], k[r]>``,
    each K chunk loaded (and widened) once for every head. ``ksa``: q8
    codes' scales ``[nr, hd / K_GROUP]``, each chunk times its group's scale
    (one float32 multiply, as :func:`_dequant_k_rows` rounds it) before the
    dots. The rows ahead are prefetched (:func:`ir_prefetch`; at
    :data:`QK_WIDE` chunks line by line, :data:`HINT_ROWS` rows ahead)."""
    f32 = ir.FloatType()
    vt = ir.VectorType(f32, LANES)

    def c(x):
        return ir.Constant(nr.type, x)

    wide = nch == QK_WIDE   # line hints HINT_ROWS rows ahead, not a burst per row
    ahead = builder.mul(builder.extract_value(kba.strides, 0), c(HINT_ROWS)) if wide else None
    # q's chunks loaded once per QK_SUB rows (kept in registers or spilled
    # to one stack slot: reloading them through q's strides every row
    # measured up to 1.4x slower)
    nsb = builder.sdiv(builder.add(nr, c(QK_SUB - 1)), c(QK_SUB))
    with cgutils.for_range(builder, nsb) as sbl:
        r0 = builder.mul(sbl.index, c(QK_SUB))
        end = builder.add(r0, c(QK_SUB))
        r1 = builder.select(builder.icmp_signed("<", end, nr), end, nr)
        qptr = [_elem_ptr(builder, qa, c(h), c(0), vt) for h in range(nheads)]
        qv = [[builder.load(builder.gep(qptr[h], [c(k)]), align=4) for k in range(nch)] for h in range(nheads)]

        def rows(rs):
            # the rows' dots side by side: each q chunk meets every row's K
            # chunk in turn, and the rows' heads share one packed tree of
            # lane sums (the same additions of the same values as a tree
            # per row)
            for r in rs:
                if not wide:
                    ir_prefetch(builder, _elem_ptr(builder, kba, r, c(0), ir.IntType(8)), nch * LANES * ESIZE[kkind])
                if ksa is not None:
                    ir_prefetch(builder, _elem_ptr(builder, ksa, r, c(0), ir.IntType(8)), 4)
            accs = [[ir.Constant(vt, [0.0] * LANES)] * nheads for _ in rs]
            for k in range(nch):
                kvs = []
                for r in rs:
                    at = _elem_ptr(builder, kba, r, c(k * LANES), _raw_vector(kkind))
                    if wide and k * LANES * ESIZE[kkind] % 64 == 0:
                        ir_prefetch_l2(builder, at, ahead)
                    raw = builder.load(at, align=1)
                    kv = ir_widen(builder, raw, kkind)
                    if ksa is not None:
                        s = builder.load(_elem_ptr(builder, ksa, r, c(k * LANES // K_GROUP), f32))
                        kv = builder.fmul(kv, ir_broadcast(builder, s, vt))
                    kvs.append(kv)
                for h in range(nheads):
                    for i, kv in enumerate(kvs):
                        accs[i][h] = ir_fma(builder, qv[h][k], kv, accs[i][h])
            sums = ir_tree_sums(builder, [a for row in accs for a in row])
            for i, r in enumerate(rs):
                for h in range(nheads):
                    builder.store(builder.fmul(sums[i * nheads + h], scale),
                                  _elem_ptr(builder, Ea, c(h), builder.add(col, r), f32))

        step = QK_STEP if nch == QK_STEP_CHUNKS else 1
        nstep = builder.sdiv(builder.sub(r1, r0), c(step))
        with cgutils.for_range(builder, nstep) as sl:
            ra = builder.add(r0, builder.mul(sl.index, c(step)))
            rows([builder.add(ra, c(i)) for i in range(step)])
        with cgutils.for_range_slice(builder, builder.add(r0, builder.mul(nstep, c(step))), r1, c(1)) as (r, _):
            rows([r])


@intrinsic
def qk(typingctx, q, E, col, kb, nr, scale):
    """``E[h, col + r] = scale * <q[h], kb[r]>`` for ``r < nr`` and the 1-4
    heads of ``q [nh, hd]``, one K row at a time (two at hd 64,
    :data:`QK_STEP`): each K chunk loaded once for every head's
    accumulator, the heads' lane sums packed into one tree
    (:func:`ir_tree_sums`). Every dot is :func:`lane_dot`'s fixed-order lane
    arithmetic, so the same bits as :func:`scores`' loop. Measured on one
    AVX-512 core, 4 heads, hd 128: 16-20 / 18-30 ns a row (L2 / memory)
    against 26-31 / 26-34 ns for a tree per dot; at hd 128 several rows
    per step (two or four row streams) measured slower from memory. ``q``
    and ``kb [nr, hd]`` (float32 or 2-byte rows) with contiguous rows."""
    if not (isinstance(q, types.Array) and isinstance(E, types.Array) and isinstance(kb, types.Array)
            and q.ndim == E.ndim == kb.ndim == 2 and q.dtype == E.dtype == types.float32
            and kb.dtype in KV_KINDS and scale == types.float32):
        return None

    def codegen(context, builder, sig, args):
        qa, Ea, kba = ir_arrays(context, builder, [sig.args[i] for i in (0, 1, 3)], [args[i] for i in (0, 1, 3)])
        col_, nr_ = (context.cast(builder, args[i], sig.args[i], types.intp) for i in (2, 4))
        kkind = sig.args[3].dtype
        f32 = ir.FloatType()
        vt = ir.VectorType(f32, LANES)

        def c(x):
            return ir.Constant(nr_.type, x)

        hd = builder.extract_value(kba.shape, 1)
        nch = builder.sdiv(hd, c(LANES))

        def rows(nheads):
            qrow = [_elem_ptr(builder, qa, c(h), c(0), vt) for h in range(nheads)]
            with cgutils.for_range(builder, nr_) as rl:
                r = rl.index
                krow = _elem_ptr(builder, kba, r, c(0), _raw_vector(kkind))
                accs = [cgutils.alloca_once_value(builder, ir.Constant(vt, [0.0] * LANES)) for _ in range(nheads)]
                with cgutils.for_range(builder, nch) as kl:
                    kv = ir_widen(builder, builder.load(builder.gep(krow, [kl.index]), align=2), kkind)
                    for h in range(nheads):
                        qv = builder.load(builder.gep(qrow[h], [kl.index]), align=4)
                        builder.store(ir_fma(builder, qv, kv, builder.load(accs[h])), accs[h])
                tot = [cgutils.alloca_once_value(builder, x)
                       for x in ir_tree_sums(builder, [builder.load(a) for a in accs])]
                # the elements past the last chunk, in order (as _lane_reduce)
                with cgutils.for_range_slice(builder, builder.mul(nch, c(LANES)), hd, c(1)) as (i, _):
                    kx = ir_widen(builder, builder.load(_elem_ptr(builder, kba, r, i, _raw_vector(kkind).element)),
                                   kkind)
                    for h in range(nheads):
                        qx = builder.load(_elem_ptr(builder, qa, c(h), i, f32))
                        builder.store(ir_fma(builder, qx, kx, builder.load(tot[h])), tot[h])
                for h in range(nheads):
                    builder.store(builder.fmul(builder.load(tot[h]), args[5]),
                                  _elem_ptr(builder, Ea, c(h), builder.add(col_, r), f32))

        def unrolled(nheads, nch):
            _ir_qk_unrolled(builder, qa, Ea, col_, kba, nr_, args[5], nheads, nch, kkind)

        nh = builder.extract_value(qa.shape, 0)
        exact = builder.icmp_signed("==", builder.srem(hd, c(LANES)), c(0))
        built = [builder.and_(exact, builder.icmp_signed("==", nch, c(k))) for k in QK_CHUNKS]
        for k, cond in zip(QK_CHUNKS, built):
            with builder.if_then(cond):
                _per_head_count(builder, nh, lambda n, k=k: unrolled(n, k))
        wide = builder.and_(builder.and_(exact, builder.icmp_signed("==", nch, c(QK_WIDE))),
                            builder.icmp_signed("==", nh, c(4)))
        with builder.if_then(wide):
            unrolled(4, QK_WIDE)
        with builder.if_then(builder.not_(functools.reduce(builder.or_, built + [wide]))):
            _per_head_count(builder, nh, rows)
        return context.get_dummy_value()

    return types.void(q, E, col, kb, nr, scale), codegen


@intrinsic
def qk8(typingctx, q, E, col, kq, ks, nr, scale):
    """:func:`qk` on q8 K rows read as stored: ``kq [nr, hd]`` int8 codes,
    ``ks [nr, hd / K_GROUP]`` their scales, each code widened and times its
    group's scale in registers, the very float32 values
    :func:`_dequant_k_rows` writes to its buffer, so the same bits as
    dequantizing and scoring the buffer. hd in ``LANES`` x
    :data:`QK_CHUNKS` (64, 128) with 1-4 heads, or ``LANES`` x
    :data:`QK_WIDE` (256) with 4; the caller checks both."""
    if not (all(isinstance(a, types.Array) and a.ndim == 2 for a in (q, E, kq, ks))
            and q.dtype == E.dtype == ks.dtype == types.float32 and kq.dtype == types.int8
            and scale == types.float32):
        return None

    def codegen(context, builder, sig, args):
        qa, Ea, kqa, ksa = ir_arrays(context, builder, [sig.args[i] for i in (0, 1, 3, 4)],
                                   [args[i] for i in (0, 1, 3, 4)])
        col_, nr_ = (context.cast(builder, args[i], sig.args[i], types.intp) for i in (2, 5))

        def c(x):
            return ir.Constant(nr_.type, x)

        nch = builder.sdiv(builder.extract_value(kqa.shape, 1), c(LANES))
        nh = builder.extract_value(qa.shape, 0)
        for k in QK_CHUNKS:
            with builder.if_then(builder.icmp_signed("==", nch, c(k))):
                _per_head_count(builder, nh, lambda n, k=k: _ir_qk_unrolled(builder, qa, Ea, col_, kqa, nr_, args[6],
                                                                           n, k, types.int8, ksa))
        wide4 = builder.and_(builder.icmp_signed("==", nch, c(QK_WIDE)), builder.icmp_signed("==", nh, c(4)))
        with builder.if_then(wide4):
            _ir_qk_unrolled(builder, qa, Ea, col_, kqa, nr_, args[6], 4, QK_WIDE, types.int8, ksa)
        return context.get_dummy_value()

    return types.void(q, E, col, kq, ks, nr, scale), codegen
