"""The cache wire format (v2, and v3 for non-F32 storage): a pure codec over
plain data (see docs/wire.md).

This package knows bytes and arrays, never a layer object. Export reads a
:class:`LayerState` that the layer fills in; import returns a fresh
:class:`LayerState` that the layer installs in one step. Byte-compatible with
the seed's ``export_wire`` / ``import_wire`` (kv_cache.rs): little-endian, a
32-byte header (magic ``CMFS``, u32 version 2, u64 operator identity, u32
layer, u8 kind, u8 f16 flag, u16 flags (0 in v2), u64 position) then one
record whose shape the kind fixes. The unversioned legacy blob is the Full body alone.

By concept: ``_format`` (fields, records, the reader, the CRC), ``_seed``
(the v2 bodies), ``_storage`` (the v3 body), ``_record`` (a layer's record:
header, body, CRC), ``_container`` (``KVRC`` and ``inspect``).

Contracts:

* :func:`decode_layer` raises nothing but :class:`WireError` for any byte
  string, never mutates its input, and returns freshly allocated arrays; no
  header or count field makes it allocate more than the buffer could hold
  (every ``count * width`` is checked against the bytes left first).
* A blob :func:`encode_layer` writes always passes :func:`decode_layer` with
  the exporting layer's own :class:`Expect`: export validates the same
  invariants import enforces, so a layer cannot ship what its twin refuses.
* f16 payloads are IEEE binary16, round to nearest even (overflow to inf,
  NaN stays NaN, subnormals kept); linear state and importance are always f32.
* v3 (:data:`WIRE_VERSION_STORAGE`) carries a Full/FullTail layer of any
  storage mode as that storage holds it: the mode's name, then every array
  block (name, dtype code, per-row shape) and per head its rows, so a mode
  whose storage declares its blocks travels with no change here. An F32
  layer keeps writing v2 (the seed's bytes); Linear and Bounded stay v2.
* What crosses processes is checked for corruption in transit: a v3 record
  ends with a CRC-32 of its bytes (header flag :data:`FLAG_CRC32`), and the
  ``KVRC`` container (version 2) carries one per layer blob, so the seed's
  v2 records are covered there without a byte of theirs changing. Every
  CRC is checked before anything is decoded or installed.
"""

from __future__ import annotations

from ._container import decode_cache, encode_cache, inspect
from ._format import (
    CACHE_MAGIC,
    CACHE_VERSION,
    CACHE_VERSIONS,
    DTYPE_CODES,
    FLAG_CRC32,
    HEADER_SIZE,
    MAX_POSITION,
    WIRE_MAGIC,
    WIRE_VERSION,
    WIRE_VERSION_STORAGE,
    WIRE_VERSIONS,
    BlockRecord,
    BlockSpec,
    BoundedRecord,
    Expect,
    LayerState,
    RowClass,
    StorageRecord,
    StorageSchema,
    WireKind,
)
from ._record import decode_layer, encode_layer
from ._seed import check_exportable, encode_full_body

__all__ = [
    "WireKind", "WIRE_MAGIC", "WIRE_VERSION", "WIRE_VERSION_STORAGE", "WIRE_VERSIONS", "CACHE_MAGIC",
    "CACHE_VERSION", "CACHE_VERSIONS", "FLAG_CRC32", "HEADER_SIZE", "MAX_POSITION", "BoundedRecord", "LayerState",
    "Expect", "check_exportable", "RowClass", "DTYPE_CODES", "BlockSpec", "StorageSchema", "BlockRecord",
    "StorageRecord", "encode_layer", "encode_full_body", "decode_layer", "encode_cache", "decode_cache", "inspect",
]
