"""kvreg-toy: a minimal third-party kvreg backend (docs/writing-a-backend.md).

``ToyBackend`` inherits every kernel of the NumPy reference and overrides
three with its own code: ``gather_rows`` and, for float32 storage,
``attend_group`` and ``attend_layer`` (other storage modes fall back to the
reference). Both attention kernels share one per-group routine, which is how
``attend_layer == attend_group`` per group holds bit for bit.
"""

from __future__ import annotations

import numpy as np

from kvreg import KvMode
from kvreg.hookspecs import hookimpl
from kvreg.reference import ReferenceBackend


class ToyBackend(ReferenceBackend):
    name = "toy"            # what --kvreg-backend / KVREG_BACKEND select
    auto = False            # never picked by KVREG_BACKEND=auto
    native_modes = frozenset({KvMode.F32})   # storage its attention kernels read themselves
    #: Known gaps under kvreg's conformance suite: "package:resource".
    conformance_xfail = "kvreg_toy:conformance_xfail.txt"

    def gather_rows(self, rows, idx):
        return np.take(rows, idx, axis=0)

    def attend_group(self, q, kv, g, *, scale, first=0, upto=None, softcap=0.0, sinks=None, imp=None):
        if kv.mode is not KvMode.F32:
            return super().attend_group(q, kv, g, scale=scale, first=first, upto=upto,
                                        softcap=softcap, sinks=sinks, imp=imp)
        n = int(kv.lens[g]) if upto is None else min(int(kv.lens[g]), upto)
        return _attend_f32(q, kv, g, first, n, scale, softcap, sinks, imp)

    def attend_layer(self, q, kv, *, scale, window=None, softcap=0.0, sinks=None, imp=None):
        if kv.mode is not KvMode.F32:
            return super().attend_layer(q, kv, scale=scale, window=window,
                                        softcap=softcap, sinks=sinks, imp=imp)
        nkv = len(kv.lens)
        hpk = q.shape[0] // nkv
        out = np.empty_like(q)
        for g in range(nkv):
            n = int(kv.lens[g])
            first = max(0, n - window) if window else 0
            hs = slice(g * hpk, (g + 1) * hpk)
            out[hs] = _attend_f32(q[hs], kv, g, first, n, scale, softcap,
                                  None if sinks is None else sinks[hs], imp)
        return out


def _attend_f32(q, kv, g, first, n, scale, softcap, sinks, imp):
    """Attention of the Q heads ``q [nh, hd]`` over rows ``[first, n)`` of
    KV head ``g`` of float32 storage; each head on its own, in order."""
    out = np.zeros_like(q)
    if n == 0:
        return out
    first = min(first, n - 1)
    keys = kv.dense.k[g, first:n]
    values = kv.dense.v[g, first:n]
    m_imp = 0 if imp is None else min(imp.shape[0], n)
    with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
        for h in range(q.shape[0]):
            s = (keys @ q[h]) * np.float32(scale)
            if softcap > 0:
                c = np.float32(softcap)
                s = c * np.tanh(s / c)
            top = s.max() if sinks is None else np.maximum(s.max(), sinks[h])
            e = np.exp(s - top)
            # float64 running sum, in row order (leading zeros change nothing)
            z = np.cumsum(e, dtype=np.float64)[-1]
            if sinks is not None:
                z += np.exp(np.float64(sinks[h]) - np.float64(top))
            p = (e / z).astype(np.float32)
            out[h] = p @ values
            if m_imp > first:
                imp[first:m_imp] += p[: m_imp - first]
    return out


@hookimpl
def kvreg_register_backends(register):
    register(ToyBackend)
