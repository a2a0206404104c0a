"""Atomic operations on int64 arrays, for threads that share one call.

A decode's helper threads and the prefill chunk's workers claim units of
work from a shared array of claims (compare-and-swap, acquire loads), and a
caller measures its patience in CPU cycles. numba has no atomics of its own,
so these are intrinsics emitting LLVM's ``cmpxchg``, atomic loads and
``llvm.readcyclecounter``. They are apart from :mod:`.intrinsics` because
they are about threads, not arithmetic: no value a kernel computes depends
on them, only who computes it.
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic


def _item_pointer(context, builder, sig, args):
    aryty = sig.args[0]
    ary = context.make_array(aryty)(context, builder, args[0])
    return cgutils.get_item_pointer(context, builder, aryty, ary, [args[1]])


@intrinsic
def claim(typingctx, arr, idx, expected, new):
    """Atomic compare-and-swap of the int64 ``arr[idx]`` from ``expected`` to
    ``new`` (sequentially consistent); returns the value it found."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64 and arr.ndim == 1):
        return None

    def codegen(context, builder, signature, args):
        ptr = _item_pointer(context, builder, signature, args)
        i64 = ir.IntType(64)
        exp = context.cast(builder, args[2], signature.args[2], types.int64)
        val = context.cast(builder, args[3], signature.args[3], types.int64)
        res = builder.cmpxchg(ptr, exp, val, "seq_cst", "seq_cst")
        assert res.type.elements[0] == i64
        return builder.extract_value(res, 0)

    return types.int64(arr, idx, expected, new), codegen


@intrinsic
def claim_of(typingctx, arr, idx):
    """Atomic (acquire) load of the int64 ``arr[idx]``: a helper's partial
    states are complete once its done code is seen."""
    if not (isinstance(arr, types.Array) and arr.dtype == types.int64 and arr.ndim == 1):
        return None

    def codegen(context, builder, signature, args):
        return builder.load_atomic(_item_pointer(context, builder, signature, args), "acquire", 8)

    return types.int64(arr, idx), codegen


@intrinsic
def cycles(typingctx):
    """The CPU's cycle counter (``llvm.readcyclecounter``: rdtsc on x86; 0
    where a target has none)."""
    def codegen(context, builder, signature, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ir.IntType(64), []),
                                            "llvm.readcyclecounter")
        return builder.call(fn, [])

    return types.int64(), codegen
