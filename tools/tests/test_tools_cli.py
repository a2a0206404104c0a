"""kvreg-tools' commands reach the kvreg command through the ``kvreg.commands``
entry points, and its wheel carries those commands and no research code."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kvreg import cli

TOOLS = Path(__file__).resolve().parents[1]
COMMANDS = {"generate", "eval", "bench", "demo", "report"}
#: The research scripts (research/): nothing shipped carries them.
RESEARCH = {"kv_quant_study", "o1_report", "q8_report", "realistic", "real_attention", "real_attention_capture"}


def test_entry_points_declare_every_tool_command():
    eps = {ep.name: ep.value for ep in cli._command_entry_points()}
    assert COMMANDS <= set(eps), f"kvreg-tools is not installed (pip install -e tools): {eps}"
    assert all(eps[name].startswith("kvreg_tools.cli:") for name in COMMANDS)
    assert COMMANDS == {name for name, (dist, _, _) in cli.PLUGIN_COMMANDS.items() if dist == "kvreg-tools"}


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_installed_command_parses_its_own_help(name, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main([name, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: kvreg {name}" in out and "kvreg-tools distribution" not in out


def test_bench_flags_are_kept():
    args = cli.build_parser().parse_args(["bench", "decode", "--quick", "--backend", "reference",
                                          "--json", "x.json", "--plot", "x.png"])
    assert (args.what, args.quick, args.backend, args.json, args.plot) == \
        ("decode", True, ["reference"], "x.json", "x.png")
    assert not getattr(args, "_plugin_missing", False)


@pytest.mark.skipif(importlib.util.find_spec("setuptools") is None, reason="needs setuptools to build")
def test_tools_wheel_carries_the_commands_and_no_research_code(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    shutil.copy(TOOLS / "pyproject.toml", src / "pyproject.toml")
    shutil.copytree(TOOLS / "kvreg_tools", src / "kvreg_tools",
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path / "wheel"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "-w", str(out), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (whl,) = out.glob("kvreg_tools-*.whl")
    with zipfile.ZipFile(whl) as zf:
        names = set(zf.namelist())
        eps = next(zf.read(n).decode() for n in names if n.endswith(".dist-info/entry_points.txt"))
    assert {f"kvreg_tools/{m}.py" for m in ("cli", "bench", "evaluation", "generate", "demo", "report")} <= names
    assert "[kvreg.commands]" in eps
    research = [n for n in names if Path(n).stem in RESEARCH or Path(n).suffix == ".npz"]
    assert not research, f"research code or data in the kvreg-tools wheel: {research}"
