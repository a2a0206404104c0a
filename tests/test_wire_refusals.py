"""Wire refusals are WireErrors raised before any layer changes, for whole
caches as for layers."""

import struct

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from kvreg import KvCache, KvMode, LayerKvCache, WireError, WireKind
from kvreg.bounded import BoundedRope, BoundedWeights
from kvreg.wire import LayerState, decode_cache, encode_cache, encode_full_body

NKV, HD, W = 2, 4, 4


def make_cache(seed, rows=6, inserts=5):
    """Three layers: Full, Bounded (ring of W), Full; filled from ``seed``."""
    rng = np.random.default_rng(seed)
    c = KvCache(3, NKV, HD, 1024, mode=KvMode.F32, backend="reference")
    c.layers[1].install_bounded(W)
    for i in (0, 2):
        for _ in range(rows):
            c.layers[i].append(rng.standard_normal(NKV * HD).astype(np.float32),
                               rng.standard_normal(NKV * HD).astype(np.float32))
        c.layers[i].accumulate_imp(rng.random(rows).astype(np.float32))
    ring = c.layers[1]
    for _ in range(inserts):
        ring.bounded.insert(rng.standard_normal(NKV * HD).astype(np.float32),
                            rng.standard_normal(NKV * HD).astype(np.float32))
    ring.seq_len = ring.bounded.seen
    return c


def fingerprint(c):
    return (c.export_wire(), [(layer.seq_len, layer.base, layer.generation) for layer in c.layers])


def ring_payload_offset(blob):
    """Byte offset of the ring K payload in a Bounded layer blob."""
    return 32 + 20


def patch_bounded_blob(blob, fn):
    parts = decode_cache(blob)
    parts[1] = fn(bytearray(parts[1]))
    return encode_cache(parts)


def test_cache_import_with_a_nan_ring_after_good_layers_changes_nothing():
    src, dst = make_cache(1), make_cache(2)

    def poison(b):
        struct.pack_into("<f", b, ring_payload_offset(b) + 4 * 5, float("nan"))
        return bytes(b)

    blob = patch_bounded_blob(src.export_wire(), poison)
    before = fingerprint(dst)
    with pytest.raises(WireError, match="inf/NaN"):
        dst.import_wire(blob)
    assert fingerprint(dst) == before


def test_cache_import_with_a_bad_last_record_changes_nothing():
    src, dst = make_cache(1), make_cache(2)
    parts = decode_cache(src.export_wire())
    parts[2] = parts[2][:-1]   # truncated last layer
    before = fingerprint(dst)
    with pytest.raises(WireError):
        dst.import_wire(encode_cache(parts))
    assert fingerprint(dst) == before


def test_layer_import_of_a_nan_ring_is_a_wire_error_and_changes_nothing():
    src, dst = make_cache(1), make_cache(2)
    blob = bytearray(src.layers[1].export_wire())
    struct.pack_into("<f", blob, ring_payload_offset(blob), float("inf"))
    before = fingerprint(dst)
    with pytest.raises(WireError, match="inf/NaN"):
        dst.layers[1].import_wire(bytes(blob))
    assert fingerprint(dst) == before


def test_f16_export_of_a_ring_value_above_65504_is_refused():
    c = make_cache(1)
    c.layers[1].bounded.ring_v[1, 2, 3] = 70000.0
    with pytest.raises(WireError, match="65504"):
        c.layers[1].export_wire(True)
    with pytest.raises(WireError, match="65504"):
        c.export_wire(True)
    # f32 carries it, and 65504 itself fits f16
    c.layers[1].export_wire(False)
    c.layers[1].bounded.ring_v[1, 2, 3] = 65504.0
    d = make_cache(2)
    d.layers[1].import_wire(c.layers[1].export_wire(True))
    assert d.layers[1].bounded.ring_v[1, 2, 3] == 65504.0


@settings(max_examples=60, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=hs.data())
def test_fuzzed_containers_either_install_whole_or_change_nothing(data):
    fuzzed_container_installs_whole_or_changes_nothing(data)


@pytest.mark.long_fuzz
@settings(max_examples=2000, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=hs.data())
def test_long_fuzzed_containers_either_install_whole_or_change_nothing(data):
    fuzzed_container_installs_whole_or_changes_nothing(data)


def fuzzed_container_installs_whole_or_changes_nothing(data):
    src = make_cache(1, inserts=data.draw(hs.integers(0, 9)))
    blob = bytearray(src.export_wire(f16=data.draw(hs.booleans())))
    # Most mutations land after the first layer's record: a bad record after good ones.
    lo = data.draw(hs.sampled_from([0, len(blob) // 3, 2 * len(blob) // 3]))
    for _ in range(data.draw(hs.integers(1, 3))):
        at = data.draw(hs.integers(lo, len(blob) - 1))
        kind = data.draw(hs.sampled_from(["bit", "byte", "nan"]))
        if kind == "bit":
            blob[at] ^= 1 << data.draw(hs.integers(0, 7))
        elif kind == "byte":
            blob[at] = data.draw(hs.integers(0, 255))
        elif at + 4 <= len(blob):
            blob[at:at + 4] = struct.pack("<f", data.draw(hs.sampled_from([np.nan, np.inf, -np.inf])))
    if data.draw(hs.booleans()):
        blob = blob[:data.draw(hs.integers(0, len(blob)))]
    dst = make_cache(2)
    before = fingerprint(dst)
    try:
        dst.import_wire(bytes(blob))
    except WireError:
        assert fingerprint(dst) == before
    else:
        # Installed whole: the cache exports again and its twin accepts it.
        make_cache(3).import_wire(dst.export_wire())


# ── positions ──

def bounded_blob_at(position):
    c = make_cache(1)
    blob = bytearray(c.layers[1].export_wire())
    struct.pack_into("<Q", blob, 24, position)
    struct.pack_into("<II", blob, 32 + 12, min(position, W), position % W)
    return bytes(blob)


@pytest.mark.parametrize("position", [2**64 - 1, 2**53 + 1, 2**63])
def test_bounded_records_past_2_53_are_refused(position):
    dst = make_cache(2)
    before = fingerprint(dst)
    with pytest.raises(WireError, match="2\\*\\*53"):
        dst.layers[1].import_wire(bounded_blob_at(position))
    assert fingerprint(dst) == before


def test_a_bounded_record_at_2_53_imports_and_refuses_the_next_step_cleanly():
    dst = make_cache(2)
    layer = dst.layers[1]
    layer.import_wire(bounded_blob_at(2**53))
    assert layer.seq_len == layer.bounded.seen == 2**53
    weights = BoundedWeights(np.zeros((NKV, 0, HD), np.float32), np.zeros((NKV, 0, HD), np.float32), 0, [W] * NKV)
    before = fingerprint(dst)
    with pytest.raises(Exception) as e:
        layer.bounded_step(np.ones((NKV, HD), np.float32), np.ones(NKV * HD, np.float32),
                           np.ones(NKV * HD, np.float32), weights, BoundedRope(), 0.5, NKV)
    assert isinstance(e.value, ValueError) and type(e.value).__module__ == "kvreg.errors"
    assert fingerprint(dst) == before
    layer.export_wire()   # still exportable


def test_fulltail_base_past_2_53_is_refused():
    src = LayerKvCache(1, 4, KvMode.F32, "reference")
    for i in range(3):
        src.append(np.full(4, i, np.float32), np.full(4, i, np.float32))
    blob = bytearray(src.export_wire())
    # Rewrite as FullTail with base 2**60.
    tail = bytes(blob[:20]) + bytes([3]) + bytes(blob[21:24]) + struct.pack("<Q", 2**60 + 3) + \
        struct.pack("<Q", 2**60) + bytes(blob[32:])
    dst = LayerKvCache(1, 4, KvMode.F32, "reference")
    with pytest.raises(WireError, match="2\\*\\*53"):
        dst.import_wire(tail)
    assert dst.seq_len == 0 and dst.base == 0


# ── a record of positions with no rows ──

def test_a_record_with_positions_but_no_rows_is_an_empty_prefix_that_keeps_export_and_eviction_working():
    st = LayerState(WireKind.Full, 0, 0, 7, 0, 7, 2, 4, k=[np.zeros((0, 4), np.float32)] * 2,
                    v=[np.zeros((0, 4), np.float32)] * 2)
    c = KvCache(1, 2, 4, 8, mode=KvMode.F32, backend="reference")
    layer = c.layers[0]
    from kvreg.wire import encode_layer

    layer.import_wire(encode_layer(st, f16=False))
    # the seven positions are a prefix that holds nothing, as after a trim
    assert (layer.base, layer.seq_len, layer.pos_len, layer.imp.size) == (7, 0, 7, 0)
    assert c.seq_len == 7 and layer.reserved_bytes() == 0
    for _ in range(9):
        layer.append(np.ones(8, np.float32), np.ones(8, np.float32))
    assert layer.export_wire()[20] == WireKind.FullTail and layer.pos_len == 16
    assert c.needs_eviction()
    c.evict(4)   # eviction reaches the rows, and brings the layer under the cap
    assert not c.needs_eviction() and layer.seq_len == 4 and layer.pos_len == 11


# ── legacy bodies ──

def test_a_legacy_body_with_rows_is_refused_by_a_linear_layer():
    full = LayerState(WireKind.Full, 0, 0, 2, 0, 2, 1, 4, linear_state=np.ones(3, np.float32),
                      imp=np.zeros(2, np.float32), k=[np.ones((2, 4), np.float32)], v=[np.ones((2, 4), np.float32)])
    lin = LayerKvCache(1, 4, KvMode.F32, "reference")
    lin.wire_kind = WireKind.Linear
    lin.linear_state = np.full(3, 9.0, np.float32)
    with pytest.raises(WireError, match="Linear layer"):
        lin.import_wire(encode_full_body(full, f16=False))
    assert lin.linear_state.tolist() == [9.0] * 3 and lin.seq_len == 0
    # the seed's linear legacy body (recurrent state only) still imports
    state_only = LayerState(WireKind.Full, 0, 0, 5, 0, 5, 1, 4, linear_state=np.ones(3, np.float32),
                            k=[np.zeros((0, 4), np.float32)], v=[np.zeros((0, 4), np.float32)])
    lin.import_wire(encode_full_body(state_only, f16=False))
    assert lin.linear_state.tolist() == [1.0] * 3 and lin.seq_len == 5
    assert lin.export_wire()[:4] == b"CMFS"
