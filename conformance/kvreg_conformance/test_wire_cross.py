"""Wire round trips across backends: state exported by backend A and imported
by backend B answers the same query as A did, within tolerance; bit for bit
when A and B are the same backend. F32 layers travel as v2; every other
storage mode as v3, its stored blocks bit for bit (docs/wire.md)."""

import numpy as np
import pytest

from kvreg import KvMode, LayerKvCache

from .data import EXACT_ROWS, filled, queries

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


# ── wire v3: every non-F32 storage mode in its own format ──

STORAGE_MODES = [m for m in KvMode if m is not KvMode.F32]


@pytest.mark.quick
@pytest.mark.parametrize("direction", DIRECTIONS)
@pytest.mark.parametrize("mode", STORAGE_MODES, ids=lambda m: m.value)
def test_v3_storage_travels_bit_for_bit_to_the_importing_backend(backend, ref, check, direction, mode):
    """The exporter's stored blocks land on the importer unchanged (the
    re-export is byte-identical), so the importer answers as its own backend
    answers on that storage: bit for bit when the backends are the same."""
    names = direction.split("->")
    src_be, dst_be = ({"under_test": backend, "reference": ref}[n] for n in names)
    nkv, hd, hpk = 2, 40, 2
    a, _, _ = filled(src_be, nkv, hd, mode, 75, seed=310, alive=[True, False])
    a.accumulate_imp(np.linspace(0, 2, 75, dtype=np.float32))
    blob = a.export_wire(False)
    check.equal("wire", blob[4], 3, "a non-F32 layer writes v3")
    b = LayerKvCache(nkv, hd, mode, dst_be, q8_exact_rows=EXACT_ROWS)
    b.import_wire(blob)
    check.equal("wire", b.export_wire(False) == blob, True, f"{direction} {mode.value}: re-export byte-identical")
    check.exact("wire", b.imp, a.imp, f"{direction}: importance travels bit for bit")
    # the importer's own backend on the same storage, built by appends there
    twin, _, _ = filled(dst_be, nkv, hd, mode, 75, seed=310, alive=[True, False])
    twin.import_wire(blob)
    q = queries(310, nkv * hpk, hd, 2.0)
    got = b.attend_layer(q, window=16, softcap=4.0, importance=False)
    check.exact("attend_layer", got, twin.attend_layer(q, window=16, softcap=4.0, importance=False),
                f"{direction} {mode.value}: the import answers as any layer holding that storage")
    want = a.attend_layer(q, window=16, softcap=4.0, importance=False)
    if src_be is dst_be:
        check.exact("attend_layer", got, want, f"{direction} {mode.value}")
    else:
        check.close("wire_cross_backend", got, want, f"{direction} {mode.value}")
    go, gp = b.attend(q[0], 0)
    wo, wp = a.attend(q[0], 0)
    if src_be is dst_be:
        check.exact("attend_group", go, wo, f"{direction} {mode.value} head 0")
        check.exact("attend_probs", gp, wp, f"{direction} {mode.value} head 0")
    else:
        check.close("wire_cross_backend", go, wo, f"{direction} {mode.value} head 0")
        check.close("attend_probs", gp, wp, f"{direction} {mode.value} head 0")


@pytest.mark.quick
@pytest.mark.parametrize("mode", STORAGE_MODES, ids=lambda m: m.value)
def test_an_f32_record_is_stored_as_the_importing_backend_appends(backend, ref, check, mode):
    """An F32 (v2) record exported on the reference, imported into a layer
    of another mode on the backend under test, holds what that backend's own
    extend of the same rows holds (the mode policy of docs/wire.md)."""
    nkv, hd = 2, 40
    src, k, v = filled(ref, nkv, hd, KvMode.F32, 70, seed=320)
    got = LayerKvCache(nkv, hd, mode, backend, q8_exact_rows=EXACT_ROWS)
    got.import_wire(src.export_wire(False))
    want = LayerKvCache(nkv, hd, mode, backend, q8_exact_rows=EXACT_ROWS)
    want.extend(k, v)
    check.equal("wire", got.mode is mode, True, "the layer keeps its mode")
    check.equal("wire", got.export_wire(False) == want.export_wire(False), True,
                f"{mode.value}: the converted storage is the appended one")
