"""`kvreg bench` code paths on tiny sizes, and the bulk-filled layers the
benchmarks start from."""

import argparse
import contextlib
import json
import os
import time

import numpy as np
import pytest

from kvreg import LayerKvCache
from kvreg_conformance.fill import filled_layer, kv_rows
from kvreg_tools import bench


@pytest.mark.parametrize("mode", ["f32", "q8", "q8k", "q8v"])
def test_filled_layer_equals_appending_row_by_row(mode):
    n = 150
    a = filled_layer(n, 3, 40, mode=mode, backend="reference")
    k, v = kv_rows(n, 3, 40, 0)
    b = LayerKvCache(3, 40, mode, "reference")
    for i in range(n):
        b.append(k[:, i], v[:, i])
    sa, sb = a.storage, b.storage
    for name in sa.block_names():
        assert np.array_equal(getattr(sa, name)[:, :n], getattr(sb, name)[:, :n]), name
    assert np.array_equal(sa.kcol, sb.kcol) and np.array_equal(sa.vcol, sb.vcol)
    assert a.seq_len == b.seq_len and np.array_equal(sa.lens, sb.lens)
    assert a.memory_bytes() == b.memory_bytes()
    q = np.random.default_rng(0).standard_normal((6, 40), dtype=np.float32)
    assert np.array_equal(a.attend_layer(q), b.attend_layer(q))


def test_time_call_stops_at_max_time():
    calls = []
    bench.time_call(lambda: calls.append(1), min_time=0.0, repeats=1000, max_time=0.0)
    assert len(calls) == 1


def test_cold_ring_spans_twice_the_last_level_cache(monkeypatch):
    monkeypatch.setattr(bench, "last_level_cache_bytes", lambda: 100)
    made = []
    ring = bench.ColdRing(lambda: made.append(len(made)) or len(made) - 1, lambda item: 30)
    assert len(ring.items) == len(made) == 7   # 7 x 30 bytes >= twice 100
    assert [ring.next() for _ in range(8)] == [1, 2, 3, 4, 5, 6, 0, 1]
    assert len(bench.ColdRing(lambda: 0, lambda item: 30, max_copies=3).items) == 3
    assert len(bench.ColdRing(lambda: 0, lambda item: 10**9).items) == 1


def test_the_probe_is_taken_around_the_timing(monkeypatch):
    events = []
    probes = iter([(10.0, "src"), (30.0, "src")])
    monkeypatch.setattr(bench, "stream_read_bandwidth", lambda nbytes: events.append("probe") or next(probes))
    t, bw = bench.time_beside_probe(lambda: events.append("time") or 0.5, 1 << 20)
    assert (t, bw) == (0.5, 20.0) and events == ["probe", "time", "probe"]


def _cpu_ticks(pid):
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return int(fields[11]) + int(fields[12])   # utime + stime


@pytest.mark.skipif(not os.path.exists("/proc/self/stat"), reason="reads /proc")
def test_busy_process_spins_while_inside_and_is_gone_after():
    with bench.busy_process() as busy:
        t0 = _cpu_ticks(busy.pid)
        # it spends CPU while alive: 0.1 s of it within a minute, however
        # busy the machine's neighbours are (a sleeping process spends none)
        for _ in range(600):
            time.sleep(0.1)
            if _cpu_ticks(busy.pid) - t0 >= 10:
                break
        assert busy.poll() is None and _cpu_ticks(busy.pid) - t0 >= 10
    assert busy.poll() is not None


def test_quiet_time_is_the_mean_around_the_busy_one(monkeypatch):
    inside = []

    @contextlib.contextmanager
    def fake_busy():
        inside.append(True)
        yield
        inside.pop()

    monkeypatch.setattr(bench, "busy_process", fake_busy)
    times = iter([1.0, 3.0, 2.0])
    seen = []
    d = bench.quiet_and_busy(None, lambda fn: seen.append(bool(inside)) or next(times))
    assert seen == [False, True, False]
    assert d == dict(quiet_seconds=1.5, busy_seconds=3.0, ratio=2.0)


@pytest.mark.parametrize("call", bench.SmallModelCall.CALLS)
def test_small_model_call_appends_and_attends_each_layer_in_turn(call):
    small = bench.SmallModelCall("reference", rows=32, layers=3)
    layers = small.layers.items
    assert len(layers) == 3 and all(lay.seq_len == 32 for lay in layers)
    ref = filled_layer(32, 3, 64, backend="reference")
    ref.append(small.kv, small.kv)
    want = ref.attend_layer(small.q)
    called = []
    for i in range(3):
        layer = small.call(call)
        called.append(id(layer))
        assert sorted(lay.seq_len for lay in layers) == [32] * (2 - i) + [33] * (i + 1)
        assert layer.seq_len == 33
        got = small._steps[id(layer)].out if call == "decode_step" else layer.attend_layer(small.q)
        assert np.array_equal(got, want)
    assert len(set(called)) == 3
    t, rows = small.seconds(call, repeats=2)
    assert t > 0 and rows in (33 + 1.5, 33 + 3.5)   # the best round's mean rows
    assert all(lay.seq_len == 33 for lay in layers)   # the timed rounds' rows dropped


def test_last_level_cache_is_a_positive_size():
    assert bench.last_level_cache_bytes() >= 1 << 10


def test_bench_without_kvreg_conformance_says_how_to_install_it(capsys, monkeypatch):
    real = bench.importlib.util.find_spec
    monkeypatch.setattr(bench.importlib.util, "find_spec",
                        lambda name, *a: None if name == "kvreg_conformance" else real(name, *a))
    args = argparse.Namespace(what="all", backend=["reference"], quick=True, json=None, plot=None,
                              sizes=bench.TINY, progress=False)
    assert bench.main(args) == 2
    assert "needs kvreg-conformance" in capsys.readouterr().err


def test_bench_tiny_run_writes_every_figure(tmp_path, capsys):
    out = tmp_path / "b.json"
    args = argparse.Namespace(what="all", backend=["reference"], quick=True, json=str(out), plot=None,
                              sizes=bench.TINY, progress=False)
    assert bench.main(args) == 0
    text = capsys.readouterr().out
    for part in ("stream-read bandwidth", "decode", "q8/F32", "prefill", "append", "wire"):
        assert part in text
    res = json.loads(out.read_text())
    assert {d["rows"] for d in res["decode"] if d["backend"] == "reference"} == set(bench.TINY.decode_rows)
    assert {d["copies"] for d in res["decode"]} == {bench.TINY.cold_copies}
    for d in res["decode"]:
        assert d["probe_gbps"] > 0 and d["fraction"] == pytest.approx(d["gbps"] / d["probe_gbps"])
    assert "the probe around these timings read" in text
    for key in ("decode", "q8", "busy", "prefill", "append", "wire"):
        assert res[key], key
    assert {d["backend"] for d in res["busy"]} == {"reference", "torch-sdpa"}
    for d in res["busy"]:
        assert d["rows"] == bench.TINY.busy_rows
        assert d["ratio"] == pytest.approx(d["busy_seconds"] / d["quiet_seconds"])
    assert "beside a busy process" in text
    assert [(d["backend"], d["call"]) for d in res["small"]] == [("reference", c) for c in bench.SmallModelCall.CALLS]
    for d in res["small"]:
        assert d["rows"] == bench.TINY.small_rows and d["layers"] == bench.TINY.small_layers
        assert d["probe_gbps"] > 0 and d["ratio"] > 0
    assert "a small model's decode call" in text
    assert res["machine"]["stream_read_gbps"] > 0 and res["machine"]["bandwidth_source"]
    assert "torch-sdpa" in res["peers"]


def test_bench_decode_only(capsys):
    res = bench.run("decode", ["reference"], bench.TINY, progress=False)
    assert res["decode"] and res["q8"] and not res["prefill"] and not res["wire"]


def test_bench_plot(tmp_path):
    pytest.importorskip("matplotlib")
    res = bench.run("decode", ["reference"], bench.TINY, progress=False)
    path = tmp_path / "d.png"
    bench.plot_decode(res, str(path))
    assert path.stat().st_size > 0


def test_a_device_for_opencl_leaves_the_cpu_backends_measured(monkeypatch):
    monkeypatch.setenv("KVREG_DEVICE", "gpu")
    started, failed = bench._backends(["reference"])
    assert [b.name for b in started] == ["reference"] and not failed


def test_unknown_backend_is_reported_not_fatal():
    res = bench.run("decode", ["no-such-backend"], bench.TINY, progress=False)
    assert any(u["backend"] == "no-such-backend" for u in res["unavailable"])
    assert res["decode"]
