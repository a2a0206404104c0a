"""``OpenCLBackend``: the kvreg kernel surface on an OpenCL device.

Native: ``attend_group``, ``attend_layer``, ``attend_chunk`` (every KV mode:
F32, Q8, Q8K, Q8V), ``quantize_rows`` (exact class; only on a device with
correctly rounded fp32 division, else the reference's). Inherited from the
NumPy reference: ``gather_rows`` (a host-side storage operation), bounded
and Nyström kernels.

Each layer storage gets a :class:`~kvreg_opencl.mirror.DeviceMirror` (held
weakly, so a dropped layer frees its device memory) that is synced before
every attend: a decode step uploads only the appended rows.
"""

from __future__ import annotations

import weakref

import numpy as np

from kvreg.errors import BackendError
from kvreg.reference import ReferenceBackend

from . import device as _device
from . import kernels
from .mirror import DeviceMirror


class OpenCLBackend(ReferenceBackend):
    name = "opencl"
    priority = 10
    auto = False  # never chosen by "auto": a device backend is asked for by name
    #: attend_chunk reads q8 storage itself: the core may pass the layer's
    #: own storage instead of a dequantized F32 view.
    native_q8_chunk = True

    def __init__(self, device: str | None = None):
        self._dev = _device.get_device(device)
        super().__init__(self._dev.info.selector)
        self._mirrors: "weakref.WeakKeyDictionary[object, DeviceMirror]" = weakref.WeakKeyDictionary()
        try:
            import pyopencl  # noqa: F401  (already imported by get_device)
            from . import programs

            programs.quant_program(self._dev)
            self._native_quant = True
        except BackendError:
            self._native_quant = False

    # -- bookkeeping --------------------------------------------------------
    def describe(self) -> str:
        i = self._dev.info
        q = "" if self._native_quant else ", quantize_rows on the reference (no exact fp32 division)"
        return f"opencl on {i.selector} {i.name} ({i.kind}, {i.platform}{q})"

    @classmethod
    def devices(cls) -> list[str]:
        """``"p:d"`` per OpenCL device (a spec the constructor accepts);
        BackendError (with the install hint) when there is none."""
        return [d.selector for d in _device.list_devices()]

    @classmethod
    def device_labels(cls) -> list[str]:
        """``"p:d name (KIND)"`` per OpenCL device, for ``kvreg info``."""
        return [f"{d.selector} {d.name} ({d.kind})" for d in _device.list_devices()]

    def mirror(self, st) -> DeviceMirror:
        """The (synced) device mirror of ``st``."""
        m = self._mirrors.get(st)
        if m is None:
            m = self._mirrors[st] = DeviceMirror(self._dev)
        m.sync(st)
        return m

    @staticmethod
    def _empty(st) -> bool:
        return int(np.asarray(st.lens).max(initial=0)) == 0 or all(
            getattr(st, n, None) is None for n in ("k", "kq"))

    # -- kernels ------------------------------------------------------------
    def attend_group(self, q, st, g, *, scale, first=0, upto=None, softcap=0.0, sinks=None, imp=None):
        n = int(st.lens[g]) if upto is None else min(int(st.lens[g]), int(upto))
        if n == 0 or self._empty(st):
            return np.zeros_like(q, dtype=np.float32)
        out, _ = kernels.attend_layer(
            self.mirror(st), q, lens=st.lens, scale=scale, first=first, softcap=softcap,
            upto=upto, sinks=sinks, imp=imp, g0=g, ng=1)
        return out

    def attend_layer(self, q, st, *, scale, window=None, softcap=0.0, sinks=None, imp=None):
        if self._empty(st):
            return np.zeros_like(q, dtype=np.float32)
        lens = np.asarray(st.lens, dtype=np.int64)
        first = np.maximum(0, lens - int(window)) if window else 0
        out, _ = kernels.attend_layer(
            self.mirror(st), q, lens=lens, scale=scale, first=first, softcap=softcap,
            sinks=sinks, imp=imp)
        return out

    def attend_chunk(self, q, st, *, s0, b, hpk, scale, window=None, imp=None):
        if b == 0 or self._empty(st):
            return np.zeros((b,) + tuple(np.shape(q))[1:], dtype=np.float32)
        return kernels.attend_chunk(self.mirror(st), q, lens=st.lens, s0=s0, hpk=hpk,
                                    scale=scale, window=window, imp=imp)

    def quantize_rows(self, x, col, group):
        if not self._native_quant:
            return super().quantize_rows(x, col, group)
        return kernels.quantize_rows(self._dev, x, col, group)
