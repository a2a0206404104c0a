"""`kvreg info` lists every KV mode with its bytes/element and its measured KL,
read from kvreg's shipped benchmark records (kvreg/results/*.json)."""

import fnmatch
import json
import re
import sys
from pathlib import Path

import kvreg
from kvreg import cli
from kvreg.cli import main

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "kvreg" / "results"


def _info(capsys, monkeypatch) -> str:
    monkeypatch.setenv("KVREG_BACKEND", "reference")
    monkeypatch.delenv("KVREG_DEVICE", raising=False)
    monkeypatch.delenv("KVREG_KV", raising=False)
    assert main(["info"]) == 0
    return capsys.readouterr().out


def _sizes(out: str) -> dict[str, tuple[float, float]]:
    """Each mode's line in the KV modes section: (SmolLM2, Gemma) bytes/element."""
    section = out.split("KV modes", 1)[1]
    found = {}
    for m in re.finditer(r"^  (\S+)\s+(\d+\.\d{3}) / (\d+\.\d{3}) bytes/element", section, re.M):
        found[m.group(1)] = (float(m.group(2)), float(m.group(3)))
    return found


def _mode_lines(out: str) -> dict[str, str]:
    section = out.split("KV modes", 1)[1].splitlines()[1:]
    return {line.split()[0]: line for line in section if "bytes/element" in line}


def _records() -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(RESULTS.glob("*.json"))]


def test_info_lists_every_kv_mode_with_its_bytes_per_element(capsys, monkeypatch):
    out = _info(capsys, monkeypatch)
    sizes = _sizes(out)
    assert set(sizes) == {m.value for m in kvreg.KvMode}
    assert sizes["f32"] == (4.0, 4.0)
    assert sizes["f16"] == (2.0, 2.0) and sizes["bf16"] == (2.0, 2.0)
    assert "4.000 / 4.000 bytes/element" in out and "2.000 / 2.000 bytes/element" in out
    # Every quantized mode stores less than float32.
    assert all(0 < a < 4 and 0 < b < 4 for mode, (a, b) in sizes.items() if mode != "f32")


def test_info_prints_each_records_kl_top1_date_and_command(capsys, monkeypatch):
    out = _info(capsys, monkeypatch)
    lines = _mode_lines(out)
    modes = {m.value for m in kvreg.KvMode}
    records = [r for r in _records() if r["kind"] == "eval" and all(x["config"] in modes for x in r["results"])]
    assert records, "kvreg/results holds no eval record"
    models = ["smollm2-135m", "gemma3-270m"]         # the order of the sizes: SmolLM2 / Gemma-3
    assert {r["model"] for r in records} == set(models)
    assert f"SmolLM2-135M 3x64 / Gemma-3-270M 1x256; mean KL (top-1), {' / '.join(models)}):" in out
    for rec in records:
        assert f"  measured {rec['date']} on {rec['machine']['cpu']}: {rec['command']}" in out
        for row in rec["results"]:
            if row["config"] in lines:
                kl = lines[row["config"]].split(" KL ", 1)[1].split(" / ")
                assert kl[models.index(rec["model"])].startswith(f"{row['kl_mean']:.2e} ({100 * row['top1']:.1f}%)")
    measured = {row["config"] for r in records for row in r["results"]}
    for mode in {m.value for m in kvreg.KvMode} - measured:
        assert "KL " + " / ".join(["—"] * len(models)) + " " in lines[mode]   # not measured: dashes, not numbers


def test_the_later_record_of_a_mode_and_model_wins(tmp_path, monkeypatch):
    pkg = tmp_path / "kvreg"
    (pkg / "results").mkdir(parents=True)

    def rec(date, kl):
        return {"kind": "eval", "model": "m", "date": date, "command": f"run {date}", "machine": {"cpu": "c"},
                "results": [{"config": "q8", "kl_mean": kl, "top1": 0.5}]}

    budget = dict(rec("2026-03-01", 3e-4),
                  results=[{"config": "q8", "kl_mean": 3e-4}, {"config": "born:8", "kl_mean": 1.0}])
    (pkg / "results" / "a.json").write_text(json.dumps(rec("2026-02-01", 2e-4)))
    (pkg / "results" / "c.json").write_text(json.dumps(budget))   # not modes alone: another protocol
    (pkg / "results" / "b.json").write_text(json.dumps([rec("2026-01-01", 1e-4)]))
    (pkg / "results" / "notes.txt").write_text("not a record")
    monkeypatch.setattr("importlib.resources.files", lambda name: pkg)
    models, figures, used = cli.measured_modes()
    assert models == ["m"] and figures == {"q8": {"m": (2e-4, 0.5)}}
    assert [r["date"] for r in used] == ["2026-02-01"]


def test_a_broken_record_leaves_the_rest_of_info_printed(capsys, monkeypatch):
    def broken():
        raise ValueError("kvreg/results/x.json: Expecting value")

    monkeypatch.setattr(cli, "measured_modes", broken)
    out = _info(capsys, monkeypatch)
    assert "measured KL: ERROR: ValueError: kvreg/results/x.json" in out
    assert set(_sizes(out)) == {m.value for m in kvreg.KvMode}


def test_the_records_ship_as_package_data():
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = conf["tool"]["setuptools"]["package-data"]["kvreg"]
    files = [p.relative_to(ROOT / "kvreg").as_posix() for p in RESULTS.glob("*.json")]
    assert files
    assert all(any(fnmatch.fnmatch(f, pat) for pat in patterns) for f in files)
