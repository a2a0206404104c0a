"""The cache wire format (v2, and v3 for non-F32 storage): a pure codec over
plain data (see docs/wire.md).

This module knows bytes and arrays, never a layer object. Export reads a
:class:`LayerState` that the layer fills in; import returns a fresh
:class:`LayerState` that the layer installs in one step. Byte-compatible with
the seed's ``export_wire`` / ``import_wire`` (kv_cache.rs): little-endian, a
32-byte header (magic ``CMFS``, u32 version 2, u64 operator identity, u32
layer, u8 kind, u8 f16 flag, u16 zero, u64 position) then one record whose
shape the kind fixes. The unversioned legacy blob is the Full body alone.

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
"""

from __future__ import annotations

import enum
import math
import struct
from dataclasses import dataclass, field

import numpy as np

from kvreg.errors import ShapeError, WireError
from kvreg.modes import KvMode

__all__ = [
    "WireKind", "WIRE_MAGIC", "WIRE_VERSION", "WIRE_VERSION_STORAGE", "WIRE_VERSIONS", "CACHE_MAGIC",
    "CACHE_VERSION", "HEADER_SIZE", "BoundedRecord", "LayerState", "Expect", "check_exportable",
    "RowClass", "DTYPE_CODES", "BlockSpec", "StorageSchema", "BlockRecord", "StorageRecord",
    "encode_layer", "encode_full_body", "decode_layer", "encode_cache",
    "decode_cache", "inspect",
]


class WireKind(enum.IntEnum):
    """State-record kind of the v2 header (byte 20)."""

    Full = 0  # per-position K/V (+ importance): the legacy body
    Linear = 1  # recurrent state vector, f32
    Bounded = 2  # bounded anchor: ring geometry, len/head, ring K/V
    FullTail = 3  # a trimmed Full layer: u64 base, then the Full body


WIRE_MAGIC = b"CMFS"
#: The version an F32 layer (and every Linear/Bounded record) writes: the seed's.
WIRE_VERSION = 2
#: The version of a Full/FullTail record of non-F32 storage (q8, f16, ...).
WIRE_VERSION_STORAGE = 3
WIRE_VERSIONS = (WIRE_VERSION, WIRE_VERSION_STORAGE)
HEADER_SIZE = 32
CACHE_MAGIC = b"KVRC"
CACHE_VERSION = 1

_HEADER = struct.Struct("<4sIQIBBHQ")  # magic, version, identity, layer, kind, f16, zero, position
_FULL_HEAD = struct.Struct("<6I")  # f16, seq_len, heads, hd, lin, nimp
_CACHE_HEAD = struct.Struct("<4sII")  # magic, version, layer count
_LINEAR_HEAD = struct.Struct("<3I")  # heads, hd, linear length
_BOUNDED_HEAD = struct.Struct("<5I")  # heads, hd, window, len, head
_V3_HEAD = struct.Struct("<7I")  # seq_len, heads, hd, exact_cap, lin, nimp, nblocks
_V3_ENTRY = struct.Struct("<BBB")  # dtype code, row class, ndim
_KIND_VALUES = frozenset(k.value for k in WireKind)
_U32 = struct.Struct("<I")
_U64 = struct.Struct("<Q")
_U32_MAX = 0xFFFF_FFFF
_U64_MAX = 0xFFFF_FFFF_FFFF_FFFF
#: The largest position a record may carry (the u64 field holds more): past
#: 2**53 float64 does not resolve positions (RoPE angles), and a layer or
#: ring refuses to count beyond it, so importing one would land a state the
#: next step cannot advance.
MAX_POSITION = 2**53


@dataclass(eq=False)
class BoundedRecord:
    """A bounded anchor's ring as it travels: ``ring_k``/``ring_v`` are
    ``[num_kv_heads, window, head_dim]`` float32; ``len == min(seen, window)``
    and ``head == seen % window`` where ``seen`` is the header position."""

    window: int
    len: int
    head: int
    ring_k: np.ndarray
    ring_v: np.ndarray


class RowClass(enum.IntEnum):
    """How many rows of a v3 block each head sends."""

    ROWS = 0  # lens[h]: the stored rows (K/V blocks, q8 scales)
    EXACT = 1  # xlen[h]: the exact (float32) leading rows of a q8 side
    HEAD = 2  # 1: a per-head array (the frozen 2f field and its flags)


#: v3 dtype codes (u8) -> little-endian numpy dtype. 0 is no dtype. A bool
#: block travels as one byte 0/1 per element (any other byte is refused).
DTYPE_CODES = {
    1: np.dtype("<f4"), 2: np.dtype("<f2"), 3: np.dtype("i1"), 4: np.dtype("u1"),
    5: np.dtype("<i2"), 6: np.dtype("<u2"), 7: np.dtype("<i4"), 8: np.dtype("<u4"),
    9: np.dtype("<i8"), 10: np.dtype("<u8"), 11: np.dtype("<f8"), 12: np.dtype("?"),
}
_CODE_OF = {(d.kind, d.itemsize): c for c, d in DTYPE_CODES.items()}
#: Bounds of a v3 table (a storage holds a handful of blocks).
MAX_BLOCKS = 64
MAX_NAME = 32
MAX_NDIM = 4


def _dtype_code(dt) -> int | None:
    dt = np.dtype(dt)
    return _CODE_OF.get((dt.kind, dt.itemsize))


def _dtype_name(dt) -> str:
    return "bool" if np.dtype(dt).kind == "b" else np.dtype(dt).newbyteorder("=").name


@dataclass(frozen=True)
class BlockSpec:
    """One array block of a storage as v3 describes it: ``name`` (the
    storage's attribute), ``rows`` (:class:`RowClass`), ``dtype`` and the
    per-row ``shape`` (the array's shape past ``[head, row]``, or past
    ``[head]`` for a HEAD block)."""

    name: str
    rows: RowClass
    dtype: np.dtype
    shape: tuple

    def describe(self) -> str:
        per = {RowClass.ROWS: "stored row", RowClass.EXACT: "exact row", RowClass.HEAD: "head"}[self.rows]
        return f"{self.name}: {_dtype_name(self.dtype)} {list(self.shape)} per {per}"


@dataclass(frozen=True)
class StorageSchema:
    """What a storage of ``mode`` (its ``KvMode.value``) holds: the exact-row
    capacity per head (0 when no side keeps exact rows) and its blocks."""

    mode: str
    exact_cap: int
    blocks: tuple


@dataclass(eq=False)
class BlockRecord:
    """A block as it travels: ``data`` is one ``[n_h, *shape]`` array per
    head for ROWS/EXACT (``n_h`` = ``lens[h]`` / ``xlen[h]``), or one
    ``[num_kv_heads, *shape]`` array for HEAD."""

    spec: BlockSpec
    data: object


@dataclass(eq=False)
class StorageRecord:
    """A v3 record's storage: mode name, exact-row capacity, per-head row
    counts (``lens``, ``xlen``) and every block."""

    mode: str
    exact_cap: int
    lens: np.ndarray
    xlen: np.ndarray
    blocks: list


@dataclass(eq=False)
class LayerState:
    """What export reads and import produces: one layer's whole wire state.

    ``kind`` is the layer's wire kind on export (Full becomes FullTail on the
    wire when ``base > 0``) and the record's kind on import (a legacy body
    decodes as Full). ``position`` is the absolute depth (``base + seq_len``
    for Full; the counter itself for Linear/Bounded, whose decoded ``seq_len``
    equals it and whose ``k``/``v``/``imp`` come back empty). ``k``/``v`` hold
    one float32 ``[rows_h, head_dim]`` array per KV head (``rows_h`` may be 0
    for a dead head); ``imp`` has one entry per position or is empty when no
    head stores a row.
    """

    kind: WireKind
    identity: int
    layer: int
    position: int
    base: int
    seq_len: int
    num_kv_heads: int
    head_dim: int
    linear_state: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    imp: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    k: list = field(default_factory=list)
    v: list = field(default_factory=list)
    bounded: BoundedRecord | None = None
    #: v3 only: the storage record (``k``/``v`` are then empty per head).
    storage: StorageRecord | None = None
    #: Decoded v2 Full bodies: per head the byte offsets of its K and V
    #: payloads and the element width (for refusals naming a row's byte).
    payload_at: list = field(default_factory=list)
    payload_width: int = 4
    #: Decoded: the record's wire version, and a v3 record's mode name.
    version: int = WIRE_VERSION
    mode: str | None = None


@dataclass(frozen=True)
class Expect:
    """The importing layer's facts, against which a blob is checked.

    ``kind`` is the layer's wire kind (Full, Linear or Bounded; a Full layer
    also takes FullTail); ``bounded_window`` is the installed ring's window or
    None; ``linear_wire_allowed`` False refuses the untagged legacy body.
    ``storage``: the layer's own storage (mode, exact rows, blocks); a v3
    record must match it exactly (None checks v3 structure only).
    """

    num_kv_heads: int
    head_dim: int
    identity: int = 0
    layer: int = 0
    kind: WireKind = WireKind.Full
    bounded_window: int | None = None
    linear_wire_allowed: bool = True
    storage: StorageSchema | None = None

    def __post_init__(self) -> None:
        if self.kind in _KIND_VALUES:  # a plain int becomes the enum member
            object.__setattr__(self, "kind", WireKind(self.kind))
        if self.num_kv_heads < 1 or self.head_dim < 1:
            raise ShapeError(f"Expect: {self.num_kv_heads}×{self.head_dim} is not a layer geometry")
        if self.kind not in (WireKind.Full, WireKind.Linear, WireKind.Bounded):
            raise ShapeError(f"Expect: a layer's wire kind is Full, Linear or Bounded, not {self.kind!r}")
        if self.bounded_window is not None and self.bounded_window < 1:
            raise ShapeError(f"Expect: ring window {self.bounded_window} must be >= 1")
        if self.storage is not None and not isinstance(self.storage, StorageSchema):
            raise ShapeError(f"Expect: storage must be a StorageSchema, got {type(self.storage).__name__}")


# ----------------------------------------------------------------- export


def check_exportable(mode_is_f32: bool, has_o1: bool, has_frozen_cols: bool) -> None:
    """Refuse, in the seed's order, a layer holding state this format does
    not describe; shipping the rest would land a plausible cache that
    answers differently."""
    if not mode_is_f32:
        raise WireError("kv export: only the F32 cache is described by this format "
                        "(q8 stores int8 rows and per-row scales)")
    if has_o1:
        raise WireError("kv export: an O(1) Nyström overlay is not part of this format — "
                        "the skeletons are irreversible and would have to travel with it")
    if has_frozen_cols:
        raise WireError("kv export: frozen columns under an F32 cache — refusing to ship "
                        "a state this format does not describe")


def _uint(value, name: str, top: int) -> int:
    v = int(value)
    if not 0 <= v <= top:
        raise WireError(f"kv export: {name} {v} does not fit its {top.bit_length()}-bit field")
    return v


def _f32_array(a, name: str, ndim: int) -> np.ndarray:
    if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.ndim != ndim:
        got = f"{a.dtype} {a.ndim}-D" if isinstance(a, np.ndarray) else type(a).__name__
        raise ShapeError(f"kv export: {name} must be a float32 {ndim}-D array, got {got}")
    return a


def _payload(a: np.ndarray, f16: bool) -> np.ndarray:
    # Arrays go to bytes.join as buffers: a contiguous little-endian f32
    # array is copied once, straight into the blob. astype(float16) is IEEE
    # round-to-nearest-even (pinned by the tests); overflow to inf is the
    # format's rule, not an accident, so numpy's warning is silenced.
    if not f16:
        return np.ascontiguousarray(a, dtype="<f4")
    with np.errstate(over="ignore"):
        return np.ascontiguousarray(a, dtype="<f2")


def _full_chunks(st: LayerState, f16: bool) -> list:
    heads, hd = st.num_kv_heads, st.head_dim
    if len(st.k) != heads or len(st.v) != heads:
        raise ShapeError(f"kv export: {len(st.k)} K / {len(st.v)} V heads for a {heads}-head layer")
    lin = _f32_array(st.linear_state, "linear_state", 1)
    imp = _f32_array(st.imp, "imp", 1)
    chunks: list = []
    rows_max = 0
    for h in range(heads):
        k = _f32_array(st.k[h], f"k[{h}]", 2)
        v = _f32_array(st.v[h], f"v[{h}]", 2)
        if k.shape[1] != hd or v.shape != k.shape:
            raise ShapeError(f"kv export: head {h} K {k.shape} / V {v.shape}, want [rows, {hd}] each")
        n = _uint(k.size, f"element count of head {h}", _U32_MAX)
        rows_max = max(rows_max, k.shape[0])
        chunks += [_U32.pack(n), _payload(k, f16), _U32.pack(n), _payload(v, f16)]
    seq_len = _uint(st.seq_len, "seq_len", _U32_MAX)
    _check_rows(seq_len, rows_max, imp.size, WireError, "kv export: ")
    head = _FULL_HEAD.pack(int(f16), seq_len, _uint(heads, "num_kv_heads", _U32_MAX),
                           _uint(hd, "head_dim", _U32_MAX),
                           _uint(lin.size, "linear state length", _U32_MAX), imp.size)
    return [head, _payload(lin, False), _payload(imp, False)] + chunks


def _check_rows(seq_len: int, rows_max: int, nimp: int, err, prefix: str, at=None) -> None:
    # Beyond the seed: a head cannot hold more rows than there are positions,
    # and eviction indexes imp per position, so its length is seq_len (empty
    # only for a record that stores no row at all: a position counter).
    if rows_max > seq_len:
        raise _err(err, f"{prefix}a head holds {rows_max} rows but seq_len is {seq_len}", at)
    if nimp != seq_len and not (nimp == 0 and rows_max == 0):
        raise _err(err, f"{prefix}{nimp} importance entries for seq_len {seq_len}", at)


_MODE_NAMES = tuple(m.value for m in KvMode)
_U8 = struct.Struct("<B")


def _counts(a, name: str, heads: int) -> np.ndarray:
    a = np.asarray(a)
    if a.shape != (heads,) or a.dtype.kind not in "iu":
        raise ShapeError(f"kv export: {name} must be {heads} integers, got {a.dtype} {a.shape}")
    if heads and (int(a.min()) < 0 or int(a.max()) > _U32_MAX):
        raise WireError(f"kv export: a {name} count does not fit its 32-bit field")
    return a.astype("<u4")


def _block_name(name, what: str, err) -> str:
    if not isinstance(name, str) or not name.isascii() or not name.isidentifier() or not 1 <= len(name) <= MAX_NAME:
        raise err(f"{what} {name!r} is not an ASCII identifier of 1..{MAX_NAME} characters")
    return name


def _same_dtype(a, b) -> bool:
    a, b = np.dtype(a), np.dtype(b)
    return (a.kind, a.itemsize) == (b.kind, b.itemsize)


def _v3_chunks(st: LayerState) -> list:
    """The v3 storage body (docs/wire.md): refuses whatever decode would."""
    s = st.storage
    heads, hd = int(st.num_kv_heads), int(st.head_dim)
    if s.mode not in _MODE_NAMES:
        raise WireError(f"kv export: unknown KV mode {s.mode!r} (this runtime stores {', '.join(_MODE_NAMES)})")
    lens, xlen = _counts(s.lens, "lens", heads), _counts(s.xlen, "xlen", heads)
    exact_cap = _uint(s.exact_cap, "exact_cap", _U32_MAX)
    if heads and (xlen > np.minimum(lens, exact_cap)).any():
        h = int(np.flatnonzero(xlen > np.minimum(lens, exact_cap))[0])
        raise WireError(f"kv export: head {h} has {xlen[h]} exact rows, more than its {lens[h]} rows "
                        f"or the exact-row capacity {exact_cap}")
    lin = _f32_array(st.linear_state, "linear_state", 1)
    imp = _f32_array(st.imp, "imp", 1)
    seq_len = _uint(st.seq_len, "seq_len", _U32_MAX)
    _check_rows(seq_len, int(lens.max(initial=0)), imp.size, WireError, "kv export: ")
    if len(s.blocks) > MAX_BLOCKS:
        raise WireError(f"kv export: {len(s.blocks)} blocks, the format takes at most {MAX_BLOCKS}")
    table: list = []
    payload: list = []
    seen = set()
    for b in s.blocks:
        sp = b.spec
        name = _block_name(sp.name, "kv export: block name", WireError)
        if name in seen:
            raise WireError(f"kv export: block {name!r} listed twice")
        seen.add(name)
        code = _dtype_code(sp.dtype)
        if code is None:
            raise ShapeError(f"kv export: block {name!r} has dtype {np.dtype(sp.dtype)}, which the wire has no code for")
        shape = tuple(int(d) for d in sp.shape)
        if len(shape) > MAX_NDIM or any(not 1 <= d <= _U32_MAX for d in shape):
            raise ShapeError(f"kv export: block {name!r} per-row shape {list(shape)} (at most {MAX_NDIM} dims >= 1)")
        rc = RowClass(sp.rows)
        nb = name.encode("ascii")
        table += [_U8.pack(len(nb)), nb, _V3_ENTRY.pack(code, int(rc), len(shape)),
                  struct.pack(f"<{len(shape)}I", *shape)]
        le = DTYPE_CODES[code]
        if rc is RowClass.HEAD:
            parts, want = [b.data], [(heads,) + shape]
        else:
            if len(b.data) != heads:
                raise ShapeError(f"kv export: block {name!r} has {len(b.data)} heads, want {heads}")
            counts = lens if rc is RowClass.ROWS else xlen
            parts, want = list(b.data), [(int(counts[h]),) + shape for h in range(heads)]
        for h, (a, w) in enumerate(zip(parts, want)):
            if not isinstance(a, np.ndarray) or not _same_dtype(a.dtype, sp.dtype) or a.shape != w:
                got = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
                raise ShapeError(f"kv export: block {name!r} (head {h}) is {got}, want "
                                 f"{_dtype_name(sp.dtype)} {w}")
            if a.size:
                payload.append(np.ascontiguousarray(a, dtype=le))
    nm = s.mode.encode("ascii")
    head = _V3_HEAD.pack(seq_len, _uint(heads, "num_kv_heads", _U32_MAX), _uint(hd, "head_dim", _U32_MAX),
                         exact_cap, _uint(lin.size, "linear state length", _U32_MAX), imp.size, len(s.blocks))
    return ([_U32.pack(len(nm)), nm, head, _payload(lin, False), _payload(imp, False), lens.tobytes(),
             xlen.tobytes()] + table + payload)


def encode_full_body(state: LayerState, *, f16: bool) -> bytes:
    """The per-position record alone: the seed's legacy (unversioned) blob."""
    return b"".join(_full_chunks(state, bool(f16)))


def encode_layer(state: LayerState, *, f16: bool) -> bytes:
    """Header + record, byte for byte as the seed's ``export_wire`` writes
    them (v2); a state with a ``storage`` record is written as v3 (Full or
    FullTail only, f16 flag 0: its blocks carry their own dtypes). Raises
    WireError (a value does not fit, inconsistent position, missing ring) or
    ShapeError (an array of the wrong shape or dtype)."""
    f16 = bool(f16)
    if state.kind not in _KIND_VALUES:
        raise WireError(f"kv export: unknown wire kind {state.kind!r}")
    kind = WireKind(state.kind)
    v3 = state.storage is not None
    if v3 and kind not in (WireKind.Full, WireKind.FullTail):
        raise WireError(f"kv export: a {kind.name} record is v2 only (it carries no row storage)")
    if v3 and f16:
        raise WireError("kv export: f16 rounds F32 rows on the v2 wire; a v3 record carries its storage's "
                        "own blocks (export with f16=False)")
    base = _uint(state.base, "base", _U64_MAX)
    if kind in (WireKind.Full, WireKind.FullTail):
        kind = WireKind.FullTail if base > 0 else WireKind.Full
        if int(state.position) != base + int(state.seq_len):
            raise WireError(f"kv export: position {state.position} != base {base} + seq_len {state.seq_len}")
    position = _uint(state.position, "position", _U64_MAX)
    if position > MAX_POSITION:
        raise WireError(f"kv export: position {position} is past 2**53, which float64 positions do not resolve")
    header = _HEADER.pack(WIRE_MAGIC, WIRE_VERSION_STORAGE if v3 else WIRE_VERSION,
                          _uint(state.identity, "identity", _U64_MAX),
                          _uint(state.layer, "layer", _U32_MAX), int(kind), int(f16), 0, position)
    if v3:
        chunks = [header] + ([_U64.pack(base)] if kind is WireKind.FullTail else []) + _v3_chunks(state)
    elif kind is WireKind.Full:
        chunks = [header] + _full_chunks(state, f16)
    elif kind is WireKind.FullTail:
        chunks = [header, _U64.pack(base)] + _full_chunks(state, f16)
    elif kind is WireKind.Linear:
        lin = _f32_array(state.linear_state, "linear_state", 1)
        chunks = [header, _LINEAR_HEAD.pack(_uint(state.num_kv_heads, "num_kv_heads", _U32_MAX),
                                      _uint(state.head_dim, "head_dim", _U32_MAX),
                                      _uint(lin.size, "linear state length", _U32_MAX)),
                  _payload(lin, False)]
    else:
        b = state.bounded
        if b is None:
            raise WireError("kv export: bounded wire kind without an installed ring")
        shape = (state.num_kv_heads, b.window, state.head_dim)
        for name in ("ring_k", "ring_v"):
            if _f32_array(getattr(b, name), name, 3).shape != shape:
                raise ShapeError(f"kv export: {name} {getattr(b, name).shape}, want {shape}")
        if b.window < 1 or b.len != min(position, b.window) or b.head != position % b.window:
            raise WireError(f"kv export: ring len/head {b.len}/{b.head} inconsistent with "
                            f"position {position} (window {b.window})")
        fields = [_uint(x, n, _U32_MAX) for x, n in ((state.num_kv_heads, "num_kv_heads"),
                  (state.head_dim, "head_dim"), (b.window, "window"), (b.len, "len"), (b.head, "head"))]
        chunks = [header, _BOUNDED_HEAD.pack(*fields), _payload(b.ring_k, f16), _payload(b.ring_v, f16)]
    return b"".join(chunks)


# ----------------------------------------------------------------- import


def _err(cls, msg: str, at) -> Exception:
    e = cls(msg if at is None else f"{msg} (at byte {at})")
    e.offset = at
    return e


class _Reader:
    """Bounds-checked cursor over a blob. Every read checks the bytes left
    BEFORE it allocates, so no field can make the decoder allocate more
    than the buffer holds. ``materialize=False`` validates without copying
    (inspect)."""

    def __init__(self, mv: memoryview, start: int, materialize: bool, notes):
        self.mv, self.o, self.n = mv, start, len(mv)
        self.materialize, self.notes = materialize, notes

    def fail(self, msg: str, at=None):
        return _err(WireError, "kv import: " + msg, self.o if at is None else at)

    def need(self, nbytes: int, what: str, truncated: str) -> None:
        if nbytes > self.n - self.o:
            raise self.fail(f"truncated {truncated}: {what} needs {nbytes} bytes, {self.n - self.o} remain")

    def unpack(self, st: struct.Struct, what: str) -> tuple:
        self.need(st.size, what, "record")
        vals = st.unpack_from(self.mv, self.o)
        self.o += st.size
        return vals

    def floats(self, count: int, f16: bool, what: str):
        width = 2 if f16 else 4
        self.need(count * width, f"{what} ({count} × {'f16' if f16 else 'f32'})", "payload")
        at = self.o
        self.o += count * width
        if not self.materialize:
            return None
        if count == 0:
            return np.zeros(0, np.float32)
        # astype always copies: the result owns fresh memory whatever buf is.
        return np.frombuffer(self.mv, "<f2" if f16 else "<f4", count, at).astype(np.float32)

    def note(self, line: str) -> None:
        if self.notes is not None:
            self.notes.append(line)


def _geometry(r: _Reader, heads: int, hd: int, expect: Expect | None, at: int) -> None:
    if expect is not None and (heads != expect.num_kv_heads or hd != expect.head_dim):
        raise r.fail(f"peer sent {heads}×{hd} per position, this layer is "
                     f"{expect.num_kv_heads}×{expect.head_dim}", at)
    if hd == 0 and heads > 0:
        raise r.fail("head_dim 0 with KV heads", at)


def _full_body(r: _Reader, expect: Expect | None, header_f16: bool | None):
    start = r.o
    f16w, seq_len, heads, hd, lin, nimp = r.unpack(_FULL_HEAD, "Full body fields")
    r.note(f"Full body at byte {start}: f16 flag {f16w}, seq_len {seq_len}, heads×hd {heads}×{hd}, "
           f"linear state {lin} f32 ({4 * lin} bytes), importance {nimp} f32 ({4 * nimp} bytes)")
    _geometry(r, heads, hd, expect, start + 8)
    if f16w > 1:
        raise r.fail(f"Full body f16 flag {f16w} is neither 0 nor 1", start)
    f16 = f16w == 1
    if header_f16 is not None and header_f16 != f16:
        raise r.fail(f"header f16 flag {int(header_f16)} disagrees with the Full body's {f16w}", start)
    lin_a = r.floats(lin, False, "linear state")
    imp_a = r.floats(nimp, False, "importance")
    # Each head is at least two u32 counts: bound the loop by the bytes left.
    r.need(8 * heads, f"{heads} K/V count pairs", "record")
    ks, vs, rows_max, payload_at = [], [], 0, []
    for h in range(heads):
        pair, offs = [], []
        for which in "KV":
            at = r.o
            (n,) = r.unpack(_U32, f"{which} count of head {h}")
            if n % hd:
                raise r.fail(f"{which} of head {h} holds {n} elements, not a multiple of head_dim {hd}", at)
            if which == "V" and n != pair[0][0]:
                raise r.fail(f"head {h} holds {pair[0][0] // hd} K rows but {n // hd} V rows", at)
            offs.append(r.o)
            a = r.floats(n, f16, f"{which} of head {h}")
            pair.append((n, None if a is None else a.reshape(n // hd, hd)))
        rows_max = max(rows_max, pair[0][0] // hd)
        r.note(f"  head {h}: K and V {pair[0][0] // hd} rows each, "
               f"{2 * pair[0][0] * (2 if f16 else 4)} bytes ({'f16' if f16 else 'f32'})")
        ks.append(pair[0][1])
        vs.append(pair[1][1])
        payload_at.append(tuple(offs))
    _check_rows(seq_len, rows_max, nimp, WireError, "kv import: ", at=start + 4)
    return dict(seq_len=seq_len, num_kv_heads=heads, head_dim=hd, linear_state=lin_a,
                imp=imp_a, k=ks, v=vs, payload_at=payload_at, payload_width=2 if f16 else 4)


def _v3_body(r: _Reader, expect: Expect | None) -> dict:
    start = r.o
    (m,) = r.unpack(_U32, "mode name length")
    if not 1 <= m <= MAX_NAME:
        raise r.fail(f"mode name length {m} is not in 1..{MAX_NAME}", start)
    r.need(m, f"mode name ({m} bytes)", "record")
    at_name = r.o
    name = bytes(r.mv[at_name:at_name + m]).decode("ascii", "replace")
    r.o += m
    r.note(f"v3 storage body at byte {start}: mode {name!r}")
    if name not in _MODE_NAMES:
        raise r.fail(f"unknown KV mode {name!r}: this runtime stores {', '.join(_MODE_NAMES)}", at_name)
    schema = expect.storage if expect is not None else None
    if schema is not None and name != schema.mode:
        raise r.fail(f"the record stores {name} rows, this layer stores {schema.mode}: a v3 record imports only "
                     f"into a layer of its own mode (set layer.mode = {name!r} on an empty layer, clear() it "
                     f"first if it holds rows, then import)", at_name)
    at = r.o
    seq_len, heads, hd, exact_cap, lin, nimp, nblocks = r.unpack(_V3_HEAD, "v3 storage fields")
    r.note(f"  seq_len {seq_len}, heads×hd {heads}×{hd}, exact rows per head {exact_cap}, linear state {lin} "
           f"f32 ({4 * lin} bytes), importance {nimp} f32 ({4 * nimp} bytes), {nblocks} block(s)")
    _geometry(r, heads, hd, expect, at + 4)
    if schema is not None and exact_cap != schema.exact_cap:
        raise r.fail(f"the record keeps {exact_cap} exact rows per head, this layer's {name} storage keeps "
                     f"{schema.exact_cap}: build the importing layer with q8_exact_rows={exact_cap}", at + 12)
    if nblocks > MAX_BLOCKS:
        raise r.fail(f"{nblocks} blocks, the format takes at most {MAX_BLOCKS}", at + 24)
    lin_a = r.floats(lin, False, "linear state")
    imp_a = r.floats(nimp, False, "importance")
    r.need(8 * heads, f"{heads} lens and {heads} xlen counts", "record")
    lens_at = r.o
    lens = np.frombuffer(r.mv, "<u4", heads, lens_at).astype(np.int64)
    xlen = np.frombuffer(r.mv, "<u4", heads, lens_at + 4 * heads).astype(np.int64)
    r.o += 8 * heads
    if heads:
        bad = np.flatnonzero(lens > seq_len)
        if bad.size:
            h = int(bad[0])
            raise r.fail(f"a head holds {lens[h]} rows but seq_len is {seq_len} (head {h})", lens_at + 4 * h)
        bad = np.flatnonzero(xlen > np.minimum(lens, exact_cap))
        if bad.size:
            h = int(bad[0])
            raise r.fail(f"head {h} has {xlen[h]} exact rows, more than its {lens[h]} rows or the "
                         f"exact-row capacity {exact_cap}", lens_at + 4 * heads + 4 * h)
        if r.notes is not None and heads <= 64:
            r.note(f"  rows per head {lens.tolist()}, exact rows per head {xlen.tolist()}")
    _check_rows(seq_len, int(lens.max(initial=0)), nimp, WireError, "kv import: ", at=at + 20)
    specs = []
    seen = set()
    want = {b.name: b for b in schema.blocks} if schema is not None else None
    for i in range(nblocks):
        e_at = r.o
        (nl,) = r.unpack(_U8, f"name length of block {i}")
        if not 1 <= nl <= MAX_NAME:
            raise r.fail(f"block {i}: name length {nl} is not in 1..{MAX_NAME}", e_at)
        r.need(nl, f"name of block {i} ({nl} bytes)", "record")
        bname = bytes(r.mv[r.o:r.o + nl]).decode("ascii", "replace")
        r.o += nl
        if not (bname.isascii() and bname.isidentifier()):
            raise r.fail(f"block {i}: name {bname!r} is not an ASCII identifier", e_at + 1)
        if bname in seen:
            raise r.fail(f"block {bname!r} listed twice", e_at)
        seen.add(bname)
        code_at = r.o
        code, rc, ndim = r.unpack(_V3_ENTRY, f"entry of block {bname!r}")
        if code not in DTYPE_CODES:
            raise r.fail(f"block {bname!r}: unknown dtype code {code} (known: 1..{max(DTYPE_CODES)})", code_at)
        if rc not in RowClass._value2member_map_:
            raise r.fail(f"block {bname!r}: row class {rc} is not 0 (rows), 1 (exact) or 2 (head)", code_at + 1)
        if ndim > MAX_NDIM:
            raise r.fail(f"block {bname!r}: {ndim} per-row dims, at most {MAX_NDIM}", code_at + 2)
        dims = r.unpack(struct.Struct(f"<{ndim}I"), f"per-row shape of block {bname!r}")
        if 0 in dims:
            raise r.fail(f"block {bname!r}: per-row shape {list(dims)} has a zero dim", code_at + 3)
        sp = BlockSpec(bname, RowClass(rc), DTYPE_CODES[code], tuple(dims))
        if want is not None:
            w = want.get(bname)
            if w is None:
                raise r.fail(f"block {bname!r} is not part of this runtime's {name} storage (it holds "
                             f"{', '.join(want)})", e_at)
            if w.rows is not sp.rows or not _same_dtype(w.dtype, sp.dtype) or tuple(w.shape) != sp.shape:
                raise r.fail(f"block {sp.describe()}, but this runtime's {name} storage holds {w.describe()}", e_at)
        specs.append(sp)
    if want is not None and len(seen) != len(want):
        missing = [n for n in want if n not in seen]
        raise r.fail(f"the record lacks block(s) {', '.join(missing)} of this runtime's {name} storage", r.o)
    blocks = []
    for sp in specs:
        per_row = math.prod(sp.shape)
        counts = lens if sp.rows is RowClass.ROWS else xlen if sp.rows is RowClass.EXACT else None
        nrows = heads if counts is None else int(counts.sum())
        count = nrows * per_row
        r.need(count * sp.dtype.itemsize, f"block {sp.name!r} ({nrows} rows × {per_row} {_dtype_name(sp.dtype)})",
               "payload")
        at_b = r.o
        raw = np.frombuffer(r.mv, "u1" if sp.dtype.kind == "b" else sp.dtype, count, at_b)
        r.o += count * sp.dtype.itemsize
        r.note(f"  block {sp.describe()}: {nrows} rows, {count * sp.dtype.itemsize} bytes at byte {at_b}")
        if sp.dtype.kind == "b" and count and int(raw.max()) > 1:
            i = int(np.flatnonzero(raw > 1)[0])
            raise r.fail(f"block {sp.name!r} (bool) holds byte {raw[i]}, not 0 or 1", at_b + i)
        if not r.materialize:
            continue
        # astype always copies: fresh memory, native byte order.
        arr = raw.astype(sp.dtype.newbyteorder("="))
        if counts is None:
            data = arr.reshape((heads,) + sp.shape)
        else:
            ends = np.cumsum(counts) * per_row
            data = [arr[e - int(n) * per_row:e].reshape((int(n),) + sp.shape) for n, e in zip(counts, ends)]
        blocks.append(BlockRecord(sp, data))
    storage = StorageRecord(name, exact_cap, lens, xlen, blocks) if r.materialize else None
    return dict(seq_len=seq_len, num_kv_heads=heads, head_dim=hd, linear_state=lin_a, imp=imp_a,
                k=_empty_rows(heads, hd, r.materialize), v=_empty_rows(heads, hd, r.materialize),
                storage=storage, mode=name)


def _trailing(r: _Reader) -> None:
    if r.o != r.n:
        raise r.fail(f"{r.n - r.o} trailing byte(s) after the record")


def _empty_rows(heads: int, hd: int, materialize: bool) -> list:
    # Unmaterialized (inspect), heads is the peer's unchecked word: no list.
    return [np.zeros((0, hd), np.float32) for _ in range(heads)] if materialize else []


def _parse(mv: memoryview, expect: Expect | None, materialize: bool, notes) -> LayerState:
    r = _Reader(mv, 0, materialize, notes)
    if bytes(mv[:4]) != WIRE_MAGIC:
        r.note("legacy (unversioned) blob: the Full body alone")
        if expect is not None and not expect.linear_wire_allowed:
            raise r.fail("Delta linear state cannot use the unversioned cache wire; refusing "
                         "until the wire carries operator identity", 0)
        if expect is not None and (expect.bounded_window is not None or expect.kind is WireKind.Bounded):
            raise r.fail("a bounded anchor takes only the versioned wire (v2) — the unversioned "
                         "body has no ring record", 0)
        body = _full_body(r, expect, None)
        _trailing(r)
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
    _, version, identity, layer, kind_b, f16_b, zero, position = _HEADER.unpack_from(mv, 0)
    kname = WireKind(kind_b).name if kind_b in _KIND_VALUES else "unknown"
    r.note(f"header (32 bytes): magic CMFS, version {version}, identity {identity:016x}, "
           f"layer {layer}, kind {kind_b} ({kname}), f16 flag {f16_b}, reserved {zero}, "
           f"position {position}")
    if version not in WIRE_VERSIONS:
        raise r.fail(f"wire version {version}, this runtime speaks {WIRE_VERSION} and {WIRE_VERSION_STORAGE}", 4)
    if kind_b not in _KIND_VALUES:
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
    v3 = version == WIRE_VERSION_STORAGE
    if v3 and kind not in (WireKind.Full, WireKind.FullTail):
        raise r.fail(f"a v3 record carries Full or FullTail storage, not {kind.name} "
                     "(Linear and Bounded records are v2)", 20)
    # Beyond the seed: the flag and the reserved field have exactly one
    # meaning each, so any other value is a corrupt header.
    if f16_b > 1:
        raise r.fail(f"f16 flag {f16_b} is neither 0 nor 1", 21)
    if v3 and f16_b:
        raise r.fail("f16 flag 1 on a v3 record: its blocks carry their own dtypes, the flag must be 0", 21)
    if zero != 0:
        raise r.fail(f"reserved field is {zero}, not 0", 22)
    if position > MAX_POSITION:
        raise r.fail(f"position {position} is past 2**53, which float64 positions do not resolve "
                     "(a layer or ring cannot advance from it)", 24)
    f16 = f16_b == 1
    r.o = HEADER_SIZE
    if kind in (WireKind.Full, WireKind.FullTail):
        base = 0
        if kind is WireKind.FullTail:
            (base,) = r.unpack(_U64, "FullTail base")
            r.note(f"FullTail base {base}")
        body = _v3_body(r, expect) if v3 else _full_body(r, expect, f16)
        if kind is WireKind.Full and body["seq_len"] != position:
            raise r.fail(f"header position {position} != record seq_len {body['seq_len']}", 24)
        if kind is WireKind.FullTail and base + body["seq_len"] != position:
            raise r.fail(f"tail base {base} + {body['seq_len']} rows != header position {position}", 24)
        _trailing(r)
        return _state(kind, identity, layer, position, base, body)
    if kind is WireKind.Linear:
        at = r.o
        heads, hd, lin = r.unpack(_LINEAR_HEAD, "Linear record fields")
        r.note(f"Linear record at byte {at}: heads×hd {heads}×{hd}, state {lin} f32 ({4 * lin} bytes)")
        _geometry(r, heads, hd, expect, at)
        lin_a = r.floats(lin, False, "linear state")
        _trailing(r)
        return LayerState(kind, identity, layer, position, 0, position, heads, hd,
                          linear_state=lin_a, imp=np.zeros(0, np.float32) if materialize else None,
                          k=_empty_rows(heads, hd, materialize), v=_empty_rows(heads, hd, materialize))
    at = r.o
    heads, hd, window, blen, bhead = r.unpack(_BOUNDED_HEAD, "Bounded record fields")
    r.note(f"Bounded record at byte {at}: heads×window×hd {heads}×{window}×{hd}, len {blen}, "
           f"head {bhead}, ring K and V {2 * heads * window * hd * (2 if f16 else 4)} bytes "
           f"({'f16' if f16 else 'f32'})")
    if expect is not None:
        if expect.bounded_window is None:
            raise r.fail("bounded record for a layer without a ring", at)
        if (heads, hd, window) != (expect.num_kv_heads, expect.head_dim, expect.bounded_window):
            raise r.fail(f"bounded record {heads}×{window}×{hd} does not fit this layer's ring "
                         f"{expect.num_kv_heads}×{expect.bounded_window}×{expect.head_dim}", at)
    if window == 0:
        raise r.fail("bounded record with window 0", at + 8)
    if blen != min(position, window) or bhead != position % window:
        raise r.fail(f"bounded record len/head {blen}/{bhead} inconsistent with position "
                     f"{position} (window {window})", at + 12)
    n = heads * window * hd
    r.need(2 * n * (2 if f16 else 4), f"ring K and V ({2 * n} × {'f16' if f16 else 'f32'})", "payload")
    rk = r.floats(n, f16, "ring K")
    rv = r.floats(n, f16, "ring V")
    _trailing(r)
    if materialize:
        rk, rv = rk.reshape(heads, window, hd), rv.reshape(heads, window, hd)
    return LayerState(kind, identity, layer, position, 0, position, heads, hd,
                      linear_state=np.zeros(0, np.float32) if materialize else None,
                      imp=np.zeros(0, np.float32) if materialize else None,
                      k=_empty_rows(heads, hd, materialize), v=_empty_rows(heads, hd, materialize),
                      bounded=BoundedRecord(window, blen, bhead, rk, rv))


def _state(kind, identity, layer, position, base, body) -> LayerState:
    return LayerState(kind, identity, layer, position, base, body["seq_len"], body["num_kv_heads"],
                      body["head_dim"], linear_state=body["linear_state"], imp=body["imp"],
                      k=body["k"], v=body["v"], storage=body.get("storage"),
                      payload_at=body.get("payload_at", []), payload_width=body.get("payload_width", 4),
                      version=WIRE_VERSION_STORAGE if "mode" in body else WIRE_VERSION, mode=body.get("mode"))


def _view(buf) -> memoryview:
    if not isinstance(buf, (bytes, bytearray, memoryview)):
        raise WireError(f"kv import: expected a bytes-like blob, got {type(buf).__name__}")
    mv = memoryview(buf)
    if not mv.c_contiguous:
        raise WireError("kv import: the blob's buffer is not contiguous")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv


def decode_layer(buf, expect: Expect) -> LayerState:
    """Parse a v2 blob (or a legacy body) for the layer ``expect`` describes.

    Every seed refusal, plus the stricter checks of docs/wire.md, raises
    WireError naming what is wrong and at which byte. Nothing is mutated:
    the caller installs the returned state atomically, so a refused import
    leaves its layer exactly as it was."""
    return _parse(_view(buf), expect, True, None)


# -------------------------------------------------------------- container


def encode_cache(layer_blobs) -> bytes:
    """A whole cache: magic ``KVRC``, u32 version 1, u32 layer count, then per
    layer a u64 length and the layer's blob (opaque here)."""
    blobs = [memoryview(b).cast("B") for b in layer_blobs]
    chunks = [_CACHE_HEAD.pack(CACHE_MAGIC, CACHE_VERSION, _uint(len(blobs), "layer count", _U32_MAX))]
    for b in blobs:
        chunks += [_U64.pack(len(b)), b]
    return b"".join(chunks)


def _parse_cache(mv: memoryview, notes) -> list:
    r = _Reader(mv, 0, False, notes)
    if bytes(mv[:4]) != CACHE_MAGIC:
        raise r.fail("not a cache container (magic is not KVRC)", 0)
    magic_version_count = r.unpack(_CACHE_HEAD, "container header")
    _, version, count = magic_version_count
    if version != CACHE_VERSION:
        raise r.fail(f"cache container version {version}, this runtime speaks {CACHE_VERSION}", 4)
    r.note(f"cache container v{version}: {count} layer(s)")
    r.need(8 * count, f"{count} layer length fields", "record")  # before the list grows
    spans = []
    for i in range(count):
        (n,) = r.unpack(_U64, f"length of layer {i}")
        r.need(n, f"layer {i} blob ({n} bytes)", "payload")
        spans.append((r.o, n))
        r.o += n
    _trailing(r)
    return spans


def decode_cache(buf) -> list:
    """Split a cache container into its layer blobs (fresh ``bytes`` each);
    refuses bad magic/version, truncation and trailing bytes with WireError."""
    mv = _view(buf)
    return [bytes(mv[o:o + n]) for o, n in _parse_cache(mv, None)]


# ---------------------------------------------------------------- inspect


def inspect(buf) -> str:
    """A human report of a layer blob or a cache container: the header, a
    body summary and a verdict line, unindented: ``OK: ...`` or, for a broken
    blob, ``ERROR: <what is wrong> (at byte N)`` (a container with a broken
    layer blob ends with one such line per broken blob). Checks structure only:
    identity, layer and geometry are the importing layer's to judge. Never
    raises for bytes-like input."""
    try:
        mv = _view(buf)
    except WireError as e:
        return f"ERROR: {e}"
    if bytes(mv[:4]) == CACHE_MAGIC:
        notes: list = []
        try:
            spans = _parse_cache(mv, notes)
        except WireError as e:
            return "\n".join(notes + [f"ERROR: {e}"])
        verdicts = []
        for i, (o, n) in enumerate(spans):
            notes.append(f"layer blob {i} at byte {o}, {n} bytes:")
            report = inspect(mv[o:o + n]).splitlines()
            notes += ["  " + line for line in report]
            if report[-1].startswith("ERROR: "):
                verdicts.append(f"ERROR: layer blob {i} (at byte {o} of the container): {report[-1][7:]}")
        return "\n".join(notes + (verdicts or [f"OK: {len(spans)} layer blob(s)"]))
    notes = [f"{len(mv)} bytes"]
    try:
        st = _parse(mv, None, False, notes)
    except WireError as e:
        notes.append(f"ERROR: {e}")
        return "\n".join(notes)
    v3 = f" (v3, mode {st.mode})" if st.version == WIRE_VERSION_STORAGE else ""
    notes.append(f"OK: {st.kind.name} record{v3}, position {st.position}, seq_len {st.seq_len}, "
                 f"{st.num_kv_heads}×{st.head_dim}")
    return "\n".join(notes)
