"""The exact class: bit for bit against the NumPy reference on every backend.

``quantize_rows`` (ties, NaN, short last groups, fields), ``rotate_rows``
(the Walsh-Hadamard transform of the rotated modes), the storage after
every mutation in every KV mode, and the wire bytes (f32 and f16).
"""

import struct

import numpy as np
import pytest

from kvreg import KV_K_GROUP, KvMode, LayerKvCache
from kvreg.quant import fwht
from kvreg.quant import quantize_rows as quantize_rows_spec

from .checks import assert_same_storage
from .data import ALL_MODES, f32, rng_rows

MODE_IDS = [m.value for m in ALL_MODES]


def _quantize_both(backend, check, x, col, group, what):
    got_q, got_s = backend.quantize_rows(x.copy(), None if col is None else col.copy(), group=group)
    want_q, want_s = quantize_rows_spec(x, col, group)
    check.exact("quantize_rows", np.asarray(got_q), want_q, f"{what}: int8 rows")
    check.exact("quantize_rows", np.asarray(got_s), want_s, f"{what}: scales")


@pytest.mark.quick
@pytest.mark.parametrize("group", [KV_K_GROUP, 64], ids=["g32", "g64"])
def test_quantize_rows_rounds_ties_away_from_zero(backend, check, group):
    # absmax 127 makes the scale exactly 1, so x/s lands on the .5 ties.
    ties = f32([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5, 3.5, -3.5, 0.49999997, -0.49999997,
                63.5, -63.5, 0.0, -0.0, 100.5, -100.5, 7.5])
    x = np.zeros((2, 64), np.float32)
    x[0, : ties.size] = ties
    x[1, : ties.size] = -ties
    _quantize_both(backend, check, x, None, group, "half-way values")


@pytest.mark.quick
def test_quantize_rows_maps_nan_to_zero_and_ignores_it_in_the_scale(backend, check):
    x = rng_rows(3, 4, 40)
    x[0, 3] = np.nan
    x[1, :32] = np.nan                      # a whole group of NaN: the scale floor
    x[2, 35] = np.nan                       # in the short last group
    _quantize_both(backend, check, x, None, KV_K_GROUP, "NaN inputs")


@pytest.mark.parametrize("hd", [1, 5, 31, 33, 64, 100, 128])
@pytest.mark.parametrize("field", ["none", "shared", "per_row"])
def test_quantize_rows_matches_the_spec(backend, check, hd, field):
    n = 37
    x = rng_rows(hd, n, hd, 3.0)
    x[0] = 0.0                               # the scale floor 1e-12
    x[1] *= 1e-30                            # tiny values: the floor again, huge quotients clamp
    x[2, 0] = -0.0
    col = None
    if field == "shared":
        col = np.abs(rng_rows(hd + 1, 1, hd))[0] + np.float32(0.01)
    elif field == "per_row":
        col = np.abs(rng_rows(hd + 2, n, hd)) + np.float32(0.01)
    for group in (KV_K_GROUP, hd):
        _quantize_both(backend, check, x, col, group, f"hd {hd}, field {field}, group {group}")


def _bf16_spec(x: float) -> int:
    """bfloat16 bits of a float32 value, round to nearest, ties to even,
    written on Python ints (an oracle independent of kvreg.quant)."""
    b = struct.unpack("<I", struct.pack("<f", x))[0]
    if x != x:
        return (b >> 16) | 0x40
    hi, lo = b >> 16, b & 0xFFFF
    return (hi + (lo > 0x8000 or (lo == 0x8000 and hi & 1))) & 0xFFFF


def _f16_spec(x: float) -> int:
    """binary16 bits (struct's 'e' rounds to nearest even; past 65520 it is inf)."""
    if x != x:
        return struct.unpack("<H", struct.pack("<e", x))[0]
    try:
        return struct.unpack("<H", struct.pack("<e", x))[0]
    except OverflowError:
        return 0x7C00 | (0x8000 if x < 0 else 0)


@pytest.mark.quick
@pytest.mark.parametrize("mode", [KvMode.F16, KvMode.BF16], ids=["f16", "bf16"])
def test_two_byte_storage_rounds_to_nearest_even(backend, check, mode):
    # ties of each format (the kept half's last bit odd and even), subnormals
    # of both, the largest finite values, signed zeros, inf; NaN keeps a NaN.
    specials = [1.0 + 2.0 ** -8, 1.0 + 3 * 2.0 ** -8, 1.0 + 2.0 ** -11, 1.0 + 3 * 2.0 ** -11, 2.0 ** -24,
                3 * 2.0 ** -25, 1e-40, -1e-40, 65504.0, 65519.0, -65519.0, 3.3895e38, 0.0, -0.0,
                float("inf"), float("-inf"), 1.1754942e-38, 2.0 ** -149]
    x = np.concatenate([f32(specials), rng_rows(7, 1, 300, 50.0)[0]])
    if mode is KvMode.F16:
        x = x[np.isinf(x) | (np.abs(x) < 65520)]
    width = 4
    x = np.concatenate([x, np.zeros(-x.size % (2 * width), np.float32)]).reshape(-1, 2, width)
    lay = LayerKvCache(2, width, mode, backend)
    lay.extend(x, -x)
    spec = _f16_spec if mode is KvMode.F16 else _bf16_spec
    st = lay.storage
    for name, sign in (("k", 1), ("v", -1)):
        got = getattr(st, name)[:, : x.shape[0]].view(np.uint16)
        want = np.array([[[spec(float(sign * e)) for e in row] for row in x[:, h]] for h in range(2)], np.uint16)
        check.exact("round_half", got, want, f"{mode.value} {name} bits")
    nan_row = np.full((1, 2, width), np.nan, np.float32)
    lay.extend(nan_row, nan_row)
    check.exact("round_half", np.isnan(lay.head_keys(0)[-1]), np.ones(width, bool), f"{mode.value} NaN stays NaN")


def _twins(backend, ref, nkv, hd, mode):
    return LayerKvCache(nkv, hd, mode, backend), LayerKvCache(nkv, hd, mode, ref)


def _append_both(a, b, rows, seed, alive=None):
    nkv, hd = a.num_kv_heads, a.head_dim
    k = rng_rows(seed, rows, nkv * hd) * np.where(np.arange(nkv * hd) % 3 == 0, 4.0, 0.5).astype(np.float32)
    v = rng_rows(seed + 7, rows, nkv * hd)
    for p in range(rows):
        a.append(k[p], v[p], alive)
        b.append(k[p], v[p], alive)


@pytest.mark.quick
@pytest.mark.parametrize("mode", ALL_MODES, ids=MODE_IDS)
@pytest.mark.parametrize("hd", [16, 40])
def test_storage_after_append_across_the_freeze(backend, ref, check, mode, hd):
    a, b = _twins(backend, ref, 3, hd, mode)
    _append_both(a, b, 63, 1, [True, False, True])
    assert_same_storage(check, a, b, "quantize_rows", f"{mode.value}: 63 rows, before the freeze")
    _append_both(a, b, 10, 2, [True, False, True])
    assert_same_storage(check, a, b, "quantize_rows", f"{mode.value}: 73 rows, field frozen and requantized")


@pytest.mark.quick
@pytest.mark.parametrize("mode", ALL_MODES, ids=MODE_IDS)
def test_extend_stores_what_row_by_row_appends_store(backend, ref, check, mode):
    # A prefill chunk in one call, across the q8 freeze, against the
    # reference appending the same rows one by one.
    a, b = _twins(backend, ref, 3, 40, mode)
    rows_k, rows_v = rng_rows(9, 100, 3 * 40), rng_rows(10, 100, 3 * 40)
    alive = np.array([True, False, True])
    a.extend(rows_k[:50], rows_v[:50], alive)
    a.extend(rows_k[50:], rows_v[50:], alive)
    for p in range(100):
        b.append(rows_k[p], rows_v[p], alive)
    assert_same_storage(check, a, b, "quantize_rows", f"{mode.value}: extend 50 + 50 vs 100 appends")


@pytest.mark.parametrize("mode", ALL_MODES, ids=MODE_IDS)
def test_storage_after_truncate_then_append(backend, ref, check, mode):
    a, b = _twins(backend, ref, 2, 16, mode)
    _append_both(a, b, 70, 3)
    for d, seed in ((3, 4), (1, 5), (10, 6)):
        a.truncate_last(d)
        b.truncate_last(d)
        assert_same_storage(check, a, b, "truncate_last", f"{mode.value}: truncate {d}")
        _append_both(a, b, d + 1, seed)
        assert_same_storage(check, a, b, "append", f"{mode.value}: append after truncate {d}")


@pytest.mark.parametrize("mode", ALL_MODES, ids=MODE_IDS)
def test_storage_after_trim_window(backend, ref, check, mode):
    a, b = _twins(backend, ref, 2, 16, mode)
    dropped = 0
    for rnd in range(12):
        _append_both(a, b, 9, 10 + rnd, [True, rnd % 3 != 0])
        da, db = a.trim_window(20, 3, 4), b.trim_window(20, 3, 4)
        check.equal("trim_window", da, db, f"{mode.value}: rows dropped, round {rnd}")
        dropped += da
        assert_same_storage(check, a, b, "trim_window", f"{mode.value}: round {rnd}")
    assert dropped > 0


@pytest.mark.parametrize("mode", ALL_MODES, ids=MODE_IDS)
def test_storage_after_evict(backend, ref, check, mode):
    a, b = _twins(backend, ref, 2, 16, mode)
    _append_both(a, b, 80, 20, [True, False])
    _append_both(a, b, 5, 21)
    a.evict(50)
    b.evict(50)
    assert_same_storage(check, a, b, "evict", f"{mode.value}: keep 50 of 85")


@pytest.mark.quick
@pytest.mark.parametrize("mode", ALL_MODES, ids=MODE_IDS)
def test_storage_after_evict_born_gathers_every_block(backend, ref, check, mode):
    a, b = _twins(backend, ref, 2, 16, mode)
    _append_both(a, b, 80, 30, [True, False])
    _append_both(a, b, 10, 31)
    mass = np.abs(rng_rows(32, 1, 90))[0]
    mass[[5, 17, 40, 41, 77]] += 10.0
    a.accumulate_imp(mass)
    b.accumulate_imp(mass)
    a.evict_born(30, 4, 8)
    b.evict_born(30, 4, 8)
    assert_same_storage(check, a, b, "gather_rows", f"{mode.value}: evict_born keep 30 (sink 4, recent 8)")


@pytest.mark.quick
def test_gather_rows_matches_numpy_indexing(backend, check):
    rows = rng_rows(40, 50, 24)
    for idx in (np.arange(50), np.array([0]), np.array([3, 4, 9, 30, 49]), np.array([], dtype=np.int64)):
        check.exact("gather_rows", np.asarray(backend.gather_rows(rows, idx)), rows[idx], f"idx {idx.tolist()}")


@pytest.mark.quick
@pytest.mark.parametrize("hd", [2, 4, 8, 16, 64, 128, 256])
def test_rotate_rows_gives_the_walsh_hadamard_bits_of_the_reference(backend, check, hd):
    rows = rng_rows(41, 7, hd) * f32(3.0)
    rows[1, : min(hd, 6)] = f32([np.inf, -np.inf, np.nan, -0.0, 1e-45, 3e38][: min(hd, 6)])
    rows[2] = 0.0
    rows[3, 0] = f32(3.4e38)                       # overflows to inf in the butterflies
    for x, what in ((rows, "rows [7, hd]"), (rows[::2], "every other row (a strided view)"),
                    (np.stack((rows, -rows)), "stacked [2, 7, hd]"), (rows[:0], "no rows")):
        check.exact("rotate_rows", np.asarray(backend.rotate_rows(x)), fwht(x), f"hd {hd}, {what}")


@pytest.mark.parametrize("f16", [False, True], ids=["f32", "f16"])
@pytest.mark.parametrize("trimmed", [False, True], ids=["full", "tail"])
def test_wire_bytes_equal_the_reference(backend, ref, check, f16, trimmed):
    a, b = _twins(backend, ref, 2, 12, KvMode.F32)
    _append_both(a, b, 50, 50, [True, False])
    # f16 rounding edge cases travel too: halfway, overflow, subnormal, NaN, -0.
    special = f32([1.0 + 2.0 ** -11, 65520.0, -70000.0, 2.0 ** -25, 6e-8, np.nan, -0.0, 1.0 - 2.0 ** -12] * 3)
    a.append(special, special)
    b.append(special, special)
    a.accumulate_imp(np.linspace(0, 1, 51, dtype=np.float32))
    b.accumulate_imp(np.linspace(0, 1, 51, dtype=np.float32))
    if trimmed:
        assert a.trim_window(8, 2, 4) == b.trim_window(8, 2, 4) > 0
    ba, bb = a.export_wire(f16), b.export_wire(f16)
    check.exact("wire", np.frombuffer(ba, np.uint8), np.frombuffer(bb, np.uint8),
                f"export_wire(f16={f16}) bytes, {'trimmed' if trimmed else 'untrimmed'}")
