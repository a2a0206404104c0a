"""The core wheel carries the cache library only: no benchmark, report, demo
or evaluation module (kvreg-tools'), no research script, no conformance suite
or test helper (kvreg-conformance's) and no large data file. The
kvreg-conformance wheel carries the suite with its xfail lists and py.typed,
and builds without a setuptools warning."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MAX_BYTES = 256 * 1024
#: Module names of kvreg-tools and of research/, not of the core package.
TOOL_MODULES = {"bench", "demo", "evaluation", "eval", "generate", "o1_report", "q8_report", "realistic",
                "real_attention", "kv_quant_study"}
#: What kvreg-conformance holds: the suite, its CLI, its oracle and helpers.
SUITE_MODULES = {"conftest", "oracle", "tolerances", "checks", "fill", "conformance_cli"}

needs_setuptools = pytest.mark.skipif(importlib.util.find_spec("setuptools") is None,
                                      reason="needs setuptools to build")


def _check(names_sizes) -> None:
    big = [(n, s) for n, s in names_sizes if s > MAX_BYTES]
    assert not big, f"files over {MAX_BYTES} bytes: {big}"
    py = [Path(n) for n, _ in names_sizes if Path(n).suffix == ".py"]
    tools = [str(p) for p in py if p.stem in TOOL_MODULES]
    assert not tools, f"kvreg-tools or research modules in the core package: {tools}"
    suite = [str(p) for p in py if p.stem in SUITE_MODULES or p.stem.startswith("test_")]
    suite += [n for n, _ in names_sizes if {"conformance", "testing", "xfail"} & set(Path(n).parts)]
    assert not suite, f"the conformance suite or its helpers in the core package: {suite}"
    data = [n for n, _ in names_sizes if Path(n).suffix in (".npz", ".npy", ".bin", ".gguf")]
    assert not data, f"data files in the core package: {data}"


def _wheel(tmp_path: Path, src: Path, name: str) -> tuple[list[zipfile.ZipInfo], str, str]:
    """Build ``src`` into a wheel: its entries, its entry_points.txt and the build's output."""
    out = tmp_path / "wheel"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-deps", "--no-build-isolation",
                           "-w", str(out), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (whl,) = out.glob(f"{name}-*.whl")
    with zipfile.ZipFile(whl) as zf:
        infos = zf.infolist()
        eps = [zf.read(i).decode() for i in infos if i.filename.endswith(".dist-info/entry_points.txt")]
    return infos, "".join(eps), proc.stdout + proc.stderr


def test_core_source_tree_has_no_tools_suite_or_large_files():
    files = [p for p in (ROOT / "kvreg").rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    _check([(str(p.relative_to(ROOT)), p.stat().st_size) for p in files])


@needs_setuptools
def test_core_wheel_has_no_tools_suite_or_large_files(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "kvreg", src / "kvreg", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    infos, eps, _ = _wheel(tmp_path, src, "kvreg")
    names = {i.filename for i in infos}
    assert {"kvreg/__init__.py", "kvreg/cli.py", "kvreg/py.typed"} <= names
    assert "pytest11" not in eps, "the suite's pytest plugin belongs to kvreg-conformance"
    _check([(i.filename, i.file_size) for i in infos])


@needs_setuptools
def test_conformance_wheel_carries_the_suite_its_xfail_lists_and_py_typed(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(ROOT / "conformance", src,
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "build", "*.egg-info", "tests"))
    infos, eps, log = _wheel(tmp_path, src, "kvreg_conformance")
    names = {i.filename for i in infos}
    lists = {f"kvreg_conformance/xfail/{p.name}" for p in (ROOT / "conformance/kvreg_conformance/xfail").glob("*.txt")}
    assert lists and lists <= names, f"xfail lists missing from the wheel: {lists - names}"
    assert {"kvreg_conformance/py.typed", "kvreg_conformance/conftest.py", "kvreg_conformance/plugin.py",
            "kvreg_conformance/cli.py", "kvreg_conformance/oracle.py"} <= names
    assert "kvreg = kvreg_conformance.plugin" in eps and "conformance = kvreg_conformance.cli:register" in eps
    assert "BuildBackendWarning" not in log and "SetuptoolsDeprecationWarning" not in log, log[-3000:]
