"""A KVREG_DEVICE the chosen backend does not understand is an error naming
the backends that take devices, and `kvreg info` reports a bad environment
without a traceback."""

import os
import subprocess
import sys

import pytest

import kvreg
from kvreg import BackendError, registry
from kvreg.cli import main
from kvreg.hookspecs import hookimpl
from kvreg.reference import ReferenceBackend


class DeviceTaker(ReferenceBackend):
    """A device backend whose driver fails with its own exception type."""

    name = "devicetaker_test"
    auto = False

    def __init__(self, device=None):
        if device == "nope":
            raise RuntimeError("clCreateContext failed: INVALID_DEVICE")
        super().__init__(device)

    @classmethod
    def devices(cls):
        return ["d0", "d1"]


class BadLabels(ReferenceBackend):
    name = "badlabels_test"
    auto = False

    @classmethod
    def devices(cls):
        raise LookupError("driver crashed while listing devices")


class _Plugin:
    @hookimpl
    def kvreg_register_backends(self, register):
        register(DeviceTaker)
        register(BadLabels)


@pytest.fixture
def plugin():
    p = _Plugin()
    registry.register_plugin(p)
    yield p
    registry.unregister_plugin(p)


@pytest.mark.parametrize("name", ["auto", "reference"])
def test_a_device_a_cpu_backend_does_not_understand_is_an_error_naming_device_backends(name, plugin):
    with pytest.raises(BackendError, match="KVREG_DEVICE='gpu:1'.*takes? devices: .*devicetaker_test"):
        kvreg.get_backend(name, "gpu:1")


def test_auto_under_kvreg_device_no_longer_falls_back_to_the_reference(monkeypatch, plugin):
    monkeypatch.setenv("KVREG_DEVICE", "nope")
    monkeypatch.delenv("KVREG_BACKEND", raising=False)
    with pytest.raises(BackendError, match="auto picks CPU backends only"):
        kvreg.LayerKvCache(1, 4, "f32")


def test_cpu_device_specs_still_select_cpu_backends():
    assert kvreg.get_backend("auto", "cpu").device == "cpu"
    assert kvreg.get_backend("reference", "cpu").device == "cpu"


def test_a_device_backend_takes_its_devices(plugin):
    assert kvreg.get_backend("devicetaker_test", "d1").device == "d1"


def test_kvreg_info_reports_a_failing_backend_without_a_traceback(capsys, monkeypatch, plugin):
    monkeypatch.setenv("KVREG_BACKEND", "devicetaker_test")
    monkeypatch.setenv("KVREG_DEVICE", "nope")
    assert main(["info"]) == 1
    out = capsys.readouterr().out
    assert "active backend: ERROR: RuntimeError: clCreateContext failed" in out
    assert "badlabels_test" in out and "unavailable: driver crashed" in out
    assert "devicetaker_test (priority 0, takes KVREG_DEVICE)" in out


@pytest.mark.parametrize("env", [
    {"KVREG_BACKEND": "opencl", "KVREG_DEVICE": "nope"},
    {"KVREG_DEVICE": "nope"},
    {"KVREG_BACKEND": "nosuch"},
    {"KVREG_KV": "int4"},
    {"KVREG_BACKEND": "numba", "KVREG_DEVICE": "0:0"},
])
def test_kvreg_info_never_tracebacks_on_a_bad_environment(env):
    full = {k: v for k, v in os.environ.items() if not k.startswith("KVREG_")}
    full.update(env)
    proc = subprocess.run([sys.executable, "-m", "kvreg.cli", "info"], env=full, capture_output=True, text=True,
                          timeout=120)
    assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
    assert "ERROR" in proc.stdout and proc.returncode in (0, 1)


# ── the host CPU's own specs: cpu and cpu:0, nothing else ──

@pytest.mark.parametrize("spec", ["cpu", "cpu:0", "CPU:0", " cpu:0 "])
def test_a_cpu_spec_picks_the_same_backend_as_none_without_a_word(spec, monkeypatch):
    import warnings

    monkeypatch.delenv("KVREG_BACKEND", raising=False)
    monkeypatch.setenv("KVREG_DEVICE", spec)
    best = kvreg.get_backend("auto", None)
    with warnings.catch_warnings():
        warnings.simplefilter("error")   # no fallback, silent or said
        assert kvreg.get_backend().name == best.name
        assert kvreg.LayerKvCache(1, 4, "f32").backend.name == best.name


def test_the_numba_backend_takes_cpu_0():
    pytest.importorskip("kvreg_numba")
    assert kvreg.get_backend("numba", "cpu:0").name == "numba"


@pytest.mark.parametrize("spec", ["cpu:abc", "cpu:-1", "cpu:1", "cpu:", "cpu:0:0"])
@pytest.mark.parametrize("name", ["auto", "reference"])
def test_a_malformed_cpu_spec_is_an_error_naming_the_cpu_specs(spec, name):
    with pytest.raises(BackendError, match=f"KVREG_DEVICE={spec!r} is not a CPU device: .*'cpu' or 'cpu:0'"):
        kvreg.get_backend(name, spec)


def test_a_device_backend_judges_its_own_cpu_specs(plugin):
    # a backend that takes devices reads every spec itself (an OpenCL CPU, a
    # socket): the registry does not judge them
    assert kvreg.get_backend("devicetaker_test", "cpu:1").device == "cpu:1"


class _Broken(ReferenceBackend):
    name = "broken_best_test"
    auto = True
    priority = 1000

    def __init__(self, device=None):
        raise BackendError("its compiler cannot build for this CPU")


class _BrokenPlugin:
    @hookimpl
    def kvreg_register_backends(self, register):
        register(_Broken)


def test_auto_says_when_it_passes_over_a_better_backend_that_cannot_start():
    p = _BrokenPlugin()
    registry.register_plugin(p)
    try:
        with pytest.warns(RuntimeWarning, match="auto runs the .* backend; better ones could not start "
                                                r"\(broken_best_test: its compiler cannot build"):
            chosen = kvreg.get_backend("auto")
        assert chosen.name != "broken_best_test"
    finally:
        registry.unregister_plugin(p)
