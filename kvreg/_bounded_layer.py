"""The natively bounded anchor of a layer (``swa_sink_v1``): a fixed ring
installed once from the model header; nothing is stored per position."""

from __future__ import annotations

from .bounded import BoundedSnapshot, BoundedState, check_bounded_attend_args, ring_view
from .errors import StateError
from .lifecycle import Lifecycle


class BoundedMixin:
    """``install_bounded``, ``bounded_step`` and the ring's snapshots."""

    def install_bounded(self, window: int, *, undo_depth: int = 8) -> None:
        """Give this layer its fixed ring (``[kvh, window, hd]`` K and V).
        Called once at load; ``clear()`` zeroes it, nothing reallocates it."""
        from .wire import WireKind

        if self._seq_len or self._st.seq_len:
            raise StateError(f"install_bounded on a layer holding {self._seq_len} rows: install at load")
        if self._lifecycle in (Lifecycle.COLLECTING, Lifecycle.SEALED):
            raise StateError(f"install_bounded on a layer with an O(1) overlay ({self._lifecycle.value})")
        self.bounded = BoundedState(self.num_kv_heads, self.head_dim, window, undo_depth=undo_depth)
        self.wire_kind = WireKind.Bounded
        self._lifecycle = Lifecycle.BOUNDED

    def bounded_step(self, q, k, v, weights, rope, scale: float, num_heads: int):
        """One position: insert raw ``k, v`` (``[kvh, hd]``) into slot
        ``t mod W``, then attend every Q head of ``q`` (``[nh, hd]``, raw) over
        its group's sinks ∪ newest rows. Returns ``[num_heads, hd]``.

        Everything is validated before the insert: a refused step leaves the
        ring and the depth as they were.
        """
        b = self.bounded
        if b is None:
            raise StateError("bounded_step on a layer without an installed ring (install_bounded)")
        # Validate against the ring as it will be after the insert.
        after = ring_view(b.ring_k, b.ring_v, b.seen + 1, weights.sink_k, weights.sink_v,
                          weights.group_windows, rope)
        check_bounded_attend_args(q, after, scale, num_heads)
        b.insert(k, v)
        out = self.backend.bounded_attend(q, b.view(weights, rope), scale=scale, num_heads=num_heads)
        # The honest context depth for the memory/seq report.
        self._seq_len += 1
        return out

    def bounded_state_bytes(self) -> int:
        """Bytes of the bounded ring (0 on other layers)."""
        return 0 if self.bounded is None else self.bounded.state_bytes()

    def bounded_snapshot(self) -> BoundedSnapshot | None:
        """Bit-for-bit copy of the ring for speculation (None on other layers)."""
        return None if self.bounded is None else self.bounded.snapshot()

    def bounded_restore(self, snap: BoundedSnapshot) -> None:
        """Restore a ring snapshot; ``seq_len`` follows the restored counter."""
        if self.bounded is None:
            return
        self.bounded.restore(snap)
        self._seq_len = self.bounded.seen
        self._new_generation()
