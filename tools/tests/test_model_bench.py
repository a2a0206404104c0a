"""``kvreg bench --model`` (kvreg_tools.model_bench) at a tiny size on a real
model: the report's structure and that each step's split adds up, no speed."""

from __future__ import annotations

import contextlib
import json

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvreg_tools import model_bench  # noqa: E402


def test_bench_model_quick_reports_split_ratios_and_raw_timings(tmp_path, capsys):
    from kvreg.cli import main

    out = tmp_path / "model.json"
    assert main(["bench", "--model", "smollm2-135m", "--quick", "--repeats", "2", "--configs",
                 "kvreg:f32,dynamic,static", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for part in ("| kvreg:f32 |", "| dynamic |", "| static |", "cache+attn / dynamic", "prefill attn / SDPA",
                 "target kvreg:f32"):
        assert part in text, part
    res = json.loads(out.read_text())
    assert res["model"] == "smollm2-135m" and res["context"] == 64 and res["steps"] == 2 and res["repeats"] == 2
    assert res["configs"] == ["kvreg:f32", "dynamic", "static"]
    layers = 30
    for name in res["configs"]:
        raw = res["raw"][name]
        assert len(raw["earlier_prefills"]) == 1   # a prefill per round, the last on the kept cache
        for pre in raw["earlier_prefills"] + [raw["prefill"]]:
            assert pre["tokens"] == 64 and pre["attention_calls"] == layers
            assert pre["cache_ns"] + pre["attention_ns"] + pre["rest_ns"] == pre["step_ns"]
            assert (pre["kvreg_store_ns"] > 0) == name.startswith("kvreg")   # the prefill's extend
        assert len(raw["steps"]) == 4 and len(raw["tokens"]) == 1 + 1 + 4   # prefill, warm-up, timed
        for st in raw["steps"]:
            assert st["cache_ns"] > 0 and st["attention_ns"] > 0 and st["rest_ns"] > 0
            assert st["cache_ns"] + st["attention_ns"] + st["rest_ns"] == st["step_ns"]
            assert st["attention_calls"] == layers and st["round"] in (0, 1)
            assert st["update_call_ns"] + st["kvreg_store_ns"] == st["cache_ns"]
            # a decode step stores its row inside append_attend: attention, not a store call
            assert st["kvreg_store_ns"] == 0
        s = res["summary"][name]
        parts = s["median_cache_ms"] + s["median_attention_ms"] + s["median_rest_ms"]
        assert parts == pytest.approx(s["median_step_ms"], rel=1e-9)
        assert s["tokens_per_s"] == pytest.approx(1e3 / s["median_step_ms"])
        both = [p["attention_ns"] / 1e6 for p in raw["earlier_prefills"] + [raw["prefill"]]]
        assert s["prefill_attention_ms"] == pytest.approx(sum(both) / 2) and s["prefill_rounds"] == 2
    r = res["ratios"]["kvreg:f32"]
    for key in ("cache_attention_vs_dynamic", "cache_attention_vs_static", "step_vs_dynamic", "step_vs_static",
                "prefill_attention_vs_sdpa"):
        assert r[key] > 0, key
    assert set(res["ratios"]) == {"kvreg:f32"}
    assert res["greedy_agreement_with_dynamic"]["dynamic"] == 1.0
    assert res["kvreg_backend"] and res["machine"]["torch_threads"] >= 1


def test_bench_model_busy_runs_the_decode_rounds_again_beside_a_spinning_process(tmp_path, capsys, monkeypatch):
    from kvreg.cli import main
    from kvreg_tools import bench

    spun = []
    real = bench.busy_process

    @contextlib.contextmanager
    def counted():
        with real() as p:
            spun.append(p.pid)
            yield p

    monkeypatch.setattr(bench, "busy_process", counted)
    out = tmp_path / "model.json"
    assert main(["bench", "--model", "smollm2-135m", "--quick", "--configs", "kvreg:f32,dynamic", "--busy",
                 "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "beside a busy process" in text and "step busy/quiet" in text
    assert len(spun) == 1
    res = json.loads(out.read_text())
    busy = res["busy"]
    for name in res["configs"]:
        raw = res["raw"][name]
        assert len(raw["steps"]) == len(raw["busy_steps"]) == 2
        assert len(raw["tokens"]) == 1 + 1 + 2 + 2    # the busy steps go on from the quiet ones
        assert busy["summary"][name] == model_bench.summarize_steps(raw["busy_steps"])
        o = busy["over_quiet"][name]
        assert o["step"] == pytest.approx(busy["summary"][name]["median_step_ms"]
                                          / res["summary"][name]["median_step_ms"])
    assert set(busy["ratios"]["kvreg:f32"]) == {"cache_attention_vs_dynamic", "step_vs_dynamic"}


def test_busy_applies_to_a_model_only(capsys):
    from kvreg.cli import main

    assert main(["bench", "decode", "--busy"]) == 2
    assert "--busy" in capsys.readouterr().err


def test_parse_configs_refuses_unknown_and_repeated():
    from kvreg.errors import ConfigError

    assert [c.name for c in model_bench.parse_configs("kvreg:q8, dynamic,static")] == ["kvreg:q8", "dynamic",
                                                                                       "static"]
    for bad in ("kvreg:nope", "sdpa", "dynamic,dynamic", ""):
        with pytest.raises(ConfigError):
            model_bench.parse_configs(bad)


def test_bench_model_refuses_a_subcommand(capsys):
    from kvreg.cli import main

    assert main(["bench", "decode", "--model", "smollm2-135m"]) == 2
    assert "--model" in capsys.readouterr().err
