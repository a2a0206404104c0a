"""Build-once cache of the backend's OpenCL programs.

Sources are the ``.cl`` files of ``kvreg_opencl/cl``; shared definitions sit
in ``cl/common.h``, reached with ``-I <cl dir>``. A program is built once per
(source, options, device) per process; pyopencl and PoCL keep their own
on-disk caches underneath, which is what makes a second test run fast.

Programs belong to a context, so the cache is keyed on the context (and
holds it, so its handle cannot be reused by another while cached);
:func:`clear` empties it, and :func:`kvreg_opencl.device.reset_device` calls
it.
"""

from __future__ import annotations

import sys
import threading
from importlib import resources
from pathlib import Path

import numpy as np

from kvreg.errors import BackendError

from . import config
from . import device as _device
from .device import DeviceState

CL_DIR = Path(str(resources.files("kvreg_opencl") / "cl"))

_cache: dict[tuple, object] = {}
_lock = threading.Lock()


def source(name: str) -> str:
    return (CL_DIR / name).read_text()


def build(dev: DeviceState, name: str, options: tuple[str, ...] = ()):
    """The built ``pyopencl.Program`` of ``cl/<name>`` for ``dev``."""
    key = (name, tuple(options), dev.context.int_ptr)
    hit = _cache.get(key)
    if hit is not None and hit[0] is dev.context:
        return hit[1]
    with _lock:
        hit = _cache.get(key)
        prg = hit[1] if hit is not None and hit[0] is dev.context else None
        if prg is None:
            cl = dev.cl
            # argument info: the kernels' scalar types for set_scalar_arg_dtypes (_new_kernel)
            opts = ["-I", str(CL_DIR), "-cl-kernel-arg-info", *options]
            try:
                prg = cl.Program(dev.context, source(name)).build(options=opts)
            except cl.RuntimeError as exc:  # build failure: the log is in the message
                raise BackendError(f"kvreg-opencl: building {name} for {dev.info.name!r} failed:\n{exc}") from exc
            _cache[key] = (dev.context, prg)
    return prg


_kernels: dict[tuple, object] = {}


def kernel(prg, name: str):
    """One ``pyopencl.Kernel`` per (program, name): retrieving a kernel from
    a program creates a new object each time, which costs per launch."""
    key = (id(prg), name)
    hit = _kernels.get(key)
    # The program is held with its kernel: its id cannot be reused meanwhile.
    if hit is None or hit[0] is not prg:
        hit = _kernels[key] = (prg, _new_kernel(prg, name))
    return hit[1]


def clear() -> None:
    """Forget every built program and kernel, and the launch drivers' scratch
    buffers (kept per context in :mod:`kvreg_opencl.kernels`: emptied with
    the rest)."""
    with _lock:
        _cache.clear()
        _kernels.clear()
    kernels = sys.modules.get("kvreg_opencl.kernels")
    if kernels is not None:
        with kernels._launch_lock:
            kernels._scratch.clear()


_device.on_reset(clear)


#: OpenCL C scalar argument types of the kernels, as NumPy dtypes.
_SCALARS = {"int": np.int32, "uint": np.uint32, "float": np.float32}


def _new_kernel(prg, name):
    """A kernel whose scalar arguments are declared from its argument info
    (``set_scalar_arg_dtypes``): pyopencl then packs each launch's arguments
    with generated code instead of trying every argument type in turn (a C++
    exception per failed try, ~30 arguments a launch: a tenth of a decode
    call's time on PoCL at 1k rows). Without argument info (a driver that
    keeps none) it stays pyopencl's default."""
    import pyopencl as cl

    k = cl.Kernel(prg, name)
    try:
        names = [k.get_arg_info(i, cl.kernel_arg_info.TYPE_NAME).strip() for i in range(k.num_args)]
    except cl.Error:
        return k
    if all("*" in t or t in _SCALARS for t in names):
        k.set_scalar_arg_dtypes([None if "*" in t else _SCALARS[t] for t in names])
    return k


def heads_per_wg(hpk: int) -> int:
    """Q heads of one KV group that share an attend work-group."""
    return max(1, min(int(config.HEADS_PER_WG), int(hpk)))


def attend_program(dev: DeviceState, hpk: int):
    """The attention program for groups of ``hpk`` Q heads: the heads per
    work-group are a build-time constant (``-DKVREG_HC``, and
    ``KVREG_HC_FULL`` when every chunk is full), so the per-head loops unroll
    without a head-count test."""
    hc = heads_per_wg(hpk)
    inline = config.INLINE_VEC
    if inline is None:
        inline = dev.info.kind == "CPU"
    ahead = config.PREFETCH_BYTES
    if ahead is None:
        ahead = config.PREFETCH_BYTES_CPU if dev.info.kind == "CPU" else 0
    opts = (f"-DKVREG_HC={hc}", *(("-DKVREG_HC_FULL",) if hpk % hc == 0 else ()),
            *(("-DKVREG_INLINE_VEC",) if inline else ()),
            *((f"-DKVREG_PREFETCH={int(ahead)}",) if ahead else ()), *config.ATTEND_OPTIONS)
    return build(dev, "attend.cl", opts)


def quant_program(dev: DeviceState):
    """The exact-class quantize program, or BackendError when the device has
    no correctly rounded float32 division (the backend then keeps the NumPy
    reference quantize instead; see docs/opencl.md)."""
    if not dev.info.correctly_rounded_div_sqrt:
        raise BackendError(
            f"kvreg-opencl: {dev.info.name!r} lacks correctly rounded fp32 divide/sqrt "
            "(or denormals / round-to-nearest); quantize_rows stays on the reference"
        )
    return build(dev, "quant.cl", tuple(config.QUANT_OPTIONS))


def bounded_program(dev: DeviceState):
    return build(dev, "bounded.cl", tuple(config.ATTEND_OPTIONS))


def nystrom_program(dev: DeviceState):
    """The float64 Nyström decode program, or BackendError when the device
    has no fp64 (the backend then keeps the NumPy reference's step)."""
    if not dev.info.fp64:
        raise BackendError(
            f"kvreg-opencl: {dev.info.name!r} has no fp64 (cl_khr_fp64 / double_fp_config); "
            "nystrom_step stays on the reference"
        )
    return build(dev, "nystrom.cl", tuple(config.ATTEND_OPTIONS))
