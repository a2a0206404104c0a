"""Wire export/import of a layer (format and refusals: docs/wire.md)."""

from __future__ import annotations

import numpy as np

from . import _validate as V
from .errors import ConfigError, WireError
from .modes import KvMode
from .storage import LayerStorage
from .wire import BoundedRecord, Expect, LayerState, WireKind, check_exportable, decode_layer, encode_layer


_LAYER_KINDS = (WireKind.Full, WireKind.Linear, WireKind.Bounded)


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
        """This layer's state as a v2 wire record (the seed's bytes exactly).

        Refuses rather than travelling half-complete: q8 storage, an O(1)
        overlay or frozen fields under F32 hold state the format does not
        describe. ``f16`` halves the K/V payloads (round to nearest even);
        recurrent and importance vectors stay f32.
        """
        f16 = V.flag("f16", f16)
        st = self._st
        check_exportable(st.mode is KvMode.F32, self._o1 is not None, st.field_frozen())
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

        Accepts the versioned wire (magic ``CMFS``) and, for full/linear
        layers, the legacy unversioned body. The whole blob is decoded and
        checked first; a refused import raises :class:`WireError` and leaves
        the layer exactly as it was. Learned sinks are weights: kept.
        """
        rec = decode_layer(buf, self._wire_expect())
        self._check_record(rec)
        self._apply_record(rec)

    def _wire_expect(self) -> Expect:
        """This layer's facts a peer's record is checked against."""
        return Expect(
            num_kv_heads=self.num_kv_heads, head_dim=self.head_dim, identity=self.wire_identity,
            layer=self.wire_layer, kind=self.wire_kind,
            bounded_window=None if self.bounded is None else self.bounded.window,
            linear_wire_allowed=self._linear_wire_allowed,
        )

    def _check_record(self, rec: LayerState) -> None:
        """What installing ``rec`` would refuse, refused now as a WireError:
        with this, :meth:`_apply_record` cannot fail, so a whole-cache import
        checks every layer before the first one changes."""
        if rec.kind == WireKind.Bounded:
            b = rec.bounded
            for name, ring in (("K", b.ring_k), ("V", b.ring_v)):
                if not np.isfinite(ring).all():
                    at = np.argwhere(~np.isfinite(ring))[0].tolist()
                    raise WireError(f"kv import: the bounded ring's {name} holds inf/NaN at [head, slot, channel] "
                                    f"{at} (a ring stores finite rows only; an f16 export of a value above "
                                    f"65504 travels as inf)")

    def _apply_record(self, rec: LayerState) -> None:
        # Nothing below can fail: the record is complete and checked
        # (decode_layer, then _check_record).
        fresh = LayerStorage(self.num_kv_heads, self.head_dim, KvMode.F32)
        if rec.kind in (WireKind.Full, WireKind.FullTail):
            rows = max((a.shape[0] for a in rec.k), default=0)
            # A record of positions with no row and no importance (a depth
            # counter) gets zero mass per position: the storage then counts
            # the same positions as the layer, so appends, export and
            # eviction keep working on it.
            fresh.reserve(max(rows, rec.seq_len))
            for h in range(self.num_kv_heads):
                n = rec.k[h].shape[0]
                if n:
                    fresh.k[h, :n] = rec.k[h]
                    fresh.v[h, :n] = rec.v[h]
                fresh.lens[h] = n
            fresh._imp[: rec.imp.shape[0]] = rec.imp
            fresh.seq_len = rec.seq_len
            self.linear_state = rec.linear_state
        elif rec.kind == WireKind.Linear:
            self.linear_state = rec.linear_state
        else:
            b = rec.bounded
            self.bounded.load(b.ring_k, b.ring_v, rec.position)
            # The undo rows describe inserts this side never made.
            self.bounded.reset_undo()
            self.linear_state = np.zeros(0, dtype=np.float32)
        self._st = fresh
        self._kv_rows_changed(0)
        self.discard_linear_scratch()
        self._init_o1()
        self._base = rec.base if rec.kind == WireKind.FullTail else 0
        self._seq_len = rec.seq_len
