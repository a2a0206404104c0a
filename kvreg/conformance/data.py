"""Deterministic inputs of the conformance cases (no randomness between runs)."""

from __future__ import annotations

import numpy as np

from kvreg import KvMode, LayerKvCache

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
