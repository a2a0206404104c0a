"""q8_2f arithmetic: the exact class of the numerics contract.

Every backend must reproduce these functions bit for bit (docs/kernels.md):
float32 throughout, correctly rounded division, no fused multiply-add, round
half AWAY from zero (the seed's ``f32::round``; ``np.round`` rounds half to
even and is wrong here), clamp to ±127, scale floor 1e-12, NaN -> 0 (Rust's
saturating ``as i8``).
"""

from __future__ import annotations

import threading

import numpy as np

SCALE_FLOOR = np.float32(1e-12)
FIELD_FLOOR = np.float32(1e-6)
_Q_MAX = np.float32(127.0)


def round_half_away(x: np.ndarray) -> np.ndarray:
    """Round to nearest, ties away from zero, exactly (float32 in, float32 out).

    ``x - trunc(x)`` is exact in binary floating point, so the tie test has no
    rounding of its own (``trunc(x + 0.5)`` would round 0.49999997 up).
    """
    t = np.trunc(x)
    frac = x - t
    return t + np.where(np.abs(frac) >= np.float32(0.5), np.sign(x), np.float32(0.0)).astype(np.float32)


def num_groups(hd: int, group: int) -> int:
    return -(-hd // group)


def quantize_rows(x: np.ndarray, col: np.ndarray | None, group: int) -> tuple[np.ndarray, np.ndarray]:
    """Quantize rows ``x [n, hd]`` against the field ``col [hd]`` (None = 1).

    Returns ``(q int8 [n, hd], s float32 [n, ceil(hd/group)])``.
    """
    x = np.asarray(x, dtype=np.float32)
    n, hd = x.shape
    r = x / col if col is not None else x
    ng = num_groups(hd, group)
    pad = ng * group - hd
    rp = np.pad(r, ((0, 0), (0, pad))) if pad else r
    rg = rp.reshape(n, ng, group)
    # One errstate and a dozen C calls: a q8 decode append quantizes two
    # handfuls of rows, where each NumPy call is most of the cost.
    with np.errstate(invalid="ignore", divide="ignore"):
        # Rust's f32::max ignores a NaN operand: fmax does the same.
        s = np.fmax(np.fmax.reduce(np.abs(rg), axis=2) / _Q_MAX, SCALE_FLOOR).astype(np.float32, copy=False)
        y = (rg / s[:, :, None]).astype(np.float64)
        # round_half_away in float64: y + copysign(0.5, y) is exact for
        # every float32 y (or cannot reach the next integer), so trunc gives
        # the same integers (a zero's sign aside, which int8 drops)
        qf = np.copysign(0.5, y)
        np.add(y, qf, out=qf)
        np.trunc(qf, out=qf)
        np.maximum(qf, -_Q_MAX, out=qf)
        np.minimum(qf, _Q_MAX, out=qf)
    # NaN -> 0 (the clamp left no inf)
    np.copyto(qf, 0.0, where=np.isnan(qf))
    q = qf.astype(np.int8).reshape(n, ng * group)[:, :hd]
    return np.ascontiguousarray(q), s


def dequantize_rows(q: np.ndarray, s: np.ndarray, group: int) -> np.ndarray:
    """``q * s`` per group, float32 ``[n, hd]`` (without the field)."""
    n, hd = q.shape
    idx = np.arange(hd) // group
    return q.astype(np.float32) * s[:, idx]


def field_rms(rows: np.ndarray) -> np.ndarray:
    """The 2f field over dequantized rows ``[n, hd]``: RMS per channel, floor 1e-6.

    The sum of squares is taken in row order (the seed's loop), float32.
    """
    acc = np.zeros(rows.shape[1], dtype=np.float32)
    for p in range(rows.shape[0]):
        r = rows[p]
        acc += r * r
    # fmax: Rust's f32::max ignores a NaN operand.
    return np.fmax(np.sqrt(acc / np.float32(rows.shape[0])), FIELD_FLOOR).astype(np.float32)


def freeze_field(q: np.ndarray, s: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Freeze the 2f field over one head's stored rows ``q [n, hd]``, ``s [n,
    ceil(hd/group)]``: dequantize, :func:`field_rms`, requantize every row
    against it. Returns ``(col [hd], q2, s2)``."""
    rows = dequantize_rows(q, s, group)
    col = field_rms(rows)
    q2, s2 = quantize_rows(rows, col, group)
    return col, q2, s2


# ── 2-byte floats (the f16 and bf16 storage modes) ──
#
# Exact class too: round to nearest, ties to even, from float32. numpy's
# float16 cast is IEEE's (subnormals kept, overflow to ±inf); bfloat16 is the
# top half of a float32 after adding 0x7FFF plus the kept half's lowest bit
# (ties to even), NaN quieted first (the add would carry a NaN whose payload
# sits in the low half into inf).

#: The smallest float32 magnitude each 2-byte format rounds to infinity.
HALF_OVERFLOW = {"f16": np.float32(65520.0), "bf16": np.float32(3.3961776e38)}


def to_bf16(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), round to nearest even."""
    b = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    with np.errstate(over="ignore"):
        r = (b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)
    r = np.where(np.isnan(x), (b >> np.uint32(16)) | np.uint32(0x0040), r)
    return r.astype(np.uint16)


def from_bf16(u: np.ndarray) -> np.ndarray:
    """bfloat16 bit patterns (uint16) -> float32, exact."""
    return (np.asarray(u, dtype=np.uint16).astype(np.uint32) << np.uint32(16)).view(np.float32)


def to_half(x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """float32 rows in a 2-byte storage dtype (float16, or uint16 = bfloat16)."""
    if dtype == np.uint16:
        return to_bf16(x)
    with np.errstate(over="ignore"):
        return np.asarray(x, dtype=np.float32).astype(np.float16)


def from_half(a: np.ndarray) -> np.ndarray:
    """Rows of a K/V block as float32 (a float32 block is returned as is)."""
    if a.dtype == np.uint16:
        return from_bf16(a)
    return a.astype(np.float32, copy=False)


# ── q4: rotated rows, int4/int8 codes with float16 scales ──
#
# Exact class as the rest of this module: float32 arithmetic, round half
# away from zero, scales rounded to float16 first and the codes computed with
# the stored scale (so dequantizing reproduces what the quantizer aimed at).

#: The smallest scale a q4/int8-tier group stores (float16's least subnormal):
#: an all-zero group gets it instead of a 0 that would divide by zero.
HALF_SCALE_FLOOR = np.float32(np.float16(6e-8))


def rotates(hd: int) -> bool:
    """Whether rows of ``hd`` channels are rotated (a power of two >= 2)."""
    return hd >= 2 and hd & (hd - 1) == 0


def fwht(x: np.ndarray) -> np.ndarray:
    """The orthonormal Walsh-Hadamard transform over the last axis (a power
    of two): Sylvester's ``H / sqrt(hd)``, which is symmetric and its own
    inverse. Butterflies in a fixed order, elementwise float32 (no BLAS), so
    the bits do not depend on threads or call history. Returns a new array."""
    x = np.asarray(x, dtype=np.float32)
    shape, hd = x.shape, x.shape[-1]
    n = x.size // hd if hd else 0
    if n == 0:
        return x.copy()
    # Channel-major [hd, n] between two buffers: a stage's butterflies are
    # then whole rows (inner loops of h*n, not h, elements): 2 ufunc calls a
    # stage, the same elementwise float32 ops as the per-row form.
    src, stages, res = _fwht_plan(n, hd)
    np.copyto(src, x.reshape(n, hd).T)
    for a0, a1, b0, b1 in stages:
        np.add(a0, a1, out=b0)
        np.subtract(a0, a1, out=b1)
    out = np.empty((n, hd), np.float32)
    np.multiply(res.T, np.float32(1.0 / np.sqrt(hd)), out=out)
    return out.reshape(shape)


#: Rows x channels up to which a thread keeps its :func:`fwht` buffers and
#: stage views (a decode step rotates a few rows: building the views cost
#: a third of its transform).
_FWHT_PLAN_MAX = 1 << 14
_fwht_plans = threading.local()


def _fwht_plan(n: int, hd: int):
    """``(src, stages, result)``: the two ``[hd, n]`` buffers' stage views
    ``(a0, a1, b0, b1)`` (``b0 = a0 + a1``, ``b1 = a0 - a1``) and the buffer
    the last stage writes; this thread's, kept for small transforms."""
    plans = getattr(_fwht_plans, "by_shape", None)
    if plans is None:
        plans = _fwht_plans.by_shape = {}
    plan = plans.get((n, hd))
    if plan is not None:
        return plan
    src = np.empty((hd, n), np.float32)
    a, b, stages, h = src, np.empty_like(src), [], 1
    while h < hd:
        av = a.reshape(hd // (2 * h), 2, h * n)
        bv = b.reshape(hd // (2 * h), 2, h * n)
        stages.append((av[:, 0], av[:, 1], bv[:, 0], bv[:, 1]))
        a, b = b, a
        h *= 2
    plan = (src, stages, a)
    if n * hd <= _FWHT_PLAN_MAX:
        if len(plans) >= 16:
            plans.pop(next(iter(plans)))
        plans[(n, hd)] = plan
    return plan


def quantize_half_scaled(x: np.ndarray, group: int, qmax: int) -> tuple[np.ndarray, np.ndarray]:
    """Rows ``x [n, hd]`` as symmetric integer codes in ``[-qmax, qmax]`` with one
    float16 scale per ``group`` channels: ``(codes int8 [n, hd], scales
    float16 [n, ceil(hd/group)])``. The scale is ``absmax/qmax`` rounded to
    float16 (floor :data:`HALF_SCALE_FLOOR`); codes divide by that stored scale."""
    x = np.asarray(x, dtype=np.float32)
    n, hd = x.shape
    ng = num_groups(hd, group)
    pad = ng * group - hd
    xg = (np.pad(x, ((0, 0), (0, pad))) if pad else x).reshape(n, ng, group)
    s16 = (np.abs(xg).max(axis=2) / np.float32(qmax)).astype(np.float16)
    s = np.maximum(s16.astype(np.float32), HALF_SCALE_FLOOR)
    codes = np.clip(round_half_away(xg / s[:, :, None]), -qmax, qmax).astype(np.int8)
    return np.ascontiguousarray(codes.reshape(n, ng * group)[:, :hd]), s.astype(np.float16)


def dequantize_half_scaled(codes: np.ndarray, s: np.ndarray, group: int) -> np.ndarray:
    """``codes * scale`` per group, float32 ``[n, hd]``."""
    hd = codes.shape[1]
    return codes.astype(np.float32) * s.astype(np.float32)[:, np.arange(hd) // group]


def pack_int4(codes: np.ndarray) -> np.ndarray:
    """int8 codes in ``[-8, 7]`` ``[n, hd]`` -> uint8 ``[n, ceil(hd/2)]``: channel
    ``2j`` in the low nibble, ``2j+1`` in the high one (two's complement)."""
    n, hd = codes.shape
    c = codes.astype(np.uint8) & np.uint8(0x0F)
    if hd % 2:
        c = np.concatenate([c, np.zeros((n, 1), np.uint8)], axis=1)
    return np.ascontiguousarray(c[:, 0::2] | (c[:, 1::2] << np.uint8(4)))


def unpack_int4(packed: np.ndarray, hd: int) -> np.ndarray:
    """The inverse of :func:`pack_int4`: int8 codes ``[n, hd]``."""
    lo = (packed & np.uint8(0x0F)).astype(np.int8)
    hi = (packed >> np.uint8(4)).astype(np.int8)
    c = np.empty((packed.shape[0], 2 * packed.shape[1]), np.int8)
    c[:, 0::2], c[:, 1::2] = lo, hi
    return ((c[:, :hd] ^ np.int8(8)) - np.int8(8)).astype(np.int8)


# ── 2-bit codes (asymmetric: four levels between a group's min and max) ──

def quantize_int2(x: np.ndarray, group: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows ``x [n, hd]`` as 2-bit codes, asymmetric per ``group`` channels:
    ``x ≈ zero + code · scale`` with ``code`` in 0..3, ``zero`` the group's
    minimum and ``scale`` a third of its range, both rounded to float16
    (the codes divide by the stored values). Returns ``(codes uint8 [n, hd],
    scale float16 [n, ng], zero float16 [n, ng])``."""
    x = np.asarray(x, dtype=np.float32)
    n, hd = x.shape
    ng = num_groups(hd, group)
    pad = ng * group - hd
    xg = (np.pad(x, ((0, 0), (0, pad)), mode="edge") if pad else x).reshape(n, ng, group)
    lo16 = xg.min(axis=2).astype(np.float16)
    lo = lo16.astype(np.float32)
    s16 = ((xg.max(axis=2) - lo) / np.float32(3)).astype(np.float16)
    s = np.maximum(s16.astype(np.float32), HALF_SCALE_FLOOR)
    codes = np.clip(round_half_away((xg - lo[:, :, None]) / s[:, :, None]), 0, 3).astype(np.uint8)
    return np.ascontiguousarray(codes.reshape(n, ng * group)[:, :hd]), s.astype(np.float16), lo16


def dequantize_int2(codes: np.ndarray, scale: np.ndarray, zero: np.ndarray, group: int) -> np.ndarray:
    """``zero + codes · scale`` per group, float32 ``[n, hd]``."""
    hd = codes.shape[1]
    g = np.arange(hd) // group
    return zero.astype(np.float32)[:, g] + codes.astype(np.float32) * scale.astype(np.float32)[:, g]


def pack_int2(codes: np.ndarray) -> np.ndarray:
    """uint8 codes in 0..3 ``[n, hd]`` -> uint8 ``[n, ceil(hd/4)]``: channel
    ``4j + i`` in bits ``2i`` and ``2i + 1``."""
    n, hd = codes.shape
    c = codes.astype(np.uint8) & np.uint8(3)
    pad = -hd % 4
    if pad:
        c = np.concatenate([c, np.zeros((n, pad), np.uint8)], axis=1)
    return np.ascontiguousarray(c[:, 0::4] | (c[:, 1::4] << np.uint8(2)) | (c[:, 2::4] << np.uint8(4))
                                | (c[:, 3::4] << np.uint8(6)))


def unpack_int2(packed: np.ndarray, hd: int) -> np.ndarray:
    """The inverse of :func:`pack_int2`: uint8 codes ``[n, hd]``."""
    c = np.empty((packed.shape[0], 4 * packed.shape[1]), np.uint8)
    for i in range(4):
        c[:, i::4] = (packed >> np.uint8(2 * i)) & np.uint8(3)
    return np.ascontiguousarray(c[:, :hd])
