"""Integer arguments as numpy integer types answer exactly as Python ints
(regression cases: a ``np.uint8`` window once wrapped at 256 and wiped the
layer; ``np.uint64`` overflowed after rows moved), and row counts past 255 reach
the kernels whole (a kernel narrowing them would answer from the wrong rows).
"""

import numpy as np
import pytest

from kvreg import KvMode

from .checks import assert_same_storage
from .data import filled, queries

ROWS = 300   # past uint8: a count narrowed anywhere wraps
TYPES = [np.uint16, np.int32, np.uint32, np.int64, np.uint64]


@pytest.mark.quick
@pytest.mark.parametrize("itype", TYPES, ids=[t.__name__ for t in TYPES])
@pytest.mark.parametrize("mode", [KvMode.F32, KvMode.Q8], ids=lambda m: m.value)
def test_numpy_integer_arguments_answer_as_python_ints(backend, check, mode, itype):
    nkv, hd, hpk = 2, 32, 2
    a, _, _ = filled(backend, nkv, hd, mode, rows=ROWS, seed=11)
    b, _, _ = filled(backend, nkv, hd, mode, rows=ROWS, seed=11)
    q = queries(11, nkv * hpk, hd)
    I = itype  # noqa: E741
    for g in range(nkv):
        qg = q[g * hpk:(g + 1) * hpk]
        want = a.attend_group(qg, g, scale=0.2, first=7, upto=280)
        got = b.attend_group(qg, I(g), scale=0.2, first=I(7), upto=I(280))
        check.exact("attend_group", got, want, f"{itype.__name__} kv_head/first/upto")
    check.exact("attend_layer", b.attend_layer(q, window=I(260)), a.attend_layer(q, window=260),
                f"{itype.__name__} window")
    big = min(int(np.iinfo(itype).max), 2**63 - 1)
    check.exact("attend_layer", b.attend_layer(q, window=I(big)), a.attend_layer(q, window=big),
                f"{itype.__name__} window past every row")
    a.truncate_last(3)
    b.truncate_last(I(3))
    a.evict_born(270, 4, 20)
    b.evict_born(I(270), I(4), I(20))
    assert_same_storage(check, b, a, "gather_rows", f"{itype.__name__} evict_born")
    if mode is KvMode.F32:   # trims wait for the q8 field; F32 trims at once
        check.equal("trim_window", b.trim_window(I(8), I(30), I(1)), a.trim_window(8, 30, 1))
        assert_same_storage(check, b, a, "trim_window", f"{itype.__name__} trim_window")
        check.equal("trim_window", (type(b.seq_len), type(b.base)), (int, int), "seq_len and base stay Python ints")
    b.evict(I(40))
    a.evict(40)
    assert_same_storage(check, b, a, "evict", f"{itype.__name__} evict")


@pytest.mark.quick
def test_upto_past_255_rows_equals_the_layer_that_held_them(backend, check):
    nkv, hd, hpk = 2, 16, 2
    full, k, v = filled(backend, nkv, hd, rows=ROWS, seed=5)
    q = queries(5, nkv * hpk, hd)
    for upto in (257, 290):
        short, _, _ = filled(backend, nkv, hd, rows=upto, seed=5)
        for g in range(nkv):
            qg = q[g * hpk:(g + 1) * hpk]
            check.exact("attend_group", full.attend_group(qg, g, scale=0.25, upto=np.uint16(upto)),
                        short.attend_group(qg, g, scale=0.25), f"upto={upto} == a layer of {upto} rows")
