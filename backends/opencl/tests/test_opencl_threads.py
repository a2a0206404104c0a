"""kvreg's thread budget reaches PoCL (docs/threads.md): POCL_MAX_PTHREAD_COUNT
is set from it before the platform opens, unless the host set it."""

import os
import subprocess
import sys

import pytest

pytest.importorskip("pyopencl")

CODE = """
import os, kvreg
from kvreg.errors import BackendError
try:
    kvreg.get_backend("opencl")
except BackendError:
    pass
print(os.environ.get("POCL_MAX_PTHREAD_COUNT"))
"""


def run(env_extra):
    env = {k: v for k, v in os.environ.items() if k not in ("POCL_MAX_PTHREAD_COUNT", "KVREG_THREADS")}
    env.update(env_extra)
    return subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True,
                          check=True, timeout=120).stdout.strip().splitlines()[-1]


def test_the_budget_becomes_pocls_thread_count():
    assert run({"KVREG_THREADS": "1"}) == "1"


def test_a_pocl_count_the_host_set_wins():
    assert run({"KVREG_THREADS": "1", "POCL_MAX_PTHREAD_COUNT": "2"}) == "2"
