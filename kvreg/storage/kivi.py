"""2-bit blocks: ``Q2``, after KIVI (arXiv 2402.02750).

Rows of a head, oldest first: ``[0, b8)`` 2-bit (the ``k2``/``v2`` blocks,
indexed by position), ``[b8, lens)`` float16 (``thk``/``thv``, the window,
oldest first). ``b8`` is always a multiple of :data:`~kvreg.modes.Q2_GROUP`
(G): rows leave the window only in whole blocks ``[b·G, (b+1)·G)``, when an
append brings it to :data:`~kvreg.modes.Q2_WINDOW` + G rows, so it holds
``Q2_WINDOW`` to ``Q2_WINDOW + G - 1`` rows once that many are stored. A
block is quantized from its rows' float16 values, asymmetric 2-bit
(``zero + code · scale``, codes 0..3, scale and zero float16):

* K per channel over the block (KIVI: key outliers sit in fixed channels,
  so a channel's range is what fits them), its ``hd`` scales and zeros
  striped over the block's rows so they stay per-row arrays that eviction,
  forks and the wire walk like any row block: row ``r`` of a block holds
  the statistics of channels ``[(r % G)·c, (r % G + 1)·c)``, ``c =
  ceil(hd/G)`` (``k2s``/``k2z [nkv, cap, c]``, the slots past ``hd`` zero);
* V per row, a scale and zero per :data:`~kvreg.modes.Q2_V_GROUP` channels
  (``v2s``/``v2z``).

Every quantization is a function of one block's (one row's) float16
values, so ``n`` appends and one extend of ``n`` rows store the same bits.
Rows are not rotated, and each head's first :data:`~kvreg.modes.Q2_SINK_ROWS`
rows are also held in float32 (the attention sinks, as under q4). The
kernels are the reference's on every backend (a row's form depends on its
tier).

Re-blocking: a removal that breaks the block alignment (an eviction's
gather, ``drop_front`` of a sliding trim, a truncation that cuts into the
2-bit rows) re-blocks each head from its rows' current float values (a
2-bit row dequantized, a window row widened): rows ``[0, floor((n -
Q2_WINDOW)/G)·G)`` 2-bit again, the rest back in the float16 window. A new
block whose rows are exactly an old block (the same rows, in order, from a
position that was a block start) keeps its bits, so a removal that takes
whole blocks or window rows only requantizes nothing; any other block's
rows are quantized a second time, from their dequantized values (a
little more error on those rows). A truncation that stays inside the
window changes nothing else (the window is shorter until appends refill it).
"""

from __future__ import annotations

import numpy as np

from ..errors import ShapeError
from ..modes import Q2_GROUP, Q2_SINK_ROWS, Q2_V_GROUP, Q2_WINDOW, KvMode
from ..quant import HALF_OVERFLOW, dequantize_int2, num_groups, pack_int2, quantize_int2, unpack_int2
from ..views import KiviRows, kivi_keys
from .base import Groups, writes
from .int8 import Int8Storage

_F16_MAX = HALF_OVERFLOW["f16"]


class KiviStorage(Int8Storage):
    """The q2 family (module docstring)."""

    drop_align = Q2_GROUP   # whole blocks leave with their bits; a partial one re-blocks

    def __init__(self, num_kv_heads: int, head_dim: int, mode: KvMode, exact_rows: int = 0):
        super().__init__(num_kv_heads, head_dim, mode, exact_rows)
        #: Channels of K statistics each row of a block holds (its stripe).
        self.kc = num_groups(head_dim, Q2_GROUP)

    def _exact_rows(self, asked: int) -> int:
        return Q2_SINK_ROWS

    def _groups(self, array, count) -> Groups:
        dense, _, exact, window, _ = super()._groups(array, count)
        tiers = KiviRows(array("k2"), array("k2s"), array("k2z"), array("v2"), array("v2s"), array("v2z"))
        return dense, None, exact, window, tiers

    # ── layout ──

    def block_names(self) -> tuple[str, ...]:
        return ("k2", "k2s", "k2z", "v2", "v2s", "v2z")

    def _block_specs(self, cap: int) -> dict:
        nkv, hd = self.num_kv_heads, self.head_dim
        codes = ((nkv, cap, -(-hd // 4)), np.dtype(np.uint8))
        kstat = ((nkv, cap, self.kc), np.dtype(np.float16))
        vstat = ((nkv, cap, num_groups(hd, Q2_V_GROUP)), np.dtype(np.float16))
        return {"k2": codes, "k2s": kstat, "k2z": kstat, "v2": codes, "v2s": vstat, "v2z": vstat}

    def written_rows(self, block: str) -> np.ndarray:
        """Every 2-bit block stops at the window (its rows' slots stay zero)."""
        return self.b8

    def stored_bytes(self) -> int:
        """Codes and statistics of the 2-bit rows (the K stripes as held,
        padding included), the float16 window, the float32 sink rows."""
        hd = self.head_dim
        n2 = int(self.b8.sum())
        n16 = int((self.lens - self.b8).sum())
        per_row = 2 * -(-hd // 4) + 2 * 2 * self.kc + 2 * 2 * num_groups(hd, Q2_V_GROUP)
        return n2 * per_row + n16 * hd * 2 * 2 + int(self.xlen.sum()) * hd * 4 * 2

    def tiers_consistent(self) -> str | None:
        bad = super().tiers_consistent()
        if bad:
            return bad
        if (self.b8 % Q2_GROUP).any():
            return f"2-bit rows per head {self.b8.tolist()} are not whole blocks of {Q2_GROUP} rows"
        return None

    # ── rows in ──

    def check_rows(self, k: np.ndarray, v: np.ndarray) -> None:
        """Refuse rows the float16 window (and the float16 scales) cannot
        hold: one comparison refuses NaN (it compares false) and inf too."""
        for name, x in (("k", k), ("v", v)):
            if not (np.abs(x) < _F16_MAX).all():
                what = "inf/NaN values" if not np.isfinite(x).all() else f"values with |x| >= {float(_F16_MAX):.6g}"
                raise ShapeError(f"{name} has {what}: a q2 layer stores its newest rows and its scales in "
                                 "float16: use f32 or bf16 storage")

    def store(self, k: np.ndarray, v: np.ndarray, heads: np.ndarray, kernels) -> None:
        """The rows of the alive ``heads`` (checked by :meth:`check_rows`)
        into the window, whole blocks out of it, the sinks kept exact."""
        n = k.shape[0]
        every = heads.size == self.num_kv_heads
        kh = np.asarray((k if every else k[:, heads]).transpose(1, 0, 2), np.float32)
        vh = np.asarray((v if every else v[:, heads]).transpose(1, 0, 2), np.float32)
        t = self.exact_rows_wanted(heads, n)
        self.append_blocks(kh, vh, heads, n)
        self.append({}, heads, n, {"xk": kh[:, :t], "xv": vh[:, :t]} if t else None)

    def append_row(self, k: np.ndarray, v: np.ndarray, kernels) -> bool:
        return False

    def _row_steps(self) -> bool:
        return False

    @writes
    def append_blocks(self, kh: np.ndarray, vh: np.ndarray, heads: np.ndarray, n: int) -> None:
        """``n`` rows per head (``[len(heads), n, hd]`` float32) of ``heads``
        join the window; the whole blocks it then holds beyond
        :data:`~kvreg.modes.Q2_WINDOW` rows leave it, quantized. The caller
        then counts the rows (:meth:`append`)."""
        if not heads.size or not n:
            return
        self.reserve(int(self.lens[heads].max()) + n)
        fh = self.lens[heads] - self.b8[heads]
        if (fh == fh[0]).all():
            self._push(heads, int(fh[0]), kh, vh)
        else:
            for i in range(heads.size):
                self._push(heads[i:i + 1], int(fh[i]), kh[i:i + 1], vh[i:i + 1])

    def _push(self, heads: np.ndarray, fh: int, kh: np.ndarray, vh: np.ndarray) -> None:
        """:meth:`append_blocks` for heads whose windows hold ``fh`` rows each."""
        total = fh + kh.shape[1]
        out = (total - Q2_WINDOW) // Q2_GROUP * Q2_GROUP if total >= Q2_WINDOW + Q2_GROUP else 0
        if not out:
            # The decode step's common case: the rows go into free window slots.
            self.thk[heads, fh:total] = kh
            self.thv[heads, fh:total] = vh
            return
        fk = np.concatenate([self.thk[heads, :fh], kh.astype(np.float16)], axis=1)
        fv = np.concatenate([self.thv[heads, :fh], vh.astype(np.float16)], axis=1)
        hd = self.head_dim
        blocks = self._quantized(fk[:, :out].reshape(-1, hd).astype(np.float32),
                                 fv[:, :out].reshape(-1, hd).astype(np.float32))
        for i, h in enumerate(heads):
            b = int(self.b8[h])
            for name, a in blocks.items():
                getattr(self, name)[h, b:b + out] = a[i * out:(i + 1) * out]
        for th, f in ((self.thk, fk), (self.thv, fv)):
            th[heads, : total - out] = f[:, out:]
            # Slots past the rows kept zero: equal layers export equal bytes.
            th[heads, total - out:] = 0
        self.b8[heads] += out

    def _quantized(self, k: np.ndarray, v: np.ndarray) -> dict[str, np.ndarray]:
        """Whole blocks of float32 rows ``[m·G, hd]`` as the row blocks store them."""
        hd, g, c = self.head_dim, Q2_GROUP, self.kc
        m = k.shape[0] // g
        # K per channel: each channel's G values of a block are one group of the transposed block.
        codes, s, z = quantize_int2(k.reshape(m, g, hd).transpose(0, 2, 1).reshape(m * hd, g), g)
        codes = codes.reshape(m, hd, g).transpose(0, 2, 1).reshape(m * g, hd)
        stripes = []
        for stat in (s, z):
            full = np.zeros((m, g * c), np.float16)
            full[:, :hd] = stat.reshape(m, hd)
            stripes.append(full.reshape(m * g, c))
        vcodes, vs, vz = quantize_int2(v, Q2_V_GROUP)
        return {"k2": pack_int2(codes), "k2s": stripes[0], "k2z": stripes[1], "v2": pack_int2(vcodes), "v2s": vs,
                "v2z": vz}

    # ── re-blocking after a removal ──

    def _float_rows(self, h: int) -> dict:
        """Head ``h`` before a removal: its rows' current float values (not
        the sinks' exact copies: the stored form is what is re-blocked), its
        2-bit blocks' bits and its bounds."""
        n, b8, hd = int(self.lens[h]), int(self.b8[h]), self.head_dim
        k, v = np.empty((n, hd), np.float32), np.empty((n, hd), np.float32)
        if b8:
            k[:b8] = kivi_keys(self.k2[h], self.k2s[h], self.k2z[h], 0, b8, hd)
            v[:b8] = dequantize_int2(unpack_int2(self.v2[h, :b8], hd), self.v2s[h, :b8], self.v2z[h, :b8], Q2_V_GROUP)
        k[b8:] = self.thk[h, : n - b8]
        v[b8:] = self.thv[h, : n - b8]
        bits = {name: getattr(self, name)[h, :b8].copy() for name in self.block_names()}
        return {"n": n, "b8": b8, "k": k, "v": v, "bits": bits}

    def _reblock(self, h: int, old: dict, src: np.ndarray) -> None:
        """Head ``h`` holds the rows ``src`` (ascending old positions) of
        ``old`` (:meth:`_float_rows`): its blocks and window rebuilt by the
        rule of the module docstring."""
        g, n = Q2_GROUP, src.size
        nb = max(n - Q2_WINDOW, 0) // g * g
        fresh = []
        for j in range(nb // g):
            s = src[j * g:(j + 1) * g]
            a = int(s[0])
            if a % g == 0 and a + g <= old["b8"] and int(s[-1]) - a == g - 1:
                # An old block, whole and in order: its bits stay.
                for name, bits in old["bits"].items():
                    getattr(self, name)[h, j * g:(j + 1) * g] = bits[a:a + g]
            else:
                fresh.append(j)
        if fresh:
            idx = np.concatenate([src[j * g:(j + 1) * g] for j in fresh])
            blocks = self._quantized(old["k"][idx], old["v"][idx])
            # V is per row: a row that was 2-bit keeps its own bits (its
            # dequantized value would requantize to about the same ones).
            was = idx < old["b8"]
            for name in ("v2", "v2s", "v2z"):
                blocks[name][was] = old["bits"][name][idx[was]]
            for i, j in enumerate(fresh):
                for name, arr in blocks.items():
                    getattr(self, name)[h, j * g:(j + 1) * g] = arr[i * g:(i + 1) * g]
        for name in self.block_names():
            getattr(self, name)[h, nb:max(n, old["n"])] = 0
        for th, side in ((self.thk, "k"), (self.thv, "v")):
            th[h, : n - nb] = old[side][src[nb:]]
            th[h, n - nb:] = 0
        self.b8[h] = nb

    def _rows_before(self, heads) -> dict:
        return {h: self._float_rows(h) for h in heads if self.lens[h]}

    @writes
    def gather(self, kept: np.ndarray, gather_rows) -> None:
        """Keep rows ``kept`` of every head, then re-block (module docstring)."""
        old = self._rows_before(range(self.num_kv_heads))
        super().gather(kept, gather_rows)
        for h, o in old.items():
            self._reblock(h, o, kept[kept < o["n"]])
        self._rewritten()

    @writes
    def drop_front(self, d: int) -> None:
        """Drop the first ``d`` rows of every head, then re-block (module docstring)."""
        old = self._rows_before(range(self.num_kv_heads))
        super().drop_front(d)
        for h, o in old.items():
            self._reblock(h, o, np.arange(min(d, o["n"]), o["n"]))
        self._rewritten()

    @writes
    def truncate(self, d: int) -> None:
        """Drop the last ``d`` rows of every head; a head cut into its 2-bit
        rows is re-blocked (its rows from the first block it rebuilt on are
        logged as rewritten)."""
        new = np.maximum(self.lens - d, 0)
        old = self._rows_before(np.flatnonzero(new < self.b8))
        super().truncate(d)
        if old:
            floor = self.lens.copy()
            for h, o in old.items():
                self._reblock(h, o, np.arange(int(self.lens[h])))
                floor[h] = self.b8[h]
            self._truncated(floor)
