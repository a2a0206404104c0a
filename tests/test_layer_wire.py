"""kvreg's wire guarantees beyond the Rust engine's (its own wire tests run in
kvreg_conformance/test_reference_semantics.py)."""

import struct

import numpy as np
import pytest

from kvreg import WIRE_MAGIC, KvCache, KvMode, LayerKvCache, WireError
from kvreg.bounded import BoundedRope, BoundedWeights


def layer(nkv, hd, mode=KvMode.F32):
    return LayerKvCache(nkv, hd, mode, "reference")


def pseudo_random_row(p, n, salt):
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


def test_wire_refuses_an_o1_overlay():
    c = layer(1, 4)
    c.o1_begin(4, 8, 2, far="nystrom")
    with pytest.raises(WireError, match="O\\(1\\)"):
        c.export_wire(False)


def _busy_layer():
    c = layer(2, 4)
    for p in range(6):
        c.append(pseudo_random_row(p, 8, 1), pseudo_random_row(p, 8, 2))
    c.accumulate_imp(np.arange(6, dtype=np.float32))
    c.linear_state = np.array([1.0, 2.0], np.float32)
    c.sinks = [0.1, 0.2, 0.3, 0.4]
    return c


@pytest.mark.parametrize("mutate", [
    lambda b: b[:-1],                                   # truncated payload
    lambda b: b + b"\0",                                # trailing byte
    lambda b: b[:20],                                   # truncated header
    lambda b: b[:4] + struct.pack("<I", 4) + b[8:],     # version
    lambda b: b[:4] + struct.pack("<I", 3) + b[8:],     # a v2 body read as v3
    lambda b: b[:16] + struct.pack("<I", 7) + b[20:],   # layer
    lambda b: b[:20] + bytes([9]) + b[21:],             # unknown kind
    lambda b: b[:24] + struct.pack("<Q", 99) + b[32:],  # position vs rows
])
def test_a_refused_import_leaves_the_layer_exactly_as_it_was(mutate):
    blob = layer(2, 4)
    for p in range(3):
        blob.append(pseudo_random_row(p, 8, 5), pseudo_random_row(p, 8, 6))
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


def test_an_f32_record_into_a_q8_layer_keeps_its_mode_and_stores_the_rows_as_append_does():
    # The seed replaced a q8 layer's storage by F32 (4x the memory, silently);
    # the mode policy (docs/wire.md) keeps the layer's mode.
    src = layer(1, 4)
    src.append(np.ones(4, np.float32), np.ones(4, np.float32))
    dst = layer(1, 4, KvMode.Q8)
    dst.import_wire(src.export_wire())
    want = layer(1, 4, KvMode.Q8)
    want.append(np.ones(4, np.float32), np.ones(4, np.float32))
    assert dst.mode is KvMode.Q8
    assert dst.export_wire() == want.export_wire()


def test_cache_container_round_trips_every_layer():
    a = KvCache(3, 2, 4, 64, mode="f32", backend="reference")
    for p in range(7):
        for lay in a.layers:
            lay.append(pseudo_random_row(p + lay.wire_layer, 8, 1), pseudo_random_row(p, 8, 2))
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
        out = c.bounded_step(pseudo_random_row(p, 4 * hd, 1), pseudo_random_row(p, kvh * hd, 2),
                             pseudo_random_row(p, kvh * hd, 3), weights, rope, 0.5, 4)
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
        c.bounded.insert(pseudo_random_row(p, hd, 1), pseudo_random_row(p, hd, 2))
    row = pseudo_random_row(0, hd, 1)
    c.bounded_step(row, row, row, weights, rope, 0.5, 1)
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
