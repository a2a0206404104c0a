"""Which OpenCL device kvreg uses, chosen lazily.

Order: ``KVREG_DEVICE`` (``"platform:device"`` indices such as ``0:0``, or a
case-insensitive substring of the device or platform name), else pyopencl's
own ``PYOPENCL_CTX`` convention (same ``p:d`` form), else the first GPU, else
the first CPU device. Importing this module touches no OpenCL state; the
context and queue are made on first use and then reused.
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass

from kvreg.errors import BackendError, ConfigError
from kvreg.threads import cpu_threads

INSTALL_HINT = (
    "install an OpenCL driver: `pip install pocl-binary-distribution` for the "
    "CPU (PoCL), or your GPU vendor's OpenCL ICD (NVIDIA driver, ROCm, Intel "
    "compute-runtime)"
)

_lock = threading.Lock()
_states: dict = {}
# One DeviceState (one context) per physical device, whatever selector
# reached it: the program and scratch caches are per context, and two
# contexts on one device would hand a launch buffers of the other.
_by_device: dict = {}
# (platform, device) -> the BackendError its opening raised (its compiler cannot build)
_unusable: dict = {}
_reset_hooks: list = []


@dataclass(frozen=True)
class DeviceInfo:
    """One OpenCL device as ``kvreg info`` lists it."""

    platform_index: int
    device_index: int
    platform: str
    name: str
    kind: str  # "GPU", "CPU", "ACCELERATOR", "OTHER"
    compute_units: int
    global_mem_bytes: int
    local_mem_bytes: int
    correctly_rounded_div_sqrt: bool
    fp64: bool = False

    @property
    def selector(self) -> str:
        return f"{self.platform_index}:{self.device_index}"


def _cl():
    try:
        import pyopencl as cl
    except Exception as exc:  # ImportError, or a broken ICD loader
        raise BackendError(f"kvreg-opencl: cannot import pyopencl ({exc}); "
                           f"pip install pyopencl, then {INSTALL_HINT}") from exc
    return cl


def bound_pocl_threads() -> None:
    """Lower ``POCL_MAX_PTHREAD_COUNT`` to the CPUs this process may run on
    (:func:`kvreg.threads.cpu_threads`) before OpenCL is first opened. PoCL
    starts that many worker threads at once when it opens its CPU device,
    and has no bound of its own: ``KVREG_THREADS=1000000``, which the backend
    hands over (numba clamps it to its pool), ends the process with SIGABRT,
    2**31-1 with SIGSEGV. More workers than CPUs only take turns,
    so the host's own value is lowered as well; a value PoCL would not read
    as a count is PoCL's to judge."""
    raw = os.environ.get("POCL_MAX_PTHREAD_COUNT")
    if raw is None or not raw.strip().isdigit():
        return
    cpus = cpu_threads()
    if int(raw) > cpus:
        os.environ["POCL_MAX_PTHREAD_COUNT"] = str(cpus)


def _platforms(cl):
    bound_pocl_threads()
    try:
        plats = cl.get_platforms()
    except Exception as exc:  # pyopencl raises LogicError on "no platforms"
        raise BackendError(f"kvreg-opencl: no OpenCL platform found ({exc}); {INSTALL_HINT}") from exc
    if not plats:
        raise BackendError(f"kvreg-opencl: no OpenCL platform found; {INSTALL_HINT}")
    return plats


def _kind(cl, dtype: int) -> str:
    if dtype & cl.device_type.GPU:
        return "GPU"
    if dtype & cl.device_type.CPU:
        return "CPU"
    if dtype & cl.device_type.ACCELERATOR:
        return "ACCELERATOR"
    return "OTHER"


def _info(cl, pi, di, plat, dev) -> DeviceInfo:
    return DeviceInfo(
        platform_index=pi,
        device_index=di,
        platform=plat.name.strip(),
        name=dev.name.strip(),
        kind=_kind(cl, dev.type),
        compute_units=int(dev.max_compute_units),
        global_mem_bytes=int(dev.global_mem_size),
        local_mem_bytes=int(dev.local_mem_size),
        correctly_rounded_div_sqrt=supports_exact_division(cl, dev),
        fp64=supports_fp64(dev),
    )


def supports_exact_division(cl, dev) -> bool:
    """True when the device can build the exact-class quantize kernel:
    correctly rounded float32 divide (the build option), round-to-nearest
    and denormals (a flushed subnormal quotient would change the bits)."""
    cfg = int(dev.single_fp_config)
    fpc = cl.device_fp_config
    need = fpc.CORRECTLY_ROUNDED_DIVIDE_SQRT | fpc.ROUND_TO_NEAREST | fpc.DENORM
    return (cfg & need) == need


def supports_fp64(dev) -> bool:
    """True when the device has double precision (a non-zero
    ``CL_DEVICE_DOUBLE_FP_CONFIG``; OpenCL 1.2 devices report it with
    ``cl_khr_fp64``), which the Nyström step needs (docs/opencl.md)."""
    try:
        cfg = int(dev.double_fp_config)
    except Exception:  # noqa: BLE001  (pyopencl LogicError: the query is unknown, so no fp64)
        return False
    return cfg != 0 and "cl_khr_fp64" in dev.extensions


def _enumerate(cl):
    out = []
    for pi, plat in enumerate(_platforms(cl)):
        try:
            devs = plat.get_devices()
        except Exception:  # a platform with no device of any type
            devs = []
        for di, dev in enumerate(devs):
            out.append((pi, di, plat, dev))
    if not out:
        raise BackendError(f"kvreg-opencl: OpenCL platforms exist but expose no device; {INSTALL_HINT}")
    return out


def list_devices() -> list[DeviceInfo]:
    """Every OpenCL device, in platform/device index order (no context made)."""
    cl = _cl()
    return [_info(cl, pi, di, plat, dev) for pi, di, plat, dev in _enumerate(cl)]


def usable_devices() -> tuple[list[DeviceInfo], dict[str, str]]:
    """The devices that open (each is opened: a context and the probe
    build, kept for later use) and, per selector, why each other one
    cannot."""
    ok, why = [], {}
    for d in list_devices():
        try:
            get_device(d.selector)
        except BackendError as exc:
            why[d.selector] = str(exc)
        else:
            ok.append(d)
    return ok, why


def parse_selector(text: str) -> tuple | str:
    """``"1:0"`` -> (1, 0); ``"2"`` -> (2, 0) (pyopencl's form); ``"gpu"`` /
    ``"cpu"`` -> ("kind", "GPU") (the first device of that kind); anything
    else is a name substring (stripped, lower-cased)."""
    s = text.strip()
    if not s:
        raise ConfigError("empty OpenCL device selector")
    if s.lower() in ("gpu", "cpu", "accelerator"):
        return ("kind", s.upper())
    parts = s.split(":")
    if all(p.strip().isdigit() for p in parts) and 1 <= len(parts) <= 2:
        pi = int(parts[0])
        di = int(parts[1]) if len(parts) == 2 else 0
        return (pi, di)
    return s.lower()


def choose(entries, kvreg_device: str | None, pyopencl_ctx: str | None, cl_module=None):
    """Pick one of ``entries`` [(pi, di, platform, device)] by the rules in the
    module docstring. Pure apart from reading names and types, so tests can
    feed it fake platforms."""
    for var, value in (("KVREG_DEVICE", kvreg_device), ("PYOPENCL_CTX", pyopencl_ctx)):
        if value is None or value.strip() == "":
            continue
        sel = parse_selector(value)
        if isinstance(sel, tuple) and sel[0] == "kind":
            for e in entries:
                if _kind(cl_module, e[3].type) == sel[1]:
                    return e
        elif isinstance(sel, tuple):
            for e in entries:
                if (e[0], e[1]) == sel:
                    return e
        else:
            for e in entries:
                if sel in e[3].name.lower() or sel in e[2].name.lower():
                    return e
        have = ", ".join(f"{e[0]}:{e[1]} {e[3].name.strip()}" for e in entries)
        raise ConfigError(f"{var}={value!r} matches no OpenCL device; available: {have}")
    for want in ("GPU", "CPU"):
        for e in entries:
            if _kind(cl_module, e[3].type) == want:
                return e
    return entries[0]


#: Built once per device when it is opened: a device whose OpenCL compiler
#: cannot build this cannot run any kvreg kernel.
_PROBE = "__kernel void kvreg_probe(__global float *x) { x[get_global_id(0)] += 1.0f; }"


class DeviceState:
    """The chosen device with its context and in-order queue. Opening it
    builds a one-line program, so a device whose compiler cannot build
    (seen: PoCL 3.0's LLVM 14 on an AMD Zen 5 CPU, which it cannot name:
    "unknown target CPU 'generic'") fails here, as a device that cannot
    start, not at the first attend."""

    def __init__(self, cl, pi, di, plat, dev):
        self.cl = cl
        self.device = dev
        self.info = _info(cl, pi, di, plat, dev)
        self.context = cl.Context([dev])
        self.queue = cl.CommandQueue(self.context)
        try:
            cl.Program(self.context, _PROBE).build()
        except cl.RuntimeError as exc:
            errors = re.findall(r"error: [^\n]*", str(exc))
            log = errors[0] if errors else " ".join(str(exc).split())[-200:]
            raise BackendError(f"kvreg-opencl: the OpenCL compiler of {dev.name.strip()!r} cannot build "
                               f"programs for it ({log}); with PoCL this is a CPU its LLVM does not know "
                               "(a newer pocl-binary-distribution / pyopencl may), else pick another device "
                               "with KVREG_DEVICE or another backend with KVREG_BACKEND") from None

    def __repr__(self) -> str:
        i = self.info
        return f"<OpenCL {i.selector} {i.name!r} ({i.kind}, {i.platform})>"


def get_device(selector: str | None = None) -> DeviceState:
    """The device for ``selector`` (None: the environment rules above),
    created on the first call and shared afterwards."""
    key = selector.strip() if selector else None
    st = _states.get(key)
    if st is not None:
        return st
    with _lock:
        st = _states.get(key)
        if st is None:
            cl = _cl()
            entries = _enumerate(cl)
            if key is None:
                e = choose(entries, os.environ.get("KVREG_DEVICE"), os.environ.get("PYOPENCL_CTX"), cl)
            else:
                e = choose(entries, key, None, cl)
            st = _by_device.get((e[0], e[1]))
            if st is None:
                failed = _unusable.get((e[0], e[1]))
                if failed is not None:
                    raise failed
                try:
                    st = DeviceState(cl, *e)
                except BackendError as exc:
                    _unusable[(e[0], e[1])] = exc   # not probed again in this process
                    raise
                except Exception as exc:
                    raise BackendError(f"kvreg-opencl: cannot open {e[3].name.strip()!r}: {exc}; "
                                       f"{INSTALL_HINT}") from exc
                _by_device[(e[0], e[1])] = st
            _states[key] = st
    return st


def on_reset(hook) -> None:
    """Call ``hook()`` from :func:`reset_device` (caches of per-context
    objects register their ``clear`` here)."""
    with _lock:
        if hook not in _reset_hooks:
            _reset_hooks.append(hook)


def reset_device() -> None:
    """Forget the chosen devices and every cache of objects made in their
    contexts (programs, kernels, scratch buffers), and the registry's backend
    instances, which hold those contexts: the next backend opens a fresh
    context and builds into it. A backend object made before the reset must
    not be used after it (tests; a changed KVREG_DEVICE)."""
    with _lock:
        _states.clear()
        _by_device.clear()
        _unusable.clear()
        hooks = list(_reset_hooks)
    for hook in hooks:
        hook()
    from kvreg import registry

    registry.refresh()
