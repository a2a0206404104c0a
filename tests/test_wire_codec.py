"""The wire v2 codec (kvreg.wire): golden bytes, round trips, every refusal,
and a fuzz run (100k examples in the ``long_fuzz`` tier). Its speed is
asv's (asv_bench/benchmarks/wire.py)."""

from __future__ import annotations

import hashlib
import importlib.util
import pathlib
import struct
import tracemalloc
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvreg.errors import ShapeError, WireError
from kvreg.wire import (
    BoundedRecord,
    Expect,
    LayerState,
    WireKind,
    check_exportable,
    decode_cache,
    decode_layer,
    encode_cache,
    encode_full_body,
    encode_layer,
    inspect,
)

DATA = pathlib.Path(__file__).resolve().parent / "data"
_spec = importlib.util.spec_from_file_location("make_golden", DATA / "make_golden.py")
golden = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(golden)

ID_FULL = 0x0123456789ABCDEF

EXPECT = {
    "full_f32": Expect(2, 4, identity=ID_FULL, layer=3),
    "fulltail_f16": Expect(2, 4, identity=0xC0FFEE, layer=1),
    "linear_f16flag": Expect(1, 4, identity=0xC0FFEE, layer=0, kind=WireKind.Linear),
    "bounded_f16": Expect(2, 4, identity=7, layer=2, kind=WireKind.Bounded, bounded_window=3),
    "legacy_f32": Expect(2, 4, identity=ID_FULL, layer=3),
}


# ------------------------------------------------------- hand-built bytes

def u32(*xs):
    return struct.pack(f"<{len(xs)}I", *xs)


def u64(x):
    return struct.pack("<Q", x)


def f32s(xs):
    return struct.pack(f"<{len(xs)}f", *xs)


def f16s(xs):
    # Python's struct 'e' rounds a double to binary16 half-to-even: an
    # oracle independent of numpy's cast.
    return struct.pack(f"<{len(xs)}e", *xs)


def seq(start, n):
    return [start + 0.125 * i for i in range(n)]


def header(identity, layer, kind, f16, position):
    return (b"CMFS" + u32(2) + u64(identity) + u32(layer) + bytes([kind, f16])
            + b"\x00\x00" + u64(position))


FULL_BODY = (
    u32(0, 2, 2, 4, 2, 2)  # f16=0, seq_len 2, 2 heads × hd 4, 2 linear, 2 importance
    + f32s([0.5, -0.25]) + f32s([0.75, 0.25])
    + u32(8) + f32s(seq(1.0, 8)) + u32(8) + f32s(seq(2.0, 8))  # head 0: K, V
    + u32(8) + f32s(seq(-1.0, 8)) + u32(8) + f32s(seq(-2.0, 8))  # head 1: K, V
)
RING_V = seq(-3.0, 24)
RING_V_BYTES = (f16s([np.float32(0.1).item()]) + f16s(RING_V[1:23])
                + b"\x00\x7c")  # 1e5 > 65504: +inf

HAND_BUILT = {
    "full_f32": header(ID_FULL, 3, 0, 0, 2) + FULL_BODY,
    "fulltail_f16": (
        header(0xC0FFEE, 1, 3, 1, 7) + u64(5)  # FullTail, position 7 = base 5 + 2 rows
        + u32(1, 2, 2, 4, 0, 2) + f32s([1.0, 0.5])
        + u32(8) + f16s(seq(0.5, 8)) + u32(8) + f16s(seq(-0.5, 8))
        + u32(0) + u32(0)  # head 1 is dead: two empty counts
    ),
    "linear_f16flag": header(0xC0FFEE, 0, 1, 1, 9) + u32(1, 4, 4) + f32s([0.5, -0.25, 1.0, 3.5]),
    "bounded_f16": (
        header(7, 2, 2, 1, 4) + u32(2, 4, 3, 3, 1)  # 2×4, window 3, len 3, head 4 % 3
        + f16s(seq(0.0, 24)) + RING_V_BYTES
    ),
    "legacy_f32": FULL_BODY,
}


def arrays_equal_bits(a, b):
    a, b = np.asarray(a), np.asarray(b)
    return a.shape == b.shape and a.dtype == b.dtype and np.array_equal(a.view(np.uint32), b.view(np.uint32))


def assert_same_state(got: LayerState, want: LayerState):
    assert (got.kind, got.identity, got.layer, got.position, got.base, got.seq_len,
            got.num_kv_heads, got.head_dim) == (want.kind, want.identity, want.layer,
                                                want.position, want.base, want.seq_len,
                                                want.num_kv_heads, want.head_dim)
    assert arrays_equal_bits(got.linear_state, want.linear_state)
    assert arrays_equal_bits(got.imp, want.imp)
    assert len(got.k) == len(want.k) == len(got.v) == len(want.v)
    for a, b in zip(got.k + got.v, want.k + want.v):
        assert arrays_equal_bits(a, b)
    assert (got.bounded is None) == (want.bounded is None)
    if want.bounded is not None:
        g, w = got.bounded, want.bounded
        assert (g.window, g.len, g.head) == (w.window, w.len, w.head)
        assert arrays_equal_bits(g.ring_k, w.ring_k) and arrays_equal_bits(g.ring_v, w.ring_v)


def layer(heads=2, hd=4, rows=3, *, base=0, seed=0, lin=0, layer_no=0):
    rng = np.random.default_rng(seed)
    mk = lambda: rng.standard_normal((rows, hd)).astype(np.float32)  # noqa: E731
    return LayerState(WireKind.Full, 0, layer_no, base + rows, base, rows, heads, hd,
                      linear_state=rng.standard_normal(lin).astype(np.float32),
                      imp=rng.random(rows).astype(np.float32),
                      k=[mk() for _ in range(heads)], v=[mk() for _ in range(heads)])


def refusal(buf, expect, meaning):
    with pytest.raises(WireError) as info:
        decode_layer(buf, expect)
    assert meaning in str(info.value), str(info.value)
    return info.value


# ----------------------------------------------------------------- golden

@pytest.mark.parametrize("name", sorted(HAND_BUILT))
def test_golden_file_is_the_hand_built_byte_layout(name):
    assert (DATA / f"wire_{name}.bin").read_bytes() == HAND_BUILT[name]


@pytest.mark.parametrize("name", sorted(HAND_BUILT))
def test_encoder_reproduces_golden_file(name):
    assert golden.blob(name) == (DATA / f"wire_{name}.bin").read_bytes()


@pytest.mark.parametrize("name", ["full_f32", "fulltail_f16", "legacy_f32"])
def test_golden_full_blob_decodes_to_its_state(name):
    state, _, _ = golden.states()[name]
    got = decode_layer((DATA / f"wire_{name}.bin").read_bytes(), EXPECT[name])
    want = state if name != "fulltail_f16" else LayerState(
        WireKind.FullTail, state.identity, state.layer, state.position, state.base, state.seq_len,
        state.num_kv_heads, state.head_dim, state.linear_state, state.imp, state.k, state.v)
    assert_same_state(got, want)


def test_golden_linear_blob_decodes_to_state_and_empty_rows():
    got = decode_layer((DATA / "wire_linear_f16flag.bin").read_bytes(), EXPECT["linear_f16flag"])
    assert (got.kind, got.seq_len, got.position, got.base) == (WireKind.Linear, 9, 9, 0)
    assert got.linear_state.tolist() == [0.5, -0.25, 1.0, 3.5]
    assert [a.shape for a in got.k + got.v] == [(0, 4), (0, 4)] and got.imp.size == 0


def test_golden_bounded_blob_decodes_rounded_ring():
    state, _, _ = golden.states()["bounded_f16"]
    got = decode_layer((DATA / "wire_bounded_f16.bin").read_bytes(), EXPECT["bounded_f16"])
    assert (got.kind, got.seq_len, got.bounded.len, got.bounded.head) == (WireKind.Bounded, 4, 3, 1)
    assert arrays_equal_bits(got.bounded.ring_k, state.bounded.ring_k)
    with np.errstate(over="ignore"):
        want_v = state.bounded.ring_v.astype(np.float16).astype(np.float32)
    assert arrays_equal_bits(got.bounded.ring_v, want_v)
    assert got.bounded.ring_v[1, 2, 3] == np.inf


# ------------------------------------------------------------ round trips

def test_f32_round_trip_is_bit_exact_including_specials():
    st_ = layer(rows=5, lin=3, seed=1)
    st_.k[0][0, :4] = np.array([np.nan, -0.0, np.inf, 1e-45], np.float32)
    st_.k[1][2, 0] = np.frombuffer(struct.pack("<I", 0x7F800001), np.float32)[0]  # signalling NaN
    assert_same_state(decode_layer(encode_layer(st_, f16=False), Expect(2, 4)), st_)


def test_f16_round_trip_equals_numpy_nearest_even_cast():
    st_ = layer(rows=7, seed=2)
    got = decode_layer(encode_layer(st_, f16=True), Expect(2, 4))
    for g, w in zip(got.k + got.v, st_.k + st_.v):
        assert arrays_equal_bits(g, w.astype(np.float16).astype(np.float32))


def test_f16_keeps_importance_and_linear_state_f32():
    st_ = layer(rows=3, lin=5, seed=3)
    got = decode_layer(encode_layer(st_, f16=True), Expect(2, 4))
    assert arrays_equal_bits(got.imp, st_.imp) and arrays_equal_bits(got.linear_state, st_.linear_state)


F16_CASES = [  # (f32 value or bits, expected binary16 bits, why)
    (1.0 + 2.0**-11, 0x3C00, "tie between 1 and 1+ulp goes to even 1"),
    (1.0 + 3 * 2.0**-11, 0x3C02, "tie between 1+ulp and 1+2ulp goes to even"),
    (1.0 + 2.0**-11 + 2.0**-20, 0x3C01, "just past the tie rounds up"),
    (65504.0, 0x7BFF, "largest finite"),
    (65519.0, 0x7BFF, "below the overflow tie stays finite"),
    (65520.0, 0x7C00, "the overflow tie rounds to inf"),
    (-1e30, 0xFC00, "overflow keeps the sign"),
    (float("inf"), 0x7C00, "inf stays inf"),
    (2.0**-24, 0x0001, "smallest subnormal"),
    (2.0**-25, 0x0000, "half the smallest subnormal ties to even zero"),
    (3 * 2.0**-25, 0x0002, "1.5 subnormal ulps ties to even 2"),
    (2.0**-14 - 2.0**-24, 0x03FF, "largest subnormal"),
    (-1e-45, 0x8000, "an f32 subnormal flushes to signed zero"),
]


@pytest.mark.parametrize("value,bits,why", F16_CASES, ids=[c[2] for c in F16_CASES])
def test_f16_conversion_is_ieee_round_to_nearest_even(value, bits, why):
    st_ = LayerState(WireKind.Full, 0, 0, 1, 0, 1, 1, 1, imp=np.zeros(1, np.float32),
                     k=[np.full((1, 1), value, np.float32)], v=[np.zeros((1, 1), np.float32)])
    blob = encode_layer(st_, f16=True)
    assert struct.unpack_from("<H", blob, 32 + 24 + 4 + 4)[0] == bits  # header, body fields, imp, K count


def test_f16_nan_stays_nan():
    for nan_bits in (0x7FC00000, 0x7F800001, 0xFFC00001):
        x = np.frombuffer(struct.pack("<I", nan_bits), np.float32).reshape(1, 1)
        st_ = LayerState(WireKind.Full, 0, 0, 1, 0, 1, 1, 1, imp=np.zeros(1, np.float32),
                         k=[x], v=[x])
        got = decode_layer(encode_layer(st_, f16=True), Expect(1, 1))
        assert np.isnan(got.k[0][0, 0]) and np.isnan(got.v[0][0, 0]), hex(nan_bits)


def test_full_layer_with_base_travels_as_full_tail():
    blob = encode_layer(layer(rows=3, base=10), f16=False)
    kind, position, base = blob[20], *struct.unpack_from("<QQ", blob, 24)
    assert (kind, position, base) == (3, 13, 10)


def test_untrimmed_full_layer_is_byte_identical_full_record():
    st_ = layer(rows=3)
    assert encode_layer(st_, f16=False) == header(0, 0, 0, 0, 3) + encode_full_body(st_, f16=False)


def test_full_tail_decodes_with_its_base():
    got = decode_layer(encode_layer(layer(rows=3, base=10), f16=False), Expect(2, 4))
    assert (got.kind, got.base, got.seq_len, got.position) == (WireKind.FullTail, 10, 3, 13)


def test_linear_record_is_f32_whatever_the_wire_dtype():
    st_ = LayerState(WireKind.Linear, 5, 0, 9, 0, 9, 1, 4, linear_state=np.float32([0.1, 1e5]))
    a, b = encode_layer(st_, f16=False), encode_layer(st_, f16=True)
    assert a[:21] + a[22:] == b[:21] + b[22:] and (a[21], b[21]) == (0, 1)
    got = decode_layer(b, Expect(1, 4, identity=5, kind=WireKind.Linear))
    assert arrays_equal_bits(got.linear_state, st_.linear_state)


def test_dead_head_at_every_position_round_trips():
    # The seed's append with every head dead counts a position and stores no
    # row, so seq_len may exceed every head's rows; that state must travel.
    st_ = layer(rows=2)
    st_.seq_len, st_.position, st_.imp = 3, 3, np.float32([0.5, 0.25, 0.0])
    assert_same_state(decode_layer(encode_layer(st_, f16=False), Expect(2, 4)), st_)


def test_position_counter_without_rows_round_trips_without_importance():
    st_ = LayerState(WireKind.Full, 0, 0, 9, 0, 9, 1, 4, linear_state=np.float32([1.0]),
                     k=[np.zeros((0, 4), np.float32)], v=[np.zeros((0, 4), np.float32)])
    assert_same_state(decode_layer(encode_full_body(st_, f16=False), Expect(1, 4)), st_)


def test_bounded_f32_round_trip_is_bit_exact():
    rng = np.random.default_rng(4)
    ring = lambda: rng.standard_normal((2, 5, 4)).astype(np.float32)  # noqa: E731
    st_ = LayerState(WireKind.Bounded, 1, 2, 12, 0, 12, 2, 4,
                     bounded=BoundedRecord(5, 5, 2, ring(), ring()))
    got = decode_layer(encode_layer(st_, f16=False),
                       Expect(2, 4, identity=1, layer=2, kind=WireKind.Bounded, bounded_window=5))
    assert arrays_equal_bits(got.bounded.ring_k, st_.bounded.ring_k)
    assert arrays_equal_bits(got.bounded.ring_v, st_.bounded.ring_v)


def test_decode_returns_fresh_writable_arrays_and_leaves_the_buffer_alone():
    buf = bytearray(encode_layer(layer(rows=4, lin=2), f16=False))
    digest = hashlib.sha256(buf).digest()
    got = decode_layer(buf, Expect(2, 4))
    assert hashlib.sha256(buf).digest() == digest
    raw = np.frombuffer(buf, np.uint8)
    for a in [got.linear_state, got.imp] + got.k + got.v:
        assert a.flags.writeable and not np.shares_memory(a, raw)


def test_decode_accepts_memoryview_and_bytearray():
    blob = encode_layer(layer(), f16=False)
    a = decode_layer(memoryview(blob), Expect(2, 4))
    assert_same_state(a, decode_layer(bytearray(blob), Expect(2, 4)))


# ---------------------------------------------------------------- refusals

def full_blob(**kw):
    return encode_layer(layer(**kw), f16=False)


def patch(blob, offset, fmt, value):
    b = bytearray(blob)
    struct.pack_into(fmt, b, offset, value)
    return bytes(b)


BODY = 32  # the Full body starts right after the header


def test_check_exportable_refuses_q8():
    with pytest.raises(WireError, match="only the F32 cache is described by this format"):
        check_exportable(False, False, False)


def test_check_exportable_refuses_o1_overlay():
    with pytest.raises(WireError, match=r"O\(1\) Nyström overlay is not part of this format"):
        check_exportable(True, True, False)


def test_check_exportable_refuses_frozen_columns():
    with pytest.raises(WireError, match="frozen columns under an F32 cache"):
        check_exportable(True, False, True)


def test_check_exportable_passes_a_plain_f32_layer():
    assert check_exportable(True, False, False) is None


def test_legacy_body_refused_without_operator_identity():
    # The seed's own case: four zero bytes to a delta layer.
    refusal(b"\x00\x00\x00\x00", Expect(1, 4, linear_wire_allowed=False), "operator identity")


def test_legacy_body_refused_on_a_bounded_layer():
    refusal(HAND_BUILT["legacy_f32"], Expect(2, 4, kind=WireKind.Bounded, bounded_window=3),
            "only the versioned wire")


def test_refuses_another_wire_version():
    refusal(patch(full_blob(), 4, "<I", 4), Expect(2, 4), "wire version 4, this runtime speaks 2 and 3")


def test_refuses_another_operator_identity():
    refusal(HAND_BUILT["linear_f16flag"], Expect(1, 4, identity=0, kind=WireKind.Linear),
            "operator identity")


def test_refuses_another_layer():
    refusal(full_blob(layer_no=4), Expect(2, 4, layer=5), "record is for layer 4, this is layer 5")


def test_refuses_unknown_kind():
    refusal(patch(full_blob(), 20, "<B", 4), Expect(2, 4), "unknown state kind 4")


def test_refuses_linear_record_on_full_layer():
    refusal(HAND_BUILT["linear_f16flag"], Expect(1, 4, identity=0xC0FFEE), "does not match")


def test_bounded_layer_refuses_full_tail():
    refusal(HAND_BUILT["fulltail_f16"], Expect(2, 4, identity=0xC0FFEE, layer=1,
                                               kind=WireKind.Bounded, bounded_window=8),
            "does not match")


def test_refuses_other_geometry_naming_the_peers():
    refusal(full_blob(), Expect(2, 8), "2×4")


def test_linear_record_refuses_other_geometry():
    refusal(HAND_BUILT["linear_f16flag"], Expect(2, 4, identity=0xC0FFEE, kind=WireKind.Linear), "1×4")


def test_refuses_truncated_header():
    refusal(full_blob()[:31], Expect(2, 4), "truncated header")


def test_refuses_truncated_record():
    refusal(full_blob()[:BODY + 10], Expect(2, 4), "truncated record")


def test_refuses_truncated_payload():
    refusal(full_blob()[:-1], Expect(2, 4), "truncated payload")


def test_refuses_trailing_bytes():
    refusal(full_blob() + b"\x00", Expect(2, 4), "1 trailing byte(s) after the record")


def test_refuses_legacy_trailing_bytes():
    refusal(HAND_BUILT["legacy_f32"] + b"xy", Expect(2, 4), "2 trailing byte(s)")


def test_refuses_full_position_other_than_seq_len():
    refusal(patch(full_blob(rows=3), 24, "<Q", 4), Expect(2, 4), "header position 4 != record seq_len 3")


def test_refuses_tail_base_plus_rows_other_than_position():
    refusal(patch(full_blob(rows=3, base=10), 24, "<Q", 14), Expect(2, 4),
            "tail base 10 + 3 rows != header position 14")


def test_refuses_bounded_record_of_another_window():
    refusal(HAND_BUILT["bounded_f16"], Expect(2, 4, identity=7, layer=2, kind=WireKind.Bounded,
                                              bounded_window=6), "does not fit this layer's ring")


def test_refuses_bounded_record_without_a_ring():
    refusal(HAND_BUILT["bounded_f16"], Expect(2, 4, identity=7, layer=2, kind=WireKind.Bounded),
            "without a ring")


def test_refuses_bounded_len_head_inconsistent_with_position():
    blob = patch(HAND_BUILT["bounded_f16"], 24, "<Q", 5)  # head says 1, 5 % 3 = 2
    refusal(blob, EXPECT["bounded_f16"], "inconsistent with position 5")


def test_refuses_head_count_not_a_multiple_of_head_dim():
    # head 0's K count sits after 6 fields, 2 importance and 0 linear.
    refusal(patch(full_blob(rows=2), BODY + 24 + 8, "<I", 7), Expect(2, 4), "not a multiple of head_dim 4")


def test_refuses_k_and_v_counts_that_differ():
    blob = encode_layer(layer(rows=2), f16=False)
    v_count = BODY + 24 + 8 + 4 + 32  # after head 0's K count and 8 f32
    b2 = patch(blob, v_count, "<I", 4)
    refusal(b2, Expect(2, 4), "head 0 holds 2 K rows but 1 V rows")


def test_refuses_more_rows_than_seq_len():
    st_ = layer(rows=3)
    blob = patch(patch(encode_layer(st_, f16=False), BODY + 4, "<I", 2), 24, "<Q", 2)
    refusal(blob, Expect(2, 4), "a head holds 3 rows but seq_len is 2")


def test_refuses_importance_length_other_than_seq_len():
    body = (u32(0, 3, 1, 4, 0, 2) + f32s([0.5, 0.25])  # seq_len 3, but 2 importance entries
            + u32(12) + f32s(seq(0.0, 12)) + u32(12) + f32s(seq(1.0, 12)))
    refusal(body, Expect(1, 4), "2 importance entries for seq_len 3")


def test_refuses_header_and_body_f16_flags_that_disagree():
    refusal(patch(full_blob(), 21, "<B", 1), Expect(2, 4), "disagrees")


def test_refuses_f16_flag_other_than_0_or_1():
    refusal(patch(full_blob(), 21, "<B", 2), Expect(2, 4), "neither 0 nor 1")


def test_refuses_full_body_f16_flag_other_than_0_or_1():
    refusal(patch(full_blob(), BODY, "<I", 2), Expect(2, 4), "Full body f16 flag 2 is neither 0 nor 1")


def test_inspect_reports_a_zero_window_ring():
    blob = header(0, 0, 2, 0, 4) + u32(1, 4, 0, 0, 0)
    assert "bounded record with window 0" in inspect(blob)


def test_inspect_reports_zero_head_dim_with_heads():
    assert "head_dim 0 with KV heads" in inspect(header(0, 0, 0, 0, 0) + u32(0, 0, 1, 0, 0, 0))


def test_refuses_nonzero_reserved_field():
    refusal(patch(full_blob(), 22, "<H", 1), Expect(2, 4), "reserved field is 1")


def test_refusal_names_the_byte_offset():
    err = refusal(full_blob()[:-1], Expect(2, 4), "truncated payload")
    assert err.offset == len(full_blob()) - 4 * 12 and f"(at byte {err.offset})" in str(err)


def test_refuses_a_non_bytes_argument():
    refusal("CMFS", Expect(2, 4), "bytes-like")


def test_wire_error_is_a_value_error():
    with pytest.raises(ValueError):
        decode_layer(b"", Expect(2, 4))


HUGE = [
    ("linear length", header(0, 0, 0, 0, 0) + u32(0, 0, 1, 4, 0xFFFFFFFF, 0)),
    ("head count", header(0, 0, 0, 0, 0) + u32(0, 0, 1, 4, 0, 0) + u32(0xFFFFFFFC)),
    ("linear record", header(0, 0, 1, 0, 0) + u32(1, 4, 0xFFFFFFFF)),
]


@pytest.mark.parametrize("what,blob", HUGE, ids=[h[0] for h in HUGE])
def test_huge_count_fails_before_allocating(what, blob):
    # A 64-byte blob claiming ~4G elements: refused before any allocation.
    kind = WireKind(blob[20])
    blob = blob + bytes(64 - len(blob))
    tracemalloc.start()
    try:
        with pytest.raises(WireError, match="truncated payload"):
            decode_layer(blob, Expect(1, 4, kind=kind))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak


def test_inspect_of_huge_geometry_fails_before_allocating():
    blob = header(0, 0, 2, 0, 0) + u32(0xFFFFFFFF, 0xFFFFFFFF, 0xFFFFFFFF, 0, 0)
    tracemalloc.start()
    try:
        report = inspect(blob)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert "truncated payload" in report and peak < 1 << 20


# ----------------------------------------------------------------- export

def test_export_refuses_bounded_kind_without_ring():
    with pytest.raises(WireError, match="without an installed ring"):
        encode_layer(LayerState(WireKind.Bounded, 0, 0, 0, 0, 0, 1, 4), f16=False)


def test_export_refuses_position_other_than_base_plus_seq_len():
    st_ = layer(rows=3)
    st_.position = 4
    with pytest.raises(WireError, match="position 4 != base 0 \\+ seq_len 3"):
        encode_layer(st_, f16=False)


def test_export_refuses_what_import_would_refuse():
    st_ = layer(rows=3)
    st_.imp = st_.imp[:2]
    with pytest.raises(WireError, match="2 importance entries for seq_len 3"):
        encode_layer(st_, f16=False)


def test_export_refuses_an_unknown_kind():
    st_ = layer()
    st_.kind = 9
    with pytest.raises(WireError, match="unknown wire kind 9"):
        encode_layer(st_, f16=False)


def test_expect_takes_a_plain_int_kind():
    got = decode_layer(HAND_BUILT["linear_f16flag"], Expect(1, 4, identity=0xC0FFEE, kind=1))
    assert got.kind is WireKind.Linear


def test_export_refuses_float64_rows():
    st_ = layer()
    st_.k[0] = st_.k[0].astype(np.float64)
    with pytest.raises(ShapeError, match="float32"):
        encode_layer(st_, f16=False)


def test_export_refuses_k_v_shape_mismatch():
    st_ = layer(rows=3)
    st_.v[1] = st_.v[1][:2]
    with pytest.raises(ShapeError, match="head 1"):
        encode_layer(st_, f16=False)


def test_export_refuses_values_past_their_field():
    st_ = layer()
    st_.layer = 1 << 32
    with pytest.raises(WireError, match="layer 4294967296 does not fit its 32-bit field"):
        encode_layer(st_, f16=False)


# -------------------------------------------------------------- container

def test_cache_container_round_trips_layer_blobs():
    blobs = [HAND_BUILT[n] for n in sorted(HAND_BUILT)] + [b""]
    assert decode_cache(encode_cache(blobs)) == blobs


def test_cache_container_layout():
    # version 2: a CRC-32 (zlib's) of each layer blob after it
    assert encode_cache([b"ab", b""]) == (b"KVRC" + u32(2, 2) + u64(2) + b"ab" + u32(zlib.crc32(b"ab"))
                                          + u64(0) + u32(0))


def test_a_version_1_container_still_reads():
    # what a kvreg before the checksums wrote: no CRC after each blob
    assert decode_cache(b"KVRC" + u32(1, 2) + u64(2) + b"ab" + u64(0)) == [b"ab", b""]


def crc(b):
    return u32(zlib.crc32(b))


@pytest.mark.parametrize("blob,meaning", [
    (b"KVRD" + u32(2, 0), "magic"),
    (b"KVRC" + u32(3, 0), "cache container version 3, this runtime speaks 1 and 2"),
    (b"KVRC" + u32(2), "truncated record"),
    (b"KVRC" + u32(2, 0xFFFFFFFF), "4294967295 layer length fields"),
    (b"KVRC" + u32(2, 1) + u64(5) + b"abcd", "truncated payload"),
    (b"KVRC" + u32(2, 1) + u64(4) + b"abcd", "truncated payload: layer 0 blob (4 bytes) and its CRC-32"),
    (b"KVRC" + u32(2, 1) + u64(1) + b"a" + crc(b"a") + b"b", "1 trailing byte(s)"),
    (b"KVRC" + u32(1, 1) + u64(1) + b"ab", "1 trailing byte(s)"),
    (b"KVRC" + u32(2, 2) + u64(1) + b"a" + crc(b"a") + u64(2) + b"bX" + crc(b"bc"),
     "layer 1's blob (bytes 33..34 of the container) fails its CRC-32"),
], ids=["magic", "version", "short header", "huge count", "short blob", "no crc", "trailing", "v1 trailing",
        "changed blob"])
def test_cache_container_refusals(blob, meaning):
    with pytest.raises(WireError, match=meaning.replace("(", r"\(").replace(")", r"\)")):
        decode_cache(blob)


# ---------------------------------------------------------------- inspect

def test_inspect_reports_header_and_body():
    report = inspect(HAND_BUILT["full_f32"])
    for part in ("identity 0123456789abcdef", "layer 3", "kind 0 (Full)", "position 2",
                 "heads×hd 2×4", "head 1: K and V 2 rows each, 64 bytes (f32)", "\nOK: Full record"):
        assert part in report, (part, report)


def test_inspect_says_what_is_broken_and_where():
    report = inspect(HAND_BUILT["full_f32"][:100])
    last = report.splitlines()[-1]
    assert last.startswith("ERROR: kv import: truncated payload: K of head 0") and "(at byte 76)" in last


def test_inspect_walks_a_cache_container():
    report = inspect(encode_cache([HAND_BUILT["bounded_f16"], HAND_BUILT["linear_f16flag"][:40]]))
    assert "2 layer(s)" in report and "Bounded record" in report
    assert report.splitlines()[-1].startswith("ERROR: layer blob 1 (at byte 180 of the container)")
    assert "cache container v2" in report


def test_inspect_names_a_container_blob_changed_in_transit():
    blob = bytearray(encode_cache([HAND_BUILT["full_f32"], HAND_BUILT["linear_f16flag"]]))
    blob[12 + 8 + 80] ^= 0x10   # a K payload byte of layer 0 (its record is still well formed)
    last = inspect(bytes(blob)).splitlines()[-1]
    assert last.startswith("ERROR: kv import: layer 0's blob (bytes 20..") and "fails its CRC-32" in last


def test_inspect_ends_a_sound_container_with_ok():
    assert inspect(encode_cache([HAND_BUILT["full_f32"]])).splitlines()[-1] == "OK: 1 layer blob(s)"


# ------------------------------------------------------------------- fuzz

SEEDS = [(HAND_BUILT[n], EXPECT[n]) for n in sorted(HAND_BUILT)] + [
    (encode_cache([HAND_BUILT["full_f32"], HAND_BUILT["linear_f16flag"]]), EXPECT["full_f32"])]
EDGE_U32 = [0, 1, 2, 3, 4, 7, 8, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFC, 0xFFFFFFFF]


@st.composite
def mutated(draw):
    blob, expect = draw(st.sampled_from(SEEDS))
    b = bytearray(blob)
    for _ in range(draw(st.integers(0, 4))):
        op = draw(st.sampled_from(["byte", "u32", "truncate", "extend"]))
        if op == "byte" and b:
            b[draw(st.integers(0, len(b) - 1))] = draw(st.integers(0, 255))
        elif op == "u32" and len(b) >= 4:
            at = draw(st.integers(0, (len(b) - 4) // 4)) * 4
            struct.pack_into("<I", b, at, draw(st.sampled_from(EDGE_U32)))
        elif op == "truncate":
            del b[draw(st.integers(0, len(b))):]
        elif op == "extend":
            b += draw(st.binary(max_size=16))
    return bytes(b), expect


def expect_for(blob, expect):
    # Follow the mutated header where it names a layer we could be, so the
    # body parser is reached far more often than a fixed Expect allows.
    if len(blob) < 32 or blob[:4] != b"CMFS" or blob[20] > 2:
        return expect
    ident, layer_no = struct.unpack_from("<QI", blob, 8)
    kind = WireKind(blob[20])
    window = expect.bounded_window or (3 if kind is WireKind.Bounded else None)
    return Expect(expect.num_kv_heads, expect.head_dim, ident, layer_no, kind, window)


def fuzzed_blob_raises_only_wire_error_and_allocates_little(case):
    blob, expect = case
    tracemalloc.start()
    try:
        assert isinstance(inspect(blob), str)
        accepted = []
        for e in (expect, expect_for(blob, expect)):
            try:
                accepted.append((decode_layer(blob, e), e))
            except WireError:
                pass
        try:
            decode_cache(blob)
        except WireError:
            pass
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # The blobs are under 300 bytes: no field may buy a large allocation.
    assert peak < 256 << 10, peak
    for got, e in accepted:  # whatever import accepts, export writes again
        if blob[:4] == b"CMFS":
            assert decode_layer(encode_layer(got, f16=bool(blob[21])), e).position == got.position


@settings(max_examples=500, deadline=None, database=None, derandomize=True,
          suppress_health_check=list(HealthCheck))
@given(mutated())
def test_fuzzed_blobs_raise_only_wire_error_and_allocate_little(case):
    fuzzed_blob_raises_only_wire_error_and_allocates_little(case)


@pytest.mark.long_fuzz
@settings(max_examples=100_000, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(mutated())
def test_long_fuzzed_blobs_raise_only_wire_error_and_allocate_little(case):
    fuzzed_blob_raises_only_wire_error_and_allocates_little(case)
