"""``kvreg report``: docs/benchmarks.md generated from benchmark records, and
what a run records about itself (kvreg_tools.report)."""

from __future__ import annotations

import argparse
import copy
import json
from pathlib import Path

import pytest

from kvreg.errors import ConfigError
from kvreg_tools import report

REPO = Path(__file__).resolve().parents[2]

MACHINE = {"cpu": "Test CPU 9000", "cores": 2, "platform": "Linux-test", "python": "3.11.7"}


def _eval_record(system="kvreg", model="smollm2-135m", date="2026-01-02", tokens=1024, prefix=256, configs=None):
    configs = configs or [("q8", 1e-4, 0.99, 1 << 20), ("q4", 3e-3, 0.96, 1 << 19)]
    return {
        "kind": "eval", "system": system, "command": f"{system} eval --model {model}", "machine": dict(MACHINE),
        "date": date, "model": model, "text": "textwrap.py", "text_sha256": "ab" * 32,
        "tokens": tokens, "prefix": prefix, "scored": tokens - prefix,
        "reference": {"config": "f32", "ppl": 8.0, "peak_bytes": 4 << 20, "avg_bytes": 3 << 20},
        "results": [{"config": c, "ppl": 8.1, "kl_mean": kl, "kl_p99": 10 * kl, "top1": t1, "peak_bytes": peak,
                     "avg_bytes": peak * 0.75, "ms_per_token": 12.5} for c, kl, t1, peak in configs],
    }


def _tree(tmp_path: Path, kvreg_records: dict, peer_records: dict | None = None) -> Path:
    for folder, records in ((report.KVREG_RESULTS, kvreg_records), (report.PEER_RESULTS, peer_records or {})):
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
        for name, rec in records.items():
            (tmp_path / folder / name).write_text(json.dumps(rec))
    return tmp_path


def _run(root: Path, check: bool = False) -> int:
    return report.main(argparse.Namespace(root=str(root), check=check))


def test_the_committed_page_is_what_the_committed_records_give(capsys):
    rc = _run(REPO, check=True)
    assert rc == 0, capsys.readouterr().err


def test_the_committed_records_are_valid_and_cover_the_kv_modes_on_both_models():
    records = report.load_records(REPO)
    modes = {(r["model"], row["config"]) for w, r in records if w.startswith("kvreg/results/") and r["kind"] == "eval"
             for row in r["results"]}
    for model in ("smollm2-135m", "gemma3-270m"):
        assert {(model, m) for m in ("f16", "bf16", "q8", "q8v", "q4")} <= modes


def test_a_section_per_model_and_context_naming_machine_date_and_command(tmp_path):
    root = _tree(tmp_path, {"modes-smollm2.json": _eval_record(),
                            "modes-gemma.json": _eval_record(model="gemma3-270m", date="2026-01-03")},
                 {"llamacpp-smollm2.json": _eval_record(system="llama.cpp", configs=[("q8_0", 5e-3, 0.95, 1 << 20)])})
    page = report.render(report.load_records(root))
    heads = [line for line in page.splitlines() if line.startswith("### ")]
    assert heads == ["### gemma3-270m · textwrap.py · 1024 tokens, prefix 256 (768 scored)",
                     "### smollm2-135m · textwrap.py · 1024 tokens, prefix 256 (768 scored)"]
    smol = page.split(heads[1])[1]
    rows = [line for line in smol.splitlines() if line.startswith("| ") and not line.startswith("| system")]
    # kvreg's run first (its reference, then its configs in run order), then the peer's
    assert [r.split(" | ")[:2] for r in rows] == [["| kvreg", "f32 (reference)"], ["| kvreg", "q8"], ["| kvreg", "q4"],
                                                   ["| llama.cpp", "f32 (reference)"], ["| llama.cpp", "q8_0"]]
    # KL, p99, top-1, PPL, peak and average MiB, and the peak over the reference's peak
    assert rows[1] == "| kvreg | q8 | 1.00e-04 | 1.00e-03 | 99.0% | 8.1000 | 1.00 | 0.75 | 0.250 |"
    assert rows[0] == "| kvreg | f32 (reference) | 0 | 0 | 100.0% | 8.0000 | 4.00 | 3.00 | 1.000 |"
    assert ("- **kvreg** (`kvreg/results/modes-smollm2.json`): measured 2026-01-02 on Test CPU 9000, 2 cores, "
            "Linux-test, Python 3.11.7.") in smol
    assert "`llama.cpp eval --model smollm2-135m`" in smol
    assert "## Speed" not in page


def test_the_page_depends_on_the_records_alone_not_their_order(tmp_path):
    a = _tree(tmp_path / "a", {"x.json": _eval_record(), "y.json": _eval_record(model="gemma3-270m")})
    b = _tree(tmp_path / "b", {"y.json": _eval_record(model="gemma3-270m"), "x.json": _eval_record()})
    first = report.render(report.load_records(a))
    assert report.render(report.load_records(b)) == first == report.render(report.load_records(a))
    assert first.count("measured 2026-01-02") == 2


def test_check_passes_on_a_fresh_page_and_names_the_line_a_changed_record_moves(tmp_path, capsys):
    root = _tree(tmp_path, {"modes.json": _eval_record()})
    assert _run(root, check=True) == 1                      # no page yet
    assert "does not exist" in capsys.readouterr().err
    assert _run(root) == 0 and (root / report.PAGE).exists()
    assert _run(root, check=True) == 0
    rec = _eval_record()
    rec["results"][0]["kl_mean"] = 2e-4
    (root / report.KVREG_RESULTS / "modes.json").write_text(json.dumps(rec))
    capsys.readouterr()
    assert _run(root, check=True) == 1
    err = capsys.readouterr().err
    assert "differs from what its records give" in err
    assert "-| kvreg | q8 | 1.00e-04" in err and "+| kvreg | q8 | 2.00e-04" in err


def test_a_file_may_hold_a_list_of_records(tmp_path):
    root = _tree(tmp_path, {"all.json": [_eval_record(), _eval_record(model="gemma3-270m")]})
    found = report.load_records(root)
    assert [w for w, _ in found] == ["kvreg/results/all.json[0]", "kvreg/results/all.json[1]"]


@pytest.mark.parametrize("break_it, expected", [
    (lambda r: r.pop("date"), "lacks date"),
    (lambda r: r["machine"].pop("cores"), "lacks machine.cores"),
    (lambda r: r["reference"].pop("peak_bytes"), "lacks reference.peak_bytes"),
    (lambda r: r["results"][1].pop("avg_bytes"), "lacks results[1].avg_bytes"),
    (lambda r: r.update(results=[]), "at least one configuration"),
    (lambda r: r.update(kind="speed"), "\"kind\" must be"),
    (lambda r: r.update(date="5 Dec"), "YYYY-MM-DD"),
])
def test_a_bad_record_is_refused_naming_the_file_and_the_field(tmp_path, capsys, break_it, expected):
    rec = _eval_record()
    break_it(rec)
    root = _tree(tmp_path, {"bad.json": rec})
    with pytest.raises(ConfigError, match="kvreg/results/bad.json"):
        report.load_records(root)
    assert _run(root) == 2
    err = capsys.readouterr().err
    assert expected in err and not (root / report.PAGE).exists()


def test_unreadable_json_and_a_missing_results_folder_are_errors(tmp_path, capsys):
    assert _run(tmp_path) == 2
    assert "no kvreg/results" in capsys.readouterr().err
    (tmp_path / report.KVREG_RESULTS).mkdir(parents=True)
    (tmp_path / report.KVREG_RESULTS / "x.json").write_text("{not json")
    assert _run(tmp_path) == 2
    assert "x.json: not readable JSON" in capsys.readouterr().err


def test_a_bench_record_is_shown_as_the_benchmark_prints_it(tmp_path):
    bench = json.loads((Path(__file__).parent / "data" / "bench-kernels.json").read_text())
    rec = {**report.header("bench", ["kvreg", "bench"]), **bench}
    rec["machine"] = {**MACHINE, **bench["machine"]}
    rec["date"] = "2026-01-04"
    root = _tree(tmp_path, {"bench.json": rec})
    page = report.render(report.load_records(root))
    speed = page.split("## Speed (`kvreg bench --json`)")[1]
    assert "### kernels (all)" in speed and "measured 2026-01-04" in speed and "`kvreg bench`" in speed
    from kvreg_tools.bench import format_report

    assert format_report(bench).rstrip() in speed


def test_a_bench_record_of_unknown_shape_is_refused(tmp_path):
    rec = {**report.header("bench", ["kvreg", "bench"]), "figures": []}
    root = _tree(tmp_path, {"odd.json": rec})
    with pytest.raises(ConfigError, match="odd.json: a bench record must be"):
        report.render(report.load_records(root))


def test_header_names_the_machine_today_and_the_command_with_its_environment(monkeypatch):
    for k in report.COMMAND_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("KVREG_THREADS", "1")
    h = report.header("eval", ["kvreg", "eval", "--configs", "q8,born:104", "--text", "my text.txt"])
    assert h["kind"] == "eval" and h["system"] == "kvreg"
    assert h["command"] == "KVREG_THREADS=1 kvreg eval --configs q8,born:104 --text 'my text.txt'"
    assert set(h["machine"]) == {"cpu", "cores", "platform", "python"} and h["machine"]["cores"] >= 1
    assert report.datetime.date.fromisoformat(h["date"])


def test_load_counts_the_cores_other_processes_kept_busy(monkeypatch):
    clock = {"wall": 100.0, "own": 10.0, "busy": 1000.0}
    monkeypatch.setattr(report.time, "perf_counter", lambda: clock["wall"])
    monkeypatch.setattr(report.time, "process_time", lambda: clock["own"])
    monkeypatch.setattr(report, "_busy_seconds", lambda: clock["busy"])
    monkeypatch.setattr(report.os, "cpu_count", lambda: 2)
    load = report.Load()
    # 10 s: this process used 12 CPU seconds, the machine 15: others kept 0.3 cores busy
    clock.update(wall=110.0, own=22.0, busy=1015.0)
    assert load.others() == pytest.approx(0.3)
    assert load.warning() is None
    # the machine 30 busy seconds: others 1.8 of 2 cores
    clock.update(busy=1030.0)
    assert load.others() == pytest.approx(1.8)
    assert load.warning().startswith("timings are unreliable: the machine was busy (other processes kept 1.8 of "
                                     "its 2 cores busy")
    monkeypatch.setattr(report, "_busy_seconds", lambda: None)     # no /proc/stat: no claim either way
    assert report.Load().others() is None and report.Load().warning() is None


def test_busy_seconds_reads_the_machine_counters():
    busy = report._busy_seconds()
    if busy is None:
        pytest.skip("no /proc/stat here")
    assert busy > 0


def test_render_does_not_change_its_records(tmp_path):
    root = _tree(tmp_path, {"modes.json": _eval_record()})
    records = report.load_records(root)
    before = copy.deepcopy(records)
    report.render(records)
    assert records == before


def test_kvreg_bench_json_is_a_record_with_the_benchmarks_own_figures(tmp_path, monkeypatch):
    import kvreg_tools.bench as bench
    from kvreg.cli import main

    out = tmp_path / "bench.json"

    def fake_main(args):
        out.write_text(json.dumps({"what": args.what, "machine": {"cpu_count": 2, "stream_read_gbps": 30.0},
                                   "decode": [{"rows": 4096}]}))
        return 0

    monkeypatch.setattr(bench, "main", fake_main)
    for k in report.COMMAND_ENV:
        monkeypatch.delenv(k, raising=False)
    assert main(["bench", "decode", "--backend", "numba", "--quick", "--json", str(out)]) == 0
    rec = json.loads(out.read_text())
    assert rec["kind"] == "bench" and rec["system"] == "kvreg" and rec["what"] == "decode"
    assert rec["command"] == "kvreg bench decode --backend numba --quick"
    assert rec["machine"]["stream_read_gbps"] == 30.0 and rec["machine"]["cores"] >= 1 and "cpu" in rec["machine"]
    assert rec["decode"] == [{"rows": 4096}]
    report._check_record(rec, "bench.json")
