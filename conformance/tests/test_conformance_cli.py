"""`kvreg conformance` (kvreg_conformance.cli.run): exit status, report, JUnit."""

import argparse
import json
from pathlib import Path

from kvreg_conformance import cli as conformance_cli

HERE = Path(__file__).resolve().parent


def args(**kw):
    base = dict(backend="reference", device=None, report=None, junit=None, keyword=None, quick=False)
    base.update(kw)
    return argparse.Namespace(**base)


def test_a_passing_run_exits_zero_and_writes_the_report_and_junit(tmp_path):
    report, junit = tmp_path / "r.json", tmp_path / "j.xml"
    rc = conformance_cli.run(args(keyword="quantize_rows_rounds_ties", report=str(report), junit=str(junit)))
    assert rc == 0
    run = json.loads(report.read_text())["runs"][0]
    assert (run["backend"], run["device"], run["outcomes"]) == ("reference", "cpu", {"passed": 2})
    assert "kvreg-conformance[reference@cpu]" in junit.read_text()


def test_unknown_backend_exits_two(capsys):
    assert conformance_cli.run(args(backend="no_such_backend")) == 2
    assert "no_such_backend" in capsys.readouterr().err


def test_a_failing_backend_exits_one_and_reports_the_failure(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(HERE))
    import broken_backends

    from kvreg import registry

    registry.register_plugin(broken_backends.PLUGIN)   # the parent must know the name it is asked for

    monkeypatch.setenv("PYTHONPATH", str(HERE))
    monkeypatch.setenv("PYTEST_ADDOPTS", "-p broken_backends")
    report = tmp_path / "r.json"
    try:
        rc = conformance_cli.run(args(backend="broken_round", keyword="quantize_rows_rounds_ties",
                                      report=str(report)))
    finally:
        registry.unregister_plugin(broken_backends.PLUGIN)
    assert rc == 1
    assert json.loads(report.read_text())["runs"][0]["outcomes"]["failed"] == 2


def test_all_selects_every_registered_backend_on_each_device():
    pairs, _ = conformance_cli.targets("all", None)
    assert ("reference", "cpu") in pairs
