"""Wire round trips across backends: state exported by backend A and imported
by backend B answers the same query as A did, within tolerance; bit for bit
when A and B are the same backend. Only F32 layers travel (the format
refuses q8 storage, see test_seed)."""

import numpy as np
import pytest

from kvreg import KvMode, LayerKvCache

from .data import filled, queries

DIRECTIONS = ["under_test->reference", "reference->under_test", "under_test->under_test"]


@pytest.mark.quick
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("f16", [False, True], ids=["f32", "f16"])
@pytest.mark.parametrize("trim", [False, True], ids=["full", "tail"])
def test_state_answers_the_same_on_the_importing_backend(backend, ref, check, direction, f16, trim):
    src_be, dst_be = {"under_test": backend, "reference": ref}[direction.split("->")[0]], \
        {"under_test": backend, "reference": ref}[direction.split("->")[1]]
    nkv, hd, hpk = 2, 24, 3
    a, _, _ = filled(src_be, nkv, hd, KvMode.F32, 75, seed=300, alive=[True, False])
    a.accumulate_imp(np.linspace(0, 2, 75, dtype=np.float32))
    if trim:
        assert a.trim_window(20, 2, 4) > 0
    b = LayerKvCache(nkv, hd, KvMode.F32, dst_be)
    b.import_wire(a.export_wire(f16))
    # The importer answers as the exporter would after the same round trip:
    # an f16 wire changes the rows, so the exporter's side re-imports too.
    a2 = LayerKvCache(nkv, hd, KvMode.F32, src_be)
    a2.import_wire(a.export_wire(f16))
    check.exact("wire", b.imp, a2.imp, f"{direction}: importance travels bit for bit")
    q = queries(300, nkv * hpk, hd, 2.0)
    got = b.attend_layer(q, window=16, softcap=4.0, importance=False)
    want = a2.attend_layer(q, window=16, softcap=4.0, importance=False)
    same = src_be is dst_be
    what = f"{direction} f16={f16} {'trimmed' if trim else 'untrimmed'}"
    if same:
        check.exact("attend_layer", got, want, what)
    else:
        check.close("wire_cross_backend", got, want, what)
    for g in range(nkv):
        go, gp = b.attend(q[g * hpk], g)
        wo, wp = a2.attend(q[g * hpk], g)
        if same:
            check.exact("attend_group", go, wo, f"{what} head {g}")
            check.exact("attend_probs", gp, wp, f"{what} head {g}")
        else:
            check.close("wire_cross_backend", go, wo, f"{what} head {g}")
            check.close("attend_probs", gp, wp, f"{what} head {g}")
