"""Backend discovery, selection by environment, and `kvreg info`."""

import pytest

import kvreg
from kvreg import BackendError, registry
from kvreg.cli import main
from kvreg.hookspecs import hookimpl
from kvreg.reference import ReferenceBackend


class Doubling(ReferenceBackend):
    """A test backend overriding one kernel."""

    name = "doubling_test"
    auto = False

    def gather_rows(self, rows, idx):
        return rows[idx]


class Unstartable(ReferenceBackend):
    name = "unstartable_test"
    auto = True
    priority = 100

    def __init__(self, device=None):
        raise BackendError("needs hardware this machine lacks")


class _Plugin:
    @hookimpl
    def kvreg_register_backends(self, register):
        register(Doubling)
        register(Unstartable)


@pytest.fixture
def plugin():
    p = _Plugin()
    registry.register_plugin(p)
    yield p
    registry.unregister_plugin(p)


def test_reference_registers_through_the_hook_like_any_plugin():
    assert registry.backends()["reference"] is ReferenceBackend
    assert "kvreg._reference_plugin" in registry.DEFAULT_PLUGINS


def test_unset_backend_means_auto_and_picks_a_cpu_backend(monkeypatch):
    monkeypatch.delenv("KVREG_BACKEND", raising=False)
    b = kvreg.get_backend()
    assert b.auto and b.device == "cpu"


def test_env_selects_backend_and_device(monkeypatch, plugin):
    monkeypatch.setenv("KVREG_BACKEND", "doubling_test")
    monkeypatch.setenv("KVREG_DEVICE", "cpu:0")
    b = kvreg.get_backend()
    assert isinstance(b, Doubling) and b.device == "cpu:0"
    layer = kvreg.LayerKvCache(1, 4, "f32")
    assert layer.backend is b


def test_unknown_backend_lists_the_registered_ones():
    with pytest.raises(BackendError, match="registered: .*reference"):
        kvreg.get_backend("nosuch")


def test_a_backend_that_cannot_start_says_why_and_auto_skips_it(plugin):
    with pytest.raises(BackendError, match="lacks"):
        kvreg.get_backend("unstartable_test")
    assert kvreg.get_backend("auto").name != "unstartable_test"


def test_native_kernels_name_what_a_backend_overrides(plugin):
    assert Doubling.native_kernels() == ["gather_rows"]
    assert "attend_layer" in ReferenceBackend.native_kernels()


def test_a_plugin_that_fails_to_load_warns_and_the_rest_work(monkeypatch):
    class BadEP:
        name = "broken_ep"

        def load(self):
            raise ImportError("missing dependency xyz")

    import importlib.metadata as md

    real = md.entry_points
    monkeypatch.setattr(md, "entry_points", lambda group=None: [BadEP()] if group == "kvreg" else real(group=group))
    registry.refresh()
    try:
        with pytest.warns(UserWarning, match="broken_ep"):
            names = registry.backends()
        assert "reference" in names
        assert "xyz" in registry.load_errors()["broken_ep"]
    finally:
        monkeypatch.setattr(md, "entry_points", real)
        registry.refresh()


def test_kvreg_info_prints_version_backends_and_environment(capsys, plugin, monkeypatch):
    monkeypatch.setenv("KVREG_KV", "q8")
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert kvreg.__version__ in out
    assert "KVREG_KV=q8" in out and "KV mode: q8" in out
    assert "doubling_test" in out and "native kernels: gather_rows" in out


def test_import_kvreg_does_not_import_numba_or_pyopencl():
    import subprocess
    import sys

    code = "import sys, kvreg; kvreg.LayerKvCache(1, 4); print('numba' in sys.modules, 'pyopencl' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"KVREG_BACKEND": "reference", "PATH": "/usr/bin:/bin",
                              "PYTHONPATH": ":".join(sys.path)}).stdout
    assert out.split() == ["False", "False"]
