"""``kv_abs_max``: the largest |k| and |v| a layer's float rows hold, kept
up to date lazily (a scan of the rows appended since the last call)."""

from __future__ import annotations

import numpy as np

from . import _validate as V
from .errors import ShapeError
from .quant import from_half
from .storage import Storage


class AbsMax:
    """The running maxima of one layer's float K and V rows, and how far the
    scan reached: ``rows`` overall, and per head (a head that was dead for
    earlier appends lags behind the longest, and its new rows sit below that
    mark)."""

    def __init__(self, layer):
        self._layer = layer
        self.maxima = [0.0, 0.0]
        self.rows = 0
        self.per_head = np.zeros(layer.num_kv_heads, dtype=np.int64)

    def changed(self, first: int) -> None:
        """Rows from ``first`` on changed (a truncation, clear, eviction): the
        next call rescans them."""
        self.rows = min(self.rows, first)

    def dropped_front(self, d: int) -> None:
        """The first ``d`` rows went (a trim): the scanned mark moves with the
        rows; left in place, rows appended after the trim up to the old mark
        would never be scanned."""
        self.rows = max(self.rows - d, 0)
        self.per_head = np.maximum(self.per_head - d, 0)

    @staticmethod
    def _held(st: Storage) -> int:
        return 0 if st.k is None and st.v is None else int(st.lens.max())

    def scan(self) -> tuple[float, float]:
        """(max |k|, max |v|) over the layer's float K and V rows, +inf once
        one is inf or NaN. Lazy: scans only rows appended since the last call."""
        st = self._layer.storage
        rows = self._held(st)
        if rows < self.rows:
            self.rows = 0
        if self.rows == 0:
            self.maxima = [0.0, 0.0]
            self.per_head[:] = 0
        # A lowered mark (truncation, clear) applies to every head.
        frm = np.minimum(self.per_head, self.rows)
        for i, blk in enumerate((st.k, st.v)):
            if blk is None:
                continue
            for h in range(st.num_kv_heads):
                n, f = int(st.lens[h]), int(frm[h])
                if n > f:
                    x = from_half(blk[h, f:n])
                    m = np.inf if not np.isfinite(x).all() else float(np.abs(x).max())
                    self.maxima[i] = max(self.maxima[i], m)
        self.rows = rows
        self.per_head = st.lens.astype(np.int64, copy=True)
        return (self.maxima[0], self.maxima[1])

    def scan_after(self, chunk) -> tuple[float, float]:
        """:meth:`scan` folding in the caller's maxima ``(from, upto, kmax,
        vmax)`` of rows it just appended, when they continue the scanned
        prefix and the layer holds exactly ``upto`` rows; else the scan."""
        st = self._layer.storage
        if not isinstance(chunk, (tuple, list)) or len(chunk) != 4:
            raise ShapeError(f"chunk must be (from, upto, kmax, vmax), got {chunk!r}")
        frm, upto = V.nonneg_int("chunk from", chunk[0]), V.nonneg_int("chunk upto", chunk[1])
        km, vm = (V.real_at_least(f"chunk {n}", x, 0.0) for n, x in (("kmax", chunk[2]), ("vmax", chunk[3])))
        lens = st.lens
        # Every head must have continued the scanned prefix: a head that
        # lagged holds new rows below `frm` that the caller's maxima may miss.
        ragged = ((self.per_head != frm) & (lens != self.per_head)).any() if frm else False
        if self.rows != frm or self._held(st) != upto or frm > upto or ragged:
            return self.scan()
        if frm == 0:
            self.maxima = [0.0, 0.0]
        self.maxima = [max(self.maxima[0], float(km)), max(self.maxima[1], float(vm))]
        self.rows = upto
        self.per_head = lens.astype(np.int64, copy=True)
        return (self.maxima[0], self.maxima[1])
