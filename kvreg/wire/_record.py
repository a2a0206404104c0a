"""One layer's record: the 32-byte header, the kind's body (v2: the seed's;
v3: the storage record) and, on v3, the CRC-32 that ends it."""

from __future__ import annotations

from kvreg.errors import WireError

from . import _seed, _storage
from ._format import (
    FLAG_CRC32,
    HEADER,
    HEADER_SIZE,
    KIND_VALUES,
    MAX_POSITION,
    U32,
    U32_MAX,
    U64,
    U64_MAX,
    WIRE_MAGIC,
    WIRE_VERSION,
    WIRE_VERSION_STORAGE,
    WIRE_VERSIONS,
    Expect,
    LayerState,
    Reader,
    WireKind,
    crc32,
    uint,
    view,
)


def encode_layer(state: LayerState, *, f16: bool) -> bytes:
    """Header + record, byte for byte as the seed's ``export_wire`` writes
    them (v2); a state with a ``storage`` record is written as v3 (Full or
    FullTail only, f16 flag 0: its blocks carry their own dtypes), ended by
    a CRC-32 of every byte before it. Raises WireError (a value does not
    fit, inconsistent position, missing ring) or ShapeError (an array of the
    wrong shape or dtype)."""
    f16 = bool(f16)
    if state.kind not in KIND_VALUES:
        raise WireError(f"kv export: unknown wire kind {state.kind!r}")
    kind = WireKind(state.kind)
    v3 = state.storage is not None
    if v3 and kind not in (WireKind.Full, WireKind.FullTail):
        raise WireError(f"kv export: a {kind.name} record is v2 only (it carries no row storage)")
    if v3 and f16:
        raise WireError("kv export: f16 rounds F32 rows on the v2 wire; a v3 record carries its storage's "
                        "own blocks (export with f16=False)")
    base = uint(state.base, "base", U64_MAX)
    if kind in (WireKind.Full, WireKind.FullTail):
        kind = WireKind.FullTail if base > 0 else WireKind.Full
        if int(state.position) != base + int(state.seq_len):
            raise WireError(f"kv export: position {state.position} != base {base} + seq_len {state.seq_len}")
    position = uint(state.position, "position", U64_MAX)
    if position > MAX_POSITION:
        raise WireError(f"kv export: position {position} is past 2**53, which float64 positions do not resolve")
    header = HEADER.pack(WIRE_MAGIC, WIRE_VERSION_STORAGE if v3 else WIRE_VERSION,
                         uint(state.identity, "identity", U64_MAX), uint(state.layer, "layer", U32_MAX),
                         int(kind), int(f16), FLAG_CRC32 if v3 else 0, position)
    tail = [U64.pack(base)] if kind is WireKind.FullTail else []
    if v3:
        chunks = [header] + tail + _storage.v3_chunks(state)
        chunks.append(U32.pack(crc32(chunks)))
    elif kind in (WireKind.Full, WireKind.FullTail):
        chunks = [header] + tail + _seed.full_chunks(state, f16)
    elif kind is WireKind.Linear:
        chunks = [header] + _seed.linear_chunks(state)
    else:
        chunks = [header] + _seed.bounded_chunks(state, position, f16)
    return b"".join(chunks)


def _check_crc(r: Reader, flags: int, layer: int) -> None:
    """Check a v3 header's flags and, when they say one ends the record, its
    CRC-32 over every byte before it, before any other field is judged: a
    record changed in transit is refused as such, not by whichever field the
    change happened to break. The reader then stops at the CRC."""
    if flags & ~FLAG_CRC32:
        raise r.fail(f"header flags {flags:#06x}: only bit 0 (a CRC-32 ends the record) is defined", 22)
    if not flags:
        r.note("no CRC-32 (flags 0: a record of an older kvreg; its bytes are not checked)")
        return
    if r.n < HEADER_SIZE + 4:
        raise r.fail(f"truncated record: the CRC-32 needs 4 bytes, {r.n - HEADER_SIZE} remain", HEADER_SIZE)
    at = r.n - 4
    (stored,) = U32.unpack_from(r.mv, at)
    got = crc32([r.mv[:at]])
    if got != stored:
        raise r.fail(f"the v3 record for layer {layer} ({r.n} bytes) fails its CRC-32: its bytes hash to "
                     f"{got:08x}, it carries {stored:08x}; it was changed or cut in transit", at)
    r.note(f"CRC-32 {stored:08x} at byte {at} (over bytes 0..{at - 1}): matches")
    r.n = at


def parse(mv: memoryview, expect: Expect | None, materialize: bool, notes) -> LayerState:
    r = Reader(mv, 0, materialize, notes)
    if bytes(mv[:4]) != WIRE_MAGIC:
        r.note("legacy (unversioned) blob: the Full body alone")
        if expect is not None and not expect.linear_wire_allowed:
            raise r.fail("Delta linear state cannot use the unversioned cache wire; refusing "
                         "until the wire carries operator identity", 0)
        if expect is not None and (expect.bounded_window is not None or expect.kind is WireKind.Bounded):
            raise r.fail("a bounded anchor takes only the versioned wire (v2) — the unversioned "
                         "body has no ring record", 0)
        body = _seed.full_body(r, expect, None)
        r.trailing()
        if expect is not None and expect.kind is WireKind.Linear and (
                body["imp"].size or any(a.shape[0] for a in body["k"])):
            # A Linear layer exports only its recurrent state: rows installed
            # from a legacy body would be dropped silently at its next export.
            raise r.fail("a legacy body holding K/V rows or importance for a Linear layer: its wire kind "
                         "carries the recurrent state only (export the peer as a Full layer)", 0)
        return _state(WireKind.Full, expect.identity if expect else 0, expect.layer if expect else 0,
                      body["seq_len"], 0, body)
    if r.n < HEADER_SIZE:
        raise r.fail(f"truncated header: {r.n} of {HEADER_SIZE} bytes", 0)
    _, version, identity, layer, kind_b, f16_b, flags, position = HEADER.unpack_from(mv, 0)
    kname = WireKind(kind_b).name if kind_b in KIND_VALUES else "unknown"
    flag_name = "flags" if version == WIRE_VERSION_STORAGE else "reserved"
    r.note(f"header (32 bytes): magic CMFS, version {version}, identity {identity:016x}, "
           f"layer {layer}, kind {kind_b} ({kname}), f16 flag {f16_b}, {flag_name} {flags}, "
           f"position {position}")
    if version not in WIRE_VERSIONS:
        raise r.fail(f"wire version {version}, this runtime speaks {WIRE_VERSION} and {WIRE_VERSION_STORAGE}", 4)
    v3 = version == WIRE_VERSION_STORAGE
    if v3:
        _check_crc(r, flags, layer)
    if kind_b not in KIND_VALUES:
        raise r.fail(f"unknown state kind {kind_b}", 20)
    kind = WireKind(kind_b)
    if expect is not None:
        if identity != expect.identity:
            raise r.fail(f"peer operator identity {identity:016x} != mine {expect.identity:016x} — "
                         "the two sides do not hold the same operator", 8)
        if layer != expect.layer:
            raise r.fail(f"record is for layer {layer}, this is layer {expect.layer}", 16)
        if not (kind is expect.kind or (kind is WireKind.FullTail and expect.kind is WireKind.Full)):
            raise r.fail(f"record kind {kind.name} does not match this layer's {expect.kind.name}", 20)
    if v3 and kind not in (WireKind.Full, WireKind.FullTail):
        raise r.fail(f"a v3 record carries Full or FullTail storage, not {kind.name} "
                     "(Linear and Bounded records are v2)", 20)
    # Beyond the seed: the flag and the reserved field have exactly one
    # meaning each, so any other value is a corrupt header.
    if f16_b > 1:
        raise r.fail(f"f16 flag {f16_b} is neither 0 nor 1", 21)
    if v3 and f16_b:
        raise r.fail("f16 flag 1 on a v3 record: its blocks carry their own dtypes, the flag must be 0", 21)
    if not v3 and flags:
        raise r.fail(f"reserved field is {flags}, not 0", 22)
    if position > MAX_POSITION:
        raise r.fail(f"position {position} is past 2**53, which float64 positions do not resolve "
                     "(a layer or ring cannot advance from it)", 24)
    f16 = f16_b == 1
    r.o = HEADER_SIZE
    head = (kind, identity, layer, position)
    if kind is WireKind.Linear:
        return _seed.linear_record(r, expect, head)
    if kind is WireKind.Bounded:
        return _seed.bounded_record(r, expect, head, f16)
    base = 0
    if kind is WireKind.FullTail:
        (base,) = r.unpack(U64, "FullTail base")
        r.note(f"FullTail base {base}")
    body = _storage.v3_body(r, expect) if v3 else _seed.full_body(r, expect, f16)
    if kind is WireKind.Full and body["seq_len"] != position:
        raise r.fail(f"header position {position} != record seq_len {body['seq_len']}", 24)
    if kind is WireKind.FullTail and base + body["seq_len"] != position:
        raise r.fail(f"tail base {base} + {body['seq_len']} rows != header position {position}", 24)
    r.trailing()
    return _state(kind, identity, layer, position, base, body)


def _state(kind, identity, layer, position, base, body) -> LayerState:
    return LayerState(kind, identity, layer, position, base, body["seq_len"], body["num_kv_heads"],
                      body["head_dim"], linear_state=body["linear_state"], imp=body["imp"],
                      k=body["k"], v=body["v"], storage=body.get("storage"),
                      payload_at=body.get("payload_at", []), payload_width=body.get("payload_width", 4),
                      version=WIRE_VERSION_STORAGE if "mode" in body else WIRE_VERSION, mode=body.get("mode"))


def decode_layer(buf, expect: Expect) -> LayerState:
    """Parse a v2 or v3 blob (or a legacy body) for the layer ``expect``
    describes.

    Every seed refusal, plus the stricter checks of docs/wire.md, raises
    WireError naming what is wrong and at which byte; a v3 record's CRC-32
    is checked before any of its body is read. Nothing is mutated: the
    caller installs the returned state atomically, so a refused import
    leaves its layer exactly as it was."""
    mv = view(buf)
    try:
        return parse(mv, expect, True, None)
    except MemoryError:
        # The copies are bounded by the buffer, but a large one may still
        # not fit: a refusal like any other, not a crash of the host.
        raise WireError(f"kv import: decoding a {len(mv)}-byte record needs more memory than this process "
                        "can allocate") from None
