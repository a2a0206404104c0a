"""Shapes at the edges: hd not a multiple of 32, one row, window 1 and
window >= rows, dead heads, GQA 1 and 8, an empty layer. Each against the
oracle (tolerance class) and, where storage is involved, the reference (exact)."""

import numpy as np
import pytest

from kvreg import LayerKvCache

from . import oracle
from .checks import assert_same_storage
from .data import ALL_MODES, filled, queries, rng_rows

MODE_IDS = [m.value for m in ALL_MODES]


@pytest.mark.quick
@pytest.mark.parametrize("mode", ALL_MODES, ids=MODE_IDS)
@pytest.mark.parametrize("hd", [1, 5, 33, 65])
def test_odd_head_dims_attend_and_store_like_the_reference(backend, ref, check, mode, hd):
    nkv, hpk, rows = 2, 2, 70
    c, _, _ = filled(backend, nkv, hd, mode, rows, seed=200 + hd)
    r, _, _ = filled(ref, nkv, hd, mode, rows, seed=200 + hd)
    assert_same_storage(check, c, r, "quantize_rows", f"{mode.value} hd {hd}")
    for g in range(nkv):
        q = queries(200 + g, hpk, hd, 2.0)
        out = c.attend_group(q, g, scale=0.5, first=3)
        want, _, _, _ = oracle.attend_group_oracle(c.storage, g, q, scale=0.5, first=3)
        check.close("attend_group", out, want, f"{mode.value} hd {hd} group {g}")


@pytest.mark.quick
@pytest.mark.parametrize("mode", ALL_MODES, ids=MODE_IDS)
def test_one_row_attends_to_its_value(backend, check, mode):
    c, k, v = filled(backend, 1, 8, mode, 1, seed=210)
    out, probs = c.attend(queries(210, 1, 8)[0], 0)
    check.close("attend_probs", probs, [1.0], f"{mode.value}: one row takes all the mass")
    check.close("attend_group", out, oracle.head_values64(c.storage, 0)[0], f"{mode.value}: one row")


@pytest.mark.parametrize("mode", ALL_MODES, ids=MODE_IDS)
@pytest.mark.parametrize("window", [1, 2, 69, 70, 71, 1000], ids=lambda w: f"w{w}")
def test_window_edges_match_the_oracle(backend, check, mode, window):
    nkv, hd, hpk, rows = 1, 16, 3, 70
    c, _, _ = filled(backend, nkv, hd, mode, rows, seed=220)
    q = queries(220, hpk, hd, 2.0)
    before = c.imp.astype(np.float64)
    out = c.attend_layer(q, scale=0.3, window=window)
    want, imp = oracle.attend_layer_oracle(c.storage, q, scale=0.3, window=window)
    check.close("attend_layer", out, want, f"{mode.value} window {window}")
    check.close("importance", c.imp, before + imp, f"{mode.value} window {window}")


@pytest.mark.quick
@pytest.mark.parametrize("mode", ALL_MODES, ids=MODE_IDS)
def test_dead_heads_answer_zero_and_live_heads_ignore_them(backend, ref, check, mode):
    nkv, hd, hpk, rows = 3, 16, 2, 70
    alive = [False, True, False]
    c, _, _ = filled(backend, nkv, hd, mode, rows, seed=230, alive=alive)
    r, _, _ = filled(ref, nkv, hd, mode, rows, seed=230, alive=alive)
    assert_same_storage(check, c, r, "append", f"{mode.value}: dead heads store nothing")
    q = queries(230, nkv * hpk, hd, 2.0)
    out = c.attend_layer(q, window=9, importance=True)
    check.exact("attend_layer", out[:hpk], np.zeros((hpk, hd), np.float32), f"{mode.value}: dead head 0")
    check.exact("attend_layer", out[2 * hpk:], np.zeros((hpk, hd), np.float32), f"{mode.value}: dead head 2")
    want, _ = oracle.attend_layer_oracle(c.storage, q, scale=1 / np.sqrt(hd), window=9)
    check.close("attend_layer", out, want, f"{mode.value}: live head among dead ones")


@pytest.mark.parametrize("mode", ALL_MODES, ids=MODE_IDS)
@pytest.mark.parametrize("hpk", [1, 8])
def test_gqa_extremes_match_the_oracle(backend, check, mode, hpk):
    nkv, hd, rows = 2, 32, 66
    c, _, _ = filled(backend, nkv, hd, mode, rows, seed=240 + hpk)
    sinks = rng_rows(241, 1, nkv * hpk)[0]
    c.sinks = sinks
    q = queries(240, nkv * hpk, hd, 2.0)
    out = c.attend_layer(q, scale=0.2, window=20, softcap=6.0, importance=False)
    want, _ = oracle.attend_layer_oracle(c.storage, q, scale=0.2, window=20, softcap=6.0, sinks=sinks)
    check.close("attend_layer", out, want, f"{mode.value} hpk {hpk}")


@pytest.mark.quick
@pytest.mark.parametrize("mode", ALL_MODES, ids=MODE_IDS)
def test_empty_layer_answers_zeros(backend, check, mode):
    nkv, hd, hpk = 2, 12, 2
    c = LayerKvCache(nkv, hd, mode, backend)
    q = queries(250, nkv * hpk, hd)
    zeros = np.zeros((nkv * hpk, hd), np.float32)
    check.exact("attend_layer", c.attend_layer(q, window=4), zeros, f"{mode.value}: empty layer")
    check.exact("attend_group", c.attend_group(q[:hpk], 0, scale=0.3), zeros[:hpk], f"{mode.value}: empty")
    out, probs = c.attend(q[0], 1)
    check.exact("attend_group", out, zeros[0], f"{mode.value}: attend on an empty layer")
    check.equal("attend_group", probs.shape, (0,), f"{mode.value}: no probabilities")
    c.append(rng_rows(251, 1, nkv * hd)[0], rng_rows(252, 1, nkv * hd)[0])
    c.clear()
    check.exact("attend_layer", c.attend_layer(q), zeros, f"{mode.value}: cleared layer")
