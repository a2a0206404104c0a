"""The seed's wire tests at the layer level, plus kvreg's stronger guarantees."""

import struct

import numpy as np
import pytest

from kvreg import KvCache, KvMode, LayerKvCache, WireError, WireKind, WIRE_MAGIC
from kvreg.bounded import BoundedRope, BoundedWeights


def layer(nkv, hd, mode=KvMode.F32):
    return LayerKvCache(nkv, hd, mode, "reference")


def swa_row(p, n, salt):
    i = np.arange(n)
    return (((p * 7919 + i * 104_729 + salt * 1_299_709) % 2003) / 1001.5 - 1.0).astype(np.float32)


def bits(a):
    return np.asarray(a, np.float32).view(np.uint32)


def snapshot(c):
    """Everything a refused import must leave as it was."""
    st = c.storage
    return (c.seq_len, c.base, c.generation, c.mode, st.lens.copy(), c.imp.copy(), c.linear_state.copy(),
            None if c.sinks is None else c.sinks.copy(),
            [c.head_keys(h).copy() for h in range(c.num_kv_heads)],
            [c.head_values(h).copy() for h in range(c.num_kv_heads)])


def same(a, b):
    for x, y in zip(a, b):
        if isinstance(x, list):
            assert all(np.array_equal(u, w) for u, w in zip(x, y))
        elif isinstance(x, np.ndarray):
            assert np.array_equal(x, y)
        else:
            assert x == y


def test_wire_round_trip_reproduces_attention():
    heads, hd = 2, 4
    a = layer(heads, hd)
    i = np.arange(heads * hd)
    for p in range(5):
        a.append(((p * 10 + i) * 0.031).astype(np.float32), ((p * 7 + i) * -0.017).astype(np.float32))
    a.linear_state = np.array([0.5, -0.25, 1.0], np.float32)
    q = (0.1 * (np.arange(hd) + 1.0)).astype(np.float32)
    blob = a.export_wire(False)
    b = layer(heads, hd)
    b.linear_scratch = np.full(3, 9.0, np.float32)
    b.import_wire(blob)
    assert b.linear_scratch.size == 0, "import must discard tentative state"
    assert b.seq_len == a.seq_len
    assert np.array_equal(b.linear_state, a.linear_state)
    for h in range(heads):
        oa, sa = a.attend(q, h)
        ob, sb = b.attend(q, h)
        assert np.array_equal(bits(oa), bits(ob)), f"head {h} attention output diverged"
        assert np.array_equal(bits(sa), bits(sb)), f"head {h} attention scores diverged"


def test_wire_refuses_what_it_cannot_describe():
    c = layer(1, 4, KvMode.Q8)
    with pytest.raises(WireError, match="F32"):
        c.export_wire(False)


def test_wire_refuses_an_o1_overlay():
    c = layer(1, 4)
    c.o1_begin(4, 8, 2)
    with pytest.raises(WireError, match="O\\(1\\)"):
        c.export_wire(False)


def test_wire_refuses_unversioned_delta_state():
    c = layer(1, 4)
    c.set_linear_wire_allowed(False)
    blob = c.export_wire(False)
    assert blob[:4] == WIRE_MAGIC
    with pytest.raises(WireError, match="operator identity"):
        c.import_wire(bytes(4))


def test_wire_v2_round_trips_linear_records():
    a = layer(1, 4)
    a.wire_kind = WireKind.Linear
    a.wire_identity = 0xC0FFEE
    a.linear_state = np.array([0.5, -0.25, 1.0, 3.5], np.float32)
    a.seq_len = 9
    blob = a.export_wire(True)
    b = layer(1, 4)
    b.wire_kind = WireKind.Linear
    b.wire_identity = 0xC0FFEE
    b.import_wire(blob)
    assert np.array_equal(b.linear_state, a.linear_state)
    assert b.seq_len == 9
    c = layer(1, 4)
    c.wire_kind = WireKind.Linear
    with pytest.raises(WireError, match="operator identity"):
        c.import_wire(blob)


@pytest.mark.parametrize("f16", [False, True])
def test_wire_v2_round_trips_bounded_records(f16):
    kvh, hd, w = 2, 4, 8
    a = layer(kvh, hd)
    a.install_bounded(w)
    k = (np.arange(kvh * hd) * 0.125).astype(np.float32)
    for p in range(11):
        a.bounded.insert(k, k)
        a.seq_len = p + 1
    blob = a.export_wire(f16)
    b = layer(kvh, hd)
    b.install_bounded(w)
    b.import_wire(blob)
    assert b.bounded.seen == 11
    assert b.seq_len == 11
    # 0.125 multiples are exact in f16, so both dtypes round-trip bit for bit.
    assert a.bounded.same_state(b.bounded)
    assert b.bounded.rollback(1) == 0, "the undo rows describe inserts this side never made"
    c = layer(kvh, hd)
    c.install_bounded(w * 2)
    with pytest.raises(WireError):
        c.import_wire(blob)


def test_wire_import_checks_geometry():
    blob = layer(2, 4).export_wire(False)
    with pytest.raises(WireError, match="2×4"):
        layer(2, 8).import_wire(blob)


def test_sinks_survive_clear_and_wire_import():
    c = layer(1, 4)
    c.sinks = [0.5, -0.5]
    c.append(np.ones(4, np.float32), np.full(4, 2.0, np.float32))
    wire = c.export_wire(False)
    c.clear()
    assert c.sinks.tolist() == [0.5, -0.5]
    c.import_wire(wire)
    assert c.sinks.tolist() == [0.5, -0.5]
    assert c.seq_len == 1


def test_wire_full_tail_roundtrip():
    nkv, hd, w = 2, 4, 6
    a = layer(nkv, hd)
    for p in range(5):
        a.append(swa_row(p, nkv * hd, 1), swa_row(p, nkv * hd, 2))
    plain = a.export_wire(False)
    assert plain[20] == WireKind.Full, "untrimmed stays Full"
    assert struct.unpack_from("<Q", plain, 24)[0] == 5
    for p in range(5, 40):
        a.append(swa_row(p, nkv * hd, 1), swa_row(p, nkv * hd, 2))
        a.trim_window(w, 2, 4)
    assert a.base > 0
    for f16 in (False, True):
        blob = a.export_wire(f16)
        assert blob[20] == WireKind.FullTail
        assert struct.unpack_from("<Q", blob, 24)[0] == 40
        b = layer(nkv, hd)
        b.import_wire(blob)
        assert (b.base, b.seq_len, b.pos_len) == (a.base, a.seq_len, 40)
        if not f16:
            q = swa_row(99, 2 * hd, 3)
            for g in range(nkv):
                n = a.head_len(g)
                oa = a.attend_group(q, g, scale=0.5, first=n - w)
                ob = b.attend_group(q, g, scale=0.5, first=n - w)
                assert np.array_equal(bits(oa), bits(ob))
            b.import_wire(plain)
            assert (b.base, b.pos_len) == (0, 5)
    bad = bytearray(a.export_wire(False))
    bad[24:32] = struct.pack("<Q", 41)
    with pytest.raises(WireError):
        layer(nkv, hd).import_wire(bytes(bad))
    r = layer(nkv, hd)
    r.install_bounded(8)
    with pytest.raises(WireError, match="does not match"):
        r.import_wire(a.export_wire(False))


def _busy_layer():
    c = layer(2, 4)
    for p in range(6):
        c.append(swa_row(p, 8, 1), swa_row(p, 8, 2))
    c.accumulate_imp(np.arange(6, dtype=np.float32))
    c.linear_state = np.array([1.0, 2.0], np.float32)
    c.sinks = [0.1, 0.2, 0.3, 0.4]
    return c


@pytest.mark.parametrize("mutate", [
    lambda b: b[:-1],                                   # truncated payload
    lambda b: b + b"\0",                                # trailing byte
    lambda b: b[:20],                                   # truncated header
    lambda b: b[:4] + struct.pack("<I", 3) + b[8:],     # version
    lambda b: b[:16] + struct.pack("<I", 7) + b[20:],   # layer
    lambda b: b[:20] + bytes([9]) + b[21:],             # unknown kind
    lambda b: b[:24] + struct.pack("<Q", 99) + b[32:],  # position vs rows
])
def test_a_refused_import_leaves_the_layer_exactly_as_it_was(mutate):
    blob = layer(2, 4)
    for p in range(3):
        blob.append(swa_row(p, 8, 5), swa_row(p, 8, 6))
    bad = mutate(blob.export_wire(False))
    c = _busy_layer()
    before = snapshot(c)
    with pytest.raises(WireError):
        c.import_wire(bad)
    same(before, snapshot(c))


def test_a_huge_count_fails_at_once_without_allocating():
    # A Full body that claims 4G elements per head: refused from the lengths
    # alone (the importer never allocates more than the buffer could hold).
    hdr = WIRE_MAGIC + struct.pack("<IQIBBHQ", 2, 0, 0, 0, 0, 0, 1)
    body = struct.pack("<6I", 0, 1, 1, 4, 0, 0) + struct.pack("<I", 0xFFFF_FFFC)
    blob = (hdr + body).ljust(64, b"\0")
    with pytest.raises(WireError, match="truncated"):
        layer(1, 4).import_wire(blob)


def test_import_resets_a_q8_layer_to_f32_storage_as_the_seed_does():
    src = layer(1, 4)
    src.append(np.ones(4, np.float32), np.ones(4, np.float32))
    dst = layer(1, 4, KvMode.Q8)
    dst.import_wire(src.export_wire())
    assert dst.mode is KvMode.F32
    assert np.array_equal(dst.head_keys(0), src.head_keys(0))


def test_cache_container_round_trips_every_layer():
    a = KvCache(3, 2, 4, 64, mode="f32", backend="reference")
    for p in range(7):
        for lay in a.layers:
            lay.append(swa_row(p + lay.wire_layer, 8, 1), swa_row(p, 8, 2))
    b = KvCache(3, 2, 4, 64, mode="f32", backend="reference")
    b.import_wire(a.export_wire())
    for la, lb in zip(a.layers, b.layers):
        assert np.array_equal(la.head_keys(1), lb.head_keys(1))
        assert lb.seq_len == 7


def test_cache_import_with_one_bad_layer_changes_no_layer():
    a = KvCache(2, 1, 4, 64, mode="f32", backend="reference")
    for lay in a.layers:
        lay.append(np.ones(4, np.float32), np.ones(4, np.float32))
    blob = a.export_wire()
    b = KvCache(2, 1, 4, 64, mode="f32", backend="reference")
    b.layers[1].wire_identity = 42   # layer 1 refuses the record
    b.layers[0].append(np.full(4, 3.0, np.float32), np.ones(4, np.float32))
    with pytest.raises(WireError, match="operator identity"):
        b.import_wire(blob)
    assert b.layers[0].seq_len == 1 and b.layers[0].head_keys(0)[0, 0] == 3.0


def test_bounded_layer_steps_and_rolls_back_through_truncate_last():
    kvh, hd, w = 2, 4, 4
    c = layer(kvh, hd)
    c.install_bounded(w, undo_depth=2)
    weights = BoundedWeights(np.zeros((kvh, 1, hd), np.float32), np.zeros((kvh, 1, hd), np.float32), 1, [w, 2])
    rope = BoundedRope(10000.0, hd)
    for p in range(6):
        out = c.bounded_step(swa_row(p, 4 * hd, 1), swa_row(p, kvh * hd, 2), swa_row(p, kvh * hd, 3),
                             weights, rope, 0.5, 4)
        assert out.shape == (4, hd)
    assert c.seq_len == 6
    mem = c.memory_bytes()
    with pytest.warns(UserWarning, match="undo depth"):
        c.truncate_last(3)
    assert c.seq_len == c.bounded.seen == 4
    assert c.memory_bytes() == mem, "a ring stores nothing per position"


def test_bounded_state_bytes_constant_in_tokens():
    kvh, hd, w = 1, 4, 16
    c = layer(kvh, hd)
    c.install_bounded(w)
    weights = BoundedWeights(np.zeros((kvh, 0, hd), np.float32), np.zeros((kvh, 0, hd), np.float32), 0, [w])
    rope = BoundedRope(10000.0, hd)
    sizes = set()
    for p in range(10_000):
        if p in (1, 100, 9_999):
            sizes.add(c.bounded_state_bytes())
        c.bounded.insert(swa_row(p, hd, 1), swa_row(p, hd, 2))
    c.bounded_step(swa_row(0, hd, 1), swa_row(0, hd, 1), swa_row(0, hd, 1), weights, rope, 0.5, 1)
    sizes.add(c.bounded_state_bytes())
    assert len(sizes) == 1


def test_bounded_step_refused_leaves_the_ring_unchanged():
    kvh, hd, w = 2, 4, 4
    c = layer(kvh, hd)
    c.install_bounded(w)
    weights = BoundedWeights(np.zeros((kvh, 0, hd), np.float32), np.zeros((kvh, 0, hd), np.float32), 0, [w, w])
    with pytest.raises(Exception, match="multiple"):   # 3 Q heads over 2 KV groups
        c.bounded_step(np.ones(3 * hd), np.ones(kvh * hd), np.ones(kvh * hd), weights,
                       BoundedRope(10000.0, hd), 0.5, 3)
    assert c.seq_len == 0 and c.bounded.seen == 0
    assert not c.bounded.ring_k.any()
