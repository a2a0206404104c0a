"""4-bit tiers: ``Q4``.

Rows of a head, oldest first: ``[0, b4)`` int4 (the ``k4``/``v4`` blocks,
indexed by position, with float16 scales per 32 key / 64 value channels),
``[b4, b8)`` int8 (``t8*``, the tier's own buffer, oldest first, float16
scale per 32 channels), ``[b8, lens)`` float16 (``thk``/``thv``). A row
moves down a tier when the tier above it overflows (an append), never back
(a truncation leaves the older rows where they are). Every move requantizes
the row from the form it leaves, row by row, so ``n`` appends and one extend
of ``n`` rows store the same bits. All three hold Walsh-Hadamard rotated
rows (``rot_k``, ``rot_v``), and each head's first
:data:`~kvreg.modes.Q4_SINK_ROWS` rows are also held in float32 (the
attention sinks, as under q8). Its kernels are the reference's on every
backend: a row's form depends on its tier.
"""

from __future__ import annotations

import numpy as np

from ..errors import ShapeError
from ..modes import Q4_INT8_GROUP, Q4_INT8_ROWS, Q4_K_GROUP, Q4_SINK_ROWS, Q4_V_GROUP, Q4_WINDOW, KvMode
from ..quant import HALF_OVERFLOW, dequantize_half_scaled, num_groups, pack_int4, quantize_half_scaled
from ..views import TierRows
from .base import Groups, writes
from .int8 import Int8Storage


class TieredStorage(Int8Storage):
    """The q4 family (module docstring)."""

    def __init__(self, num_kv_heads: int, head_dim: int, mode: KvMode, exact_rows: int = 0):
        super().__init__(num_kv_heads, head_dim, mode, exact_rows)
        g8 = num_groups(head_dim, Q4_INT8_GROUP)
        self.b4 = np.zeros(num_kv_heads, np.int64)
        self.t8k = np.zeros((num_kv_heads, Q4_INT8_ROWS, head_dim), np.int8)
        self.t8v = np.zeros((num_kv_heads, Q4_INT8_ROWS, head_dim), np.int8)
        self.t8ks = np.zeros((num_kv_heads, Q4_INT8_ROWS, g8), np.float16)
        self.t8vs = np.zeros((num_kv_heads, Q4_INT8_ROWS, g8), np.float16)

    def _exact_rows(self, asked: int) -> int:
        return Q4_SINK_ROWS

    def _groups(self, array, count) -> Groups:
        dense, q8, exact, window, _ = super()._groups(array, count)
        tiers = TierRows(array("k4"), array("k4s"), array("v4"), array("v4s"), count(self.b4), array("t8k"),
                         array("t8ks"), array("t8v"), array("t8vs"))
        return dense, None, exact, window, tiers

    def block_names(self) -> tuple[str, ...]:
        return ("k4", "k4s", "v4", "v4s")

    def _block_specs(self, cap: int) -> dict:
        nkv, hd = self.num_kv_heads, self.head_dim
        half = -(-hd // 2)
        return {"k4": ((nkv, cap, half), np.dtype(np.uint8)),
                "k4s": ((nkv, cap, num_groups(hd, Q4_K_GROUP)), np.dtype(np.float16)),
                "v4": ((nkv, cap, half), np.dtype(np.uint8)),
                "v4s": ((nkv, cap, num_groups(hd, Q4_V_GROUP)), np.dtype(np.float16))}

    def written_rows(self, block: str) -> np.ndarray:
        """The int4 blocks hold the int4 tier's rows only."""
        return self.b4

    def head_block_names(self) -> tuple[str, ...]:
        """The float16 window and its bound, and the int8 tier."""
        return super().head_block_names() + ("b4", "t8k", "t8ks", "t8v", "t8vs")

    def stored_bytes(self) -> int:
        hd = self.head_dim
        n4 = int(self.b4.sum())
        n8 = int((self.b8 - self.b4).sum())
        n16 = int((self.lens - self.b8).sum())
        half = -(-hd // 2)
        total = n4 * (2 * half + 2 * (num_groups(hd, Q4_K_GROUP) + num_groups(hd, Q4_V_GROUP)))
        total += n8 * 2 * (hd + 2 * num_groups(hd, Q4_INT8_GROUP))
        total += n16 * 2 * hd * 2
        total += int(self.xlen.sum()) * hd * 4 * 2
        return total

    def tiers_consistent(self) -> str | None:
        b8, b4, lens = self.b8, self.b4, self.lens
        if (b4 < 0).any() or (b4 > b8).any() or (b8 > lens).any():
            return f"tier bounds b4 {b4.tolist()} <= b8 {b8.tolist()} <= rows {lens.tolist()} do not hold"
        if ((b8 - b4) > Q4_INT8_ROWS).any() or ((lens - b8) > Q4_WINDOW).any():
            return (f"tiers hold more than {Q4_INT8_ROWS} int8 / {Q4_WINDOW} float16 rows "
                    f"(b4 {b4.tolist()}, b8 {b8.tolist()}, rows {lens.tolist()})")
        return None

    # ── rows in ──

    def store(self, k: np.ndarray, v: np.ndarray, heads: np.ndarray, kernels) -> None:
        """Rotate the rows of the alive ``heads``, check them, tier them in."""
        n = k.shape[0]
        every = heads.size == self.num_kv_heads
        rk, rv = self.basis((k if every else k[:, heads]).transpose(1, 0, 2),
                            (v if every else v[:, heads]).transpose(1, 0, 2), kernels)
        for name, r in (("k", rk), ("v", rv)):
            # The newest rows are float16 (the scales too): a rotated value
            # past its range would be stored as inf.
            if not (np.abs(r) < HALF_OVERFLOW["f16"]).all():
                raise ShapeError(f"{name} has values whose Walsh-Hadamard rotation exceeds float16's range "
                                 f"(|x| >= {float(HALF_OVERFLOW['f16']):.6g}), which q4 stores in float16: "
                                 "use f32 or bf16 storage")
        t = self.exact_rows_wanted(heads, n)
        self.append_tiered(rk, rv, heads, n)
        self.append({}, heads, n, {"xk": rk[:, :t], "xv": rv[:, :t]} if t else None)

    def append_row(self, k: np.ndarray, v: np.ndarray, kernels) -> bool:
        return False

    def _row_steps(self) -> bool:
        return False

    @writes
    def append_tiered(self, rk: np.ndarray, rv: np.ndarray, heads: np.ndarray, n: int) -> None:
        """Tier ``n`` rotated rows per head (``[len(heads), n, hd]`` float32) of
        ``heads`` in; the caller then counts them (:meth:`append`)."""
        if not heads.size or not n:
            return
        self.reserve(int(self.lens[heads].max()) + n)
        # Rows leaving the float16 window, per head (push_window's order).
        out16 = np.maximum(self.lens[heads] - self.b8[heads] + n - Q4_WINDOW, 0)
        starts = np.concatenate([[0], np.cumsum(out16)])
        leaving = {side: self.push_window(side, heads, r)[1] for side, r in (("k", rk), ("v", rv))}
        self.advance_window(heads, n)
        for i, h in enumerate(heads):
            b4, c8 = int(self.b4[h]), int(self.b8[h] - out16[i] - self.b4[h])
            out8 = max(c8 + int(out16[i]) - Q4_INT8_ROWS, 0)       # rows leaving int8
            for side, group in (("k", Q4_K_GROUP), ("v", Q4_V_GROUP)):
                t8, t8s = getattr(self, "t8" + side), getattr(self, "t8" + side + "s")
                codes, sc = quantize_half_scaled(leaving[side][starts[i]:starts[i + 1]], Q4_INT8_GROUP, 127)
                c8_all = np.concatenate([t8[h, :c8], codes])
                s8_all = np.concatenate([t8s[h, :c8], sc])
                if out8:
                    rows = dequantize_half_scaled(c8_all[:out8], s8_all[:out8], Q4_INT8_GROUP)
                    c4, s4 = quantize_half_scaled(rows, group, 7)
                    getattr(self, side + "4")[h, b4:b4 + out8] = pack_int4(c4)
                    getattr(self, side + "4s")[h, b4:b4 + out8] = s4
                t8[h, : c8_all.shape[0] - out8] = c8_all[out8:]
                t8s[h, : c8_all.shape[0] - out8] = s8_all[out8:]
            self.b4[h] = b4 + out8

    # ── rows out ──

    def _after_cut(self) -> None:
        super()._after_cut()
        np.minimum(self.b4, self.lens, out=self.b4)
        for h in range(self.num_kv_heads):
            for name in ("t8k", "t8ks", "t8v", "t8vs"):
                getattr(self, name)[h, int(self.b8[h] - self.b4[h]):] = 0

    def _drop_front_window(self, h: int, d: int) -> None:
        b8, b4 = int(self.b8[h]), int(self.b4[h])
        d8 = min(max(d - b4, 0), b8 - b4)   # int8 rows dropped
        if d8:
            for name in ("t8k", "t8ks", "t8v", "t8vs"):
                t = getattr(self, name)
                t[h, : b8 - b4 - d8] = t[h, d8:b8 - b4].copy()
        self.b4[h] = max(b4 - d, 0)
        super()._drop_front_window(h, d)

    def _gather_window(self, h: int, kept: np.ndarray) -> None:
        b8, b4 = int(self.b8[h]), int(self.b4[h])
        k8 = kept[(kept >= b4) & (kept < b8)] - b4
        for name in ("t8k", "t8ks", "t8v", "t8vs"):
            t = getattr(self, name)
            t[h, : k8.size] = t[h, k8]
        self.b4[h] = int(np.count_nonzero(kept < b4))
        super()._gather_window(h, kept)

    def _clear_extra(self) -> None:
        super()._clear_extra()
        self.b4[:] = 0
