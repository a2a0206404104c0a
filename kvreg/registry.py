"""Backend discovery and selection (``KVREG_BACKEND``, ``KVREG_DEVICE``).

Backends arrive through pluggy: the default plugin (the NumPy reference) and
every entry point in the group ``kvreg``. The list is cached; :func:`refresh`
rebuilds it (tests register throw-away plugins that way). A plugin that fails
to load warns and the rest still work.
"""

from __future__ import annotations

import os
import threading
import warnings

import pluggy

from . import hookspecs
from .errors import BackendError
from .plugin import Backend

_lock = threading.Lock()
_backends: dict[str, type[Backend]] | None = None
_load_errors: dict[str, str] = {}
_extra_plugins: list[object] = []
_instances: dict[tuple[str, str | None], Backend] = {}
# Separate from _lock: _auto holds neither while it lists backends.
_inst_lock = threading.Lock()

DEFAULT_PLUGINS = ("kvreg._reference_plugin",)


def _collect() -> dict[str, type[Backend]]:
    import importlib

    pm = pluggy.PluginManager("kvreg")
    pm.add_hookspecs(hookspecs)
    for modname in DEFAULT_PLUGINS:
        pm.register(importlib.import_module(modname), name=modname)
    _load_errors.clear()
    from importlib.metadata import entry_points

    for ep in entry_points(group="kvreg"):
        try:
            pm.register(ep.load(), name=f"entrypoint:{ep.name}")
        except Exception as exc:  # a broken plugin must not take the others down
            _load_errors[ep.name] = f"{type(exc).__name__}: {exc}"
            warnings.warn(f"kvreg: backend plugin {ep.name!r} failed to load: {exc}", stacklevel=3)
    for plugin in _extra_plugins:
        if not pm.is_registered(plugin):   # an installed plugin registered again in-process
            pm.register(plugin)
    found: dict[str, type[Backend]] = {}

    def register(cls: type) -> None:
        # A plugin's bad class is its load error (listed by kvreg info), not the others'.
        if not (isinstance(cls, type) and issubclass(cls, Backend)):
            _refuse(repr(cls), f"register() takes a kvreg.plugin.Backend subclass, got {cls!r}")
            return
        if cls.__abstractmethods__:
            missing = ", ".join(sorted(cls.__abstractmethods__))
            _refuse(cls.name, f"backend {cls.__name__} does not implement {missing}: "
                              "implement them, or subclass kvreg.reference.ReferenceBackend to inherit them")
            return
        why = cls.declaration_error()
        if why:
            _refuse(cls.name, f"backend {cls.__name__} {why}")
            return
        if cls.name in found and found[cls.name] is not cls:
            warnings.warn(f"kvreg: two backends named {cls.name!r}; keeping the first", stacklevel=2)
            return
        found[cls.name] = cls

    pm.hook.kvreg_register_backends(register=register)
    return found


def _refuse(name: str, why: str) -> None:
    _load_errors[name] = why
    warnings.warn(f"kvreg: {why}", stacklevel=4)


def backends() -> dict[str, type[Backend]]:
    """Registered backend classes by name (cached; see :func:`refresh`)."""
    global _backends
    with _lock:
        if _backends is None:
            _backends = _collect()
        return dict(_backends)


def load_errors() -> dict[str, str]:
    """Entry points that failed to load, with why."""
    backends()
    return dict(_load_errors)


def refresh() -> None:
    """Forget the cached backend list and instances."""
    global _backends
    with _lock:
        _backends = None
        _instances.clear()


def register_plugin(plugin: object) -> None:
    """Register a plugin object in-process (tests, notebooks), then refresh."""
    _extra_plugins.append(plugin)
    refresh()


def unregister_plugin(plugin: object) -> None:
    if plugin in _extra_plugins:
        _extra_plugins.remove(plugin)
    refresh()


def takes_devices(cls: type[Backend]) -> bool:
    """Whether a backend class selects among devices (it overrides
    :meth:`Backend.devices`); the others run on the CPU only."""
    return getattr(cls.devices, "__func__", None) is not Backend.devices.__func__  # type: ignore[attr-defined]


#: The device specs of the host's CPU, the one device of a CPU backend.
CPU_DEVICES = ("cpu", "cpu:0")


def cpu_device(device: str) -> bool:
    """Whether ``device`` names the host's CPU, the one device every CPU
    backend runs on: ``cpu`` or ``cpu:0`` (any case, spaces stripped).
    Another ``cpu:...`` (``cpu:1``, ``cpu:abc``, ``cpu:-1``) is a
    BackendError: taking it for the CPU would be a guess."""
    d = device.strip().lower()
    if d in CPU_DEVICES:
        return True
    if d.startswith("cpu:"):
        raise BackendError(f"KVREG_DEVICE={device!r} is not a CPU device: a CPU backend runs on the host's CPU, "
                           f"'cpu' or 'cpu:0' (its threads: KVREG_THREADS)")
    return False


def _check_device(cls: type[Backend] | None, device: str | None) -> None:
    """Refuse a device spec the backend cannot understand (``cls`` None:
    ``auto``, which picks among CPU backends): silently ignoring it would run
    on the CPU a caller asked to keep off it."""
    if device is None or (cls is not None and takes_devices(cls)) or cpu_device(device):
        return
    takers = sorted(name for name, c in backends().items() if takes_devices(c))
    who = "auto picks CPU backends only" if cls is None else f"the {cls.name} backend runs on the CPU only"
    raise BackendError(f"KVREG_DEVICE={device!r} is not understood: {who}; backends that take devices: "
                       f"{', '.join(takers) if takers else 'none installed'} (select one with KVREG_BACKEND)")


def _auto(device: str | None) -> Backend:
    _check_device(None, device)
    tried = []
    for cls in sorted(backends().values(), key=lambda c: -c.priority):
        if not cls.auto:
            continue
        try:
            chosen = _instantiate(cls, device)
        except BackendError as exc:
            tried.append(f"{cls.name}: {exc}")
            continue
        if tried:
            # Never a silent fallback: the host asked for the best backend.
            warnings.warn(f"kvreg: auto runs the {chosen.name} backend; better ones could not start ("
                          + "; ".join(tried) + ")", RuntimeWarning, stacklevel=3)
        return chosen
    raise BackendError("no CPU backend could start: " + "; ".join(tried))


def _instantiate(cls: type[Backend], device: str | None) -> Backend:
    _check_device(cls, device)
    key = (cls.name, device)
    with _inst_lock:   # one instance (one device context, one set of mirrors) per key
        inst = _instances.get(key)
        if inst is None:
            inst = cls(device) if device is not None else cls()
            _instances[key] = inst
        return inst


def get_backend(name: str | None = None, device: str | None = None) -> Backend:
    """The backend ``name`` on ``device``; None reads ``KVREG_BACKEND`` /
    ``KVREG_DEVICE``. Unset or ``auto``: the best installed CPU backend.

    Instances are shared per (name, device): backends hold compiled programs
    and device contexts worth reusing.
    """
    if isinstance(name, Backend):
        return name
    if name is not None and not isinstance(name, str):
        raise BackendError(f"backend must be a name, a kvreg.plugin.Backend or None, got {name!r}")
    if device is not None and not isinstance(device, str):
        raise BackendError(f"device must be a device spec string or None, got {device!r}")
    if name is None:
        name = os.environ.get("KVREG_BACKEND", "").strip() or "auto"
    if device is None:
        device = os.environ.get("KVREG_DEVICE", "").strip() or None
    name = name.lower()
    if name == "auto":
        return _auto(device)
    found = backends()
    if name not in found:
        names = ", ".join(sorted(found)) or "none"
        hint = ""
        if name in _load_errors:
            hint = f" (its plugin failed to load: {_load_errors[name]})"
        raise BackendError(f"unknown kvreg backend {name!r}{hint}; registered: {names}, or 'auto'")
    return _instantiate(found[name], device)
