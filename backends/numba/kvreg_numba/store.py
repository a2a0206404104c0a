"""A decode step's row stored into the layer's blocks, inside compiled code.

The fused decode step (:func:`kvreg_numba.decode.append_attend_groups`)
writes its new row where :meth:`kvreg.storage.LayerStorage.append_row`
writes it, with its bits: float32 as is, f16 and bf16 rounded to their bit
patterns here (:func:`half_bits`, :func:`bf16_bits`: the core's
``to_half``/``to_bf16`` rounding, in integer arithmetic), refusing a finite
value that would round to inf before anything is written. The rounding is
a storage format's, not attention's, so it lives apart from the decode
kernels; the q8 window append (:mod:`.window`) rounds with it too.
"""

from __future__ import annotations

import numpy as np
from numba import njit
from numba.core import types
from numba.extending import overload

from kvreg.quant import HALF_OVERFLOW

from .intrinsics import JIT_CACHE


@njit(nogil=True, cache=JIT_CACHE)
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


@njit(nogil=True, cache=JIT_CACHE)
def bf16_bits(x, out):
    """bfloat16 bits (uint16) of the float32 row ``x`` into ``out``, as
    :func:`kvreg.quant.to_bf16` rounds them: to nearest even (the top half
    after adding 0x7FFF plus its lowest bit, overflow to inf), a NaN quieted
    with its payload's top bits kept."""
    bits = x.view(np.uint32)
    for i in range(x.shape[0]):
        b = np.int64(bits[i])
        if b & 0x7FFFFFFF > 0x7F800000:
            out[i] = np.uint16((b >> 16) | 0x40)
        else:
            out[i] = np.uint16((b + 0x7FFF + ((b >> 16) & 1)) >> 16)


#: The smallest float32 magnitudes binary16 (int16 bits) and bfloat16
#: (uint16 bits) round to inf (kvreg.quant.HALF_OVERFLOW).
_HALF_LIMIT = np.float32(HALF_OVERFLOW["f16"])
_BF16_LIMIT = np.float32(HALF_OVERFLOW["bf16"])


@njit(nogil=True, cache=JIT_CACHE)
def _below(x, lim):
    """Whether no finite value of the row ``x`` reaches ``lim`` (inf and NaN
    are stored as they are)."""
    for i in range(x.shape[0]):
        a = abs(x[i])
        if a >= lim and a != np.inf:
            return False
    return True


def _per_storage_type(f32, f16, bf16):
    """An ``@overload`` typing function of ``(x, out)`` choosing the
    implementation by ``out``'s storage type: float32, binary16 bits
    (int16), bfloat16 bits (uint16)."""
    def typed(x, out):
        if isinstance(out, types.Array):
            return {types.int16: f16, types.uint16: bf16}.get(out.dtype, f32)
        return None
    return typed


def _row_fits(x, out):
    """Whether the float32 row ``x`` stores in ``out``'s type without a
    finite value rounding to inf (what :meth:`kvreg.LayerKvCache.append`
    refuses for an f16/bf16 layer; always for float32)."""
    raise NotImplementedError("kvreg_numba.store._row_fits runs inside compiled kernels only")


def _put_row(x, out):
    """``out = x``, the float32 row rounded to ``out``'s storage type
    (float32; binary16 as int16 bits, :func:`half_bits`; bfloat16 as uint16
    bits, :func:`bf16_bits`): what :func:`kvreg.quant.to_half` stores."""
    raise NotImplementedError("kvreg_numba.store._put_row runs inside compiled kernels only")


def _copy_row(x, out):
    out[:] = x


overload(_row_fits, jit_options={"nogil": True})(_per_storage_type(
    lambda x, out: True, lambda x, out: _below(x, _HALF_LIMIT), lambda x, out: _below(x, _BF16_LIMIT)))
overload(_put_row, jit_options={"nogil": True})(_per_storage_type(
    _copy_row, lambda x, out: half_bits(x, out), lambda x, out: bf16_bits(x, out)))


@njit(nogil=True, cache=JIT_CACHE)
def store_row(krow, vrow, kf, vf, lens, imp_all, seq):
    """A decode step's row ``[nkv, hd]`` float32 written where
    :meth:`kvreg.storage.LayerStorage.append_row` writes it, with its bits:
    slot ``lens[0]`` of every head of the blocks ``kf``/``vf`` (float32, or
    binary16/bfloat16 bits: rounded as :func:`kvreg.quant.to_half` rounds;
    every head holds ``lens[0]`` rows, the caller checked there is room),
    the counts one up, ``imp_all[seq] = 0``. Returns False, having written
    nothing, when a finite value would round to inf in a 2-byte block
    (the layer's own append then refuses it)."""
    at = lens[0]
    for g in range(kf.shape[0]):
        if not (_row_fits(krow[g], kf[g, at]) and _row_fits(vrow[g], vf[g, at])):
            return False
    for g in range(kf.shape[0]):
        _put_row(krow[g], kf[g, at])
        _put_row(vrow[g], vf[g, at])
    lens[:] = at + 1
    imp_all[seq] = 0.0
    return True
