"""The installed conformance suite runs on a third-party backend installed
outside the repository: kvreg and kvreg-conformance (each from a copy of its
sources) and examples/toy_backend, the backend of docs/writing-a-backend.md
(its ``kvreg`` entry point and its own xfail list as package data), are
pip-installed into a temporary folder, and ``pytest --pyargs kvreg_conformance
--kvreg-backend toy`` and ``kvreg conformance --backend toy`` run from there
with only those installs on ``PYTHONPATH`` (ahead of the checkout's editable
copies).

The toy's broken twin (``kvreg_toy.broken``, registered with ``-p`` for one
run) must fail the same suite naming its kernel: the passing run is not
vacuous. Quick profile (``--kvreg-profile quick``), which exercises every kernel the toy
overrides; the full suite passes on the toy too (``kvreg conformance
--backend toy``).
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.suite_meta

ROOT = Path(__file__).resolve().parents[2]
TOY = ROOT / "examples" / "toy_backend"


def pip_install(src: Path, site: Path) -> Path:
    """``pip install`` ``src`` into the folder ``site`` (offline, no dependencies)."""
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
                           "--no-index", "-q", "--target", str(site), str(src)],
                          cwd=src.parent, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return site


def copy_toy(tmp: Path) -> Path:
    dest = tmp / "toy_backend"
    shutil.copytree(TOY, dest, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    return dest


def install_kvreg(tmp: Path) -> Path:
    """kvreg itself, built from a copy of its sources (not an editable checkout)."""
    src = tmp / "kvreg_src"
    shutil.copytree(ROOT / "kvreg", src / "kvreg", ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, src / name)
    return pip_install(src, tmp / "kvreg_site")


def install_suite(tmp: Path) -> Path:
    """kvreg-conformance, built from a copy of its sources."""
    src = tmp / "conformance_src"
    shutil.copytree(ROOT / "conformance", src, ignore=shutil.ignore_patterns(
        "__pycache__", "build", "*.egg-info", "tests"))
    return pip_install(src, tmp / "suite_site")


def suite_env(*sites: Path) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTEST_ADDOPTS", "KVREG_BACKEND", "KVREG_DEVICE",
                        "KVREG_CONFORMANCE_XFAIL_DIR", "KVREG_CONFORMANCE_SIDE")}
    env.update(PYTHONPATH=os.pathsep.join(str(s) for s in sites))
    return env


def run_installed_suite(tmp: Path, sites: tuple, backend: str, *extra: str) -> tuple[int, str]:
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "kvreg_conformance", "--kvreg-backend", backend,
           "-p", "no:cacheprovider", "-q", "--tb=line", "--kvreg-profile", "quick", *extra]
    proc = subprocess.run(cmd, cwd=tmp, env=suite_env(*sites), capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """``(tmp, sites)``: the toy backend, kvreg-conformance and kvreg installed under ``tmp``."""
    tmp = tmp_path_factory.mktemp("installed")
    suite_site, kvreg_site = install_suite(tmp), install_kvreg(tmp)
    return tmp, (pip_install(copy_toy(tmp), tmp / "toy_site"), suite_site, kvreg_site)


def test_kvreg_and_its_suite_come_from_the_installed_copies(installed):
    tmp, sites = installed
    code = ("import kvreg, kvreg_conformance, kvreg_toy\n"
            "for m in (kvreg_toy, kvreg_conformance, kvreg): print(m.__file__)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp, env=suite_env(*sites),
                          capture_output=True, text=True, timeout=60)
    found = [Path(f) for f in proc.stdout.split()]
    assert len(found) == 3 and all(f.is_relative_to(site) for f, site in zip(found, sites)), \
        proc.stdout + proc.stderr
    assert not (found[2].parent / "conformance").exists(), "the core carries no suite"


def test_the_installed_suite_passes_on_the_installed_toy_backend(installed):
    tmp, sites = installed
    rc, out = run_installed_suite(tmp, sites, "toy")
    assert rc == 0, out[-3000:]
    assert "kvreg backend: toy, device: cpu" in out, out[-3000:]
    assert "kvreg native kernels: attend_group, attend_layer, gather_rows" in out, out[-3000:]
    assert " passed" in out and "failed" not in out and "stale xfail" not in out, out[-3000:]


def test_the_installed_suite_fails_the_broken_toy_naming_the_kernel(installed):
    tmp, sites = installed
    rc, out = run_installed_suite(tmp, sites, "toy_broken", "-p", "kvreg_toy.broken",
                                  "-k", "attend_layer_equals_attend_group")
    assert rc == 1, f"the suite must fail toy_broken (exit {rc}):\n{out[-3000:]}"
    assert "kernel attend_layer" in out and "backend 'toy_broken'" in out, out[-3000:]


def test_kvreg_conformance_runs_the_installed_suite(installed):
    # the kvreg command (installed core) finds the subcommand through the
    # installed kvreg-conformance's entry point and runs its suite
    tmp, sites = installed
    proc = subprocess.run([sys.executable, "-m", "kvreg.cli", "conformance", "--backend", "toy",
                           "--profile", "quick", "-k", "gather_rows_matches"],
                          cwd=tmp, env=suite_env(*sites), capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    assert "kvreg backend: toy, device: cpu" in out and "kvreg conformance summary" in out, out[-3000:]
    assert " passed" in out and "failed" not in out, out[-3000:]


def test_the_backends_own_xfail_list_is_read_from_its_package(installed, tmp_path):
    # The toy's packaged list (ToyBackend.conformance_xfail) with one real case
    # and one stale entry: the case is marked, the stale entry named with its list.
    _, sites = installed
    src = copy_toy(tmp_path)
    listing = src / "kvreg_toy" / "conformance_xfail.txt"
    listing.write_text(listing.read_text() + "test_gather_rows_matches_numpy_indexing  # marked on purpose\n"
                                             "test_no_such_case  # stale on purpose\n")
    site = pip_install(src, tmp_path / "toy_site")
    rc, out = run_installed_suite(tmp_path, (site, *sites[1:]), "toy", "-k", "gather_rows_matches", "-rX")
    assert rc == 0, out[-3000:]
    assert "1 xpassed" in out and "marked on purpose" in out, out[-3000:]
    assert "stale xfail entry in kvreg_toy:conformance_xfail.txt" in out and "test_no_such_case" in out, out[-3000:]
