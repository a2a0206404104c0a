"""Dense rows: ``F32``, ``F16``, ``BF16`` (``k``/``v [nkv, cap, hd]`` in the
mode's float dtype; bfloat16 as its uint16 bit patterns)."""

from __future__ import annotations

import numpy as np

from ..errors import ShapeError
from ..modes import KvMode
from ..quant import HALF_OVERFLOW, to_half
from .base import Storage, writes


class DenseStorage(Storage):
    """K and V stored as floats, every row as it came (2-byte modes: rounded
    to nearest, ties to even)."""

    def __init__(self, num_kv_heads: int, head_dim: int, mode: KvMode, exact_rows: int = 0):
        super().__init__(num_kv_heads, head_dim, mode)
        self._half = mode.half

    @classmethod
    def of_rows(cls, k: np.ndarray, v: np.ndarray) -> DenseStorage:
        """An F32 storage over float32 blocks ``[nkv, n, hd]`` (taken, not
        copied): the widened rows a kernel is handed in place of a layer's own."""
        st = cls(k.shape[0], k.shape[2], KvMode.F32)
        st.k, st.v, st.cap = k, v, k.shape[1]
        st.lens[:] = k.shape[1]
        st._touch(arrays=True)
        return st

    def block_names(self) -> tuple[str, ...]:
        return ("k", "v")

    def _block_specs(self, cap: int) -> dict:
        shape, dtype = (self.num_kv_heads, cap, self.head_dim), self.mode.float_dtype
        return {"k": (shape, dtype), "v": (shape, dtype)}

    def check_rows(self, k: np.ndarray, v: np.ndarray) -> None:
        """Refuse finite values an f16/bf16 store would round to inf (inf and
        NaN are stored as they are: IEEE, as under f32)."""
        if not self._half:
            return
        lim = HALF_OVERFLOW[self.mode.value]
        for name, x in (("k", k), ("v", v)):
            xa = np.abs(x)
            if ((xa >= lim) & np.isfinite(xa)).any():
                raise ShapeError(f"{name} has finite values of magnitude >= {float(lim):.6g}, which "
                                 f"{self.mode.value} storage would round to inf: use f32 (or bf16) storage")

    def store(self, k: np.ndarray, v: np.ndarray, heads: np.ndarray, kernels) -> None:
        n, rows = k.shape[0], {}
        if heads.size:
            # Head-major [n_alive, n, hd] (a view when every head is alive).
            every = heads.size == self.num_kv_heads
            for name, x in (("k", k), ("v", v)):
                xh = (x if every else x[:, heads]).transpose(1, 0, 2)
                rows[name] = to_half(xh, self.mode.float_dtype) if self._half else xh
        self.append(rows, heads, n)

    def stored_bytes(self) -> int:
        return int(self.lens.sum()) * self.head_dim * self.mode.float_dtype.itemsize * 2

    def level(self) -> bool:
        """Whether every head holds the same count (a row is then one slice
        store per side)."""
        if self.num_kv_heads == 1:
            return True
        lens = self.lens.tolist()
        return lens.count(lens[0]) == len(lens)

    def append_row(self, k: np.ndarray, v: np.ndarray, kernels) -> bool:
        if not self.level():
            return False
        if self._half:
            self.check_rows(k, v)
        self._append_row(k, v)
        return True

    @writes
    def _append_row(self, k: np.ndarray, v: np.ndarray) -> None:
        lens = self.lens
        at = lens.item(0)
        if at >= self.cap or self.seq_len >= self._imp.shape[0]:
            self.reserve(max(at, self.seq_len) + 1)
        if self._half:
            k, v = to_half(k, self.mode.float_dtype), to_half(v, self.mode.float_dtype)
        self.k[:, at] = k
        self.v[:, at] = v
        lens.fill(at + 1)   # every head held ``at``: a fill, not a ufunc call
        self._imp[self.seq_len] = 0.0
        self.seq_len += 1
        self._touch()

    def _row_steps(self) -> bool:
        return True
