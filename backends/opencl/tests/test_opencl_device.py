"""Device choice and the no-OpenCL failure mode (no device needed)."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

from kvreg.errors import BackendError, ConfigError
from kvreg_opencl import device

GPU, CPU = 4, 2
FAKE_CL = SimpleNamespace(device_type=SimpleNamespace(GPU=GPU, CPU=CPU, ACCELERATOR=8))


def entries():
    p0 = SimpleNamespace(name="Portable Computing Language")
    p1 = SimpleNamespace(name="NVIDIA CUDA")
    return [
        (0, 0, p0, SimpleNamespace(name="pthread-AMD EPYC", type=CPU)),
        (1, 0, p1, SimpleNamespace(name="NVIDIA H200", type=GPU)),
        (1, 1, p1, SimpleNamespace(name="NVIDIA H100", type=GPU)),
    ]


def pick(kv=None, ctx=None):
    e = device.choose(entries(), kv, ctx, FAKE_CL)
    return (e[0], e[1])


def test_parse_selector():
    assert device.parse_selector("1:0") == (1, 0)
    assert device.parse_selector(" 2 ") == (2, 0)
    assert device.parse_selector("GPU") == ("kind", "GPU")
    assert device.parse_selector("H200") == "h200"
    with pytest.raises(ConfigError):
        device.parse_selector("  ")


def test_default_prefers_the_first_gpu():
    assert pick() == (1, 0)


def test_cpu_when_no_gpu():
    only_cpu = entries()[:1]
    assert device.choose(only_cpu, None, None, FAKE_CL)[3].name == "pthread-AMD EPYC"


def test_kvreg_device_index_and_name():
    assert pick("0:0") == (0, 0)
    assert pick("1:1") == (1, 1)
    assert pick("h100") == (1, 1)
    assert pick("portable computing") == (0, 0)  # platform name
    assert pick("cpu") == (0, 0)


def test_kvreg_device_wins_over_pyopencl_ctx():
    assert pick("h100", "0:0") == (1, 1)
    assert pick(None, "0:0") == (0, 0)
    assert pick("", "1:1") == (1, 1)


def test_unmatched_selector_lists_devices():
    with pytest.raises(ConfigError, match="available: 0:0 pthread-AMD EPYC"):
        pick("7:0")


def test_no_platform_is_a_backend_error_with_install_hint(monkeypatch):
    class NoPlatforms:
        class LogicError(Exception):
            pass

        def get_platforms(self):
            raise self.LogicError("clGetPlatformIDs failed: PLATFORM_NOT_FOUND_KHR")

    monkeypatch.setattr(device, "_cl", lambda: NoPlatforms())
    monkeypatch.setattr(device, "_states", {})
    with pytest.raises(BackendError, match="pocl-binary-distribution"):
        device.get_device()
    with pytest.raises(BackendError, match="ICD"):
        device.list_devices()


def test_import_creates_no_context():
    code = ("import sys, kvreg_opencl, kvreg_opencl.plugin, kvreg_opencl.backend, kvreg_opencl.device; "
            "assert 'pyopencl' not in sys.modules, 'pyopencl imported at import time'")
    subprocess.run([sys.executable, "-c", code], check=True)
