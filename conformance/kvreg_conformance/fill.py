"""Layers filled with many rows, fast: what benchmarks and the bench command
start from.

Appending 64k rows one call at a time costs seconds of Python per layer (and
~3x more under q8), which would dominate a benchmark's setup.
:func:`filled_layer` hands them to ``LayerKvCache.extend`` in one call, which
leaves the storage exactly as row-by-row appends would (a test checks it).

Rows are seeded Gaussian data, generated once per geometry and cached
read-only.
"""

from __future__ import annotations

import functools

import numpy as np

from kvreg.layer import LayerKvCache
from kvreg.modes import KvMode

__all__ = ["kv_rows", "filled_layer"]


@functools.lru_cache(maxsize=4)
def kv_rows(rows: int, num_kv_heads: int, head_dim: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Seeded ``(k, v)``, float32 head-major ``[num_kv_heads, rows, head_dim]``, read-only."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(2):
        a = rng.standard_normal((num_kv_heads, rows, head_dim), dtype=np.float32)
        a.flags.writeable = False
        out.append(a)
    return out[0], out[1]


def filled_layer(rows: int, num_kv_heads: int, head_dim: int, *, mode="f32", backend=None,
                 seed: int = 0, layer: int = 0, k=None, v=None) -> LayerKvCache:
    """A :class:`LayerKvCache` holding ``rows`` rows, equal (storage bit for
    bit) to appending them one by one. The rows are :func:`kv_rows` data, or
    ``k``, ``v`` (float32 head-major ``[num_kv_heads, >= rows, head_dim]``)."""
    lay = LayerKvCache(num_kv_heads, head_dim, KvMode.parse(mode), backend, layer=layer)
    if rows == 0:
        return lay
    if k is None or v is None:
        k, v = kv_rows(rows, num_kv_heads, head_dim, seed)
    shape = (num_kv_heads, rows, head_dim)
    for name, a in (("k", k), ("v", v)):
        if a.ndim != 3 or a.shape[0] != shape[0] or a.shape[1] < rows or a.shape[2] != shape[2]:
            raise ValueError(f"filled_layer: {name} must be [{num_kv_heads}, >= {rows}, {head_dim}], got {a.shape}")
    k = np.asarray(k[:, :rows], dtype=np.float32)
    v = np.asarray(v[:, :rows], dtype=np.float32)
    # extend is bit-identical to appending row by row (q8 freeze included)
    # and copies each head's rows once; it takes position-major rows.
    lay.extend(k.transpose(1, 0, 2), v.transpose(1, 0, 2))
    return lay


def poison_window_slots(st) -> None:
    """Write extreme values into the integer slots of a windowed q8 storage's
    window rows (``[b8, lens)``, never written by the core): a kernel that
    reads them, instead of the float16 window, changes its answer."""
    for h in range(st.num_kv_heads):
        w = slice(int(st.b8[h]), int(st.lens[h]))
        if st.thk is not None:
            st.kq[h, w] = 127
            st.ks[h, w] = np.float32(1e30)
        if st.thv is not None:
            st.vq[h, w] = -127
            st.vs[h, w] = np.float32(np.nan)
