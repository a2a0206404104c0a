"""Deterministic inputs (no randomness between runs): the conformance cases'
rows and layers, and realistic attention inputs (:func:`realistic_qkv`) for
accuracy tests and benchmarks."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np

from kvreg import KvMode, LayerKvCache
from kvreg.errors import ShapeError

from .oracle import rope64

ALL_MODES = tuple(KvMode)
#: Modes whose rows keep one form for life. A mode with a float16 window
#: (q8, q8k, q8v, q4) moves a row to its integer form as newer rows arrive
#: (q4 further, to int4), so reading the first ``i`` rows later (``upto=i``)
#: reads them as they are now, not as they were at ``i``.
AGELESS_MODES = tuple(m for m in KvMode if not m.window)


def f32(xs) -> np.ndarray:
    return np.asarray(xs, dtype=np.float32)


def pseudo_random_row(p: int, n: int, salt: int) -> np.ndarray:
    """The Rust engine's pseudo-random test row in [-1, 1) (``swa_row`` of kv_cache.rs)."""
    i = np.arange(n)
    return f32(((p * 7919 + i * 104_729 + salt * 1_299_709) % 2003) / 1001.5 - 1.0)


def rng_rows(seed: int, n: int, width: int, scale: float = 1.0) -> np.ndarray:
    """``n`` rows of ``width`` float32 normals times ``scale`` (seeded)."""
    return (np.random.default_rng(seed).standard_normal((n, width)) * scale).astype(np.float32)


#: q8 layers of the suite keep this many exact rows (more than the default,
#: so windows can start inside them).
EXACT_ROWS = 4


def filled(backend, nkv: int, hd: int, mode=KvMode.F32, rows: int = 40, seed: int = 0, alive=None,
           channel_structure: bool = True, exact_rows: int = EXACT_ROWS) -> tuple[LayerKvCache, np.ndarray, np.ndarray]:
    """A layer on ``backend`` holding ``rows`` appended positions.

    Returns ``(layer, k [rows, nkv*hd], v [rows, nkv*hd])``. With
    ``channel_structure`` even channels are 4x larger than odd ones, as in
    the Rust engine's q8 test (it makes the q8 field matter). ``exact_rows``: the
    layer's ``q8_exact_rows``.
    """
    k = rng_rows(seed, rows, nkv * hd)
    v = rng_rows(seed + 1, rows, nkv * hd)
    if channel_structure:
        w = np.where(np.arange(nkv * hd) % 2 == 0, 2.0, 0.5).astype(np.float32)
        k *= w
        v *= w
    lay = LayerKvCache(nkv, hd, mode, backend, q8_exact_rows=exact_rows)
    for p in range(rows):
        lay.append(k[p], v[p], alive)
    return lay, k, v


def queries(seed: int, nh: int, hd: int, scale: float = 1.0) -> np.ndarray:
    return rng_rows(seed + 1000, nh, hd, scale)


# ── realistic attention inputs ──

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
    """Seeded realistic q/k/v, ``rows`` positions of one layer.

    Random Gaussian q/k/v make every approximate attention look good: the
    softmax is nearly uniform, nothing is far away, nothing is an outlier.
    Real decoder layers have the opposite features, and each one breaks a
    different approximation, so this data has all of them:

    * **RoPE** (rotate-half, theta ``rope_theta``): keys are rotated at their
      absolute positions, so the same raw key scores differently near and far.
    * **Outlier channels**: ``outlier_channels`` channels per KV head (fixed
      per head, chosen as whole rotate-half pairs so RoPE keeps the energy
      inside them) carry a consistent ~``outlier_scale``x bias, as K
      projections in real models do; they dominate key norms and defeat
      per-row quantization.
    * **Attention sink** at position 0: a key most queries align with, taking
      a large share of the mass (StreamingLLM's observation).
    * **Values** with a log-normal per-token scale spread.
    * **Queries** correlated with a recency-biased earlier key of their
      group, so attention is peaked but not one-hot.

    Queries are built directly in the rotated frame (equivalent to building
    raw queries and rotating them, since a rotation is invertible): that is
    what a cache sees. The result is cached on the arguments, its arrays
    read-only so a cached set cannot be corrupted by one caller for the next.

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
    k = rope64(k_raw, np.arange(rows), theta)

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
