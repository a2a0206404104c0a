"""Host driver of the float64 Nyström decode read (``cl/nystrom.cl``).

Everything the step reads travels per call: the exact rows (one slot of the
state changes per step) and the far field (``c``, ``z``, ``Θ`` and the pooled
sums change on every absorb once the window is full). The state is small and
fixed in context length -- ``(sink + w)`` float32 rows plus O(hpk·m·(m + hd))
float64 values per KV group -- so there is no mirror: see docs/opencl.md for
what this costs and where it pays.
"""

from __future__ import annotations

import numpy as np

from kvreg.nystrom import FarField

from . import programs
from .device import DeviceState
from .kernels import _launch_lock, _local_size, scratch


def nystrom_step(dev: DeviceState, q_group: np.ndarray, k_exact: np.ndarray, v_exact: np.ndarray,
                 far: FarField | None, scale: float) -> np.ndarray:
    """:func:`kvreg.nystrom.nystrom_step` on the device: ``out [hpk, hd]`` float32."""
    with _launch_lock:
        return _nystrom_step(dev, q_group, k_exact, v_exact, far, scale)


def _f64(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float64)


def _nystrom_step(dev, q_group, k_exact, v_exact, far, scale):
    cl = dev.cl
    q = np.ascontiguousarray(q_group, dtype=np.float32)
    ke = np.ascontiguousarray(k_exact, dtype=np.float32)
    ve = np.ascontiguousarray(v_exact, dtype=np.float32)
    hpk, hd = q.shape
    e = ke.shape[0]
    prg = programs.nystrom_program(dev)
    kern = programs.kernel(prg, "nystrom_step")
    sc = scratch(dev)
    d = sc.dummy
    if far is not None:
        m, npr = far.k_tilde.shape[0], far.c.shape[1]
        fbufs = [sc.put(f"ny_{n}", _f64(getattr(far, n)))
                 for n in ("k_tilde", "m_hat", "r", "c", "z", "theta")]
    else:
        m = npr = 0
        fbufs = [d] * 6
    pooled = far is not None and far.pooled
    pbufs = ([sc.put(f"ny_{n}", _f64(getattr(far, n))) for n in ("count", "vsum", "vlo", "vhi")]
             if pooled else [d] * 4)
    L = _local_size(kern, dev)
    out_buf = sc.get("ny_out", hpk * hd * 4)
    kern(dev.queue, (L, hpk), (L, 1),
         sc.put("ny_q", q), sc.put("ny_ke", ke), sc.put("ny_ve", ve),
         np.int32(e), np.int32(hd), np.int32(m), np.int32(npr), np.int32(pooled), np.float64(scale),
         *fbufs, *pbufs,
         sc.get("ny_se", hpk * e * 8), sc.get("ny_fb", max(1, hpk * (m + 2 * npr)) * 8), out_buf,
         cl.LocalMemory(8 * hd), cl.LocalMemory(8 * hd), cl.LocalMemory(8 * hd),
         cl.LocalMemory(8 * (L + 8)))
    out = np.empty((hpk, hd), np.float32)
    cl.enqueue_copy(dev.queue, out, out_buf)
    return out
