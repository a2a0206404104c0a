"""A deliberately broken toy: the negative control of kvreg's
conformance/tests/test_installed_conformance.py (the suite must fail it, naming
``attend_layer``). Not an entry point: ``pytest -p kvreg_toy.broken``
registers it for that process only.
"""

from __future__ import annotations

import numpy as np

from kvreg import KvMode, registry
from kvreg.hookspecs import hookimpl

from . import ToyBackend, _attend_f32


class BrokenToyBackend(ToyBackend):
    name = "toy_broken"
    conformance_xfail = None

    def attend_layer(self, q, kv, *, scale, window=None, softcap=0.0, sinks=None, imp=None):
        if kv.mode is not KvMode.F32:
            return super().attend_layer(q, kv, scale=scale, window=window,
                                        softcap=softcap, sinks=sinks, imp=imp)
        nkv = len(kv.lens)
        hpk = q.shape[0] // nkv
        out = np.empty_like(q)
        for g in range(nkv):
            n = int(kv.lens[g])
            first = max(0, n - window + 1) if window else 0   # the bug: one row short of the window
            hs = slice(g * hpk, (g + 1) * hpk)
            out[hs] = _attend_f32(q[hs], kv, g, first, n, scale, softcap,
                                  None if sinks is None else sinks[hs], imp)
        return out


class _Plugin:
    @hookimpl
    def kvreg_register_backends(self, register):
        register(BrokenToyBackend)


PLUGIN = _Plugin()
registry.register_plugin(PLUGIN)
