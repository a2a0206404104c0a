"""A layer's wire export and import (format, refusals and the mode policy:
docs/wire.md): :class:`WireCodec`, held by every layer as ``layer.wire``.

The codec functions of this package (:mod:`kvreg.wire`) know bytes and
arrays; this module reads a layer's state into a record and installs a
decoded record into a layer, in two steps (:meth:`WireCodec.prepare` builds
and checks everything, :meth:`WireCodec.install` cannot fail), so a
whole-cache import changes no layer until every layer is ready.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, NamedTuple

import numpy as np

from .. import _validate as V
from ..errors import ConfigError, KvregError, WireError
from ..lifecycle import Lifecycle
from ..modes import KvMode
from ..storage import Storage, make_storage
from . import (
    BlockRecord,
    BlockSpec,
    BoundedRecord,
    Expect,
    LayerState,
    RowClass,
    StorageRecord,
    StorageSchema,
    WireKind,
    check_exportable,
    decode_layer,
    encode_layer,
)

if TYPE_CHECKING:
    from ..layer import LayerKvCache


_LAYER_KINDS = (WireKind.Full, WireKind.Linear, WireKind.Bounded)
#: The exact rows of a quantized side, and the frozen 2f field (per head).
_EXACT_BLOCKS = ("xk", "xv")
_FIELD_BLOCKS = ("kcol", "vcol", "kcol_set", "vcol_set")


@functools.lru_cache(maxsize=256)
def storage_schema(num_kv_heads: int, head_dim: int, mode: KvMode, exact_rows: int) -> StorageSchema:
    """What a ``make_storage(num_kv_heads, head_dim, mode, exact_rows)`` holds,
    read from a fresh one (so a mode whose storage declares its blocks needs no
    change here): every ``block_names()`` array (ROWS), the exact rows
    ``xk``/``xv`` it allocated (EXACT), and under a field mode the frozen
    per-channel field ``kcol``/``vcol`` with ``kcol_set``/``vcol_set`` (HEAD)."""
    st = make_storage(num_kv_heads, head_dim, mode, exact_rows)
    st.reserve(1)
    blocks = [BlockSpec(n, RowClass.ROWS, getattr(st, n).dtype, getattr(st, n).shape[2:]) for n in st.block_names()]
    exact = [n for n in _EXACT_BLOCKS if getattr(st, n, None) is not None]
    blocks += [BlockSpec(n, RowClass.EXACT, getattr(st, n).dtype, getattr(st, n).shape[2:]) for n in exact]
    head = (_FIELD_BLOCKS if getattr(mode, "field", False) else ()) + st.head_block_names()
    blocks += [BlockSpec(n, RowClass.HEAD, getattr(st, n).dtype, getattr(st, n).shape[1:]) for n in head]
    return StorageSchema(mode.value, int(st.exact_cap) if exact else 0, tuple(blocks))


def storage_record(st: Storage) -> StorageRecord:
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

    storage: Storage
    linear_state: np.ndarray
    base: int
    seq_len: int
    ring: BoundedRecord | None = None


class LinearState:
    """The seed's linear-core recurrent state of a layer (``layer.linear``):
    ``state`` travels on the wire (a Linear record), ``scratch`` is the
    tentative state during a speculative verify; float32 vectors, empty on
    full-attention layers."""

    def __init__(self):
        self.clear()

    @property
    def state(self) -> np.ndarray:
        return self._state

    @state.setter
    def state(self, value) -> None:
        self._state = V.float_vector("linear_state", value)

    @property
    def scratch(self) -> np.ndarray:
        return self._scratch

    @scratch.setter
    def scratch(self, value) -> None:
        self._scratch = V.float_vector("linear_scratch", value)

    def discard_scratch(self) -> None:
        self._scratch = np.zeros(0, dtype=np.float32)

    def install(self, state: np.ndarray) -> None:
        """An import's state (decoded float32), the scratch discarded."""
        self._state = state
        self.discard_scratch()

    def clear(self) -> None:
        self.install(np.zeros(0, dtype=np.float32))


class WireCodec:
    """``export`` / ``import_`` of one layer, and the v2 header fields it
    exchanges (``kind``, ``layer``, ``identity``: checked when set, since a
    bad value would otherwise surface as a TypeError at the next export)."""

    def __init__(self, owner: LayerKvCache, layer: int = 0):
        self._owner = owner
        self.kind = WireKind.Full
        self.layer = layer
        self.identity = 0
        #: the legacy-wire policy (delta layers refuse Linear records)
        self.linear_allowed = True

    @property
    def kind(self) -> WireKind:
        """The record kind this layer exports and accepts (Full, Linear or Bounded)."""
        return self._kind

    @kind.setter
    def kind(self, kind) -> None:
        if isinstance(kind, (bool, np.bool_)) or not isinstance(kind, (int, np.integer)) \
                or int(kind) not in [k.value for k in _LAYER_KINDS]:
            raise ConfigError(f"wire_kind must be WireKind.Full, WireKind.Linear or WireKind.Bounded, got {kind!r}")
        self._kind = WireKind(int(kind))

    @property
    def layer(self) -> int:
        """The layer index of the v2 header (u32)."""
        return self._layer

    @layer.setter
    def layer(self, layer) -> None:
        self._layer = V.integer("wire_layer", layer, 0, 0xFFFF_FFFF)

    @property
    def identity(self) -> int:
        """The operator identity of the v2 header (u64): a peer of another identity is refused."""
        return self._identity

    @identity.setter
    def identity(self, identity) -> None:
        self._identity = V.integer("wire_identity", identity, 0, 0xFFFF_FFFF_FFFF_FFFF)

    def allow_linear(self, allowed: bool) -> None:
        """Bind this layer to the legacy-wire policy (delta layers refuse it)."""
        with self._owner.lock:
            self.linear_allowed = V.flag("allowed", allowed)

    def _storage(self) -> Storage:
        lay = self._owner
        return make_storage(lay.num_kv_heads, lay.head_dim, lay.mode, lay.q8_exact_rows)

    def export(self, f16: bool = False) -> bytes:
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
        with self._owner.lock:
            return self._export(V.flag("f16", f16))

    def _export(self, f16: bool) -> bytes:
        lay = self._owner
        st, nkv, hd = lay.storage, lay.num_kv_heads, lay.head_dim
        overlay = lay.lifecycle in (Lifecycle.COLLECTING, Lifecycle.SEALED)
        if self.kind == WireKind.Full and st.mode is not KvMode.F32:
            check_exportable(True, overlay, False)
            if f16:
                raise WireError(f"kv export: f16=True rounds F32 rows; this {st.mode.value} layer exports its "
                                "storage's own blocks exactly (v3): export with f16=False")
            empty = [np.zeros((0, hd), np.float32)] * nkv
            state = LayerState(
                kind=WireKind.Full, identity=self.identity, layer=self.layer, position=lay.pos_len,
                base=lay.base, seq_len=lay.seq_len, num_kv_heads=nkv, head_dim=hd,
                linear_state=lay.linear_state, imp=st.imp, k=empty, v=empty, storage=storage_record(st),
            )
            return encode_layer(state, f16=False)
        # v2: the Linear/Bounded kinds carry no rows, whatever the mode.
        check_exportable(True, overlay, st.mode is KvMode.F32 and st.field_frozen())
        bounded = None
        if self.kind == WireKind.Bounded:
            b = lay.bounded
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
        k = [st.k[h, : st.lens[h]] if st.k is not None else np.zeros((0, hd), np.float32) for h in range(nkv)]
        v = [st.v[h, : st.lens[h]] if st.v is not None else np.zeros((0, hd), np.float32) for h in range(nkv)]
        state = LayerState(
            kind=self.kind, identity=self.identity, layer=self.layer, position=lay.pos_len,
            base=lay.base, seq_len=lay.seq_len, num_kv_heads=nkv, head_dim=hd,
            linear_state=lay.linear_state, imp=st.imp, k=k, v=v, bounded=bounded,
        )
        return encode_layer(state, f16=bool(f16))

    def import_(self, buf) -> None:
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
          rows are stored as ``extend`` would store them on an empty
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
        with self._owner.lock:
            self.install(self.prepare(decode_layer(buf, self.expect())))

    def expect(self) -> Expect:
        """This layer's facts a peer's record is checked against."""
        lay = self._owner
        return Expect(
            num_kv_heads=lay.num_kv_heads, head_dim=lay.head_dim, identity=self.identity,
            layer=self.layer, kind=self.kind,
            bounded_window=None if lay.bounded is None else lay.bounded.window,
            linear_wire_allowed=self.linear_allowed,
            storage=storage_schema(lay.num_kv_heads, lay.head_dim, lay.mode, lay.q8_exact_rows),
        )

    def prepare(self, rec: LayerState) -> _Install:
        """Everything installing ``rec`` takes, built and checked now, as a
        WireError where it is refused: with this, :meth:`install` cannot
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
            return _Install(self._storage(), rec.linear_state, 0, rec.seq_len)
        if rec.kind == WireKind.Bounded:
            b = rec.bounded
            assert b is not None   # decode gives every Bounded record its ring
            for name, ring in (("K", b.ring_k), ("V", b.ring_v)):
                if not np.isfinite(ring).all():
                    at = np.argwhere(~np.isfinite(ring))[0].tolist()
                    raise WireError(f"kv import: the bounded ring's {name} holds inf/NaN at [head, slot, channel] "
                                    f"{at} (a ring stores finite rows only; an f16 export of a value above "
                                    f"65504 travels as inf)")
            return _Install(self._storage(), empty, 0, rec.seq_len, b)
        base, seq_len = (rec.base if rec.kind == WireKind.FullTail else 0), rec.seq_len
        if rec.counts_only():
            # Positions that hold nothing: a Full layer takes them as an
            # empty prefix, as if trimmed, so they cost nothing (a record
            # of 64 bytes may claim 2**32 - 1 of them); a Linear layer, which
            # stores no row, counts them as a Linear record does.
            if self.kind == WireKind.Linear:
                return _Install(self._storage(), rec.linear_state, 0, seq_len)
            base, seq_len = base + seq_len, 0
        if rec.storage is not None:
            fresh = self._storage_from(rec, seq_len)
            bad = fresh.tiers_consistent()
            if bad:
                raise WireError(f"kv import: the {fresh.mode.value} record's {bad}")
        elif self._owner.mode is not KvMode.F32:
            fresh = self._converted(rec, seq_len)
        else:
            fresh = self._storage()
            fresh.load({"k": rec.k, "v": rec.v}, np.array([a.shape[0] for a in rec.k], np.int64), seq_len, rec.imp)
        return _Install(fresh, rec.linear_state, base, seq_len)

    def _converted(self, rec: LayerState, seq_len: int) -> Storage:
        """A v2 Full record's rows stored as ``extend`` stores them on an
        empty layer of this layer's mode and backend, ``seq_len`` positions."""
        lay = self._owner
        nkv, hd = lay.num_kv_heads, lay.head_dim
        fresh = self._storage()
        rows = np.array([a.shape[0] for a in rec.k], dtype=np.int64)
        # Head h is alive at the first rows[h] positions: one store per run
        # of positions with the same alive heads (all of them, commonly).
        cuts = sorted({0, seq_len, *rows.tolist()})
        for p0, p1 in zip(cuts, cuts[1:]):
            alive = rows > p0
            heads, n = np.flatnonzero(alive), p1 - p0
            if not alive.any():
                # Positions no head stores a row at: counted at once (a 2f
                # store would take them one at a time, its freeze finding no
                # row to freeze over until a head stores one).
                if not fresh.lens.any():
                    fresh.append({}, heads, n)
                    continue
                k = v = np.broadcast_to(np.zeros((1, 1, 1), np.float32), (n, nkv, hd))
            else:
                k = np.zeros((n, nkv, hd), np.float32)
                v = np.zeros((n, nkv, hd), np.float32)
                for h in heads:
                    k[:, h] = rec.k[h][p0:p1]
                    v[:, h] = rec.v[h][p0:p1]
            try:
                fresh.check_rows(k[:, heads], v[:, heads])
                fresh.store(k, v, heads, lay.backend)
            except KvregError as e:
                raise self._conversion_error(rec, rows, p0, p1, alive, e) from None
        fresh.set_importance(rec.imp)
        return fresh

    def _conversion_error(self, rec, rows, p0, p1, alive, err) -> WireError:
        """The refusal of rows this mode cannot store, at the byte of the
        first non-finite or largest value in the run extend refused."""
        at = None
        if rec.payload_at:
            worst = None
            for h in np.flatnonzero(alive):
                for arr, off in ((rec.k[h], rec.payload_at[h][0]), (rec.v[h], rec.payload_at[h][1])):
                    seg = np.abs(arr[p0:p1])
                    key = np.where(np.isfinite(seg), seg, np.inf)
                    i = int(np.argmax(key)) if key.size else 0
                    if key.size and (worst is None or key.flat[i] > worst[0]):
                        worst = (key.flat[i], off + (p0 * self._owner.head_dim + i) * rec.payload_width)
            at = None if worst is None else worst[1]
        msg = (f"kv import: this {self._owner.mode.value} layer cannot store the F32 record's rows as extend would "
               f"(positions {p0}..{p1 - 1}): {err}")
        e = WireError(msg if at is None else f"{msg} (at byte {at})")
        e.offset = at
        return e

    def _storage_from(self, rec: LayerState, seq_len: int) -> Storage:
        """A fresh storage of this layer's mode holding a v3 record's blocks
        bit for bit (decode checked mode, exact capacity, block table, counts),
        ``seq_len`` positions."""
        s = rec.storage
        assert s is not None   # called for v3 records, which decode with their storage
        fresh = self._storage()
        fresh.load({b.spec.name: b.data for b in s.blocks if b.spec.rows is not RowClass.HEAD},
                   s.lens, seq_len, rec.imp, xlen=s.xlen,
                   head_blocks={b.spec.name: b.data for b in s.blocks if b.spec.rows is RowClass.HEAD})
        return fresh

    def install(self, plan: _Install) -> None:
        """Install a prepared record: nothing here can fail."""
        lay = self._owner
        if plan.ring is not None:
            lay.bounded.load(plan.ring.ring_k, plan.ring.ring_v, plan.seq_len)
            # The undo rows describe inserts this side never made.
            lay.bounded.reset_undo()
        lay._install_state(plan.storage, plan.linear_state, plan.base, plan.seq_len)
