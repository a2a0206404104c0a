"""The whole-cache container (``KVRC``) and ``inspect``, the human report of
a layer blob or a container."""

from __future__ import annotations

from kvreg.errors import WireError

from ._format import (
    CACHE_HEAD,
    CACHE_MAGIC,
    CACHE_VERSION,
    CACHE_VERSIONS,
    U32,
    U32_MAX,
    U64,
    WIRE_VERSION_STORAGE,
    Reader,
    crc32,
    uint,
    view,
)
from ._record import parse


def encode_cache(layer_blobs) -> bytes:
    """A whole cache: magic ``KVRC``, u32 version 2, u32 layer count, then per
    layer a u64 length, the layer's blob (opaque here) and a u32 CRC-32 of
    that blob."""
    blobs = [memoryview(b).cast("B") for b in layer_blobs]
    chunks: list[bytes | memoryview] = [CACHE_HEAD.pack(CACHE_MAGIC, CACHE_VERSION, uint(len(blobs), "layer count",
                                                                                   U32_MAX))]
    for b in blobs:
        chunks += [U64.pack(len(b)), b, U32.pack(crc32([b]))]
    return b"".join(chunks)


def _parse_cache(mv: memoryview, notes) -> tuple[list, list]:
    """The container's layer spans ``(offset, length)``, and a WireError per
    blob whose CRC-32 does not match (structural faults raise at once)."""
    r = Reader(mv, 0, False, notes)
    if bytes(mv[:4]) != CACHE_MAGIC:
        raise r.fail("not a cache container (magic is not KVRC)", 0)
    _, version, count = r.unpack(CACHE_HEAD, "container header")
    if version not in CACHE_VERSIONS:
        raise r.fail(f"cache container version {version}, this runtime speaks "
                     f"{' and '.join(map(str, CACHE_VERSIONS))}", 4)
    checked = version >= 2
    r.note(f"cache container v{version}: {count} layer(s)" + ("" if checked else ", no CRC-32 (an older kvreg's)"))
    per_layer = 12 if checked else 8
    r.need(per_layer * count, f"{count} layer length fields", "record")  # before the list grows
    spans, bad = [], []
    for i in range(count):
        (n,) = r.unpack(U64, f"length of layer {i}")
        r.need(n + (4 if checked else 0), f"layer {i} blob ({n} bytes)" + (" and its CRC-32" if checked else ""),
               "payload")
        spans.append((r.o, n))
        r.o += n
        if checked:
            (stored,) = r.unpack(U32, f"CRC-32 of layer {i}")
            got = crc32([mv[r.o - 4 - n:r.o - 4]])
            if got != stored:
                bad.append(r.fail(f"layer {i}'s blob (bytes {r.o - 4 - n}..{r.o - 5} of the container) fails its "
                                  f"CRC-32: its bytes hash to {got:08x}, the container carries {stored:08x}; "
                                  "it was changed in transit", r.o - 4))
    r.trailing()
    return spans, bad


def decode_cache(buf) -> list:
    """Split a cache container into its layer blobs (fresh ``bytes`` each),
    every blob's CRC-32 checked first; refuses bad magic/version, a blob
    changed in transit, truncation and trailing bytes with WireError."""
    mv = view(buf)
    spans, bad = _parse_cache(mv, None)
    if bad:
        raise bad[0]
    return [bytes(mv[o:o + n]) for o, n in spans]


def inspect(buf) -> str:
    """A human report of a layer blob or a cache container: the header, a
    body summary and a verdict line, unindented: ``OK: ...`` or, for a broken
    blob, ``ERROR: <what is wrong> (at byte N)`` (a container with a broken
    layer blob ends with one such line per broken blob). Checks structure
    and checksums only: identity, layer and geometry are the importing
    layer's to judge. Never raises for bytes-like input."""
    try:
        mv = view(buf)
    except WireError as e:
        return f"ERROR: {e}"
    if bytes(mv[:4]) == CACHE_MAGIC:
        notes: list = []
        try:
            spans, bad = _parse_cache(mv, notes)
        except WireError as e:
            return "\n".join(notes + [f"ERROR: {e}"])
        verdicts = [f"ERROR: {e}" for e in bad]
        for i, (o, n) in enumerate(spans):
            notes.append(f"layer blob {i} at byte {o}, {n} bytes:")
            report = inspect(mv[o:o + n]).splitlines()
            notes += ["  " + line for line in report]
            if report[-1].startswith("ERROR: "):
                verdicts.append(f"ERROR: layer blob {i} (at byte {o} of the container): {report[-1][7:]}")
        return "\n".join(notes + (verdicts or [f"OK: {len(spans)} layer blob(s)"]))
    notes = [f"{len(mv)} bytes"]
    try:
        st = parse(mv, None, False, notes)
    except WireError as e:
        notes.append(f"ERROR: {e}")
        return "\n".join(notes)
    v3 = f" (v3, mode {st.mode})" if st.version == WIRE_VERSION_STORAGE else ""
    notes.append(f"OK: {st.kind.name} record{v3}, position {st.position}, seq_len {st.seq_len}, "
                 f"{st.num_kv_heads}×{st.head_dim}")
    return "\n".join(notes)
