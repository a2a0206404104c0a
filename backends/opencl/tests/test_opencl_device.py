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


class _BuildFailure(Exception):
    pass


class _NoCompiler:
    """A program whose build fails as PoCL's does on a CPU its LLVM cannot name."""

    def __init__(self, ctx, src):
        pass

    def build(self, options=None):
        raise _BuildFailure("Build on <pyopencl.Device 'pthread-X'>:\n\nerror: unknown target CPU 'generic'\n"
                            "Device pthread-X failed to build the program")


def _broken_platform(monkeypatch):
    cl = SimpleNamespace(Context=lambda devs: object(), CommandQueue=lambda ctx: object(), Program=_NoCompiler,
                         RuntimeError=_BuildFailure, device_type=FAKE_CL.device_type,
                         device_fp_config=SimpleNamespace(CORRECTLY_ROUNDED_DIVIDE_SQRT=128, ROUND_TO_NEAREST=4,
                                                          DENORM=2))
    dev = SimpleNamespace(name="pthread-X", type=CPU, max_compute_units=2, global_mem_size=1 << 30,
                          local_mem_size=1 << 16, single_fp_config=0, double_fp_config=0, extensions="")
    plat = SimpleNamespace(name="Portable Computing Language", get_devices=lambda: [dev])
    device.reset_device()
    monkeypatch.setattr(device, "_cl", lambda: cl)
    monkeypatch.setattr(device, "_platforms", lambda cl: [plat])
    monkeypatch.delenv("KVREG_DEVICE", raising=False)
    monkeypatch.delenv("PYOPENCL_CTX", raising=False)


def test_a_device_whose_compiler_cannot_build_does_not_open_and_is_not_listed_as_usable(monkeypatch):
    from kvreg_opencl.backend import OpenCLBackend

    _broken_platform(monkeypatch)
    try:
        with pytest.raises(BackendError, match="cannot build programs for it .error: unknown target CPU 'generic'"):
            device.get_device()
        with pytest.raises(BackendError, match="cannot build"):   # remembered, and refused again
            device.get_device("0:0")
        ok, why = device.usable_devices()
        assert ok == [] and list(why) == ["0:0"] and "unknown target CPU" in why["0:0"]
        with pytest.raises(BackendError, match="no usable OpenCL device"):
            OpenCLBackend.devices()
        assert "unusable: " in OpenCLBackend.device_labels()[0]
    finally:
        monkeypatch.undo()
        device.reset_device()
