"""The slow, obvious float64 oracle of every tolerance-class kernel.

Plain loops over rows and heads, float64 throughout, nothing shared with the
fast paths (:mod:`kvreg.reference` or a backend) but the storage layout of
docs/kernels.md. The conformance suite compares every backend with it.

q8 layers: the oracle dequantizes the STORED int8 rows with their scales and
field (``q * s[group] * col``) and runs the same float64 math on them, so it
checks the kernel's arithmetic, not the quantization error (which is the
exact class and checked bit for bit elsewhere).

Functions take a :class:`kvreg.storage.LayerStorage` (``layer.storage``) or
plain arrays and return float64 results; none mutates its input.
"""

from __future__ import annotations

import math

import numpy as np

from ..modes import KV_K_GROUP
from .bounded_oracle import bounded_attend_oracle  # re-exported: one import for every oracle
from .nystrom_oracle import nystrom_oracle  # re-exported

__all__ = [
    "head_keys64", "head_values64", "attend_group_oracle", "attend_layer_oracle",
    "attend_chunk_oracle", "field_rms_oracle", "bounded_attend_oracle", "nystrom_oracle",
]


def _rows64(f32, q, s, col, col_set, g: int, n: int, group: int, exact, xlen, window=None) -> np.ndarray:
    """Rows ``[0, n)`` of KV head ``g`` as float64 ``[n, hd]``: the f32 (or
    f16/bf16) block when stored, else ``q * scale(group of d) * field`` in float64 (the oracle
    dequantizes so that it checks the kernel's math, not the quantization),
    the exact rows ``x * field``."""
    if window is not None and window[0] is not None:
        # q8's float16 window: rows [b8, n) are not integer yet. Exact rows win.
        th, b8 = window
        b8 = min(int(b8[g]), n)
        out = _rows64(f32, q, s, col, col_set, g, n, group, exact, xlen)
        out[b8:n] = th[g, : n - b8].astype(np.float64)
        xl = min(int(xlen[g]), n)
        if xl:
            out[:xl] = exact[g, :xl]
        return out
    if f32 is not None:
        rows = f32[g, :n]
        if rows.dtype == np.uint16:  # bfloat16 bit patterns: the top half of a float32
            rows = (rows.astype(np.uint32) << np.uint32(16)).view(np.float32)
        return np.array(rows, dtype=np.float64)
    hd = q.shape[2]
    sc = s[g, :n].astype(np.float64).reshape(n, -1)          # [n, groups]
    out = q[g, :n].astype(np.float64) * sc[:, np.arange(hd) // group]
    xl = min(int(xlen[g]), n)
    if xl:
        out[:xl] = exact[g, :xl]
    if col_set[g]:
        out *= col[g].astype(np.float64)
    return out


def _hadamard64(hd: int) -> np.ndarray:
    """Sylvester's orthonormal Hadamard matrix in float64 (symmetric, its own inverse)."""
    h = np.ones((1, 1))
    while h.shape[0] < hd:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(hd)


def _tiered64(st, side: str, g: int, n: int) -> np.ndarray:
    """q4 rows in their tiers' float32 values, rotated back in float64."""
    rows = np.array(st.attended_rows(side, g, 0, n), dtype=np.float64)
    return rows @ _hadamard64(st.head_dim) if (st.rot_k if side == "k" else st.rot_v) else rows


def head_keys64(st, g: int, n: int | None = None) -> np.ndarray:
    """Keys of KV head ``g`` as float64 ``[n, hd]``, dequantized under q8 K."""
    n = int(st.lens[g]) if n is None else n
    if st.mode.tiered:
        return _tiered64(st, "k", g, n)
    rows = _rows64(st.k, st.kq, st.ks, st.kcol, st.kcol_set, g, n, KV_K_GROUP, st.xk, st.xlen,
                   (st.thk, st.b8) if st.window else None)
    return rows @ _hadamard64(st.head_dim) if st.rot_k else rows


def head_values64(st, g: int, n: int | None = None) -> np.ndarray:
    """Values of KV head ``g`` as float64 ``[n, hd]``, dequantized under q8 V."""
    n = int(st.lens[g]) if n is None else n
    if st.mode.tiered:
        return _tiered64(st, "v", g, n)
    rows = _rows64(st.v, st.vq, st.vs, st.vcol, st.vcol_set, g, n, st.head_dim, st.xv, st.xlen,
                   (st.thv, st.b8) if st.window else None)
    return rows @ _hadamard64(st.head_dim) if st.rot_v else rows


def _softmax_row(scores: list[float], sink: float | None) -> list[float]:
    m = max(scores)
    if sink is not None:
        m = max(m, sink)
    e = [math.exp(s - m) for s in scores]
    z = math.fsum(e) + (math.exp(sink - m) if sink is not None else 0.0)
    return [x / z for x in e]


def attend_group_oracle(st, g: int, q, *, scale: float, first: int = 0, upto: int | None = None,
                        softcap: float = 0.0, sinks=None):
    """One KV group's attention, the contract of ``attend_group`` in float64.

    Returns ``(out [nh, hd], probs [nh, n - first], first, n)``; ``first`` is
    clamped to ``n - 1`` as the contract does. ``n == 0`` gives zero output and
    an empty ``probs``. Importance is ``probs.sum(0)`` added at ``[first, n)``
    (see :func:`importance_delta`).
    """
    q = np.asarray(q, dtype=np.float64).reshape(-1, st.head_dim)
    nh, hd = q.shape
    n = int(st.lens[g]) if upto is None else min(int(st.lens[g]), int(upto))
    if n == 0:
        return np.zeros((nh, hd)), np.zeros((nh, 0)), 0, 0
    first = min(int(first), n - 1)
    keys = head_keys64(st, g, n)
    vals = head_values64(st, g, n)
    out = np.zeros((nh, hd))
    probs = np.zeros((nh, n - first))
    for h in range(nh):
        scores = []
        for p in range(first, n):
            s = float(scale) * math.fsum(q[h, d] * keys[p, d] for d in range(hd))
            if softcap > 0:
                s = softcap * math.tanh(s / softcap)
            scores.append(s)
        sink = None if sinks is None else float(sinks[h])
        pr = _softmax_row(scores, sink)
        for i, p in enumerate(range(first, n)):
            probs[h, i] = pr[i]
            out[h] += pr[i] * vals[p]
    return out, probs, first, n


def importance_delta(probs: np.ndarray, first: int, n: int, length: int) -> np.ndarray:
    """What ``imp`` (``length`` rows) gains from ``attend_group``: ``Σ_h probs``
    at ``[first, min(length, n))``, zero elsewhere."""
    delta = np.zeros(length)
    for p in range(first, min(length, n)):
        delta[p] = math.fsum(probs[:, p - first])
    return delta


def attend_layer_oracle(st, q, *, scale: float, window: int | None = None, softcap: float = 0.0,
                        sinks=None):
    """Every KV group (``attend_layer``): ``(out [nh, hd], imp_delta [seq_len])``."""
    q = np.asarray(q, dtype=np.float64).reshape(-1, st.head_dim)
    nkv = st.num_kv_heads
    hpk = q.shape[0] // nkv
    out = np.zeros(q.shape)
    imp = np.zeros(st.seq_len)
    for g in range(nkv):
        n = int(st.lens[g])
        first = max(0, n - window) if window else 0
        hs = slice(g * hpk, (g + 1) * hpk)
        o, p, f, nn = attend_group_oracle(st, g, q[hs], scale=scale, first=first, softcap=softcap,
                                          sinks=None if sinks is None else np.asarray(sinks)[hs])
        out[hs] = o
        if nn:
            imp += importance_delta(p, f, nn, st.seq_len)
    return out, imp


def attend_chunk_oracle(keys, values, q, *, s0: int, b: int, hpk: int, scale: float,
                        window: int | None = None):
    """Causal prefill over per-head rows ``keys``/``values`` (lists of
    ``[s0+b, hd]``, already dequantized): ``q [b, nh, hd]``; row ``i`` sees
    ``[max(0, s0+i+1-window), s0+i+1)``. Returns ``(out [b, nh, hd],
    imp_delta [s0+b])`` (the masked column sums)."""
    q = np.asarray(q, dtype=np.float64)
    nh, hd = q.shape[1], q.shape[2]
    n = s0 + b
    out = np.zeros((b, nh, hd))
    imp = np.zeros(n)
    for i in range(b):
        hi = s0 + i + 1
        lo = max(0, hi - window) if window else 0
        for h in range(nh):
            k = np.asarray(keys[h // hpk], dtype=np.float64)
            v = np.asarray(values[h // hpk], dtype=np.float64)
            scores = [float(scale) * math.fsum(q[i, h, d] * k[p, d] for d in range(hd)) for p in range(lo, hi)]
            pr = _softmax_row(scores, None)
            for j, p in enumerate(range(lo, hi)):
                out[i, h] += pr[j] * v[p]
                imp[p] += pr[j]
    return out, imp


def field_rms_oracle(rows) -> np.ndarray:
    """The q8 field over dequantized rows ``[n, hd]``: ``max(sqrt(mean x²), 1e-6)``."""
    rows = np.asarray(rows, dtype=np.float64)
    n, hd = rows.shape
    return np.array([max(math.sqrt(math.fsum(rows[p, d] ** 2 for p in range(n)) / n), 1e-6)
                     for d in range(hd)])
