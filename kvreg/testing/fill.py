"""Layers filled with many rows, fast: what benchmarks and the bench command
start from.

Appending 64k rows one call at a time costs seconds of Python per layer (and
~3x more under q8), which would dominate a benchmark's setup. :func:`filled_layer`
appends only the rows whose appends have side effects (under q8: up to and
including the append that freezes the 2f field) through the public
``append``, then writes the remaining rows into the storage in bulk, exactly
as ``append`` would have: F32 rows copied, q8 rows quantized against the
frozen field with the backend's ``quantize_rows`` (an exact-class kernel,
row-wise, so a bulk call gives the bits of per-row calls). A test checks the
result equals the append-by-append layer.

Rows are seeded Gaussian data, generated once per geometry and cached
read-only.
"""

from __future__ import annotations

import functools

import numpy as np

from kvreg.layer import LayerKvCache
from kvreg.modes import KV_COL_WARMUP, KV_K_GROUP, KvMode

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
    # Under q8 the append at seq_len == KV_COL_WARMUP freezes the field: run
    # it (and everything before) through the public path.
    head = min(rows, KV_COL_WARMUP + 1) if lay.mode.quantized else 0
    for i in range(head):
        lay.append(k[:, i], v[:, i])
    if head == rows:
        return lay
    st = lay.storage
    st.reserve(rows)
    sl = slice(head, rows)
    hd = head_dim
    for h in range(num_kv_heads):
        if st.mode.quant_k:
            col = st.kcol[h] if st.kcol_set[h] else None
            st.kq[h, sl], st.ks[h, sl] = lay.backend.quantize_rows(k[h, sl], col, KV_K_GROUP)
        else:
            st.k[h, sl] = k[h, sl]
        if st.mode.quant_v:
            col = st.vcol[h] if st.vcol_set[h] else None
            q, s = lay.backend.quantize_rows(v[h, sl], col, hd)
            st.vq[h, sl], st.vs[h, sl] = q, s[:, 0]
        else:
            st.v[h, sl] = v[h, sl]
    st.lens[:] = rows
    st._imp[head:rows] = 0.0
    st.seq_len = rows
    lay.seq_len = rows
    return lay
