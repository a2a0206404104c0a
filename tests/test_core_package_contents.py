"""The core wheel carries the cache library only: no benchmark, report, demo
or evaluation module (those are kvreg-tools') and no large data file."""

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
#: Module names that belong to kvreg-tools, not to the core package.
TOOL_MODULES = {"bench", "demo", "evaluation", "eval", "generate", "o1_report", "q8_report", "realistic",
                "real_attention", "kv_quant_study"}


def _check(names_sizes) -> None:
    big = [(n, s) for n, s in names_sizes if s > MAX_BYTES]
    assert not big, f"files over {MAX_BYTES} bytes: {big}"
    tools = [n for n, _ in names_sizes if Path(n).suffix == ".py" and Path(n).stem in TOOL_MODULES]
    assert not tools, f"kvreg-tools modules in the core package: {tools}"
    data = [n for n, _ in names_sizes if Path(n).suffix in (".npz", ".npy", ".bin", ".gguf")]
    assert not data, f"data files in the core package: {data}"


def test_core_source_tree_has_no_tools_or_large_files():
    files = [p for p in (ROOT / "kvreg").rglob("*") if p.is_file() and "__pycache__" not in p.parts]
    _check([(str(p.relative_to(ROOT)), p.stat().st_size) for p in files])


@pytest.mark.skipif(importlib.util.find_spec("setuptools") is None, reason="needs setuptools to build")
def test_core_wheel_has_no_tools_or_large_files(tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    shutil.copytree(ROOT / "kvreg", src / "kvreg", ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    out = tmp_path / "wheel"
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation",
                           "-w", str(out), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (whl,) = out.glob("kvreg-*.whl")
    with zipfile.ZipFile(whl) as zf:
        infos = zf.infolist()
    names = {i.filename for i in infos}
    assert "kvreg/__init__.py" in names and "kvreg/cli.py" in names
    _check([(i.filename, i.file_size) for i in infos])
