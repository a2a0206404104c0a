"""What every part of the wire codec shares: constants, field layouts, the
plain records export reads and import returns, the importing layer's facts
(:class:`Expect`), the bounds-checked reader and the CRC-32."""

from __future__ import annotations

import enum
import math
import struct
import zlib
from dataclasses import dataclass, field

import numpy as np

from kvreg.errors import ShapeError, WireError


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
#: Header flag (the u16 at byte 22, 0 in every v2 record): the record ends
#: with a CRC-32 of every byte before it. Every v3 record kvreg writes sets it.
FLAG_CRC32 = 1
CACHE_MAGIC = b"KVRC"
#: The container version kvreg writes: a CRC-32 after each layer blob.
CACHE_VERSION = 2
#: Container versions read: 1 (no checksums) and 2.
CACHE_VERSIONS = (1, 2)

HEADER = struct.Struct("<4sIQIBBHQ")  # magic, version, identity, layer, kind, f16, flags, position
FULL_HEAD = struct.Struct("<6I")  # f16, seq_len, heads, hd, lin, nimp
CACHE_HEAD = struct.Struct("<4sII")  # magic, version, layer count
LINEAR_HEAD = struct.Struct("<3I")  # heads, hd, linear length
BOUNDED_HEAD = struct.Struct("<5I")  # heads, hd, window, len, head
V3_HEAD = struct.Struct("<7I")  # seq_len, heads, hd, exact_cap, lin, nimp, nblocks
V3_ENTRY = struct.Struct("<BBB")  # dtype code, row class, ndim
KIND_VALUES = frozenset(k.value for k in WireKind)
U8 = struct.Struct("<B")
U32 = struct.Struct("<I")
U64 = struct.Struct("<Q")
U32_MAX = 0xFFFF_FFFF
U64_MAX = 0xFFFF_FFFF_FFFF_FFFF
#: The largest position a record may carry (the u64 field holds more): past
#: 2**53 float64 does not resolve positions (RoPE angles), and a layer or
#: ring refuses to count beyond it, so importing one would land a state the
#: next step cannot advance.
MAX_POSITION = 2**53


def crc32(chunks) -> int:
    """CRC-32 (zlib's, the IEEE 802.3 polynomial) of the concatenated
    buffers ``chunks`` (bytes, memoryviews, contiguous arrays), unjoined."""
    c = 0
    for chunk in chunks:
        c = zlib.crc32(chunk, c)
    return c


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
DTYPE_CODES: dict[int, np.dtype] = {
    1: np.dtype("<f4"), 2: np.dtype("<f2"), 3: np.dtype("i1"), 4: np.dtype("u1"),
    5: np.dtype("<i2"), 6: np.dtype("<u2"), 7: np.dtype("<i4"), 8: np.dtype("<u4"),
    9: np.dtype("<i8"), 10: np.dtype("<u8"), 11: np.dtype("<f8"), 12: np.dtype("?"),
}
_CODE_OF = {(d.kind, d.itemsize): c for c, d in DTYPE_CODES.items()}
#: Bounds of a v3 table (a storage holds a handful of blocks).
MAX_BLOCKS = 64
MAX_NAME = 32
MAX_NDIM = 4
#: The most bytes one row of a v3 block may take (a u32, as every count of
#: the format). A block of no rows carries none of them, and numpy cannot
#: even describe an empty array whose row is past 2**63 bytes.
MAX_ROW_BYTES = U32_MAX


def dtype_code(dt) -> int | None:
    dt = np.dtype(dt)
    return _CODE_OF.get((dt.kind, dt.itemsize))


def dtype_name(dt) -> str:
    return "bool" if np.dtype(dt).kind == "b" else np.dtype(dt).newbyteorder("=").name


def row_bytes(shape, dtype) -> int:
    """Bytes of one row of a block of per-row ``shape`` and ``dtype``."""
    return math.prod(shape) * np.dtype(dtype).itemsize


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
        return f"{self.name}: {dtype_name(self.dtype)} {list(self.shape)} per {per}"


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

    def counts_only(self) -> bool:
        """Whether the record is a depth counter: positions, no row of any
        head and no importance (a Linear layer's legacy body, a layer whose
        positions were all dropped). Its positions cost the importer nothing:
        a Full layer takes them as an empty prefix (docs/wire.md)."""
        if self.kind not in (WireKind.Full, WireKind.FullTail) or self.imp.size:
            return False
        if self.storage is not None:
            return not self.storage.lens.any()
        return not any(a.shape[0] for a in self.k)


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
        if self.kind in KIND_VALUES:  # a plain int becomes the enum member
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


def uint(value, name: str, top: int) -> int:
    v = int(value)
    if not 0 <= v <= top:
        raise WireError(f"kv export: {name} {v} does not fit its {top.bit_length()}-bit field")
    return v


def f32_array(a, name: str, ndim: int) -> np.ndarray:
    if not isinstance(a, np.ndarray) or a.dtype != np.float32 or a.ndim != ndim:
        got = f"{a.dtype} {a.ndim}-D" if isinstance(a, np.ndarray) else type(a).__name__
        raise ShapeError(f"kv export: {name} must be a float32 {ndim}-D array, got {got}")
    return a


def payload(a: np.ndarray, f16: bool) -> np.ndarray:
    # Arrays go to bytes.join as buffers: a contiguous little-endian f32
    # array is copied once, straight into the blob. astype(float16) is IEEE
    # round-to-nearest-even (pinned by the tests); overflow to inf is the
    # format's rule, not an accident, so numpy's warning is silenced.
    if not f16:
        return np.ascontiguousarray(a, dtype="<f4")
    with np.errstate(over="ignore"):
        return np.ascontiguousarray(a, dtype="<f2")


def check_rows(seq_len: int, rows_max: int, nimp: int, err, prefix: str, at=None) -> None:
    # Beyond the seed: a head cannot hold more rows than there are positions,
    # and eviction indexes imp per position, so its length is seq_len (empty
    # only for a record that stores no row at all: a position counter).
    if rows_max > seq_len:
        raise error(err, f"{prefix}a head holds {rows_max} rows but seq_len is {seq_len}", at)
    if nimp != seq_len and not (nimp == 0 and rows_max == 0):
        raise error(err, f"{prefix}{nimp} importance entries for seq_len {seq_len}", at)


# ----------------------------------------------------------------- import


def error(cls, msg: str, at) -> Exception:
    e = cls(msg if at is None else f"{msg} (at byte {at})")
    e.offset = at
    return e


class Reader:
    """Bounds-checked cursor over a blob. Every read checks the bytes left
    BEFORE it allocates, so no field can make the decoder allocate more
    than the buffer holds. ``materialize=False`` validates without copying
    (inspect)."""

    def __init__(self, mv: memoryview, start: int, materialize: bool, notes):
        self.mv, self.o, self.n = mv, start, len(mv)
        self.materialize, self.notes = materialize, notes

    def fail(self, msg: str, at=None):
        return error(WireError, "kv import: " + msg, self.o if at is None else at)

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

    def trailing(self) -> None:
        if self.o != self.n:
            raise self.fail(f"{self.n - self.o} trailing byte(s) after the record")


def geometry(r: Reader, heads: int, hd: int, expect: Expect | None, at: int) -> None:
    if expect is not None and (heads != expect.num_kv_heads or hd != expect.head_dim):
        raise r.fail(f"peer sent {heads}×{hd} per position, this layer is "
                     f"{expect.num_kv_heads}×{expect.head_dim}", at)
    if hd == 0 and heads > 0:
        raise r.fail("head_dim 0 with KV heads", at)


def empty_rows(heads: int, hd: int, materialize: bool) -> list:
    # Unmaterialized (inspect), heads is the peer's unchecked word: no list.
    return [np.zeros((0, hd), np.float32) for _ in range(heads)] if materialize else []


def view(buf) -> memoryview:
    if not isinstance(buf, (bytes, bytearray, memoryview)):
        raise WireError(f"kv import: expected a bytes-like blob, got {type(buf).__name__}")
    mv = memoryview(buf)
    if not mv.c_contiguous:
        raise WireError("kv import: the blob's buffer is not contiguous")
    return mv.cast("B") if mv.format != "B" or mv.ndim != 1 else mv
