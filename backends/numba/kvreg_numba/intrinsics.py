"""LLVM IR the kernels share, emitted by hand, and the target it is built for.

Left to numba's lowering, the order of a reduction, the width of a vector
and the fusing of a multiply-add are LLVM's choices, which move with
inlining, the target and whether a callee came from the on-disk cache; the
kernels' bits must not move with any of them. So the arithmetic every kernel
shares is emitted here as IR: 2-byte K/V elements widened to float32,
``llvm.fma``, prefetch hints, the fixed-order lane reductions
(:func:`lane_dot`, :func:`lane_sum`), a NaN-propagating max and a
vectorizable exp (:func:`fexp`, :func:`exp_sum`), with the probe of the CPU
features those choices read (:func:`target_has`). It is a module of its own
because it holds code generators run at compile time rather than kernels,
and every kernel module of the backend builds on it.
"""

from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

from . import config

#: ``cache=`` of the kernels that may widen a binary16 row. The on-disk
#: cache does not see how binary16 rows are widened (an intrinsic's
#: codegen): a forced integer decode compiles in memory only.
JIT_CACHE = config.CACHE and config.F16_FPEXT == "auto"


# ---------------------------------------------------------------------------
# 2-byte K/V rows (the f16 and bf16 storage modes), widened in registers
# ---------------------------------------------------------------------------
#
# The kernels take a K/V block in one of three dtypes, each its own numba
# specialization of the same code: float32 (f32 storage), int16 (the bits of
# IEEE binary16: f16 storage viewed as int16, numba has no float16 on the
# CPU) and uint16 (bfloat16 bit patterns, as kvreg stores them). Every load
# of a K or V element goes through :func:`ir_widen`, so a 2-byte block is
# read as it is stored (2 bytes an element, no float32 copy) and widened in
# registers. Both widenings are exact, so a half layer gives the bits the
# float32 kernel gives on the widened rows (same reductions, same order).


def target_has(feature: str) -> bool:
    """Whether numba compiles for a CPU with ``feature`` (an LLVM feature name
    such as ``"f16c"``): the features numba's JIT targets, i.e.
    ``NUMBA_CPU_FEATURES`` when set, else the host's. numba's on-disk cache
    is keyed on them, so a choice made from them never runs on another CPU."""
    from numba.core import config as nconfig
    from numba.core.codegen import get_host_cpu_features

    feats = nconfig.CPU_FEATURES if nconfig.CPU_FEATURES is not None else get_host_cpu_features()
    return "+" + feature in str(feats).split(",")


#: binary16 rows widen with LLVM's ``fpext half -> float`` (one vcvtph2ps per
#: 8 or 16 elements) where the target has F16C; elsewhere with the integer
#: decode of :func:`ir_widen` (exact too; at 16k rows, 32/8 heads, hd 128,
#: one thread: 16.5 ms against 8.9 ms for fpext in one run, F32 13 ms; a
#: libcall per element would be worse still). Read once, at import; numba's
#: on-disk cache is keyed on the CPU features, so a cached kernel never runs
#: on a CPU without them.
F16_FPEXT = config.F16_FPEXT not in ("0", "off", "false", "no") and target_has("f16c")


def _splat(ty, value):
    """A constant of the scalar or vector type ``ty`` holding ``value`` in every lane."""
    if isinstance(ty, ir.VectorType):
        return ir.Constant(ty, [value] * ty.count)
    return ir.Constant(ty, value)


def ir_widen(builder, val, kind):
    """IR of one K/V element (or a vector of them) as float32: ``kind`` is
    the numba dtype of the block (float32: as is; int8: a q8 code's value;
    uint16: bfloat16 bits,
    ``uint32(bits) << 16``; int16: binary16 bits, decoded exactly with
    integer operations and selects, no branch, so the loops stay vectorized:
    normal numbers re-biased, subnormals as ``mantissa * 2^-24`` (exact:
    every one is a normal float32, so flush-to-zero cannot touch it), inf and
    NaN to float32's all-ones exponent with the payload shifted up as numpy
    does)."""
    if kind == types.float32:
        return val
    vec = isinstance(val.type, ir.VectorType)
    i32 = ir.VectorType(ir.IntType(32), val.type.count) if vec else ir.IntType(32)
    f32 = ir.VectorType(ir.FloatType(), val.type.count) if vec else ir.FloatType()
    if kind == types.int8:  # q8 codes: their value
        return builder.sitofp(val, f32)
    if kind == types.uint16:
        h = builder.zext(val, i32)
        return builder.bitcast(builder.shl(h, _splat(i32, 16)), f32)
    assert kind == types.int16, kind
    if F16_FPEXT:
        ht = ir.VectorType(ir.HalfType(), val.type.count) if vec else ir.HalfType()
        return builder.fpext(builder.bitcast(val, ht), f32)
    h = builder.zext(val, i32)
    sign = builder.shl(builder.and_(h, _splat(i32, 0x8000)), _splat(i32, 16))
    em = builder.and_(h, _splat(i32, 0x7FFF))
    e = builder.lshr(em, _splat(i32, 10))
    man = builder.and_(h, _splat(i32, 0x3FF))
    sh = builder.shl(em, _splat(i32, 13))
    normal = builder.add(sh, _splat(i32, 112 << 23))
    special = builder.or_(sh, _splat(i32, 0x7F800000))
    sub = builder.bitcast(builder.fmul(builder.sitofp(man, f32), _splat(f32, 2.0 ** -24)), i32)
    bits = builder.select(builder.icmp_unsigned("==", e, _splat(i32, 31)), special, normal)
    bits = builder.select(builder.icmp_unsigned("==", e, _splat(i32, 0)), sub, bits)
    return builder.bitcast(builder.or_(bits, sign), f32)


KV_KINDS = (types.float32, types.int16, types.uint16)
#: What a value row may hold: the K/V kinds and q8's int8 codes.
V_KINDS = KV_KINDS + (types.int8,)
#: Bytes of an element of each kind of K/V row.
ESIZE = {types.float32: 4, types.int16: 2, types.uint16: 2, types.int8: 1}


@intrinsic
def widen(typingctx, x):
    """One K/V element as float32 (see :func:`ir_widen`); float32 is returned as is."""
    if x not in V_KINDS:
        return None

    def codegen(context, builder, signature, args):
        return ir_widen(builder, args[0], signature.args[0])

    return types.float32(x), codegen


#: Lanes of the fixed-order reductions (:func:`lane_dot`, :func:`lane_sum`): lane
#: ``j`` sums the elements ``j, j + 16, ...``, then the lanes are added in a
#: fixed tree and the short tail in order. Elementwise vector IEEE
#: arithmetic with no fast-math flag, so the bits do not depend on the
#: target's vector width, on inlining, or on a fresh versus a cached compile.
LANES = 16


def ir_fma(builder, a, b, c):
    """``llvm.fma`` on scalars or vectors (rounded once, never approximated)."""
    t = a.type
    name = f"llvm.fma.v{t.count}f32" if isinstance(t, ir.VectorType) else "llvm.fma.f32"
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(t, [t, t, t]), name)
    return builder.call(fn, [a, b, c])


def _prefetch_fn(builder):
    """``llvm.prefetch`` declared in ``builder``'s module."""
    i32 = ir.IntType(32)
    return cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [ir.IntType(8).as_pointer(), i32, i32, i32]), "llvm.prefetch.p0")


def ir_prefetch_l2(builder, ptr, offset):
    """A prefetch hint into L2 (LLVM locality 2, ``prefetcht1`` on x86) for
    the line at ``ptr`` plus ``offset`` bytes (an IR integer). Never faults,
    changes no value."""
    i32 = ir.IntType(32)
    at = builder.gep(builder.bitcast(ptr, ir.IntType(8).as_pointer()), [offset])
    builder.call(_prefetch_fn(builder), [at, ir.Constant(i32, 0), ir.Constant(i32, 2), ir.Constant(i32, 1)])


def ir_prefetch(builder, ptr, nbytes):
    """Prefetch hints for the ``nbytes`` (a Python int, or an IR integer)
    from ``ptr`` plus :data:`config.PREFETCH_BYTES`, one per 64-byte line.
    A hint never faults (past an array's end too) and changes no value."""
    if config.PREFETCH_BYTES <= 0:
        return
    i8p = ir.IntType(8).as_pointer()
    i32 = ir.IntType(32)
    i64 = ir.IntType(64)
    fn = _prefetch_fn(builder)
    base = builder.gep(builder.bitcast(ptr, i8p), [ir.Constant(i64, config.PREFETCH_BYTES)])
    hint = [ir.Constant(i32, 0), ir.Constant(i32, 3), ir.Constant(i32, 1)]   # read, keep, data
    if isinstance(nbytes, int):
        for o in range(0, nbytes, 64):
            builder.call(fn, [builder.gep(base, [ir.Constant(i64, o)])] + hint)
        return
    with cgutils.for_range_slice(builder, ir.Constant(nbytes.type, 0), nbytes, ir.Constant(nbytes.type, 64)) as (o, _):
        builder.call(fn, [builder.gep(base, [o])] + hint)


def _lane_reduce(builder, xs, ys, ykind=types.float32):
    """IR of the fixed-order reductions over 1-D contiguous float32 arrays
    of the length of ``xs[0]``: ``sum_i x[i] * y[i]`` for every pair of
    ``xs`` x ``ys`` (x-major), or ``sum_i x[i]`` per ``x`` when ``ys`` is
    None. Every result takes the same operations: lane ``j`` of a
    :data:`LANES`-wide accumulator sums elements ``j, j + LANES, ...`` in
    order by fused multiply-adds (one load of each operand shared by every
    pair), the lanes are
    added in a fixed tree, then the tail elements in order. So a dot is the
    same bits whichever batch computes it."""
    f32 = ir.FloatType()
    vt = ir.VectorType(f32, LANES)
    i32 = ir.IntType(32)
    n = builder.extract_value(xs[0].shape, 0)
    intp = n.type
    pairs = [(a, b) for a in range(len(xs)) for b in range(len(ys))] if ys is not None else \
        [(a, None) for a in range(len(xs))]
    nvec = builder.sdiv(n, ir.Constant(intp, LANES))
    accs = [cgutils.alloca_once_value(builder, ir.Constant(vt, [0.0] * LANES)) for _ in pairs]
    with cgutils.for_range(builder, nvec) as loop:
        off = builder.mul(loop.index, ir.Constant(intp, LANES))

        def vload(arr, kind=types.float32):
            if kind == types.float32:
                return builder.load(builder.bitcast(builder.gep(arr.data, [off]), vt.as_pointer()), align=4)
            ht = ir.VectorType(ir.IntType(16), LANES)  # 2-byte rows: widened in registers
            raw = builder.load(builder.bitcast(builder.gep(arr.data, [off]), ht.as_pointer()), align=2)
            return ir_widen(builder, raw, kind)

        vx = [vload(x) for x in xs]
        vy = [vload(y, ykind) for y in ys] if ys is not None else None
        for acc, (a, b) in zip(accs, pairs):
            if b is None:
                builder.store(builder.fadd(builder.load(acc), vx[a]), acc)
            else:
                builder.store(ir_fma(builder, vx[a], vy[b], builder.load(acc)), acc)
    totals = []
    for acc in accs:
        v = builder.load(acc)
        width = LANES
        while width > 1:  # (low half + high half) until one lane: a fixed tree
            width //= 2
            lo = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, width), list(range(width))))
            hi = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, width), list(range(width, 2 * width))))
            v = builder.fadd(lo, hi)
        totals.append(cgutils.alloca_once_value(builder, builder.extract_element(v, ir.Constant(i32, 0))))
    start = builder.mul(nvec, ir.Constant(intp, LANES))
    with cgutils.for_range_slice(builder, start, n, ir.Constant(intp, 1)) as (i, _):
        sx = [builder.load(builder.gep(x.data, [i])) for x in xs]
        sy = [ir_widen(builder, builder.load(builder.gep(y.data, [i])), ykind) for y in ys] \
            if ys is not None else None
        for tot, (a, b) in zip(totals, pairs):
            if b is None:
                builder.store(builder.fadd(builder.load(tot), sx[a]), tot)
            else:
                builder.store(ir_fma(builder, sx[a], sy[b], builder.load(tot)), tot)
    return [builder.load(t) for t in totals]


def _f32_vector(t):
    return isinstance(t, types.Array) and t.ndim == 1 and t.dtype == types.float32


def _kv_vector(t):
    """A 1-D K/V row: float32, or 2-byte (int16 = binary16 bits, uint16 = bfloat16 bits)."""
    return isinstance(t, types.Array) and t.ndim == 1 and t.dtype in KV_KINDS


def ir_arrays(context, builder, tys, vals):
    return [context.make_array(t)(context, builder, v) for t, v in zip(tys, vals)]


@intrinsic
def lane_dot(typingctx, a, b):
    """``<a, b>`` of two contiguous 1-D float32 arrays of equal length, in the
    fixed order of :func:`_lane_reduce`; the caller guarantees contiguity
    and lengths."""
    if not (_f32_vector(a) and _kv_vector(b)):
        return None

    def codegen(context, builder, signature, args):
        x, y = ir_arrays(context, builder, signature.args, args)
        return _lane_reduce(builder, [x], [y], signature.args[1].dtype)[0]

    return types.float32(a, b), codegen


@intrinsic
def lane_sum(typingctx, a):
    """Sum of a contiguous 1-D float32 array in the fixed order of :func:`_lane_reduce`."""
    if not _f32_vector(a):
        return None

    def codegen(context, builder, signature, args):
        (x,) = ir_arrays(context, builder, signature.args, args)
        return _lane_reduce(builder, [x], None)[0]

    return types.float32(a), codegen


def ir_broadcast(builder, x, vt):
    """``x`` (a float) in every lane of the vector type ``vt``."""
    i32 = ir.IntType(32)
    v = builder.insert_element(ir.Constant(vt, ir.Undefined), x, ir.Constant(i32, 0))
    return builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(i32, vt.count), [0] * vt.count))


def ir_tree_sums(builder, accs):
    """The fixed-tree lane sums of ``LANES``-wide vectors (lane ``j`` +
    lane ``j + width``, halving to one lane: :func:`_lane_reduce`'s tree) of
    several vectors at once, each level's adds shared by the vectors packed
    into one register: the same additions of the same values, so the same
    bits. Returns one float per vector."""
    i32 = ir.IntType(32)
    n = 1
    while n < len(accs):
        n *= 2
    vs = list(accs) + [ir.Constant(accs[0].type, [0.0] * LANES)] * (n - len(accs))
    width, per = LANES, 1  # every vector holds `per` parts of `width` lanes
    while width > 1:
        half = width // 2
        lo = [p * width + j for p in range(per) for j in range(half)]
        hi = [p * width + half + j for p in range(per) for j in range(half)]
        if len(vs) > 1:  # two vectors' low halves against their high halves
            def mask(idx):
                return ir.Constant(ir.VectorType(i32, LANES), idx + [LANES + x for x in idx])

            vs = [builder.fadd(builder.shuffle_vector(a, b, mask(lo)), builder.shuffle_vector(a, b, mask(hi)))
                  for a, b in zip(vs[0::2], vs[1::2])]
            per *= 2
        else:
            def mask(idx):
                return ir.Constant(ir.VectorType(i32, len(idx)), idx)

            vs = [builder.fadd(builder.shuffle_vector(v, v, mask(lo)), builder.shuffle_vector(v, v, mask(hi)))
                  for v in vs]
        width = half
    return [builder.extract_element(vs[0], ir.Constant(i32, j)) for j in range(len(accs))]


def _lane_max_nan(builder, x):
    """IR of ``max_i x[i]`` that is NaN when any element is NaN (a plain
    ``x > m`` drops a NaN: docs/kernels.md, NaN and inf), in
    :data:`LANES`-wide compare-and-select steps. A max is the same value in
    any order; only the sign of a zero maximum could differ, and exp(±0) is
    1 either way."""
    f32 = ir.FloatType()
    vt = ir.VectorType(f32, LANES)
    bt = ir.VectorType(ir.IntType(1), LANES)
    i32 = ir.IntType(32)
    n = builder.extract_value(x.shape, 0)
    intp = n.type
    nvec = builder.sdiv(n, ir.Constant(intp, LANES))
    neg_inf = float("-inf")
    acc = cgutils.alloca_once_value(builder, ir.Constant(vt, [neg_inf] * LANES))
    nan = cgutils.alloca_once_value(builder, ir.Constant(bt, [0] * LANES))
    with cgutils.for_range(builder, nvec) as loop:
        off = builder.mul(loop.index, ir.Constant(intp, LANES))
        v = builder.load(builder.bitcast(builder.gep(x.data, [off]), vt.as_pointer()), align=4)
        a = builder.load(acc)
        builder.store(builder.select(builder.fcmp_ordered(">", v, a), v, a), acc)
        builder.store(builder.or_(builder.load(nan), builder.fcmp_unordered("uno", v, v)), nan)
    m = cgutils.alloca_once_value(builder, ir.Constant(f32, neg_inf))
    anynan = cgutils.alloca_once_value(builder, ir.Constant(ir.IntType(1), 0))
    va = builder.load(acc)
    vn = builder.load(nan)
    for j in range(LANES):
        e = builder.extract_element(va, ir.Constant(i32, j))
        cur = builder.load(m)
        builder.store(builder.select(builder.fcmp_ordered(">", e, cur), e, cur), m)
        builder.store(builder.or_(builder.load(anynan), builder.extract_element(vn, ir.Constant(i32, j))), anynan)
    start = builder.mul(nvec, ir.Constant(intp, LANES))
    with cgutils.for_range_slice(builder, start, n, ir.Constant(intp, 1)) as (i, _):
        e = builder.load(builder.gep(x.data, [i]))
        cur = builder.load(m)
        builder.store(builder.select(builder.fcmp_ordered(">", e, cur), e, cur), m)
        builder.store(builder.or_(builder.load(anynan), builder.fcmp_unordered("uno", e, e)), anynan)
    return builder.select(builder.load(anynan), ir.Constant(f32, float("nan")), builder.load(m))


@intrinsic
def max_nan(typingctx, a):
    """Max of a contiguous 1-D float32 array, NaN if any element is NaN
    (-inf when empty)."""
    if not _f32_vector(a):
        return None

    def codegen(context, builder, signature, args):
        (x,) = ir_arrays(context, builder, signature.args, args)
        return _lane_max_nan(builder, x)

    return types.float32(a), codegen


# ---------------------------------------------------------------------------
# a vectorizable exp (no SVML here: Numba's np.exp is a scalar libm call per
# element, ~2.5 ns, a fifth of a decode row's compute)


_LOG2E = np.float32(1.4426950408889634)
_LN2_HI = np.float32(0.693359375)
_LN2_LO = np.float32(-2.12194440e-4)
_EXP_LO = np.float32(-87.0)


@intrinsic
def fexp(typingctx, x):
    """exp(x) for float32 ``x <= 0`` (softmax arguments): Cody-Waite range
    reduction, a degree-6 polynomial (explicit fused multiply-adds, the
    same bits on every compile) and 2^n built from its bits; within
    3e-7 relative of exp. Results below 2^-126 (x < -87) flush to 0, -inf
    gives exactly 0. Pure arithmetic and selects emitted inline
    (:func:`_ir_fexp`, which :func:`exp_sum` emits 16 lanes wide), so LLVM
    vectorizes a loop of it."""
    if x != types.float32:
        return None

    def codegen(context, builder, signature, args):
        return _ir_fexp(builder, args[0])

    return types.float32(x), codegen


def _ir_fexp(builder, x):
    """IR of :func:`fexp` on a float32 scalar or vector ``x`` (every lane
    the scalar's operations in the same order, so the same bits)."""
    t = x.type
    vec = isinstance(t, ir.VectorType)
    f32 = ir.FloatType()

    def c(val):
        val = float(np.float32(val))
        return ir.Constant(t, [val] * t.count) if vec else ir.Constant(f32, val)

    it = ir.VectorType(ir.IntType(32), t.count) if vec else ir.IntType(32)
    lo = c(_EXP_LO)
    xc = builder.select(builder.fcmp_ordered(">", x, lo), x, lo)
    floor = cgutils.get_or_insert_function(builder.module, ir.FunctionType(t, [t]),
                                           f"llvm.floor.v{t.count}f32" if vec else "llvm.floor.f32")
    n = builder.call(floor, [builder.fadd(builder.fmul(xc, c(_LOG2E)), c(0.5))])
    neg = builder.fsub(c(-0.0), n)
    r = ir_fma(builder, neg, c(_LN2_HI), xc)
    r = ir_fma(builder, neg, c(_LN2_LO), r)
    p = c(1.9875691500e-4)
    for k in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1, 5.0000001201e-1):
        p = ir_fma(builder, p, r, c(k))
    p = builder.fadd(ir_fma(builder, builder.fmul(p, r), r, r), c(1.0))
    e = builder.shl(builder.add(builder.fptosi(n, it), ir.Constant(it, [127] * t.count) if vec else
                                ir.Constant(it, 127)), ir.Constant(it, [23] * t.count) if vec else ir.Constant(it, 23))
    y = builder.fmul(p, builder.bitcast(e, t))
    return builder.select(builder.fcmp_ordered(">=", x, lo), y, c(0.0))


@intrinsic
def exp_sum(typingctx, a, scale, mx):
    """``a[j] = fexp(a[j] * scale - mx)`` in place over a contiguous 1-D
    float32 array, returning ``lane_sum(a)`` of the result (the same lanes,
    tree and tail order as :func:`_lane_reduce`): one pass instead of two,
    the exponentials :data:`LANES` wide."""
    if not (_f32_vector(a) and scale == types.float32 and mx == types.float32):
        return None

    def codegen(context, builder, signature, args):
        (x,) = ir_arrays(context, builder, signature.args[:1], args[:1])
        sc, m = args[1], args[2]
        f32 = ir.FloatType()
        vt = ir.VectorType(f32, LANES)
        n = builder.extract_value(x.shape, 0)
        intp = n.type
        nvec = builder.sdiv(n, ir.Constant(intp, LANES))
        acc = cgutils.alloca_once_value(builder, ir.Constant(vt, [0.0] * LANES))
        vsc, vm = ir_broadcast(builder, sc, vt), ir_broadcast(builder, m, vt)
        with cgutils.for_range(builder, nvec) as loop:
            ptr = builder.bitcast(builder.gep(x.data, [builder.mul(loop.index, ir.Constant(intp, LANES))]),
                                  vt.as_pointer())
            y = _ir_fexp(builder, builder.fsub(builder.fmul(builder.load(ptr, align=4), vsc), vm))
            builder.store(y, ptr, align=4)
            builder.store(builder.fadd(builder.load(acc), y), acc)
        total = cgutils.alloca_once_value(builder, ir_tree_sums(builder, [builder.load(acc)])[0])
        start = builder.mul(nvec, ir.Constant(intp, LANES))
        with cgutils.for_range_slice(builder, start, n, ir.Constant(intp, 1)) as (i, _):
            ptr = builder.gep(x.data, [i])
            y = _ir_fexp(builder, builder.fsub(builder.fmul(builder.load(ptr), sc), m))
            builder.store(y, ptr)
            builder.store(builder.fadd(builder.load(total), y), total)
        return builder.load(total)

    return types.float32(a, scale, mx), codegen
