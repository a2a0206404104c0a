"""kvreg-tools' commands reach the kvreg command through the ``kvreg.commands``
entry points, and its wheel carries the captured Q/K/V data."""

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
COMMANDS = {"generate", "eval", "bench", "demo"}


def test_entry_points_declare_every_tool_command():
    eps = {ep.name: ep.value for ep in cli._command_entry_points()}
    assert COMMANDS <= set(eps), f"kvreg-tools is not installed (pip install -e tools): {eps}"
    assert all(eps[name].startswith("kvreg_tools.cli:") for name in COMMANDS)
    assert COMMANDS == set(cli.TOOL_COMMANDS)


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_installed_command_parses_its_own_help(name, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main([name, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert f"usage: kvreg {name}" in out and "kvreg-tools distribution" not in out


def test_bench_flags_are_kept():
    args = cli.build_parser().parse_args(["bench", "o1", "--real", "--quick", "--backend", "reference",
                                          "--json", "x.json", "--plot", "x.png"])
    assert (args.what, args.real, args.quick, args.backend, args.json, args.plot) == \
        ("o1", True, True, ["reference"], "x.json", "x.png")
    assert not getattr(args, "_tool_missing", False)


@pytest.mark.skipif(importlib.util.find_spec("setuptools") is None, reason="needs setuptools to build")
def test_tools_wheel_carries_the_data_file(tmp_path):
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
    assert "kvreg_tools/data/real_qkv.npz" in names and "kvreg_tools/bench.py" in names
    assert "[kvreg.commands]" in eps
