"""Prefill chunk attention against the f64 oracle (tolerance class)."""

import numpy as np
import pytest

from kvreg_numba import kernels as K

from naive import attend_oracle


@pytest.mark.parametrize("s0,b,window", [(0, 11, None), (23, 19, None), (23, 19, 5), (23, 19, 30), (40, 7, 1)])
def test_chunk_matches_per_row_oracle(small_blocks, s0, b, window):
    rng = np.random.default_rng(s0 + b)
    nkv, hpk, hd = 2, 3, 16
    n = s0 + b
    k = rng.standard_normal((nkv, n + 5, hd)).astype(np.float32)
    v = rng.standard_normal((nkv, n + 5, hd)).astype(np.float32)
    q = rng.standard_normal((b, nkv * hpk, hd)).astype(np.float32)
    imp = np.zeros(n, np.float32)
    out = K.attend_chunk(q, k, v, s0=s0, b=b, hpk=hpk, scale=0.3, window=window, imp=imp)
    imp_ref = np.zeros(n)
    for i in range(b):
        lo = max(0, s0 + i + 1 - window) if window else 0
        for g in range(nkv):
            hs = slice(g * hpk, (g + 1) * hpk)
            o, p = attend_oracle(q[i, hs], k[g].astype(np.float64), v[g].astype(np.float64),
                                 scale=0.3, first=lo, n=s0 + i + 1)
            np.testing.assert_allclose(out[i, hs], o, rtol=1e-5, atol=2e-6)
            imp_ref[lo:s0 + i + 1] += p.sum(axis=0)
    np.testing.assert_allclose(imp, imp_ref, rtol=1e-5, atol=2e-6)


def test_chunk_leaves_keys_outside_the_window_untouched(small_blocks):
    # NaN keys before the window's range must not reach any row.
    rng = np.random.default_rng(2)
    s0, b, w = 30, 6, 4
    k = rng.standard_normal((1, s0 + b, 8)).astype(np.float32)
    v = rng.standard_normal((1, s0 + b, 8)).astype(np.float32)
    k[:, : s0 + 1 - w] = np.nan
    v[:, : s0 + 1 - w] = np.nan
    out = K.attend_chunk(rng.standard_normal((b, 2, 8)).astype(np.float32), k, v, s0=s0, b=b, hpk=2,
                         scale=0.5, window=w)
    assert np.isfinite(out).all()


def test_tile_byte_cap_shrinks_tiles_evenly(monkeypatch):
    from kvreg_numba import config

    rng = np.random.default_rng(7)
    s0, b = 50, 30
    k = rng.standard_normal((1, s0 + b, 8)).astype(np.float32)
    v = rng.standard_normal((1, s0 + b, 8)).astype(np.float32)
    q = rng.standard_normal((b, 2, 8)).astype(np.float32)
    ref = K.attend_chunk(q, k, v, s0=s0, b=b, hpk=2, scale=0.5)
    monkeypatch.setattr(config, "CHUNK_TILE_BYTES", 4 * 2 * (s0 + b) * 7)  # 7 rows per tile at most
    np.testing.assert_allclose(K.attend_chunk(q, k, v, s0=s0, b=b, hpk=2, scale=0.5), ref, rtol=1e-6, atol=1e-7)
