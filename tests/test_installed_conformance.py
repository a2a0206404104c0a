"""The installed conformance suite runs on a third-party backend installed
outside the repository (issue 19 item 5): examples/toy_backend, the backend of
docs/writing-a-backend.md, is copied to a temporary folder, installed there
with pip (its ``kvreg`` entry point and its own xfail list as package data),
and ``pytest --pyargs kvreg.conformance --kvreg-backend toy`` runs from that
folder, so nothing of the repository's tree is on the path but kvreg itself.

The toy's broken twin (``kvreg_toy.broken``, registered with ``-p`` for one
run) must fail the same suite naming its kernel: the passing run is not
vacuous. Quick profile (``-m quick``), which exercises every kernel the toy
overrides; the full suite passes on the toy too (``kvreg conformance
--backend toy``).
"""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOY = ROOT / "examples" / "toy_backend"


def install_toy(tmp: Path, name: str = "site") -> Path:
    src = tmp / "toy_backend"
    if not src.exists():
        shutil.copytree(TOY, src, ignore=shutil.ignore_patterns("build", "*.egg-info", "__pycache__"))
    site = tmp / name
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
                           "--no-index", "-q", "--target", str(site), str(src)],
                          cwd=tmp, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return site


def run_installed_suite(tmp: Path, site: Path, backend: str, *extra: str) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PYTHONPATH", "PYTEST_ADDOPTS", "KVREG_BACKEND", "KVREG_DEVICE",
                        "KVREG_CONFORMANCE_XFAIL_DIR", "KVREG_CONFORMANCE_SIDE")}
    env.update(PYTHONPATH=str(site), KVREG_CONFORMANCE_PROFILE="quick")
    cmd = [sys.executable, "-m", "pytest", "--pyargs", "kvreg.conformance", "--kvreg-backend", backend,
           "-p", "no:cacheprovider", "-q", "--tb=line", "-m", "quick", *extra]
    proc = subprocess.run(cmd, cwd=tmp, env=env, capture_output=True, text=True, timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.fixture(scope="module")
def toy_site(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("installed")
    return tmp, install_toy(tmp)


def test_the_installed_suite_passes_on_the_installed_toy_backend(toy_site):
    tmp, site = toy_site
    rc, out = run_installed_suite(tmp, site, "toy")
    assert rc == 0, out[-3000:]
    assert "kvreg backend: toy, device: cpu" in out, out[-3000:]
    assert "kvreg native kernels: attend_group, attend_layer, gather_rows" in out, out[-3000:]
    assert " passed" in out and "failed" not in out and "stale xfail" not in out, out[-3000:]
    # The suite came from the installed kvreg, the backend from the temporary site.
    assert str(ROOT / "examples") not in out


def test_the_installed_suite_fails_the_broken_toy_naming_the_kernel(toy_site):
    tmp, site = toy_site
    rc, out = run_installed_suite(tmp, site, "toy_broken", "-p", "kvreg_toy.broken",
                                  "-k", "attend_layer_equals_attend_group")
    assert rc == 1, f"the suite must fail toy_broken (exit {rc}):\n{out[-3000:]}"
    assert "kernel attend_layer" in out and "backend 'toy_broken'" in out, out[-3000:]


def test_the_backends_own_xfail_list_is_read_from_its_package(tmp_path):
    # The toy's packaged list (ToyBackend.conformance_xfail) with one real case
    # and one stale entry: the case is marked, the stale entry named with its list.
    shutil.copytree(TOY, tmp_path / "toy_backend", ignore=shutil.ignore_patterns("build", "*.egg-info"))
    listing = tmp_path / "toy_backend" / "kvreg_toy" / "conformance_xfail.txt"
    listing.write_text(listing.read_text() + "test_gather_rows_matches_numpy_indexing  # marked on purpose\n"
                                             "test_no_such_case  # stale on purpose\n")
    site = install_toy(tmp_path)
    rc, out = run_installed_suite(tmp_path, site, "toy", "-k", "gather_rows_matches", "-rX")
    assert rc == 0, out[-3000:]
    assert "1 xpassed" in out and "marked on purpose" in out, out[-3000:]
    assert "stale xfail entry in kvreg_toy:conformance_xfail.txt" in out and "test_no_such_case" in out, out[-3000:]
