"""``DecodeStep``: one layer's decode step prepared once for a run of tokens
(:meth:`kvreg.LayerKvCache.decode_step`).

A model makes the same call on every layer of every token:
:meth:`~kvreg.LayerKvCache.append_attend` with the same scale, window and
output buffer. That call checks its arguments and asks the storage and the
backend for their launch each time; inside a model, whose matmuls evict the
interpreter's working set between layers, each of those Python frames costs
µs. A step resolves them once and keeps the backend's prepared launch
(:meth:`kvreg.plugin.Backend.prepare_append_attend`) for as long as the
layer stays as its own last step left it.
"""

from __future__ import annotations

import numpy as np

from . import _validate as V
from .errors import ShapeError
from .lifecycle import Lifecycle

__all__ = ["DecodeStep"]

#: Calls a step makes through ``append_attend`` before it asks the backend
#: again, after the backend had no prepared step or its step declined (a
#: q8 decode that shares threads declines every call; a retry costs µs).
RETRY_AFTER = 16


class DecodeStep:
    """``step(k, v, q)`` does what ``layer.append_attend(k, v, q, **args,
    out=step.out)`` does with the arguments the step was made with: the
    same bits, the same state afterwards, the same refusals (raised before
    anything is stored); it returns :attr:`out`, overwritten by each call.

    It takes the prepared launch while the layer's storage is at the
    version its last step left (and the layer is plain, with the same
    sinks and backend); anything else that changed the layer (an
    ``append``, an eviction or trim, capacity growth, a fork's first write
    on shared rows, new sinks, another backend, a seal) sends that call
    through ``append_attend``, and the step prepares again from the new
    state. Holds the layer's lock per call (the layer's public methods
    do)."""

    __slots__ = ("layer", "out", "_args", "_nh", "_fast", "_version", "_sinks", "_backend", "_retry")

    def __init__(self, layer, num_heads: int, args: dict, out: np.ndarray):
        self.layer = layer
        self.out = out
        self._args = args        # append_attend's keywords: scale, window, softcap, sinks, importance
        self._nh = num_heads
        self._fast = None        # the storage's prepared step, or None: through append_attend
        self._version = None     # the storage version _fast is valid at
        self._sinks = None       # the layer's sinks _fast was prepared with
        self._backend = None     # and its backend
        self._retry = 0          # calls left before preparing again

    @classmethod
    def prepare(cls, layer, num_heads: int, *, scale: float | None = None, window: int | None = None,
                softcap: float = 0.0, sinks="layer", importance: bool = True,
                out: np.ndarray | None = None) -> DecodeStep:
        """:meth:`~kvreg.LayerKvCache.append_attend` with these arguments
        prepared for a run of decode steps: a :class:`~kvreg.DecodeStep`
        ``step(k, v, q)``, the answer in ``step.out``; bit for bit the calls
        it stands for (:meth:`kvreg.LayerKvCache.decode_step`)."""
        nh = V.positive_int("num_heads", num_heads)
        args = dict(scale=scale, window=window, softcap=softcap, sinks=sinks, importance=importance)
        layer._decode_args(nh, **args)
        shape = (nh, layer.head_dim)
        out = np.empty(shape, np.float32) if out is None else V.out_block("out", out, shape)
        return cls(layer, nh, args, out)

    def __call__(self, k, v, q) -> np.ndarray:
        lay = self.layer
        with lay._lock:
            nkv, hd = lay.num_kv_heads, lay.head_dim
            q = V.heads("q_all", q, hd)
            if q.shape[0] != self._nh:
                raise ShapeError(f"q_all has {q.shape[0]} heads; this decode step was made for {self._nh}")
            k = V.rows("k", k, nkv, hd)
            v = V.rows("v", v, nkv, hd)
            fast = self._fast
            if fast is not None:
                if self._unchanged(lay) and lay._base + lay._seq_len < V.MAX_POSITION:
                    if fast(k, v, q) is not None:
                        lay._row_stored()
                        self._version = lay._st.version
                        return self.out
                    self._retry = RETRY_AFTER   # declined, having stored nothing
                self._fast = None
            lay.append_attend(k, v, q, out=self.out, **self._args)
            self._prepare()
            return self.out

    def _prepare(self) -> None:
        if self._retry:
            self._retry -= 1
            return
        lay = self.layer
        st = lay._st
        if lay._lifecycle is Lifecycle.PLAIN:
            a = lay._decode_args(self._nh, **self._args)
            self._fast = st.prepare_row_attend_by(lay.backend, shape=self.out.shape, scale=a["scale"],
                                                  window=a["window"], softcap=a["softcap"], sinks=a["sinks"],
                                                  importance=a["imp"] is not None, out=self.out)
        if self._fast is None:
            self._retry = RETRY_AFTER
        else:
            self._version, self._sinks, self._backend = st.version, lay._sinks, lay.backend

    def _unchanged(self, lay) -> bool:
        """Whether the layer is as the last prepared step left it."""
        return lay._st.version == self._version and lay._sinks is self._sinks and lay.backend is self._backend \
            and lay._lifecycle is Lifecycle.PLAIN

    @property
    def prepared(self) -> bool:
        """Whether the next call may take the prepared launch (the backend
        has one, and nothing but the step changed the layer since its last
        call)."""
        return self._fast is not None and self._unchanged(self.layer)

    def __repr__(self) -> str:
        return f"DecodeStep({self.layer!r}, heads={self._nh}, prepared={self.prepared})"
