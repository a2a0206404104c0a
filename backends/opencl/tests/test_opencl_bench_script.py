"""The decode-attend benchmark script runs against the backends as they are
(it reads views and backends through their public names, so a change of
either breaks it here rather than on the next benchmark run)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "bench_opencl.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_opencl", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("mode", ["f32", "q8", "bounded"])
def test_the_benchmark_runs_and_agrees_with_numba(dev, bench, mode, capsys):
    pytest.importorskip("kvreg_numba")
    bench.main(["--rows", "64", "--mode", mode, "--window", "32", "--reps", "1"])
    out = capsys.readouterr().out
    assert "numba" in out and "not compared" not in out
    if mode != "bounded":
        assert float(out.split("maxrel ")[1].split()[0]) < 1e-4


def test_kv_bytes_counts_the_stored_rows(bench):
    assert bench.kv_bytes(bench.random_view(64, "f32")) == 2 * bench.NKV * 64 * bench.HD * 4
