"""Records that claim what their bytes do not carry: positions without rows
and per-row shapes of no rows (docs/wire.md, "No allocation beyond the
buffer"). What an import costs is bounded by its buffer: a depth counter's
positions cost nothing, positions that carry their importance cost what
they carry, and no refusal is anything but a WireError that changes
nothing."""

from __future__ import annotations

import struct

import numpy as np
import pytest
from cpu_cost import measured, settled

from kvreg import KvCache, KvMode, LayerKvCache, WireError, WireKind
from kvreg.storage import Storage
from kvreg.wire import Expect, LayerState, decode_cache, decode_layer, encode_cache, encode_layer, inspect

NKV, HD = 2, 8
U32_MAX = 2**32 - 1


def counter(n, layer=0, lin=0):
    """A depth counter: ``n`` positions, no row, no importance (the seed's
    v2 Full kind; 64 bytes for one head, 72 for two)."""
    return (b"CMFS" + struct.pack("<IQIBBHQ", 2, 0, layer, 0, 0, 0, n)[:28]
            + struct.pack("<6I", 0, n, NKV, HD, lin, 0) + bytes(4 * lin) + bytes(8 * NKV))


def filled(mode, layers=2, rows=5, seed=0):
    c = KvCache(layers, NKV, HD, 4096, mode=mode, backend="reference", q8_exact_rows=1)
    rng = np.random.default_rng(seed)
    for lay in c.layers:
        lay.extend(rng.standard_normal((rows, NKV, HD)).astype(np.float32),
                   rng.standard_normal((rows, NKV, HD)).astype(np.float32))
    return c


def cost(fn):
    """(CPU seconds, peak bytes traced) of ``fn()``, an import that must not
    raise; one over a second is run again (:mod:`cpu_cost`)."""
    dt, peak, error = measured(fn)
    if error is not None:
        raise error
    return settled(dt, 1.0, fn), peak


MODES = list(KvMode)


@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
def test_a_counter_of_4g_positions_after_a_good_record_installs_whole_and_costs_nothing(mode):
    src, dst = filled(mode, seed=1), filled(mode, seed=2)
    blob = encode_cache([decode_cache(src.export_wire())[0], counter(U32_MAX, layer=1)])
    dt, peak = cost(lambda: dst.import_wire(blob))
    assert dt < 1.0 and peak < 64 * len(blob) + (256 << 10), (dt, peak)
    l0, l1 = dst.layers
    assert l0.export_wire() == src.layers[0].export_wire()
    # the positions are an empty prefix of layer 1, as after a trim
    assert (l1.base, l1.seq_len, l1.pos_len) == (U32_MAX, 0, U32_MAX) and not l1.storage.lens.any()
    assert l1.reserved_bytes() <= LayerKvCache(NKV, HD, mode, "reference", q8_exact_rows=1).reserved_bytes()
    again = l1.export_wire()
    empty = LayerKvCache(NKV, HD, mode, "reference", q8_exact_rows=1).export_wire()
    assert len(again) == len(empty) + 8 and again[20] == WireKind.FullTail   # + its u64 base
    # the layer goes on from there
    l1.append(np.ones(NKV * HD, np.float32), np.ones(NKV * HD, np.float32))
    assert l1.pos_len == U32_MAX + 1 and l1.seq_len == 1


@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
def test_a_bad_record_after_a_counter_of_4g_positions_changes_nothing(mode):
    src, dst = filled(mode, 3, seed=1), filled(mode, 3, seed=2)
    parts = decode_cache(src.export_wire())
    blob = encode_cache([parts[0], counter(U32_MAX, layer=1), parts[2][:-1]])
    before = dst.export_wire()
    with pytest.raises(WireError, match="truncated|CRC-32"):
        dst.import_wire(blob)
    assert dst.export_wire() == before


@pytest.mark.parametrize("mode", [KvMode.Q8_2F, KvMode.Q8K_2F, KvMode.Q8V_2F], ids=lambda m: m.value)
def test_a_counter_into_a_2f_layer_does_not_convert_position_by_position(mode):
    lay = LayerKvCache(NKV, HD, mode, "reference")
    dt, _ = cost(lambda: lay.import_wire(counter(U32_MAX)))
    assert dt < 1.0 and lay.pos_len == U32_MAX


def dead_record(n, imp):
    """An F32 layer's record of ``n`` positions at which every head was dead:
    no row, one importance entry per position (4 bytes each in the blob)."""
    src = LayerKvCache(NKV, HD, KvMode.F32, "reference")
    src.extend(np.zeros((n, NKV, HD), np.float32), np.zeros((n, NKV, HD), np.float32), [False] * NKV)
    src.accumulate_imp(imp)
    return src.export_wire()


@pytest.mark.parametrize("mode", [m for m in MODES if m is not KvMode.F32], ids=lambda m: m.value)
def test_positions_with_importance_and_no_row_convert_as_extend_stores_them(mode):
    n = 150   # past the 2f freeze point: extend tries it at every position
    imp = np.linspace(0, 1, n, dtype=np.float32)
    want = LayerKvCache(NKV, HD, mode, "reference")
    want.extend(np.zeros((n, NKV, HD), np.float32), np.zeros((n, NKV, HD), np.float32), [False] * NKV)
    want.accumulate_imp(imp)
    got = LayerKvCache(NKV, HD, mode, "reference")
    got.import_wire(dead_record(n, imp))
    assert got.seq_len == n and np.array_equal(got.imp, imp)
    assert got.export_wire() == want.export_wire()


@pytest.mark.parametrize("mode", [KvMode.Q8_2F, KvMode.Q8K_2F, KvMode.Q8V_2F], ids=lambda m: m.value)
def test_many_positions_with_importance_and_no_row_convert_in_one_step(mode):
    n = 1 << 17   # a 512 KiB record; position by position, seconds
    blob = dead_record(n, np.zeros(n, np.float32))
    lay = LayerKvCache(NKV, HD, mode, "reference")
    dt, _ = cost(lambda: lay.import_wire(blob))
    assert dt < 1.0 and lay.seq_len == n


def test_memory_an_install_cannot_get_is_a_wire_error_that_changes_nothing(monkeypatch):
    src, dst = filled(KvMode.F32, 3, seed=1), filled(KvMode.F32, 3, seed=2)
    blob = src.export_wire()
    before = dst.export_wire()
    real = Storage.load
    calls = []

    def load(self, *a, **kw):
        calls.append(1)
        if len(calls) == 3:   # the last layer's storage
            raise MemoryError
        return real(self, *a, **kw)

    monkeypatch.setattr(Storage, "load", load)
    with pytest.raises(WireError, match="layer 2 .*more memory than this process can allocate"):
        dst.import_wire(blob)
    assert dst.export_wire() == before


# ── per-row shapes of no rows ──

def v3_huge_dims(dims, rows_class=0, code=1):
    """A v3 f16 record of one empty head whose block ``k`` declares
    per-row ``dims``: no row, so no payload byte stands behind them."""
    name = b"f16"
    body = (struct.pack("<I", len(name)) + name + struct.pack("<7I", 0, 1, HD, 0, 0, 0, 1) + struct.pack("<2I", 0, 0)
            + bytes([1]) + b"k" + bytes([code, rows_class, len(dims)]) + struct.pack(f"<{len(dims)}I", *dims))
    return b"CMFS" + struct.pack("<IQIBBHQ", 3, 0, 0, 0, 0, 0, 0)[:28] + body


@pytest.mark.parametrize("dims", [(U32_MAX, U32_MAX), (U32_MAX,) * 3, (U32_MAX,) * 4, (2**31, 2**31),
                                  (2**30, 2)], ids=lambda d: "x".join(map(str, d)))
@pytest.mark.parametrize("rows_class", [0, 1], ids=["rows", "exact"])
def test_huge_per_row_dims_of_no_rows_are_a_wire_error(dims, rows_class):
    blob = v3_huge_dims(dims, rows_class)
    with pytest.raises(WireError, match="past the format's 4294967295") as info:
        decode_layer(blob, Expect(1, HD))
    assert info.value.offset == 32 + 4 + 3 + 28 + 8 + 2 + 3
    assert inspect(blob).splitlines()[-1].startswith("ERROR: kv import: block 'k': per-row shape")
    # ...and into a layer, whose storage schema refuses them first
    lay = LayerKvCache(1, HD, "f16", "reference")
    with pytest.raises(WireError):
        lay.import_wire(blob)
    assert lay.seq_len == 0


def test_a_per_row_shape_within_the_bound_still_decodes_without_a_schema():
    blob = v3_huge_dims((HD,))
    assert len(blob) == 4 * 8 + 4 + 3 + 28 + 8 + 5 + 4
    st = decode_layer(blob, Expect(1, HD))
    assert st.mode == "f16" and st.storage.blocks[0].data[0].shape == (0, HD)


def test_export_refuses_a_row_past_the_bound():
    from kvreg.wire import BlockRecord, BlockSpec, RowClass, StorageRecord

    spec = BlockSpec("k", RowClass.ROWS, np.dtype("<f4"), (2**31,))
    st = LayerState(WireKind.Full, 0, 0, 0, 0, 0, 1, HD,
                    storage=StorageRecord("f16", 0, np.zeros(1, np.int64), np.zeros(1, np.int64),
                                          [BlockRecord(spec, [np.zeros((0, 2**31), np.float32)])]))
    with pytest.raises(Exception, match="past the format's"):
        encode_layer(st, f16=False)


def test_memory_a_decode_cannot_get_is_a_wire_error(monkeypatch):
    from kvreg.wire import _format

    blob = filled(KvMode.F32, 1).layers[0].export_wire()

    def floats(*a, **kw):
        raise MemoryError

    monkeypatch.setattr(_format.Reader, "floats", floats)
    with pytest.raises(WireError, match=f"decoding a {len(blob)}-byte record needs more memory"):
        decode_layer(blob, Expect(NKV, HD))
