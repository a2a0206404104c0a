"""Real attention data (a trained decoder's captured Q/K/V) and the O(1)
seal's accuracy on it (research.o1_report.o1_real_table)."""

import json
import math

import numpy as np
import pytest

from kvreg.errors import ConfigError, ShapeError
from kvreg_conformance.data import RealisticQKV
from kvreg_conformance.oracle import attention_oracle
from research.o1_report import format_table, main, o1_accuracy_table, o1_real_table
from research.real_attention import DATA_PATH, real_layers, real_meta, real_qkv


@pytest.fixture(scope="module")
def meta():
    return real_meta()


# ── the loader

def test_data_file_is_small_and_described(meta):
    import os

    assert os.path.getsize(DATA_PATH) < 3.2e6
    for key in ("layers", "rows", "num_heads", "num_kv_heads", "head_dim", "rope_theta", "scale",
                "heldout_bits_per_byte", "final_train_bits_per_byte", "corpus", "torch_version",
                "train_seconds"):
        assert key in meta, key
    assert meta["rows"] >= 1024
    assert math.isclose(meta["scale"], 1 / math.sqrt(meta["head_dim"]))
    # the model learned something: far below the 8 bits/byte of a uniform byte
    # guess and below a byte-unigram model of source code (~4.5-5)
    assert meta["heldout_bits_per_byte"] < 3.5
    assert meta["train_seconds"] <= 15 * 60
    assert real_layers() == meta["layers"]


def test_one_layer_shapes_dtypes_readonly(meta):
    rows, nh, nkv, hd = meta["rows"], meta["num_heads"], meta["num_kv_heads"], meta["head_dim"]
    for li in meta["layers"]:
        d = real_qkv(li)
        assert isinstance(d, RealisticQKV)
        assert d.q.shape == (rows, nh, hd) and d.k.shape == (rows, nkv, hd) == d.v.shape
        for a in (d.q, d.k, d.v):
            assert a.dtype == np.float32 and a.flags.c_contiguous
            assert not a.flags.writeable
            assert np.all(np.isfinite(a))
            with pytest.raises(ValueError):
                a[0, 0, 0] = 1.0
        assert d.outlier_idx.shape == (nkv, 0)
        assert d.scale == meta["scale"]
        assert real_qkv(li) is d  # cached


def test_all_layers_stack_along_heads(meta):
    nh, nkv = meta["num_heads"], meta["num_kv_heads"]
    d = real_qkv()
    L = len(meta["layers"])
    assert d.q.shape[1] == L * nh and d.k.shape[1] == L * nkv == d.v.shape[1]
    for i, li in enumerate(meta["layers"]):
        one = real_qkv(li)
        np.testing.assert_array_equal(d.q[:, i * nh:(i + 1) * nh], one.q)
        np.testing.assert_array_equal(d.k[:, i * nkv:(i + 1) * nkv], one.k)
        np.testing.assert_array_equal(d.v[:, i * nkv:(i + 1) * nkv], one.v)
    assert d.outlier_idx.shape == (L * nkv, 0)


def test_rows_prefix(meta):
    li = meta["layers"][0]
    full, pre = real_qkv(li), real_qkv(li, rows=100)
    assert pre.q.shape[0] == 100
    np.testing.assert_array_equal(pre.k, full.k[:100])


def test_data_is_real_attention(meta):
    """Not noise: a trained model's reads are sharp (the shipped layers'
    median entropy is 0.06-0.5 nat, against log(2048) = 7.6 for a uniform
    read), where random q/k would give near-uniform attention."""

    li = meta["layers"][-1]
    d = real_qkv(li)
    t = meta["rows"]
    _, probs = attention_oracle(d.q[-8:], d.k, d.v, d.scale, return_probs=True)
    ent = -(probs * np.log(np.where(probs > 0, probs, 1))).sum(-1)
    assert np.median(ent) < 0.25 * math.log(t)


@pytest.mark.parametrize("bad", [-1, 99, 1.0, "0", True])
def test_bad_layer_refused(bad):
    with pytest.raises(ConfigError):
        real_qkv(bad)


@pytest.mark.parametrize("bad", [0, -5, 10 ** 9, 2.5, True])
def test_bad_rows_refused(bad):
    with pytest.raises(ShapeError):
        real_qkv(rows=bad)


def test_missing_or_corrupt_file_refused(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        real_qkv(path=tmp_path / "nope.npz")
    bad = tmp_path / "bad.npz"
    bad.write_bytes(b"not an npz")
    with pytest.raises(ConfigError):
        real_qkv(path=bad)
    # a well-formed file whose arrays disagree with its metadata
    meta = dict(real_meta(), layers=[0], rows=4)
    np.savez_compressed(tmp_path / "shape.npz", meta=np.array(json.dumps(meta)),
                        q0=np.zeros((4, 1, 2), np.float16), k0=np.zeros((4, 1, 2), np.float16),
                        v0=np.zeros((4, 1, 2), np.float16))
    with pytest.raises(ShapeError):
        real_qkv(path=tmp_path / "shape.npz")


# ── the O(1) seal on real data

@pytest.fixture(scope="module")
def table(meta):
    # the full context, both windows, m 16: seconds
    return o1_real_table(contexts=(meta["rows"],), windows=(64, 256), ms=(16,), ndec=16)


def pick(rows, **kw):
    out = [r for r in rows if all(r[k] == v for k, v in kw.items())]
    assert len(out) == 1, kw
    return out[0]


def test_real_table_rows(table, meta):
    layers = ["all"] + meta["layers"]
    assert {r["layer"] for r in table} == set(layers)
    assert {r["method"] for r in table} == {"nystrom", "stream", "pool_m", "pool_B", "born",
                                           "sinkwin"}
    for r in table:
        assert 0 <= r["far_reads"] <= 1 and r["budget_rows"] >= 4 + r["window"]
    text = format_table(table)
    assert "layer" in text.splitlines()[0] and "nystrom" in text


def med(table, method, w, key="rel_median"):
    return pick(table, layer="all", window=w, m=16, method=method)[key]


# Measured on the shipped capture (2048 rows, layers 1 and 3 of the 4-layer
# model, all heads pooled), sinks 4, m 16, ndec 16 (docs/figures.md, "real data"),
# Nyström with its default m heavy rows (far rows kept exact):
#
#   w 64:  median   nystrom 0.0007  sinkwin 0.0031  pool_m 0.0031  stream 0.0003
#          far-heavy nystrom 0.90   sinkwin 1.16    pool_m 1.14    stream 0.63  born 0.69
#   w 256: median   nystrom 0.0001  sinkwin 0.0003  pool_m 0.0003  stream 0.0002
#          far-heavy nystrom 1.00   sinkwin 1.23    pool_m 1.23    stream 1.16  born 0.25
#
# (without the heavy rows: far-heavy nystrom 1.12 / 1.29, median 0.0031 /
# 0.0003.) Real heads are bimodal: most reads put no mass beyond the window
# (every method is exact there, hence the tiny medians), and the far-heavy
# reads (exact far mass >= 0.2) have sharp attention on a few far rows, which
# segment-mean landmarks (and pooling) do not represent; the heavy rows keep
# the ones the recent prompt queries attend. The median target is met on
# this table (m 16, ndec 16). The report's default (ndec 32) is closer at
# m 16: far-heavy nystrom/pool_m 0.94x (w 64) and 0.91x (w 256) at 2048 rows,
# 0.59x / 0.53x at m 64. Born eviction given the same bytes still does
# better on the far-heavy reads.


@pytest.mark.parametrize("w", [64, 256])
def test_nystrom_is_near_exact_on_local_reads(table, w):
    """The seal does not damage the reads that stay inside sinks + window:
    the pooled median error is tiny."""
    assert med(table, "nystrom", w) < 0.01


@pytest.mark.parametrize("w", [64, 256])
def test_equal_memory_born_beats_nystrom_on_far_heavy_reads(table, w):
    """Measured: Born eviction given the Nyström state's byte budget in far
    rows beats Nyström on the far-heavy reads (it keeps many more exact far
    rows than the m heavy ones)."""
    assert med(table, "born", w, "rel_med_far") < med(table, "nystrom", w, "rel_med_far")


@pytest.mark.parametrize("w", [64, 256])
def test_nystrom_meets_pooling_target_on_real_data(table, w):
    """Measured: with its heavy rows Nyström is at most 0.9x segment-mean
    pooling (same w, m) on real data, in the median and on the far-heavy
    reads."""
    assert med(table, "nystrom", w) <= 0.9 * med(table, "pool_m", w)
    assert med(table, "nystrom", w, "rel_med_far") <= 0.9 * med(table, "pool_m", w, "rel_med_far")


@pytest.mark.parametrize("w", [64, 256])
def test_nystrom_beats_sinks_window_and_pooling_in_the_median(table, w):
    """The target: median below sinks + window alone AND at most 0.9x pooling."""
    ny_ = med(table, "nystrom", w)
    assert ny_ < med(table, "sinkwin", w) and ny_ <= 0.9 * med(table, "pool_m", w)


@pytest.mark.parametrize("w", [64, 256])
def test_heavy_rows_keep_the_planted_needle(table, w):
    """The needle (a far key taking ~half of the last query's mass) is kept
    as a heavy row: its far mass is (nearly) all there."""
    assert pick(table, layer="all", window=w, m=16, method="nystrom")["needle_kept"] > 0.9


def test_accuracy_table_data_switch(meta):
    rows = o1_accuracy_table(contexts=(meta["rows"],), windows=(256,), ms=(16,), ndec=4,
                             data="real")
    assert {r["layer"] for r in rows} == {"all", *meta["layers"]}
    with pytest.raises(ConfigError):
        o1_accuracy_table(data="nope")
    with pytest.raises(ConfigError):
        o1_real_table(contexts=(10 ** 9,))


def test_report_main_real(capsys, tmp_path):
    out = tmp_path / "o1.json"
    assert main(["--real", "--quick", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "real attention data" in text and "sinkwin" in text
    doc = json.loads(out.read_text())
    assert doc["data"] == "real" and {r["layer"] for r in doc["rows"]} >= {"all"}


def test_nystrom_beats_sinks_window_and_pooling_on_the_default_real_report():
    """The real-data table of docs/figures.md (``python -m research.o1_report --real``, ndec 32): the
    median over all reads is below sinks + window and at most 0.9x pooling
    in every row (on the far-heavy reads alone two m-16 rows do not reach
    0.9x, as docs/figures.md says)."""
    rows = o1_real_table()
    configs = {(r["context"], r["window"], r["m"]) for r in rows}
    assert len(configs) == 8
    for ctx, w, m in sorted(configs):
        got = {r["method"]: r["rel_median"] for r in rows
               if r["layer"] == "all" and (r["context"], r["window"], r["m"]) == (ctx, w, m)}
        assert got["nystrom"] < got["sinkwin"] and got["nystrom"] <= 0.9 * got["pool_m"], (ctx, w, m, got)
