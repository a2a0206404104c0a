"""q4: rotated rows aging through float16, int8 and int4 tiers (kvreg.storage)."""

import struct
import zlib

import numpy as np
import pytest

from kvreg import KvMode, LayerKvCache, ShapeError, WireError
from kvreg.modes import Q4_INT8_ROWS, Q4_SINK_ROWS, Q4_WINDOW
from kvreg.quant import fwht, pack_int4, quantize_half_scaled, unpack_int4


def rows(n, nkv, hd, seed=0, scale=1.0):
    r = np.random.default_rng(seed)
    return (r.standard_normal((n, nkv, hd)) * scale).astype(np.float32)


def q4(nkv=2, hd=64):
    return LayerKvCache(nkv, hd, "q4", "reference")


@pytest.mark.parametrize("nkv, hd", [(3, 64), (1, 256)])
def test_bytes_per_element_at_2k_rows_stay_under_0_6(nkv, hd):
    c = q4(nkv, hd)
    k = rows(2048, nkv, hd)
    c.extend(k, k)
    assert c.memory_bytes() / (2 * nkv * hd * 2048) <= 0.6


def test_rows_age_through_the_tiers():
    c = q4()
    c.extend(rows(10, 2, 64), rows(10, 2, 64, 1))
    st = c.storage
    assert st.b4.tolist() == [0, 0] and st.b8.tolist() == [0, 0]     # all float16
    c.extend(rows(290, 2, 64, 2), rows(290, 2, 64, 3))
    assert st.b8.tolist() == [300 - Q4_WINDOW] * 2
    assert st.b4.tolist() == [300 - Q4_WINDOW - Q4_INT8_ROWS] * 2
    # a rollback takes the newest rows and leaves the older in their tier
    c.truncate_last(20)
    assert st.lens.tolist() == [280, 280] and st.b8.tolist() == [280, 280] and st.b4.tolist() == [172, 172]


def test_the_window_is_float16_of_the_rotated_row():
    c = q4(1, 64)
    k, v = rows(5, 1, 64), rows(5, 1, 64, 1)
    c.extend(k, v)
    st = c.storage
    assert np.array_equal(st.thk[0, :5], fwht(k[:, 0]).astype(np.float16))
    # the first rows are also exact, rotated float32
    assert np.array_equal(st.xk[0, :Q4_SINK_ROWS], fwht(k[:Q4_SINK_ROWS, 0]))


def test_int4_codes_round_half_away_with_the_stored_float16_scale():
    x = np.zeros((1, 32), np.float32)
    x[0, :6] = [7.0, 0.5, -0.5, 1.5, -2.5, 3.49]
    codes, s = quantize_half_scaled(x, 32, 7)
    assert s.dtype == np.float16 and float(s[0, 0]) == 1.0
    assert codes[0, :6].tolist() == [7, 1, -1, 2, -3, 3]
    c = np.array([[-8, -1, 0, 7, 3]], np.int8)
    packed = pack_int4(c)
    assert packed.tolist() == [[0xF8, 0x70, 0x03]] and np.array_equal(unpack_int4(packed, 5), c)


def test_attention_follows_f32_on_smooth_rows():
    # rows with a shared direction (as real keys): attention is close to f32's
    nkv, hd, n = 2, 64, 600
    base = rows(1, nkv, hd, 9)
    k = base + 0.3 * rows(n, nkv, hd, 1)
    v = rows(n, nkv, hd, 2)
    a, f = q4(nkv, hd), LayerKvCache(nkv, hd, "f32", "reference")
    a.extend(k, v)
    f.extend(k, v)
    q = rows(1, 8, hd, 3)[0]
    got, want = a.attend_layer(q), f.attend_layer(q)
    # int4 values of random V rows: about 16% of the output's peak here; a
    # basis mix-up (rows rotated, queries or outputs not) is ~100%.
    assert np.abs(got - want).max() < 0.3 * np.abs(want).max()
    assert np.corrcoef(got.ravel(), want.ravel())[0, 1] > 0.95


@pytest.mark.parametrize("bad", [np.nan, np.inf, 1e6])
def test_bad_rows_are_refused_before_anything_changes(bad):
    c = q4(1, 64)
    c.extend(rows(40, 1, 64), rows(40, 1, 64, 1))
    before = c.export_wire()
    k = rows(1, 1, 64, 2)
    k[0, 0, 3] = bad
    with pytest.raises(ShapeError):
        c.extend(k, k)
    assert c.export_wire() == before


def test_a_record_with_broken_tier_counters_is_refused():
    c = q4(1, 64)
    c.extend(rows(200, 1, 64), rows(200, 1, 64, 1))
    blob = bytearray(c.export_wire())
    # find the b8 counter block's payload (u8 name length, "b8") and make it
    # exceed the rows held
    at = blob.index(b"\x02b8")
    d = LayerKvCache(1, 64, "q4", "reference")
    d.import_wire(bytes(blob))        # sound as exported
    assert d.export_wire() == bytes(blob)
    good_b8 = struct.pack("<q", 200 - Q4_WINDOW)
    pos = blob.index(good_b8, at)
    blob[pos:pos + 8] = struct.pack("<q", 10_000)
    blob[-4:] = struct.pack("<I", zlib.crc32(blob[:-4]))   # an exporter's own fault: its CRC-32 matches
    e = LayerKvCache(1, 64, "q4", "reference")
    with pytest.raises(WireError, match="tier"):
        e.import_wire(bytes(blob))
    assert e.seq_len == 0 and e.mode is KvMode.Q4


def test_a_q8_record_whose_window_bound_is_out_of_range_is_refused():
    c = LayerKvCache(1, 64, "q8", "reference")
    c.extend(rows(200, 1, 64), rows(200, 1, 64, 1))
    blob = bytearray(c.export_wire())
    at = blob.index(b"\x02b8")
    pos = blob.index(struct.pack("<q", 200 - c.storage.window), at)
    blob[pos:pos + 8] = struct.pack("<q", 10_000)
    blob[-4:] = struct.pack("<I", zlib.crc32(blob[:-4]))   # an exporter's own fault: its CRC-32 matches
    d = LayerKvCache(1, 64, "q8", "reference")
    with pytest.raises(WireError, match="window"):
        d.import_wire(bytes(blob))
    assert d.seq_len == 0


def test_eviction_keeps_each_row_in_its_tier():
    c = q4(1, 64)
    k, v = rows(300, 1, 64), rows(300, 1, 64, 1)
    c.extend(k, v)
    before = [c.storage.attended_rows("k", 0, 0, 300)]
    c.evict(150)                      # keep the newest 150 rows
    after = c.storage.attended_rows("k", 0, 0, 150)
    assert np.array_equal(after[Q4_SINK_ROWS:], before[0][150 + Q4_SINK_ROWS:]) or \
        np.array_equal(after, before[0][150:])


@pytest.mark.parametrize("mode", ["q8", "q8k", "q4"])
def test_a_prefill_chunk_attends_its_own_rows_as_handed_over(mode):
    nkv, hd, s0, b = 2, 64, 150, 40
    k, v = rows(s0 + b, nkv, hd, 5), rows(s0 + b, nkv, hd, 6)
    c = LayerKvCache(nkv, hd, mode, "reference")
    c.extend(k[:s0], v[:s0])
    c.extend(k[s0:], v[s0:])
    # what the older rows hold, back in the caller's basis
    st = c.storage

    def back(side, x):
        return fwht(x) if getattr(st, "rot_" + side) else x

    old_k = np.stack([back("k", st.attended_rows("k", h, 0, s0)) for h in range(nkv)], 1)
    old_v = np.stack([back("v", st.attended_rows("v", h, 0, s0)) for h in range(nkv)], 1)
    f = LayerKvCache(nkv, hd, "f32", "reference")
    f.extend(np.concatenate([old_k, k[s0:]]), np.concatenate([old_v, v[s0:]]))
    q = rows(b, 3 * nkv, hd, 7)
    got = c.attend_chunk(q, b, s0, 3)
    want = f.attend_chunk(q, b, s0, 3)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    # once the layer changed, the chunk reads the stored forms again
    c.truncate_last(1)
    c.append(k[-1], v[-1])
    stale = c.attend_chunk(q, b, s0, 3)
    assert np.abs(stale - want).max() > 1e-4


@pytest.mark.parametrize("mode", ["q8", "q4"])
def test_equal_layers_export_equal_bytes_whatever_their_history(mode):
    # a rollback, an eviction and a clear leave no stale bytes behind: the
    # layer then exports what a layer built directly from its rows exports
    nkv, hd = 2, 64
    k, v = rows(300, nkv, hd, 11), rows(300, nkv, hd, 12)
    a = LayerKvCache(nkv, hd, mode, "reference")
    a.extend(k[:250], v[:250])
    a.clear()
    a.extend(k[:200], v[:200])
    a.truncate_last(60)
    b = LayerKvCache(nkv, hd, mode, "reference")
    b.extend(k[:200], v[:200])
    b.truncate_last(60)
    assert a.export_wire() == b.export_wire()
    a.append(k[200], v[200])
    b.append(k[200], v[200])
    assert a.export_wire() == b.export_wire()


def _fwht_per_row(x):
    """The butterflies row by row, in fwht's stage order (an independent oracle)."""
    out = np.array(x, dtype=np.float32).reshape(-1, x.shape[-1])
    hd = out.shape[1]
    for row in out:
        h = 1
        while h < hd:
            for i in range(0, hd, 2 * h):
                a, b = row[i:i + h].copy(), row[i + h:i + 2 * h].copy()
                row[i:i + h], row[i + h:i + 2 * h] = a + b, a - b
            h *= 2
    return (out * np.float32(1.0 / np.sqrt(hd))).reshape(x.shape)


def test_fwht_answers_fresh_arrays_with_the_per_row_bits_from_any_thread():
    # fwht keeps per-thread buffers for small shapes: an answer must never be
    # one of them (a later call would overwrite it), nor another thread's.
    import threading

    rng = np.random.default_rng(3)
    xs = [rng.standard_normal(s).astype(np.float32) for s in ((8, 128), (2, 8, 128), (8, 128), (5, 64), (300, 256))]
    outs = [fwht(x) for x in xs]
    for x, out in zip(xs, outs):
        assert out.shape == x.shape
        assert np.array_equal(out.view(np.uint32), _fwht_per_row(x).view(np.uint32))
    seen = []

    def other():
        seen.append(fwht(xs[0] * 2))

    t = threading.Thread(target=other)
    t.start()
    t.join()
    assert np.array_equal(outs[0], _fwht_per_row(xs[0])) and np.array_equal(seen[0], _fwht_per_row(xs[0] * 2))
