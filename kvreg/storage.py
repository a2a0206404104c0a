"""The storage interface: one layer's rows, head-major (docs/kernels.md).

:class:`LayerStorage` owns the arrays every kernel reads. Head ``h``'s rows
are contiguous (``block[h, :lens[h]]``), so a per-head attend reads a straight
slice and a layer kernel can stride over heads. Capacity doubles as rows
arrive (amortized O(1) appends, never a copy of everything per token).

Contract for code that mutates storage (the layer does, kernels never do):

* ``generation`` takes a fresh process-wide value on every change a device
  copy cannot follow by its row count (clear, trim, eviction, import, seal);
  appends and truncations keep it (the seed's rule).
* ``truncate_last`` keeps the generation, so it bumps ``edits`` and logs the
  per-head row counts it left: :meth:`edit_floor` tells a mirror which of its
  rows may since have been rewritten.
* Dead heads (``alive[h] == False`` at append) store nothing: their ``lens``
  stay, and their pages of the blocks are never written, so never faulted in.

Exact rows (q8 only): the first ``exact_cap`` rows of each head are also held
in float32, ``xk``/``xv [nkv, exact_cap, hd]``, for the quantized side(s).
They are stored in FIELD SPACE (divided by the head's 2f field, like the
quantizer's input), so a kernel treats an exact row as an already
dequantized row: scores use ``q ⊙ kcol``, values are multiplied by ``vcol``
at the end, as for int8 rows. ``xlen[h]`` is how many leading rows of head
``h`` are exact: rows ``[0, xlen[h])`` are read from ``xk``/``xv``, the rest
from the int8 blocks. Their int8 copies stay stored (the seed's layout, the
freeze and the exact-class kernels are unchanged). This is attention-sink
aware quantization (KVQuant keeps the first token in full precision): the
sink takes a large share of most queries' mass, so its quantization error
dominates the output error of a q8 cache.
"""

from __future__ import annotations

import itertools
from collections import deque

import numpy as np

from .modes import KV_K_GROUP, KvMode
from .quant import dequantize_rows, from_half, num_groups

_GEN = itertools.count(1)


def next_generation() -> int:
    """A process-wide fresh storage generation (``next`` on a count is atomic)."""
    return next(_GEN)


_FLOOR_LOG = 64


class LayerStorage:
    """Rows of one layer in the layout of docs/kernels.md."""

    def __init__(self, num_kv_heads: int, head_dim: int, mode: KvMode, exact_rows: int = 0):
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.mode = mode
        self.ngk = num_groups(head_dim, KV_K_GROUP)
        self.cap = 0
        self.lens = np.zeros(num_kv_heads, dtype=np.int64)
        self.seq_len = 0
        self._imp = np.zeros(0, dtype=np.float32)
        self.k = self.v = self.kq = self.ks = self.vq = self.vs = None
        self.kcol = np.ones((num_kv_heads, head_dim), dtype=np.float32)
        self.vcol = np.ones((num_kv_heads, head_dim), dtype=np.float32)
        self.kcol_set = np.zeros(num_kv_heads, dtype=bool)
        self.vcol_set = np.zeros(num_kv_heads, dtype=bool)
        self.exact_cap = int(exact_rows) if mode.quantized else 0
        xshape = (num_kv_heads, self.exact_cap, head_dim)
        self.xk = np.zeros(xshape, np.float32) if self.exact_cap and mode.quant_k else None
        self.xv = np.zeros(xshape, np.float32) if self.exact_cap and mode.quant_v else None
        self.xlen = np.zeros(num_kv_heads, dtype=np.int64)
        self.generation = next_generation()
        self.edits = 0
        self._floors: deque[tuple[int, np.ndarray]] = deque(maxlen=_FLOOR_LOG)

    # ── views ──

    @property
    def imp(self) -> np.ndarray:
        """Accumulated attention mass per stored row (a view, ``[seq_len]``)."""
        return self._imp[: self.seq_len]

    def block_names(self) -> tuple[str, ...]:
        names = ("kq", "ks") if self.mode.quant_k else ("k",)
        return names + (("vq", "vs") if self.mode.quant_v else ("v",))

    def head_rows(self, h: int) -> int:
        return int(self.lens[h])

    def exact_rows_wanted(self, heads: np.ndarray, n: int) -> int:
        """How many of the next ``n`` rows of ``heads`` become exact rows (the
        most over those heads): a row is exact when it lands at index
        ``< exact_cap`` right after the head's exact rows."""
        # past the exact rows on every head (every append after the first
        # few): one reduction, no fancy indexing, on the append hot path
        if not self.exact_cap or not heads.size or int(self.lens.min()) >= self.exact_cap:
            return 0
        at = self.lens[heads]
        open_ = (self.xlen[heads] == at) & (at < self.exact_cap)
        return int(min(n, (self.exact_cap - at[open_]).max())) if open_.any() else 0

    def attended_rows(self, side: str, h: int, lo: int, n: int) -> np.ndarray:
        """Rows ``[lo, n)`` of head ``h`` as the kernels answer with them, float32
        ``[n-lo, hd]``: f32 storage as stored (a view), f16/bf16 widened; q8 ``q·s·col`` with the exact
        rows ``x·col`` (``side`` is ``"k"`` or ``"v"``)."""
        quantized = self.mode.quant_k if side == "k" else self.mode.quant_v
        if not quantized:
            return from_half(getattr(self, side)[h, lo:n])
        if side == "k":
            rows = dequantize_rows(self.kq[h, lo:n], self.ks[h, lo:n], KV_K_GROUP)
        else:
            rows = dequantize_rows(self.vq[h, lo:n], self.vs[h, lo:n, None], self.head_dim)
        x = getattr(self, "x" + side)
        xl = int(self.xlen[h])
        if lo < xl:
            rows[: xl - lo] = x[h, lo:xl]
        col, col_set = (self.kcol, self.kcol_set) if side == "k" else (self.vcol, self.vcol_set)
        return rows * col[h] if col_set[h] else rows

    def field_frozen(self) -> bool:
        """Whether the q8 field froze (the seed: any head's column is set)."""
        return bool(self.kcol_set.any() or self.vcol_set.any())

    # ── capacity ──

    def _alloc(self, cap: int) -> dict[str, np.ndarray]:
        nkv, hd = self.num_kv_heads, self.head_dim
        fdt = self.mode.float_dtype
        shapes = {
            "k": ((nkv, cap, hd), fdt),
            "v": ((nkv, cap, hd), fdt),
            "kq": ((nkv, cap, hd), np.int8),
            "ks": ((nkv, cap, self.ngk), np.float32),
            "vq": ((nkv, cap, hd), np.int8),
            "vs": ((nkv, cap), np.float32),
        }
        # np.empty: pages a dead head never writes are never faulted in.
        return {n: np.empty(*shapes[n]) for n in self.block_names()}

    def reserve(self, rows: int) -> None:
        """Capacity for ``rows`` rows per head, taken once (doubling)."""
        if rows > self.cap:
            new_cap = max(16, 2 * self.cap, rows)
            fresh = self._alloc(new_cap)
            for name, blk in fresh.items():
                old = getattr(self, name)
                if old is not None:
                    for h in np.flatnonzero(self.lens):
                        blk[h, : self.lens[h]] = old[h, : self.lens[h]]
                setattr(self, name, blk)
            self.cap = new_cap
        if rows > self._imp.shape[0]:
            imp = np.zeros(max(16, 2 * self._imp.shape[0], rows), dtype=np.float32)
            imp[: self.seq_len] = self._imp[: self.seq_len]
            self._imp = imp

    def reserved_bytes(self) -> int:
        """Bytes of capacity held (stored rows plus room to grow)."""
        blocks = sum(getattr(self, n).nbytes for n in self.block_names() if getattr(self, n) is not None)
        return blocks + self._imp.nbytes

    def stored_bytes(self) -> int:
        """Bytes of stored elements, counted as the seed's ``memory_bytes``."""
        rows = int(self.lens.sum())
        hd, w = self.head_dim, self.mode.float_dtype.itemsize
        total = 0
        total += rows * self.ngk * 4 + rows * hd if self.mode.quant_k else rows * hd * w
        total += rows * 4 + rows * hd if self.mode.quant_v else rows * hd * w
        total += int(self.kcol_set.sum() + self.vcol_set.sum()) * hd * 4
        sides = (self.xk is not None) + (self.xv is not None)
        total += int(self.xlen.sum()) * hd * 4 * sides
        return total

    # ── mutations (validated by the caller) ──

    def append(self, rows: dict, heads: np.ndarray, n: int, exact: dict | None = None) -> None:
        """Write ``n`` rows to each of ``heads``: ``rows[name]`` is
        ``[len(heads), n, ...]`` for every block of the mode; ``exact``
        (``"xk"``/``"xv"``, ``[len(heads), t, hd]`` in field space, ``t =``
        :meth:`exact_rows_wanted`) the exact copies of their first rows."""
        if n == 0:
            return
        if exact:
            for i, h in enumerate(heads):
                at, xl = int(self.lens[h]), int(self.xlen[h])
                if xl != at or at >= self.exact_cap:
                    continue
                t = min(n, self.exact_cap - at, next(iter(exact.values())).shape[1])
                for name, x in exact.items():
                    getattr(self, name)[h, at:at + t] = x[i, :t]
                self.xlen[h] = at + t
        if heads.size:
            lens = self.lens
            at = int(lens[heads[0]])
            self.reserve(int(lens[heads].max()) + n)
            if heads.size == self.num_kv_heads and (lens == at).all():
                # The common case (no dead head, no ragged head): one slice
                # store per block.
                for name, r in rows.items():
                    getattr(self, name)[:, at:at + n] = r
            else:
                for i, h in enumerate(heads):
                    a = int(lens[h])
                    for name, r in rows.items():
                        getattr(self, name)[h, a:a + n] = r[i]
            lens[heads] += n
        end = self.seq_len + n
        if end > self._imp.shape[0]:
            self.reserve(end)
        self._imp[self.seq_len:end] = 0.0
        self.seq_len = end

    def truncate(self, d: int) -> None:
        """Drop the last ``d`` rows of every head (generation kept)."""
        self.lens = np.maximum(self.lens - d, 0)
        np.minimum(self.xlen, self.lens, out=self.xlen)
        self.seq_len = max(self.seq_len - d, 0)
        self.edits += 1
        self._floors.append((self.edits, self.lens.copy()))

    def edit_floor(self, since: int) -> np.ndarray | None:
        """Per-head minimum row count left by truncations after edit ``since``.

        ``lens`` itself when none happened since; None when the log no longer
        reaches back that far (the mirror must upload everything).
        """
        floor = self.lens.copy()
        if since >= self.edits:
            return floor
        if not self._floors or self._floors[0][0] > since + 1:
            return None
        for no, lens in self._floors:
            if no > since:
                np.minimum(floor, lens, out=floor)
        return floor

    def drop_front(self, d: int) -> None:
        """Drop the first ``d`` rows of every head (fewer for a shorter head)."""
        for name in self.block_names():
            blk = getattr(self, name)
            for h in range(self.num_kv_heads):
                n, dh = int(self.lens[h]), min(d, int(self.lens[h]))
                if dh:
                    blk[h, : n - dh] = blk[h, dh:n]
        for h in range(self.num_kv_heads):
            dh, xl = min(d, int(self.lens[h])), int(self.xlen[h])
            left = max(xl - dh, 0)
            for x in (self.xk, self.xv):
                if x is not None and left:
                    x[h, :left] = x[h, dh:xl].copy()
            self.xlen[h] = left
        self.lens = np.maximum(self.lens - d, 0)
        di = min(d, self.seq_len)
        self._imp[: self.seq_len - di] = self._imp[di : self.seq_len].copy()
        self.seq_len -= di
        self.generation = next_generation()

    def gather(self, kept: np.ndarray, gather_rows) -> None:
        """Keep rows ``kept`` (ascending) of every head, each storage on its own.

        Each block is gathered independently (the seed's review regression:
        in mixed q8k/q8v modes K and V live in different storages).
        """
        for name in self.block_names():
            blk = getattr(self, name)
            for h in range(self.num_kv_heads):
                n = int(self.lens[h])
                if n == 0:
                    continue
                idx = kept[kept < n]
                blk[h, : idx.size] = gather_rows(blk[h], idx)
        for h in range(self.num_kv_heads):
            # kept is ascending, so the exact rows kept stay a prefix
            idx = kept[kept < int(self.xlen[h])]
            for x in (self.xk, self.xv):
                if x is not None and idx.size:
                    x[h, : idx.size] = x[h, idx]
            self.xlen[h] = idx.size
        self.lens = np.array([int(np.count_nonzero(kept < n)) for n in self.lens], dtype=np.int64)
        imp = self._imp[kept].copy()
        self._imp[: kept.size] = imp
        self.seq_len = int(kept.size)
        self.generation = next_generation()

    def clear(self) -> None:
        """Forget every row and the q8 field; capacity is kept for reuse."""
        self.lens[:] = 0
        self.xlen[:] = 0
        self.seq_len = 0
        self.kcol_set[:] = False
        self.vcol_set[:] = False
        self.kcol[:] = 1.0
        self.vcol[:] = 1.0
        self.generation = next_generation()

    def release(self) -> None:
        """Clear and give the capacity back (an O(1) seal's memory claim)."""
        self.clear()
        self.k = self.v = self.kq = self.ks = self.vq = self.vs = None
        self.cap = 0
        self._imp = np.zeros(0, dtype=np.float32)
