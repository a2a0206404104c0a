"""Slow, obvious float64 oracle of bounded (``swa_sink_v1``) attention.

Everything is materialized explicitly with plain loops: each visible ring
row is looked up by its absolute position, rotated in float64 pair by pair,
then scored, softmaxed and summed. It shares no code with
:func:`kvreg.bounded.bounded_attend` except reading ``rope.theta`` and
``rope.rotary_dims``, so a slicing or indexing slip in the fast path shows up
as a mismatch instead of being reproduced.
"""

from __future__ import annotations

import math

import numpy as np


def _rotate64(x: np.ndarray, pos: int, theta: float, rd: int) -> np.ndarray:
    """Rotate-half RoPE of one row in float64 (pair i = channels i and i + rd/2)."""
    y = np.array(x, dtype=np.float64, copy=True)
    half = rd // 2
    for i in range(half):
        ang = pos * theta ** (-2.0 * i / rd)
        c, s = math.cos(ang), math.sin(ang)
        a, b = float(x[i]), float(x[i + half])
        y[i] = a * c - b * s
        y[i + half] = b * c + a * s
    return y


def bounded_attend_oracle(
    q, ring_k, ring_v, seen, sink_k, sink_v, group_windows, rope, scale, num_heads
) -> np.ndarray:
    """Float64 ``[num_heads, hd]`` answer of the bounded attend contract.

    Same arguments as :func:`kvreg.bounded.bounded_attend`; assumes they are
    valid (the oracle checks nothing but what it needs to read them).
    """
    ring_k = np.asarray(ring_k, dtype=np.float64)
    ring_v = np.asarray(ring_v, dtype=np.float64)
    kvh, window, hd = ring_k.shape
    q = np.asarray(q, dtype=np.float64).reshape(num_heads, hd)
    sk = np.asarray(sink_k, dtype=np.float64).reshape(kvh, -1, hd)
    sv = np.asarray(sink_v, dtype=np.float64).reshape(kvh, -1, hd)
    rd = hd if rope.rotary_dims is None else rope.rotary_dims
    theta = float(rope.theta)
    hpk = num_heads // kvh
    out = np.zeros((num_heads, hd), dtype=np.float64)
    for h in range(num_heads):
        g = h // hpk
        qh = _rotate64(q[h], seen - 1, theta, rd)
        keys, vals = [], []
        for j in range(sk.shape[1]):
            keys.append(sk[g, j])  # sinks carry no position
            vals.append(sv[g, j])
        n = min(seen, window, group_windows[g])
        for t in range(seen - n, seen):
            keys.append(_rotate64(ring_k[g, t % window], t, theta, rd))
            vals.append(ring_v[g, t % window])
        scores = [scale * float(np.dot(qh, k)) for k in keys]
        m = max(scores)
        weights = [math.exp(s - m) for s in scores]
        z = math.fsum(weights)
        for w, v in zip(weights, vals):
            out[h] += (w / z) * v
    return out
