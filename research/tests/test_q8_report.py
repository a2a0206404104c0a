"""q8 accuracy on realistic and captured real data (research.q8_report): the
storage's error targets, and the report's error measures."""

import numpy as np
import pytest

from kvreg.modes import Q8_EXACT_ROWS
from research.q8_report import error_report, format_q8_table, q8_accuracy
from research.real_attention import real_qkv

ACCURACY = dict(rows=768, num_heads=16, num_kv_heads=4, head_dim=128, queries=16, seed=1)


@pytest.fixture(scope="module")
def accuracy():
    res = q8_accuracy(modes=("q8",), field=(True, False), exact_rows=(Q8_EXACT_ROWS, 0), **ACCURACY)
    return {(r["mode"], r["field"], r["exact_rows"]): r for r in res}


DEFAULT = ("q8", True, Q8_EXACT_ROWS)


def test_q8_accuracy_report_table(accuracy):
    table = format_q8_table(list(accuracy.values()))
    assert table.count("\n") == 1 + len(accuracy)
    f = accuracy[("f32", None, 0)]
    assert f["rel_p99"] < 1e-5 and f["bytes_per_element"] == 4.0
    assert accuracy[DEFAULT]["bytes_per_element"] < 1.1


def test_q8_output_error_p99_within_3pct(accuracy):
    r = accuracy[DEFAULT]
    assert r["rel_p99"] <= 0.03, r


def test_q8_output_error_median_within_1pct(accuracy):
    r = accuracy[DEFAULT]
    assert r["rel_median"] <= 0.01, r


def test_exact_sink_rows_carry_the_median(accuracy):
    # The seed's storage (no exact rows) misses the 1% median on this data:
    # the field, frozen over outlier-biased rows, multiplies the sink row's
    # quantization error in the outlier channels, and the sink takes a large
    # share of every query's mass. Holding that one row exact removes it.
    seed, ours = accuracy[("q8", True, 0)], accuracy[DEFAULT]
    assert seed["rel_median"] > 0.01, seed
    assert ours["rel_median"] < 0.5 * seed["rel_median"], (ours["rel_median"], seed["rel_median"])
    assert ours["sink_logit_err_rms"] < 0.01 * seed["sink_logit_err_rms"], (ours, seed)


def test_field_lowers_key_and_logit_error_on_outlier_channels(accuracy):
    for xr in (Q8_EXACT_ROWS, 0):
        on, off = accuracy[("q8", True, xr)], accuracy[("q8", False, xr)]
        assert on["key_rel_err"] < 0.75 * off["key_rel_err"], (xr, on["key_rel_err"], off["key_rel_err"])
        assert on["logit_err_rms"] < off["logit_err_rms"], (xr, on["logit_err_rms"], off["logit_err_rms"])


def test_q8_report_runs_on_real_attention_data():
    data = real_qkv(rows=256)
    res = q8_accuracy(modes=("q8v",), data=data, queries=8)
    f32, q8v = res
    assert f32["rel_p99"] < 1e-5 and f32["n"] == 8 * data.q.shape[1]
    assert 0 < q8v["rel_median"] < 0.02 and q8v["key_rel_err"] == 0.0


def test_error_report_zero_for_identical_outputs():
    o = np.random.default_rng(0).standard_normal((3, 2, 8))
    rep = error_report(o, o)
    assert rep["rel_max"] == 0.0 and rep["rel"].shape == (3, 2)


def test_error_report_relative_error_value():
    ref = np.array([[3.0, 4.0]])
    rep = error_report(ref + np.array([[0.5, 0.0]]), ref)
    assert rep["rel_median"] == pytest.approx(0.1)


def test_error_report_prob_l1():
    p = np.array([[0.5, 0.5]])
    rep = error_report(np.ones((1, 2)), np.ones((1, 2)), np.array([[1.0, 0.0]]), p)
    assert rep["prob_l1_median"] == pytest.approx(1.0)
