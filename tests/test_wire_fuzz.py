"""Fuzzed imports, every way a cache arrives: a layer record of every storage
mode, the KVRC container through KvCache.import_wire, and KvregCache's
blob through its import_wire and through a Ray decode worker's load
(:class:`kvreg.integrations.ray.Engine`, the worker's body, without Ray).

Blobs are exported states changed in transit (bytes flipped, words set to
edge values, cut, extended), the same changes resealed (a CRC-32 that
matches: an exporter's own fault, which reaches every field check and the
install), and hand-built records that claim what their bytes do not carry
(positions without rows, huge per-row shapes). Every import must raise
nothing but WireError, leave its target exactly as it was when it refuses,
install whole when it does not, and cost at most a CPU second and a small
multiple of its buffer; a record or container kvreg sealed must refuse
every change in transit. The default tier runs a few hundred blobs; the
``long_fuzz`` tier runs more than 100,000."""

from __future__ import annotations

import functools
import struct
import zlib

import numpy as np
import pytest
from cpu_cost import measured, settled

from kvreg import KvCache, KvMode, LayerKvCache, WireError
from kvreg.modes import Q8_EXACT_ROWS
from kvreg.wire import decode_cache, encode_cache

NKV, HD, EXACT = 2, 40, 2
MODES = list(KvMode)
EDGE_U32 = [0, 1, 2, 3, 4, 40, 64, 0x7FFF_FFFF, 0x8000_0000, 0xFFFF_FFFC, 0xFFFF_FFFF]
EDGE_U64 = [0, 1, 2**26, 2**32 - 1, 2**53, 2**53 + 1, 2**64 - 1]
#: A refused or accepted import costs at most this many times its blob,
#: plus the fixed allocation of the layers it builds.
MEMORY_MULTIPLE = 16
FIXED_BYTES = 1 << 20
#: CPU seconds an import may cost, refused or accepted.
SECONDS = 1.0


def layer(mode, n, seed, geometry=(NKV, HD, EXACT)):
    nkv, hd, exact = geometry
    c = LayerKvCache(nkv, hd, mode, "reference", q8_exact_rows=exact)
    rng = np.random.default_rng(seed)
    for p in range(n):   # head 1 dead at every third position
        c.append(rng.standard_normal(nkv * hd).astype(np.float32), rng.standard_normal(nkv * hd).astype(np.float32),
                 [h == 0 or p % 3 != 0 for h in range(nkv)])
    if n:
        c.accumulate_imp(rng.random(n).astype(np.float32))
    c.linear_state = np.array([0.5, -0.25], np.float32)
    return c


def cache(mode, n, seed):
    """Three layers; under F32 layer 1 is a bounded ring (a v2 Bounded record)."""
    c = KvCache(3, NKV, HD, 4096, mode=mode, backend="reference", q8_exact_rows=EXACT)
    rng = np.random.default_rng(seed)
    if mode is KvMode.F32:
        c.layers[1].install_bounded(4)
    for i, lay in enumerate(c.layers):
        if lay.bounded is not None:
            for _ in range(n):
                lay.bounded.insert(rng.standard_normal(NKV * HD).astype(np.float32),
                                   rng.standard_normal(NKV * HD).astype(np.float32))
            lay.seq_len = lay.bounded.seen
        elif n:
            lay.extend(rng.standard_normal((n + i, NKV, HD)).astype(np.float32),
                       rng.standard_normal((n + i, NKV, HD)).astype(np.float32))
    return c


def reseal(blob: bytes) -> bytes:
    """A v3 record (flag bit 0) with the CRC-32 of what it now holds."""
    if len(blob) >= 36 and blob[:4] == b"CMFS" and blob[4] == 3 and blob[22] & 1:
        return blob[:-4] + struct.pack("<I", zlib.crc32(blob[:-4]))
    return blob


def mutate(rng, blob: bytes) -> bytes:
    b = bytearray(blob)
    for _ in range(int(rng.integers(1, 4))):
        op = int(rng.integers(0, 6))
        head = len(b) and int(rng.integers(0, min(len(b), 160)))   # the header, fields and tables
        at = head if rng.random() < 0.5 else (len(b) and int(rng.integers(0, len(b))))
        if op <= 1 and b:
            b[at] ^= int(rng.integers(1, 256))
        elif op == 2 and len(b) >= 4:
            at = min(at, len(b) - 4)
            struct.pack_into("<I", b, at, EDGE_U32[int(rng.integers(0, len(EDGE_U32)))])
        elif op == 3 and len(b) >= 8:
            at = min(at, len(b) - 8)
            struct.pack_into("<Q", b, at, EDGE_U64[int(rng.integers(0, len(EDGE_U64)))])
        elif op == 4:
            del b[int(rng.integers(0, len(b) + 1)):]
        else:
            b += rng.integers(0, 256, int(rng.integers(1, 17)), dtype=np.uint8).tobytes()
    return bytes(b)


# ── hand-built records: claims the bytes do not carry ──

def v2_counter(n, base=None, legacy=False, lin=0, geometry=(NKV, HD, EXACT)):
    """``n`` positions, no row, no importance (a FullTail when ``base``)."""
    nkv, hd, _ = geometry
    body = struct.pack("<6I", 0, n, nkv, hd, lin, 0) + bytes(4 * lin) + bytes(8 * nkv)
    if legacy:
        return body
    kind = 0 if base is None else 3
    pos = n + (base or 0)
    return b"CMFS" + struct.pack("<IQIBBHQ", 2, 0, 0, kind, 0, 0, pos) + (b"" if base is None else
                                                                         struct.pack("<Q", base)) + body


def v3_counter(mode, n, geometry):
    """An empty layer's sealed record claiming ``n`` positions."""
    b = bytearray(layer(mode, 0, 0, geometry).export_wire())
    m = struct.unpack_from("<I", b, 32)[0]
    struct.pack_into("<Q", b, 24, n)
    struct.pack_into("<I", b, 36 + m, n)
    return reseal(bytes(b))


def v3_claims(mode, seed, geometry):
    """A sealed record whose counts, shapes or lengths claim too much."""
    nkv = geometry[0]
    b = bytearray(layer(mode, 3, seed, geometry).export_wire())
    m = struct.unpack_from("<I", b, 32)[0]
    f = 36 + m
    which = seed % 5
    if which == 0:     # more positions than importance entries
        struct.pack_into("<I", b, f, 2**32 - 1)
        struct.pack_into("<Q", b, 24, 2**32 - 1)
    elif which == 1:   # a head of 4G rows
        lin, nimp = struct.unpack_from("<2I", b, f + 16)
        struct.pack_into("<I", b, f + 28 + 4 * lin + 4 * nimp, 2**32 - 1)
    elif which == 2:   # the first block's per-row shape: huge
        lin, nimp, nb = struct.unpack_from("<3I", b, f + 16)
        t = f + 28 + 4 * lin + 4 * nimp + 8 * nkv
        nl = b[t]
        if b[t + 3 + nl]:
            struct.pack_into("<I", b, t + 4 + nl, 2**32 - 1)
    elif which == 3:   # the linear state: 4G entries
        struct.pack_into("<I", b, f + 16, 2**32 - 1)
    else:              # 64 blocks
        struct.pack_into("<I", b, f + 24, 64)
    return reseal(bytes(b))


def dead_positions(n, geometry):
    """An F32 layer's record of ``n`` positions with every head dead: one
    importance entry per position, no row."""
    nkv, hd, _ = geometry
    src = LayerKvCache(nkv, hd, KvMode.F32, "reference")
    src.extend(np.zeros((n, nkv, hd), np.float32), np.zeros((n, nkv, hd), np.float32), [False] * nkv)
    return src.export_wire()


@functools.lru_cache(maxsize=2)
def hand_built(geometry=(NKV, HD, EXACT), modes=tuple(MODES)):
    g = geometry
    out = [v2_counter(n, geometry=g) for n in (1, 7, 64, 2**26, 2**32 - 1)]
    out += [v2_counter(2**32 - 1, base=2**53 - 2**32, geometry=g), v2_counter(2**32 - 1, legacy=True, geometry=g),
            v2_counter(2**20, lin=3, geometry=g), dead_positions(100, g)]
    out += [v3_counter(m, n, g) for m in modes if m is not KvMode.F32 for n in (7, 70, 2**32 - 1)]
    out += [v3_claims(m, s, g) for m in modes if m is not KvMode.F32 for s in range(5)]
    return out


# ── targets ──

def layer_state(c):
    return (c.export_wire(), c.seq_len, c.base, c.generation, c.mode, c.linear_state.tobytes())


def cache_state(c):
    return (c.export_wire(), [(x.seq_len, x.base, x.generation) for x in c.layers])


def attempt(target, blob, state, twin, must_refuse, why):
    """Import ``blob``: WireError and nothing changed, or whole; within the
    CPU second and the memory bound either way."""
    before = state(target)
    dt, peak, error = measured(lambda: target.import_wire(blob))
    if error is not None and not isinstance(error, WireError):   # the failure this fuzz exists for
        raise AssertionError(f"{why}: {type(error).__name__}: {error} for blob {blob[:96].hex()}...") from error
    accepted = error is None
    dt = settled(dt, SECONDS, lambda: target.import_wire(blob))
    assert dt < SECONDS, f"{why}: import took {dt:.2f} CPU s for a {len(blob)}-byte blob"
    assert peak < MEMORY_MULTIPLE * len(blob) + FIXED_BYTES, f"{why}: {peak} bytes traced for {len(blob)}"
    if not accepted:
        assert state(target) == before, f"{why}: a refused import changed its target"
        return False
    assert not must_refuse, f"{why}: a change in transit of a sealed blob was accepted: {blob[:96].hex()}..."
    again = target.export_wire()
    twin.import_wire(again)   # installed whole: what it holds travels again
    assert twin.export_wire() == again, why
    return True


def layer_cases(rng, count):
    """(mode, blob, must_refuse) for layer imports."""
    seeds = {m: [layer(m, n, n).export_wire() for n in (0, 3, 70)] for m in MODES}
    f32 = layer(KvMode.F32, 9, 1)
    seeds[KvMode.F32] += [f32.export_wire(True)]
    f32.trim_window(2, 1, 1)
    seeds[KvMode.F32] += [f32.export_wire()]
    for _ in range(count):
        mode = MODES[int(rng.integers(0, len(MODES)))]
        blob = seeds[mode][int(rng.integers(0, len(seeds[mode])))]
        if rng.random() < 0.5:
            changed = mutate(rng, blob)
            # a sealed v3 record refuses any change in transit
            yield mode, changed, blob[4] == 3 and changed != blob
        else:
            yield mode, reseal(mutate(rng, blob)), False


def container_cases(rng, count):
    """(mode, blob, must_refuse) for KvCache imports."""
    parts = {m: decode_cache(cache(m, 5, 1).export_wire()) for m in MODES}
    for _ in range(count):
        mode = MODES[int(rng.integers(0, len(MODES)))]
        blob_parts = list(parts[mode])
        if rng.random() < 0.5:
            blob = encode_cache(blob_parts)
            changed = mutate(rng, blob)
            yield mode, changed, changed != blob   # every byte of a v2 container is checked
        else:
            j = int(rng.integers(0, 3))   # an exporter's fault inside one record, after good ones or not
            blob_parts[j] = reseal(mutate(rng, blob_parts[j]))
            yield mode, encode_cache(blob_parts), False


def run_layers_and_containers(rng, n_layer, n_cache, hand_modes=MODES):
    """``n_layer`` layer and ``n_cache`` container blobs, then every
    hand-built record into a layer, and as a container's later record, of
    each of ``hand_modes``."""
    targets = {m: (layer(m, 4, 7), layer(m, 0, 8)) for m in MODES}
    for i, (mode, blob, must) in enumerate(layer_cases(rng, n_layer)):
        target, twin = targets[mode]
        attempt(target, blob, layer_state, twin, must, f"layer {mode.value} #{i}")
    for blob in hand_built():
        for mode in hand_modes:
            target, twin = targets[mode]
            attempt(target, blob, layer_state, twin, False, f"hand-built into {mode.value}")
    ctargets = {m: (cache(m, 3, 9), cache(m, 0, 10)) for m in MODES}
    for i, (mode, blob, must) in enumerate(container_cases(rng, n_cache)):
        target, twin = ctargets[mode]
        attempt(target, blob, cache_state, twin, must, f"container {mode.value} #{i}")
    for mode in hand_modes:   # a hand-built record after good ones, in a container
        good = decode_cache(cache(mode, 5, 2).export_wire())
        target, twin = ctargets[mode]
        for blob in hand_built():
            for j in (1, 2):
                parts = list(good)
                if blob[:4] == b"CMFS":
                    b = bytearray(blob)
                    struct.pack_into("<I", b, 16, j)   # the record is for layer j
                    blob = reseal(bytes(b))
                parts[j] = blob
                attempt(target, encode_cache(parts), cache_state, twin, False,
                        f"hand-built layer {j} of a {mode.value} container")


def test_fuzzed_layers_and_containers():
    run_layers_and_containers(np.random.default_rng(20), 100, 40, [KvMode.F32, KvMode.Q8_2F])


# ── KvregCache and the Ray decode worker's load ──

HOST_MODES = ["f32", "q8", "q8_2f", "f16", "q4"]


@pytest.fixture(scope="module")
def tiny():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=32, hidden_size=32, intermediate_size=32, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                   max_position_embeddings=64)
    return transformers.LlamaForCausalLM(cfg).eval()


def host_seeds(model):
    import torch

    from kvreg.integrations.transformers import KvregCache

    out = {}
    for mode in HOST_MODES:
        c = KvregCache(model, mode=mode)
        with torch.no_grad():
            model(input_ids=torch.tensor([[1, 2, 3, 4, 5, 6, 7]]), cache=c, use_cache=True)
        out[mode] = c.export_wire()
    return out


def kvrc_start(blob):
    """Where the (one) sequence's KVRC container starts in a KvregCache blob:
    a change from there on is covered by its CRC-32s."""
    at = blob.index(b"KVRC")
    assert struct.unpack_from("<Q", blob, at - 8)[0] == len(blob) - at
    return at


def with_record(blob, j, record):
    """A KvregCache blob whose layer ``j`` record is ``record`` (the
    containers' CRC-32s match: what an exporter's fault would send)."""
    at = kvrc_start(blob)
    parts = decode_cache(blob[at:])
    if record[:4] == b"CMFS":
        rec = bytearray(record)
        struct.pack_into("<I", rec, 16, j)   # the record is for layer j
        record = reseal(bytes(rec))
    parts[j] = record
    kvrc = encode_cache(parts)
    return blob[:at - 8] + struct.pack("<Q", len(kvrc)) + kvrc


def load_attempt(engine, meta, blob, must_refuse, why):
    """A decode worker's load: WireError and nothing kept, or the state;
    within the CPU second either way."""
    def load():
        engine.load(meta, blob)
        engine.release(meta.request_id)

    dt, _, error = measured(lambda: engine.load(meta, blob))
    if error is None:
        assert not must_refuse, f"{why}: a state changed in transit was loaded"
        engine.release(meta.request_id)
    elif isinstance(error, WireError):
        assert meta.request_id not in engine._seqs, why
    else:
        raise AssertionError(f"{why}: {type(error).__name__}: {error}") from error
    assert settled(dt, SECONDS, load) < SECONDS, why


def run_hosts(model, rng, count, hand_modes=HOST_MODES):
    """Hand-built records as each layer of a KvregCache blob of each of
    ``hand_modes``, then ``count`` blobs changed in transit."""
    from dataclasses import replace

    from kvreg.integrations.ray import Engine, SequenceMeta, wire_crc32
    from kvreg.integrations.transformers import KvregCache

    seeds = host_seeds(model)
    engine = Engine(lambda: (model, None))
    cfg = model.config
    geometry = (cfg.num_key_value_heads, cfg.head_dim, Q8_EXACT_ROWS)
    built = hand_built(geometry, tuple(KvMode(m) for m in HOST_MODES))
    for mode in hand_modes:
        for k, record in enumerate(built):
            for j in range(cfg.num_hidden_layers):
                blob = with_record(seeds[mode], j, record)
                why = f"hand-built #{k} as layer {j} of a KvregCache {mode} blob"
                attempt(KvregCache(model, mode=mode), blob, lambda c: (c.export_wire(), c.get_seq_length()),
                        KvregCache(model, mode=mode), False, why)
                meta = SequenceMeta(f"h{k}", 7, (7,), 8, (), {"mode": mode}, len(blob), 0, wire_crc32(blob))
                load_attempt(engine, meta, blob, False, why)
    for i in range(count):
        mode = HOST_MODES[int(rng.integers(0, len(HOST_MODES)))]
        blob = seeds[mode]
        changed = mutate(rng, blob)
        if changed == blob:
            continue
        start = kvrc_start(blob)
        in_kvrc = len(changed) == len(blob) and all(
            changed[j] == blob[j] for j in range(start))
        target = KvregCache(model, mode=mode)
        attempt(target, changed, lambda c: (c.export_wire(), c.get_seq_length()), KvregCache(model, mode=mode),
                in_kvrc, f"KvregCache {mode} #{i}")
        # the decode worker: with the meta's CRC-32 every change is refused,
        # without it the blob's own checks and the worker's refuse them
        meta = SequenceMeta(f"r{i}", 7, (7,), 8, (), {"mode": mode}, len(blob), 0, wire_crc32(blob))
        for m in (meta, replace(meta, wire_crc32=None)):
            load_attempt(engine, m, changed, True, f"decode worker load, KvregCache {mode} #{i}")
    assert engine.load(SequenceMeta("ok", 7, (7,), 8, (), {"mode": "q8"}, len(seeds["q8"]), 0,
                                    wire_crc32(seeds["q8"])), seeds["q8"]) == 7


def test_fuzzed_kvreg_cache_and_decode_worker_loads(tiny):
    run_hosts(tiny, np.random.default_rng(21), 20, ["q8_2f"])


# ── the long tier ──

@pytest.mark.long_fuzz
def test_long_fuzz_of_every_import():
    # more than 100,000 blobs: 60k layer records, 30k containers (each a
    # hand-built set after good records too), 12k KvregCache blobs
    run_layers_and_containers(np.random.default_rng(30), 60_000, 30_000)


@pytest.mark.long_fuzz
def test_long_fuzz_of_kvreg_cache_and_decode_worker_loads(tiny):
    run_hosts(tiny, np.random.default_rng(31), 12_000)
