"""Prefill chunk attention against the f64 oracle (tolerance class), and the
bit invariants of the register-tiled kernel (kvreg_numba.chunk)."""

import numba
import numpy as np
import pytest

import kvreg
from kvreg_conformance.oracle import attend_rows_oracle
from kvreg_numba import chunk


@pytest.mark.parametrize("s0,b,window", [(0, 11, None), (23, 19, None), (23, 19, 5), (23, 19, 30), (40, 7, 1)])
def test_chunk_matches_per_row_oracle(small_blocks, s0, b, window):
    rng = np.random.default_rng(s0 + b)
    nkv, hpk, hd = 2, 3, 16
    n = s0 + b
    k = rng.standard_normal((nkv, n + 5, hd)).astype(np.float32)
    v = rng.standard_normal((nkv, n + 5, hd)).astype(np.float32)
    q = rng.standard_normal((b, nkv * hpk, hd)).astype(np.float32)
    imp = np.zeros(n, np.float32)
    out = chunk.attend_chunk(q, k, v, s0=s0, b=b, hpk=hpk, scale=0.3, window=window, imp=imp)
    imp_ref = np.zeros(n)
    for i in range(b):
        lo = max(0, s0 + i + 1 - window) if window else 0
        for g in range(nkv):
            hs = slice(g * hpk, (g + 1) * hpk)
            o, p = attend_rows_oracle(q[i, hs], k[g].astype(np.float64), v[g].astype(np.float64),
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
    out = chunk.attend_chunk(rng.standard_normal((b, 2, 8)).astype(np.float32), k, v, s0=s0, b=b, hpk=2,
                         scale=0.5, window=w)
    assert np.isfinite(out).all()


def test_tile_byte_cap_shrinks_tiles_evenly(monkeypatch):
    from kvreg_numba import config

    rng = np.random.default_rng(7)
    s0, b = 50, 30
    k = rng.standard_normal((1, s0 + b, 8)).astype(np.float32)
    v = rng.standard_normal((1, s0 + b, 8)).astype(np.float32)
    q = rng.standard_normal((b, 2, 8)).astype(np.float32)
    ref = chunk.attend_chunk(q, k, v, s0=s0, b=b, hpk=2, scale=0.5)
    monkeypatch.setattr(config, "CHUNK_TILE_BYTES", 4 * 2 * (s0 + b) * 7)  # 7 rows per tile at most
    np.testing.assert_allclose(chunk.attend_chunk(q, k, v, s0=s0, b=b, hpk=2, scale=0.5), ref, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("hd,nkv,hpk", [(64, 3, 3), (80, 2, 4), (256, 1, 4), (32, 1, 7)])
@pytest.mark.parametrize("s0,b,window", [(0, 45, None), (70, 33, None), (70, 33, 40)])
def test_the_tiled_kernel_matches_the_oracle(hd, nkv, hpk, s0, b, window):
    # hd 80: 64 channels then 16 in the value pass; 7 heads: panels that are
    # not a multiple of the 6-row register tile; 103 keys: a partial K block.
    rng = np.random.default_rng(hd + s0 + b)
    n = s0 + b
    k = rng.standard_normal((nkv, n + 3, hd)).astype(np.float32)
    v = rng.standard_normal((nkv, n + 3, hd)).astype(np.float32)
    q = rng.standard_normal((b, nkv * hpk, hd)).astype(np.float32)
    out = chunk.attend_chunk(q, k, v, s0=s0, b=b, hpk=hpk, scale=hd ** -0.5, window=window)
    for i in range(0, b, 4):
        lo = max(0, s0 + i + 1 - window) if window else 0
        for g in range(nkv):
            hs = slice(g * hpk, (g + 1) * hpk)
            o, _ = attend_rows_oracle(q[i, hs], k[g].astype(np.float64), v[g].astype(np.float64),
                                      scale=hd ** -0.5, first=lo, n=s0 + i + 1)
            np.testing.assert_allclose(out[i, hs], o, rtol=2e-5, atol=2e-6)


@pytest.mark.parametrize("window", [None, 50])
def test_tiled_bits_follow_neither_threads_tiles_chunking_nor_importance(monkeypatch, window):
    # Each score is one chain over the channels, each output channel one over
    # the keys a row sees (masked keys add exact zeros), whatever tile or
    # thread computes it: the same rows answer the same bits from one chunk
    # or two, on 1 or 2 threads, at any tile size, with importance or not.
    from kvreg_numba import config

    rng = np.random.default_rng(5)
    nkv, hpk, hd, n = 2, 3, 64, 300
    k = rng.standard_normal((nkv, n, hd), dtype=np.float32)
    v = rng.standard_normal((nkv, n, hd), dtype=np.float32)
    q = rng.standard_normal((n, nkv * hpk, hd), dtype=np.float32)

    def run(s0, b, threads=2, imp=None):
        out = np.empty((b, nkv * hpk, hd), np.float32)
        old = numba.get_num_threads()
        numba.set_num_threads(min(threads, numba.config.NUMBA_NUM_THREADS))   # the workers, as thread_budget sets them
        try:
            chunk.chunk_kernel(q[s0:s0 + b], k, v, s0, hpk, np.float32(0.125), window or 0,
                               chunk.tile_rows(hpk, hd), threads, out, np.empty(0, np.float32) if imp is None else imp)
        finally:
            numba.set_num_threads(old)
        return out

    whole = run(0, n)
    np.testing.assert_array_equal(run(0, n, threads=1), whole)
    imp = np.zeros(n, np.float32)
    np.testing.assert_array_equal(run(0, n, imp=imp), whole)
    assert imp.sum() == pytest.approx(nkv * hpk * n, rel=1e-4)   # every row's probabilities sum to 1
    imp1 = np.zeros(n, np.float32)
    run(0, n, threads=1, imp=imp1)
    np.testing.assert_array_equal(imp1, imp)   # fixed lanes: the sums' order follows no thread count
    np.testing.assert_array_equal(np.concatenate([run(0, 130), run(130, n - 130)]), whole)
    monkeypatch.setattr(config, "CHUNK_TILE_ROWS", 6)
    np.testing.assert_array_equal(run(0, n), whole)
    kvreg.set_num_threads(2)
    try:
        got = chunk.attend_chunk(q, k, v, s0=0, b=n, hpk=hpk, scale=0.125, window=window)
        np.testing.assert_array_equal(got, whole)
        qt = np.ascontiguousarray(q.transpose(1, 0, 2)).transpose(1, 0, 2)   # a model's [n, nh, hd] view, read in place
        got = chunk.attend_chunk(qt, k, v, s0=0, b=n, hpk=hpk, scale=0.125, window=window)
        np.testing.assert_array_equal(got, whole)
    finally:
        kvreg.set_num_threads(None)


def test_a_non_finite_value_row_takes_the_path_that_sums_visible_keys_only():
    # 0 x inf in a register tile would reach rows that cannot see the row.
    rng = np.random.default_rng(9)
    k = rng.standard_normal((1, 60, 32), dtype=np.float32)
    v = rng.standard_normal((1, 60, 32), dtype=np.float32)
    v[0, 40] = np.inf
    out = chunk.attend_chunk(rng.standard_normal((60, 2, 32), dtype=np.float32), k, v, s0=0, b=60, hpk=2, scale=0.2)
    assert np.isfinite(out[:40]).all() and not np.isfinite(out[40:]).any()


_WIDTH_PROBE = """
import sys
import numpy as np
from kvreg_numba import chunk
rng = np.random.default_rng(4)
k = rng.standard_normal((2, 300, 80), dtype=np.float32)
v = rng.standard_normal((2, 300, 80), dtype=np.float32)
q = rng.standard_normal((300, 6, 80), dtype=np.float32)
imp = np.zeros(300, np.float32)
o = chunk.attend_chunk(q, k, v, s0=0, b=300, hpk=3, scale=0.125, window=100, imp=imp)
sys.stdout.write(f"{chunk.LANES} {o.tobytes().hex()} {imp.tobytes().hex()}")
"""


@pytest.mark.cold_jit
def test_the_tiles_give_the_same_bits_on_avx2_as_on_avx512(tmp_path):
    # The vector width decides which products share an instruction, never
    # an operation's order: an AVX2 compile (8 lanes, 6 x 2 value vectors)
    # answers an AVX-512 one's bits. numba compiles for NUMBA_CPU_FEATURES.
    import os
    import subprocess
    import sys

    from numba.core.codegen import get_host_cpu_features

    feats = str(get_host_cpu_features()).split(",")
    if "+avx512f" not in feats:
        pytest.skip("the host has no AVX-512 to compare an AVX2 compile with")
    avx2 = ",".join("-" + f[1:] if f.startswith(("+avx512", "+avx10", "+amx")) else f for f in feats)

    def probe(features):
        env = dict(os.environ)
        if features:   # compiled into a cache of its own (the host's stays warm)
            env.update(NUMBA_CPU_FEATURES=features, NUMBA_CACHE_DIR=str(tmp_path))
        return subprocess.run([sys.executable, "-c", _WIDTH_PROBE], env=env, check=True, capture_output=True,
                              text=True, timeout=600).stdout.split()

    wide, narrow = probe(None), probe(avx2)
    assert (wide[0], narrow[0]) == ("16", "8")
    assert wide[1:] == narrow[1:]
