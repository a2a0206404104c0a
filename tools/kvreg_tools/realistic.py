"""Realistic attention inputs and float64 attention oracles for accuracy work.

Random Gaussian q/k/v make every approximate attention look good: the
softmax is nearly uniform, nothing is far away, nothing is an outlier. Real
decoder layers have the opposite features, and each one breaks a different
approximation, so :func:`realistic_qkv` builds all of them in:

* **RoPE** (rotate-half, theta ``rope_theta``): keys are rotated at their
  absolute positions, so the same raw key scores differently near and far.
* **Outlier channels**: ``outlier_channels`` channels per KV head (fixed per
  head, chosen as whole rotate-half pairs so RoPE keeps the energy inside
  them) carry a consistent ~``outlier_scale``x bias, as K projections in real
  models do; they dominate key norms and defeat per-row quantization.
* **Attention sink** at position 0: a key most queries align with, taking a
  large share of the mass (StreamingLLM's observation).
* **Values** with a log-normal per-token scale spread.
* **Queries** correlated with a recency-biased earlier key of their group,
  so attention is peaked but not one-hot.

Queries are built directly in the rotated frame (equivalent to building raw
queries and rotating them, since a rotation is invertible): that is what a
cache sees. Everything is seeded (``np.random.default_rng``) and cached on its
arguments; the arrays returned are read-only so a cached set cannot be
corrupted by one caller for the next.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from kvreg.errors import ShapeError

__all__ = [
    "RealisticQKV",
    "realistic_qkv",
    "rope_rotate_half",
    "exact_attention_f64",
    "error_report",
]


@dataclass(frozen=True)
class RealisticQKV:
    """One generated set. ``q [rows, nh, hd]``, ``k``/``v [rows, nkv, hd]``
    float32 (read-only); ``outlier_idx [nkv, outlier_channels]`` the outlier
    channels of each KV head; ``scale`` the logit scale the data is tuned for
    (``1/sqrt(hd)``)."""

    q: np.ndarray
    k: np.ndarray
    v: np.ndarray
    outlier_idx: np.ndarray
    scale: float


def rope_rotate_half(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """Rotate-half RoPE of ``x [rows, ..., hd]`` at ``positions [rows]``.

    Channel ``i < hd/2`` pairs with ``i + hd/2`` and turns by
    ``pos * theta**(-2i/hd)``. Computed in float64, returned as x's dtype.
    """
    hd = x.shape[-1]
    if hd % 2:
        raise ShapeError(f"rope_rotate_half: head_dim must be even, got {hd}")
    half = hd // 2
    inv = theta ** (-np.arange(half, dtype=np.float64) * 2.0 / hd)
    ang = np.asarray(positions, dtype=np.float64)[:, None] * inv[None, :]
    shape = (ang.shape[0],) + (1,) * (x.ndim - 2) + (half,)
    cos, sin = np.cos(ang).reshape(shape), np.sin(ang).reshape(shape)
    x64 = x.astype(np.float64)
    a, b = x64[..., :half], x64[..., half:]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1).astype(x.dtype)


def realistic_qkv(
    rows: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    seed: int = 0,
    outlier_channels: int = 4,
    outlier_scale: float = 10.0,
    rope_theta: float = 10000.0,
    sink_strength: float = 10.0,
) -> RealisticQKV:
    """Seeded realistic q/k/v; see the module docstring for what is modelled.

    ``sink_strength`` is the logit (at ``scale = 1/sqrt(hd)``) a typical query
    gives the sink key; the default makes the sink take a large share of most
    queries' mass without making it one-hot. ``outlier_channels`` must be even
    (whole rotate-half pairs) and at most ``head_dim``.
    """
    if rows < 1 or num_heads < 1 or num_kv_heads < 1 or head_dim < 2 or head_dim % 2:
        raise ShapeError(
            "realistic_qkv: expected rows >= 1, heads >= 1 and an even head_dim >= 2, got "
            f"rows={rows} num_heads={num_heads} num_kv_heads={num_kv_heads} head_dim={head_dim}"
        )
    if num_heads % num_kv_heads:
        raise ShapeError(
            f"realistic_qkv: num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}"
        )
    if outlier_channels < 0 or outlier_channels % 2 or outlier_channels > head_dim:
        raise ShapeError(
            f"realistic_qkv: outlier_channels must be even and in [0, {head_dim}], "
            f"got {outlier_channels}"
        )
    return _realistic_cached(
        int(rows), int(num_heads), int(num_kv_heads), int(head_dim), int(seed),
        int(outlier_channels), float(outlier_scale), float(rope_theta), float(sink_strength),
    )


@functools.lru_cache(maxsize=16)
def _realistic_cached(rows, nh, nkv, hd, seed, n_out, out_scale, theta, sink_strength):
    rng = np.random.default_rng(seed)
    hpk = nh // nkv
    half = hd // 2
    scale = 1.0 / np.sqrt(hd)

    # Outlier pairs live in the slow (low-frequency) half of the rotary
    # spectrum, where real models put them; whole pairs so that RoPE moves
    # energy between the two members but never out of the outlier set.
    pairs = np.stack([
        rng.choice(np.arange(half // 2, half), size=n_out // 2, replace=False) for _ in range(nkv)
    ]) if n_out else np.zeros((nkv, 0), dtype=np.int64)
    outlier_idx = np.sort(np.concatenate([pairs, pairs + half], axis=1), axis=1)

    k_raw = rng.standard_normal((rows, nkv, hd))
    for g in range(nkv):
        sign = rng.choice([-1.0, 1.0], size=n_out)
        # a consistent bias plus a little spread: the outlier is a property
        # of the channel, not of the token
        k_raw[:, g, outlier_idx[g]] = out_scale * (sign + 0.3 * rng.standard_normal((rows, n_out)))
    k = rope_rotate_half(k_raw, np.arange(rows), theta)

    # The sink key: position 0, so RoPE leaves it alone. Queries get a
    # component along it of the size that yields a logit ~sink_strength.
    sink_dir = rng.standard_normal((nkv, hd))
    sink_dir /= np.linalg.norm(sink_dir, axis=1, keepdims=True)
    k[0] = sink_dir * np.sqrt(hd) * 2.0
    sink_q = sink_strength / (scale * np.sqrt(hd) * 2.0)

    # Each query focuses on one earlier key of its group (recency-biased,
    # head-specific), with noise: peaked, not one-hot.
    back = rng.geometric(1.0 / 48.0, size=(rows, nh)) - 1
    focus = np.maximum(np.arange(rows)[:, None] - back, 0)
    group = np.arange(nh) // hpk
    fk = k[focus, group[None, :], :]
    fnorm = np.linalg.norm(fk, axis=-1, keepdims=True)
    # magnitude that puts the focus key ~4 logits above an unrelated key
    focus_q = 4.0 / (scale * fnorm)
    q = 0.35 * rng.standard_normal((rows, nh, hd))
    q += sink_q * sink_dir[group][None, :, :] * rng.uniform(0.6, 1.1, size=(rows, nh, 1))
    q += focus_q * (fk / fnorm) * rng.uniform(0.5, 1.2, size=(rows, nh, 1))

    v_scale = np.exp(0.5 * rng.standard_normal((rows, nkv, 1)))
    v = v_scale * rng.standard_normal((rows, nkv, hd))

    arrays = []
    for a in (q, k, v):
        a = np.ascontiguousarray(a, dtype=np.float32)
        a.flags.writeable = False
        arrays.append(a)
    outlier_idx.flags.writeable = False
    return RealisticQKV(arrays[0], arrays[1], arrays[2], outlier_idx, float(scale))


def exact_attention_f64(
    q: np.ndarray,
    k: np.ndarray,
    v: np.ndarray,
    scale: float,
    *,
    positions: np.ndarray | None = None,
    window: int | None = None,
    sinks_logits: np.ndarray | None = None,
    return_probs: bool = False,
):
    """The float64 oracle: causal softmax attention, GQA.

    ``q [nq, nh, hd]``, ``k``/``v [n, nkv, hd]``. Query ``i`` sits at absolute
    position ``positions[i]`` (default: the last ``nq`` positions, ``n - nq +
    i``; a single query therefore attends over all rows) and sees rows
    ``[lo, pos]`` with ``lo = max(0, pos + 1 - window)`` (all rows up to pos
    when ``window`` is None). ``sinks_logits [nh]``: a learned sink logit per
    head that joins the max and the denominator and has no value row.

    Returns ``out [nq, nh, hd]`` float64, plus ``probs [nq, nh, n]`` (zeros
    outside the visible range) when ``return_probs``.
    """
    q = np.asarray(q)
    k = np.asarray(k)
    v = np.asarray(v)
    if q.ndim != 3 or k.ndim != 3 or v.shape != k.shape or q.shape[2] != k.shape[2]:
        raise ShapeError(
            "exact_attention_f64: expected q [nq, nh, hd] and k, v [n, nkv, hd] with equal hd, got "
            f"q {q.shape}, k {k.shape}, v {v.shape}"
        )
    nq, nh, hd = q.shape
    n, nkv, _ = k.shape
    if nkv == 0 or nh % nkv:
        raise ShapeError(f"exact_attention_f64: nh={nh} is not a multiple of nkv={nkv}")
    pos = np.arange(n - nq, n) if positions is None else np.asarray(positions, dtype=np.int64)
    if pos.shape != (nq,) or (nq and (pos.min() < 0 or pos.max() >= n)):
        raise ShapeError(f"exact_attention_f64: positions must be {nq} values in [0, {n})")
    if window is not None and window < 1:
        raise ShapeError(f"exact_attention_f64: window must be >= 1, got {window}")
    hpk = nh // nkv
    k64 = k.astype(np.float64)
    v64 = v.astype(np.float64)
    out = np.zeros((nq, nh, hd))
    probs = np.zeros((nq, nh, n)) if return_probs else None
    for i, p in enumerate(pos):
        lo = 0 if window is None else max(0, p + 1 - window)
        for g in range(nkv):
            hs = slice(g * hpk, (g + 1) * hpk)
            s = scale * (q[i, hs].astype(np.float64) @ k64[lo:p + 1, g].T)  # [hpk, rows]
            mx = s.max(axis=1)
            if sinks_logits is not None:
                mx = np.maximum(mx, np.asarray(sinks_logits, dtype=np.float64)[hs])
            e = np.exp(s - mx[:, None])
            z = e.sum(axis=1)
            if sinks_logits is not None:
                z = z + np.exp(np.asarray(sinks_logits, dtype=np.float64)[hs] - mx)
            pr = e / z[:, None]
            out[i, hs] = pr @ v64[lo:p + 1, g]
            if probs is not None:
                probs[i, hs, lo:p + 1] = pr
    return (out, probs) if return_probs else out


def error_report(out, ref, probs=None, probs_ref=None) -> dict:
    """Compare an attention output with its oracle.

    ``out``/``ref [..., hd]``: the relative error ``||o - ô|| / ||o||`` per
    leading index (per (query, head)); ``probs``/``probs_ref [..., n]``: the
    L1 distance of the probability rows. Returns a dict with ``rel`` (the
    array) and ``rel_median``, ``rel_p99``, ``rel_max``; with probabilities
    also ``prob_l1`` and its ``prob_l1_median``, ``prob_l1_p99``.
    """
    o = np.asarray(out, dtype=np.float64)
    r = np.asarray(ref, dtype=np.float64)
    if o.shape != r.shape:
        raise ShapeError(f"error_report: out {o.shape} and ref {r.shape} differ in shape")
    # a zero reference row would divide by zero; its error is then absolute
    denom = np.maximum(np.linalg.norm(r, axis=-1), np.finfo(np.float64).tiny)
    rel = np.linalg.norm(o - r, axis=-1) / denom
    rep = {
        "rel": rel,
        "rel_median": float(np.median(rel)),
        "rel_p99": float(np.percentile(rel, 99)),
        "rel_max": float(rel.max()),
    }
    if (probs is None) != (probs_ref is None):
        raise ShapeError("error_report: give both probs and probs_ref, or neither")
    if probs is not None:
        p = np.asarray(probs, dtype=np.float64)
        pr = np.asarray(probs_ref, dtype=np.float64)
        if p.shape != pr.shape:
            raise ShapeError(f"error_report: probs {p.shape} and probs_ref {pr.shape} differ")
        l1 = np.abs(p - pr).sum(axis=-1)
        rep.update(prob_l1=l1, prob_l1_median=float(np.median(l1)),
                   prob_l1_p99=float(np.percentile(l1, 99)))
    return rep
