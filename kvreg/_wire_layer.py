"""Wire export/import of a layer (format, refusals and the mode policy: docs/wire.md)."""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from . import _validate as V
from .errors import ConfigError, KvregError, WireError
from .lifecycle import Lifecycle
from .modes import KvMode
from .storage import LayerStorage
from .wire import (
    BlockRecord, BlockSpec, BoundedRecord, Expect, LayerState, RowClass, StorageRecord, StorageSchema,
    WireKind, check_exportable, decode_layer, encode_layer,
)


_LAYER_KINDS = (WireKind.Full, WireKind.Linear, WireKind.Bounded)
#: The exact rows of a quantized side, and the frozen 2f field (per head).
_EXACT_BLOCKS = ("xk", "xv")
_FIELD_BLOCKS = ("kcol", "vcol", "kcol_set", "vcol_set")


@functools.lru_cache(maxsize=256)
def storage_schema(num_kv_heads: int, head_dim: int, mode: KvMode, exact_rows: int) -> StorageSchema:
    """What a ``LayerStorage(num_kv_heads, head_dim, mode, exact_rows)`` holds,
    read from a fresh one (so a mode whose storage declares its blocks needs no
    change here): every ``block_names()`` array (ROWS), the exact rows
    ``xk``/``xv`` it allocated (EXACT), and under a field mode the frozen
    per-channel field ``kcol``/``vcol`` with ``kcol_set``/``vcol_set`` (HEAD)."""
    st = LayerStorage(num_kv_heads, head_dim, mode, exact_rows)
    st.reserve(1)
    blocks = [BlockSpec(n, RowClass.ROWS, getattr(st, n).dtype, getattr(st, n).shape[2:]) for n in st.block_names()]
    exact = [n for n in _EXACT_BLOCKS if getattr(st, n, None) is not None]
    blocks += [BlockSpec(n, RowClass.EXACT, getattr(st, n).dtype, getattr(st, n).shape[2:]) for n in exact]
    head = (_FIELD_BLOCKS if getattr(mode, "field", False) else ()) + st.head_block_names()
    blocks += [BlockSpec(n, RowClass.HEAD, getattr(st, n).dtype, getattr(st, n).shape[1:]) for n in head]
    return StorageSchema(mode.value, int(st.exact_cap) if exact else 0, tuple(blocks))


def storage_record(st: LayerStorage) -> StorageRecord:
    """The v3 record of a storage: its blocks' stored rows, per head."""
    schema = storage_schema(st.num_kv_heads, st.head_dim, st.mode, st.exact_cap)
    nkv = st.num_kv_heads
    blocks = []
    for sp in schema.blocks:
        a = getattr(st, sp.name)
        if sp.rows is RowClass.HEAD:
            data = a
        else:
            counts = st.lens if sp.rows is RowClass.ROWS else st.xlen
            data = [np.zeros((0,) + sp.shape, sp.dtype) if a is None else a[h, : int(counts[h])]
                    for h in range(nkv)]
        blocks.append(BlockRecord(sp, data))
    return StorageRecord(schema.mode, schema.exact_cap, st.lens, st.xlen, blocks)


class _Install(NamedTuple):
    """What an import installs: the new storage, the recurrent state, the
    base and positions, and a bounded record's ring (None for the others)."""

    storage: LayerStorage
    linear_state: np.ndarray
    base: int
    seq_len: int
    ring: BoundedRecord | None = None


class WireMixin:
    """``export_wire`` / ``import_wire`` of :class:`~kvreg.layer.LayerKvCache`."""

    # The v2 header fields this layer exchanges, checked when set: a bad
    # value would otherwise surface as a TypeError at the next export.

    @property
    def wire_kind(self) -> WireKind:
        """The record kind this layer exports and accepts (Full, Linear or Bounded)."""
        return self._wire_kind

    @wire_kind.setter
    def wire_kind(self, kind) -> None:
        if isinstance(kind, (bool, np.bool_)) or not isinstance(kind, (int, np.integer)) \
                or int(kind) not in [k.value for k in _LAYER_KINDS]:
            raise ConfigError(f"wire_kind must be WireKind.Full, WireKind.Linear or WireKind.Bounded, got {kind!r}")
        self._wire_kind = WireKind(int(kind))

    @property
    def wire_layer(self) -> int:
        """The layer index of the v2 header (u32)."""
        return self._wire_layer

    @wire_layer.setter
    def wire_layer(self, layer) -> None:
        self._wire_layer = V.integer("wire_layer", layer, 0, 0xFFFF_FFFF)

    @property
    def wire_identity(self) -> int:
        """The operator identity of the v2 header (u64): a peer of another identity is refused."""
        return self._wire_identity

    @wire_identity.setter
    def wire_identity(self, identity) -> None:
        self._wire_identity = V.integer("wire_identity", identity, 0, 0xFFFF_FFFF_FFFF_FFFF)

    def export_wire(self, f16: bool = False) -> bytes:
        """This layer's state as a wire record (docs/wire.md).

        An F32 layer, and every Linear or Bounded wire kind, writes v2 (the
        seed's bytes exactly): ``f16`` halves its K/V payloads (round to
        nearest even); recurrent and importance vectors stay f32. A Full
        layer of any other storage mode (q8 modes, f16, bf16, ...) writes v3:
        its storage's own blocks, bit for bit (the int8 rows and scales, the
        exact rows, the frozen field and the freeze state), so the importer
        holds exactly this storage; ``f16=True`` is refused there (the rows
        already are in their stored format).

        Refuses rather than travelling half-complete: an O(1) overlay, or
        frozen fields under F32, hold state the format does not describe.
        """
        f16 = V.flag("f16", f16)
        st = self._st
        if self.wire_kind == WireKind.Full and st.mode is not KvMode.F32:
            check_exportable(True, self._lifecycle in (Lifecycle.COLLECTING, Lifecycle.SEALED), False)
            if f16:
                raise WireError(f"kv export: f16=True rounds F32 rows; this {st.mode.value} layer exports its "
                                "storage's own blocks exactly (v3): export with f16=False")
            empty = [np.zeros((0, self.head_dim), np.float32)] * self.num_kv_heads
            state = LayerState(
                kind=WireKind.Full, identity=self.wire_identity, layer=self.wire_layer, position=self.pos_len,
                base=self._base, seq_len=self._seq_len, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                linear_state=self.linear_state, imp=st.imp, k=empty, v=empty, storage=storage_record(st),
            )
            return encode_layer(state, f16=False)
        # v2: the Linear/Bounded kinds carry no rows, whatever the mode.
        check_exportable(True, self._lifecycle in (Lifecycle.COLLECTING, Lifecycle.SEALED),
                         st.mode is KvMode.F32 and st.field_frozen())
        bounded = None
        if self.wire_kind == WireKind.Bounded:
            b = self.bounded
            if b is None:
                raise WireError("kv export: bounded wire kind without an installed ring")
            if f16:
                # A ring stores finite rows only, so the importer refuses an
                # inf: refuse the f16 overflow here rather than ship it.
                with np.errstate(over="ignore"):
                    bad = [n for n, r in (("K", b.ring_k), ("V", b.ring_v))
                           if not np.isfinite(r.astype(np.float16)).all()]
                if bad:
                    raise WireError(f"kv export: the bounded ring's {' and '.join(bad)} hold values above f16's "
                                    "65504, which would travel as inf (a ring peer refuses inf): export f32")
            bounded = BoundedRecord(b.window, b.len(), b.head(), b.ring_k, b.ring_v)
        k = [st.k[h, : st.lens[h]] if st.k is not None else np.zeros((0, self.head_dim), np.float32)
             for h in range(self.num_kv_heads)]
        v = [st.v[h, : st.lens[h]] if st.v is not None else np.zeros((0, self.head_dim), np.float32)
             for h in range(self.num_kv_heads)]
        state = LayerState(
            kind=self.wire_kind, identity=self.wire_identity, layer=self.wire_layer, position=self.pos_len,
            base=self._base, seq_len=self._seq_len, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
            linear_state=self.linear_state, imp=st.imp, k=k, v=v, bounded=bounded,
        )
        return encode_layer(state, f16=bool(f16))

    def import_wire(self, buf) -> None:
        """Install a peer's state over this layer.

        Accepts the versioned wire (magic ``CMFS``, v2 and v3) and, for
        full/linear layers, the legacy unversioned body. The layer's mode
        never changes (docs/wire.md, "Mode policy"):

        * a v3 record of this layer's mode is installed exactly: the same
          storage bit for bit (its re-export is byte-identical, attention
          answers identically, a q8_2f layer not frozen yet freezes as the
          exporter would). Its exact-row capacity must equal this layer's
          ``q8_exact_rows``;
        * a v2 (F32) record into a layer of another mode is converted: its
          rows are stored as :meth:`extend` would store them on an empty
          layer (head ``h`` alive at the first ``rows_h`` positions), then its
          importance, linear state and base are installed; rows that mode
          cannot store (inf/NaN under q8, past ±65504 under f16) are refused;
        * a v3 record of another mode is refused, naming both modes (set
          ``layer.mode`` on an empty layer first);
        * a record of positions that holds no row and no importance (a depth
          counter) costs nothing: a Full layer takes its positions as an
          empty prefix (``base`` is the record's position, no row is stored),
          a Linear layer counts them.

        The whole blob is decoded and checked first (a v3 record's CRC-32
        included), and everything the install needs is built before the
        layer changes; a refused import raises :class:`WireError` and leaves
        the layer exactly as it was. Learned sinks are weights: kept.
        """
        self._install(self._prepare(decode_layer(buf, self._wire_expect())))

    def _wire_expect(self) -> Expect:
        """This layer's facts a peer's record is checked against."""
        return Expect(
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, identity=self.wire_identity,
            layer=self.wire_layer, kind=self.wire_kind,
            bounded_window=None if self.bounded is None else self.bounded.window,
            linear_wire_allowed=self._linear_wire_allowed,
            storage=storage_schema(self.num_kv_heads, self.head_dim, self.mode, self.q8_exact_rows),
        )

    def _prepare(self, rec: LayerState) -> _Install:
        """Everything installing ``rec`` takes, built and checked now, as a
        WireError where it is refused: with this, :meth:`_install` cannot
        fail, so a whole-cache import prepares every layer before the first
        one changes. The mode stays this layer's."""
        try:
            return self._prepared(rec)
        except MemoryError:
            raise WireError(f"kv import: the record for layer {rec.layer} ({rec.seq_len} positions) needs more "
                            "memory than this process can allocate; nothing was installed") from None

    def _prepared(self, rec: LayerState) -> _Install:
        empty = np.zeros(0, dtype=np.float32)
        if rec.kind == WireKind.Linear:
            return _Install(self._new_storage(self.mode), rec.linear_state, 0, rec.seq_len)
        if rec.kind == WireKind.Bounded:
            b = rec.bounded
            for name, ring in (("K", b.ring_k), ("V", b.ring_v)):
                if not np.isfinite(ring).all():
                    at = np.argwhere(~np.isfinite(ring))[0].tolist()
                    raise WireError(f"kv import: the bounded ring's {name} holds inf/NaN at [head, slot, channel] "
                                    f"{at} (a ring stores finite rows only; an f16 export of a value above "
                                    f"65504 travels as inf)")
            return _Install(self._new_storage(self.mode), empty, 0, rec.seq_len, b)
        base, seq_len = (rec.base if rec.kind == WireKind.FullTail else 0), rec.seq_len
        if rec.counts_only():
            # Positions that hold nothing: a Full layer takes them as an
            # empty prefix, as if trimmed, so they cost nothing (a record
            # of 64 bytes may claim 2**32 - 1 of them); a Linear layer, which
            # stores no row, counts them as a Linear record does.
            if self.wire_kind == WireKind.Linear:
                return _Install(self._new_storage(self.mode), rec.linear_state, 0, seq_len)
            base, seq_len = base + seq_len, 0
        if rec.storage is not None:
            fresh = self._storage_from(rec, seq_len)
            bad = fresh.tiers_consistent()
            if bad:
                raise WireError(f"kv import: the {self.mode.value} record's {bad}")
        elif self.mode is not KvMode.F32:
            fresh = self._converted(rec, seq_len)
        else:
            fresh = self._new_storage(self.mode)
            fresh.load({"k": rec.k, "v": rec.v}, np.array([a.shape[0] for a in rec.k], np.int64), seq_len, rec.imp)
        return _Install(fresh, rec.linear_state, base, seq_len)

    def _converted(self, rec: LayerState, seq_len: int) -> LayerStorage:
        """A v2 Full record's rows stored as :meth:`extend` stores them on an
        empty layer of this layer's mode and backend, ``seq_len`` positions."""
        nkv, hd = self.num_kv_heads, self.head_dim
        from .layer import LayerKvCache   # the layer module imports this one

        tmp = LayerKvCache(nkv, hd, self.mode, self.backend, q8_exact_rows=self.q8_exact_rows)
        rows = np.array([a.shape[0] for a in rec.k], dtype=np.int64)
        # Head h is alive at the first rows[h] positions: one extend per run
        # of positions with the same alive heads (all of them, commonly).
        cuts = sorted({0, seq_len, *rows.tolist()})
        for p0, p1 in zip(cuts, cuts[1:]):
            alive = rows > p0
            n = p1 - p0
            if not alive.any() and not tmp._st.lens.any():
                # No head stores a row here or before: extend would only
                # count these positions (under a 2f mode one at a time, its
                # freeze finding no row to freeze over), so count them at once.
                tmp._st.append({}, np.flatnonzero(alive), n)
                tmp._seq_len += n
                continue
            if alive.any():
                k = np.zeros((n, nkv, hd), np.float32)
                v = np.zeros((n, nkv, hd), np.float32)
                for h in np.flatnonzero(alive):
                    k[:, h] = rec.k[h][p0:p1]
                    v[:, h] = rec.v[h][p0:p1]
            else:
                # Positions no head stores: counted, never read (no copy).
                k = v = np.broadcast_to(np.zeros((1, 1, 1), np.float32), (n, nkv, hd))
            try:
                tmp._extend(k, v, alive)
            except KvregError as e:
                raise self._conversion_error(rec, rows, p0, p1, alive, e) from None
        fresh = tmp._st
        fresh.set_importance(rec.imp)
        return fresh

    def _conversion_error(self, rec, rows, p0, p1, alive, err) -> WireError:
        """The refusal of rows this mode cannot store, at the byte of the
        first non-finite or largest value in the run extend refused."""
        at = None
        if rec.payload_at:
            worst = None
            for h in np.flatnonzero(alive):
                for side, (arr, off) in enumerate(((rec.k[h], rec.payload_at[h][0]), (rec.v[h], rec.payload_at[h][1]))):
                    seg = np.abs(arr[p0:p1])
                    key = np.where(np.isfinite(seg), seg, np.inf)
                    i = int(np.argmax(key)) if key.size else 0
                    if key.size and (worst is None or key.flat[i] > worst[0]):
                        worst = (key.flat[i], off + (p0 * self.head_dim + i) * rec.payload_width)
            at = None if worst is None else worst[1]
        msg = (f"kv import: this {self.mode.value} layer cannot store the F32 record's rows as extend would "
               f"(positions {p0}..{p1 - 1}): {err}")
        e = WireError(msg if at is None else f"{msg} (at byte {at})")
        e.offset = at
        return e

    def _storage_from(self, rec: LayerState, seq_len: int) -> LayerStorage:
        """A fresh storage of this layer's mode holding a v3 record's blocks
        bit for bit (decode checked mode, exact capacity, block table, counts),
        ``seq_len`` positions."""
        s = rec.storage
        fresh = self._new_storage(self.mode)
        fresh.load({b.spec.name: b.data for b in s.blocks if b.spec.rows is not RowClass.HEAD},
                   s.lens, seq_len, rec.imp, xlen=s.xlen,
                   head_blocks={b.spec.name: b.data for b in s.blocks if b.spec.rows is RowClass.HEAD})
        return fresh

    def _install(self, plan: _Install) -> None:
        # Nothing below can fail: _prepare built and checked all of it.
        if plan.ring is not None:
            self.bounded.load(plan.ring.ring_k, plan.ring.ring_v, plan.seq_len)
            # The undo rows describe inserts this side never made.
            self.bounded.reset_undo()
        self._st = plan.storage
        self.linear_state = plan.linear_state
        self._kv_rows_changed(0)
        self.discard_linear_scratch()
        self._init_o1()
        self._base = plan.base
        self._seq_len = plan.seq_len
