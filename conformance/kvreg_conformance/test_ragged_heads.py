"""Ragged heads: a KV head that was dead for earlier appends holds fewer
rows than the others (a regression case: ``kv_abs_max`` once missed a NaN
written to such a head). Kernels must read each head's own length."""

import numpy as np
import pytest

from kvreg import KvMode, LayerKvCache

from . import oracle
from .data import ALL_MODES, queries, rng_rows


def ragged(backend, mode, nkv=3, hd=32, rows=90, seed=3):
    """Head 1 dead for the first 30 appends, head 2 for the first 55."""
    k = rng_rows(seed, rows, nkv * hd)
    v = rng_rows(seed + 1, rows, nkv * hd)
    lay = LayerKvCache(nkv, hd, mode, backend, q8_exact_rows=4)
    for p in range(rows):
        lay.append(k[p], v[p], np.array([True, p >= 30, p >= 55]))
    return lay


@pytest.mark.quick
def test_kv_abs_max_sees_a_nan_row_on_a_lagging_head(backend, check):
    lay = ragged(backend, KvMode.F32, rows=40)
    check.equal("kv_abs_max", all(np.isfinite(lay.kv_abs_max())), True)
    row = np.zeros(3 * 32, np.float32)
    row[2 * 32 + 5] = np.nan            # head 2: its first row, far below the others' length
    lay.append(row, np.zeros_like(row))
    check.equal("kv_abs_max", lay.kv_abs_max()[0], np.inf, "NaN key written to a head that lagged")
    lay2 = ragged(backend, KvMode.F32, rows=40)
    lay2.kv_abs_max()
    row = np.zeros(3 * 32, np.float32)
    row[32 + 1] = 1e30                  # head 1 lags too: a finite maximum must be seen as well
    lay2.append(np.zeros_like(row), row)
    check.equal("kv_abs_max", lay2.kv_abs_max()[1], float(np.float32(1e30)), "large value on a lagging head")


@pytest.mark.quick
@pytest.mark.parametrize("mode", ALL_MODES, ids=lambda m: m.value)
def test_attention_on_ragged_heads_reads_each_heads_own_rows(backend, check, mode):
    nkv, hd, hpk = 3, 32, 2
    lay = ragged(backend, mode, nkv, hd)
    check.equal("storage", lay.storage.lens.tolist(), [90, 60, 35])
    q = queries(3, nkv * hpk, hd)
    out = lay.attend_layer(q, scale=0.2, window=40, sinks=None, importance=False)
    for g in range(nkv):
        qg = q[g * hpk:(g + 1) * hpk]
        n = int(lay.storage.lens[g])
        first = max(0, n - 40)
        per = lay.attend_group(qg, g, scale=0.2, first=first)
        check.exact("attend_layer", out[g * hpk:(g + 1) * hpk], per, f"group {g} of ragged heads")
        want, _, _, _ = oracle.attend_group_oracle(lay.storage, g, qg, scale=0.2, first=first)
        check.close("attend_group", per, want, f"{mode.value}: group {g} holding {n} rows")
