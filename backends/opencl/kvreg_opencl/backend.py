"""``OpenCLBackend``: the kvreg kernel surface on an OpenCL device.

Native: ``attend_group``, ``attend_layer`` (every KV mode but q4: F32, F16,
BF16, Q8, Q8K, Q8V and the 2f freezes; the 2-byte rows and q8's float16
windows stay 2 bytes on the device), ``attend_batch`` (the same layer of B
sequences in one launch of each attention program, over the batch's rows
assembled on the device from the layer mirrors: :mod:`kvreg_opencl.batch`;
q4 loops over the reference), ``attend_chunk``
(F32 and the q8 modes; the core hands f16/bf16 chunks over as a widened
F32 view), ``bounded_attend``, ``quantize_rows`` (exact class; only
on a device with correctly rounded fp32 division, else the reference's) and
``nystrom_step`` (float64; only on a device with fp64, else the reference's).
Inherited from the NumPy reference: ``gather_rows`` (a host-side storage
operation), ``nystrom_prefill`` and ``nystrom_absorb`` (once per seal / per
row, float64 GEMMs and rank-1 updates NumPy already does well). On the host,
in kvreg-numba's compiled kernels when that backend is installed (else
NumPy's; ``config.HOST_KERNELS``, :meth:`OpenCLBackend.host_rows`):
``rotate_rows``, ``store_window_row`` (a q8 decode append) and the small
``quantize_rows``.

Each layer storage gets a :class:`~kvreg_opencl.mirror.DeviceMirror` (held
weakly, so a dropped layer frees its device memory) that is synced before
every attend: a decode step uploads only the appended rows. Each bounded
ring gets a :class:`~kvreg_opencl.bounded.RingMirror` the same way: a decode
step uploads only the slot it wrote.
"""

from __future__ import annotations

import os
import weakref

import numpy as np

from kvreg.bounded import check_bounded_attend_args
from kvreg.errors import BackendError, ShapeError
from kvreg.modes import KvMode
from kvreg.plugin import check_batch
from kvreg.reference import ReferenceBackend

from . import batch as _batch
from . import bounded as _bounded
from . import config, kernels, programs
from . import device as _device
from . import nystrom as _nystrom
from .mirror import DeviceMirror


def _pocl_threads() -> None:
    """Hand kvreg's thread budget to PoCL's CPU device. PoCL reads
    POCL_MAX_PTHREAD_COUNT once, when the process first opens its platform,
    so this must run before any device query; a value the host set itself
    wins (docs/threads.md)."""
    if "POCL_MAX_PTHREAD_COUNT" not in os.environ:
        from kvreg.threads import get_num_threads

        os.environ["POCL_MAX_PTHREAD_COUNT"] = str(get_num_threads())


_UNRESOLVED = object()


def _host_backend(choice: str):
    """``config.HOST_KERNELS``'s backend: "numba" = the registered numba
    backend (None when it is not installed or cannot start: NumPy's then),
    "numpy" = None."""
    from kvreg.registry import backends, get_backend

    if choice == "numpy" or "numba" not in backends():
        return None
    try:
        return get_backend("numba", "cpu")
    except BackendError:
        return None


class OpenCLBackend(ReferenceBackend):
    name = "opencl"
    priority = 10
    auto = False  # never chosen by "auto": a device backend is asked for by name
    #: attend_chunk reads q8 storage itself: the core may pass the layer's
    #: own storage instead of a dequantized F32 view.
    native_q8_chunk = True
    #: q4's three-tier rows run the reference's arithmetic.
    native_modes = frozenset(m for m in KvMode if not m.tiered)
    #: Layers and rings live on the device between calls (mirrors keyed on
    #: the views' versions).
    device_resident = True

    provides = frozenset({"bounded_ring", "nystrom", "fused_decode"})

    def __init__(self, device: str | None = None):
        host = config.HOST_KERNELS
        if host not in ("numba", "numpy"):
            raise BackendError(f"kvreg_opencl.config.HOST_KERNELS is {host!r}; expected 'numba' or 'numpy'")
        _pocl_threads()
        self._dev = _device.get_device(device)
        super().__init__(self._dev.info.selector)
        self._mirrors: weakref.WeakKeyDictionary[object, DeviceMirror] = weakref.WeakKeyDictionary()
        try:
            import pyopencl  # noqa: F401  (already imported by get_device)

            programs.quant_program(self._dev)
            self._native_quant = True
        except BackendError:
            self._native_quant = False
        self._rings = _bounded.RingMirrors(self._dev)
        self._host_choice, self._host = host, _UNRESOLVED
        self._native_nystrom = False
        if self._dev.info.fp64 and config.NYSTROM_ON_DEVICE is not False:
            try:
                programs.nystrom_program(self._dev)
                self._native_nystrom = True
            except BackendError:  # an fp64 device whose compiler refuses the program
                pass

    # -- bookkeeping --------------------------------------------------------
    def small_tunables(self):
        from . import config

        return config.small()

    def describe(self) -> str:
        i = self._dev.info
        q = "" if self._native_quant else ", quantize_rows on the reference (no exact fp32 division)"
        ny = "" if self._native_nystrom else (
            ", nystrom_step on the reference (" + ("no fp64" if not i.fp64 else "config.NYSTROM_ON_DEVICE") + ")")
        host = "numba" if self.host_rows() is not None else "NumPy"
        return f"opencl on {i.selector} {i.name} ({i.kind}, {i.platform}{q}{ny}; host rows in {host})"

    @classmethod
    def devices(cls) -> list[str]:
        """``"p:d"`` per OpenCL device that opens (a spec the constructor
        accepts; a device whose compiler cannot build is left out: see
        :class:`~kvreg_opencl.device.DeviceState`); BackendError (with the
        install hint, or why each device cannot open) when there is none."""
        _pocl_threads()
        ok, why = _device.usable_devices()
        if not ok:
            raise BackendError("kvreg-opencl: no usable OpenCL device: " + "; ".join(why.values()))
        return [d.selector for d in ok]

    @classmethod
    def device_labels(cls) -> list[str]:
        """``"p:d name (KIND)"`` per OpenCL device, for ``kvreg info``
        (``unusable: why`` for one that cannot open)."""
        _pocl_threads()
        _, why = _device.usable_devices()
        return [f"{d.selector} {d.name} ({d.kind})" + (f" unusable: {why[d.selector]}" if d.selector in why else "")
                for d in _device.list_devices()]

    def mirror(self, kv) -> DeviceMirror:
        """The (synced) device mirror of the storage ``kv`` views (a view
        built by hand, ``owner`` None, gets a mirror of its own)."""
        owner = kv.owner
        m = None if owner is None else self._mirrors.get(owner)
        if m is None:
            m = DeviceMirror(self._dev)
            if owner is not None:
                self._mirrors[owner] = m
        m.sync(kv)
        return m

    def ring_mirror(self, ring):
        """The device mirror of the bounded ring ``ring`` views (not synced:
        :meth:`bounded_attend` syncs it)."""
        return self._rings.get(ring.owner)

    @staticmethod
    def _empty(kv) -> bool:
        return int(np.asarray(kv.lens).max(initial=0)) == 0 or (kv.array("k") is None and kv.array("kq") is None)

    # -- kernels ------------------------------------------------------------
    def attend_group(self, q, kv, g, *, scale, first=0, upto=None, softcap=0.0, sinks=None, imp=None):
        if kv.mode.tiered:  # q4 rows have three forms: the reference kernel reads them
            return super().attend_group(q, kv, g, scale=scale, first=first, upto=upto, softcap=softcap,
                                        sinks=sinks, imp=imp)
        n = int(kv.lens[g]) if upto is None else min(int(kv.lens[g]), int(upto))
        if n == 0 or self._empty(kv):
            return np.zeros_like(q, dtype=np.float32)
        out, _ = kernels.attend_layer(
            self.mirror(kv), q, lens=kv.lens, scale=scale, first=first, softcap=softcap,
            upto=upto, sinks=sinks, imp=imp, g0=g, ng=1)
        return out

    def attend_layer(self, q, kv, *, scale, window=None, softcap=0.0, sinks=None, imp=None):
        if kv.mode.tiered:
            return super().attend_layer(q, kv, scale=scale, window=window, softcap=softcap, sinks=sinks, imp=imp)
        if self._empty(kv):
            return np.zeros_like(q, dtype=np.float32)
        lens = np.asarray(kv.lens, dtype=np.int64)
        first = np.maximum(0, lens - int(window)) if window else 0
        out, _ = kernels.attend_layer(
            self.mirror(kv), q, lens=lens, scale=scale, first=first, softcap=softcap,
            sinks=sinks, imp=imp)
        return out

    def attend_batch(self, q, kvs, *, scale, window=None, softcap=0.0, sinks=None, imps=None):
        """One layer of ``B`` sequences: their rows assembled on the device
        (incrementally, from the layer mirrors) and attended in one launch
        of each attention program (:mod:`kvreg_opencl.batch`), bit for bit
        :meth:`attend_layer` per sequence. q4, and a batch whose mirrors
        disagree on layout, take the per-sequence loop."""
        q, kvs = check_batch(q, kvs, imps)
        if not kvs:
            return np.zeros(q.shape, np.float32)
        kv0 = kvs[0]
        mode = kv0.mode
        if not mode.tiered:
            if imps is not None:
                for imp in imps:
                    if imp is not None and (imp.dtype != np.float32 or imp.ndim != 1):
                        raise ShapeError("attend_batch: an importance accumulator must be 1-D float32")
            out = _batch.attend_batch(self, q, kvs, scale=scale, window=window, softcap=softcap or 0.0,
                                      sinks=sinks, imps=imps)
            if out is not None:
                return out
        return super().attend_batch(q, kvs, scale=scale, window=window, softcap=softcap, sinks=sinks, imps=imps)

    def attend_chunk(self, q, kv, *, s0, b, hpk, scale, window=None, imp=None):
        if b == 0 or self._empty(kv):
            return np.zeros((b,) + tuple(np.shape(q))[1:], dtype=np.float32)
        return kernels.attend_chunk(self.mirror(kv), q, lens=kv.lens, s0=s0, hpk=hpk,
                                    scale=scale, window=window, imp=imp)

    def quantize_rows(self, x, col, *, group):
        # The device's launch and read-back cost more than a host quantize
        # of a few rows on the CPU the device runs on (a decode append on
        # PoCL: 230 us against 40 us in NumPy): those stay on the host. The
        # exact class makes the choice invisible in the bits.
        small = self._dev.info.kind == "CPU" and np.shape(x)[0] < config.HOST_QUANT_ROWS
        if small or not self._native_quant:
            return (self.host_rows() or super()).quantize_rows(x, col, group=group)
        return kernels.quantize_rows(self._dev, x, col, group)

    def rotate_rows(self, x):
        return (self.host_rows() or super()).rotate_rows(x)

    def store_window_row(self, k, v, *, rot_k, rot_v, thk, thv, kq, ks, vq, vs, kf, vf, lens, b8, imp, seq, exact_cap):
        host = self.host_rows()
        return host is not None and host.store_window_row(
            k, v, rot_k=rot_k, rot_v=rot_v, thk=thk, thv=thv, kq=kq, ks=ks, vq=vq, vs=vs, kf=kf, vf=vf, lens=lens,
            b8=b8, imp=imp, seq=seq, exact_cap=exact_cap)

    def host_rows(self):
        """The backend whose compiled kernels do this backend's per-row host
        work (``config.HOST_KERNELS``), or None for NumPy's: kvreg-numba's
        when it is installed. A q8 decode append and a q8 attend's query and
        output rotations run on the host (a PoCL launch alone costs ~35 us,
        more than the whole append in compiled code); in NumPy they are a
        few dozen small calls. Resolved at the first call (the numba
        backend's kernels load in ~0.5 s)."""
        host = self._host
        if host is _UNRESOLVED:
            host = self._host = _host_backend(self._host_choice)
        return host

    def bounded_attend(self, q, ring, *, scale, num_heads):
        q32, scale = check_bounded_attend_args(q, ring, scale, num_heads)
        m = self.ring_mirror(ring)
        with kernels._launch_lock:
            m.sync(ring)
            return _bounded.bounded_attend(m, q32, ring.seen, ring.group_windows, ring.rope, scale)

    def nystrom_step(self, q_group, k_exact, v_exact, far, *, scale):
        if not self._native_nystrom:
            return super().nystrom_step(q_group, k_exact, v_exact, far, scale=scale)
        return _nystrom.nystrom_step(self._dev, q_group, k_exact, v_exact, far, scale)
