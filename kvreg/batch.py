"""Batched decode: one layer of many sequences in one kernel call.

A serving engine decodes B sequences at once; each sequence has its own
:class:`~kvreg.LayerKvCache` per model layer, with its own length.
:func:`attend_batch` attends the same layer of all of them in one call to
the backend's :meth:`~kvreg.plugin.Backend.attend_batch` (one kernel launch
on numba and OpenCL), and answers exactly what a loop of
:meth:`LayerKvCache.attend_layer` would, bit for bit, importance included.
"""

from __future__ import annotations

from contextlib import ExitStack

import numpy as np

from . import _validate as V
from .errors import ConfigError, ShapeError
from .lifecycle import Lifecycle

__all__ = ["attend_batch"]


def attend_batch(q, layers, *, scale: float | None = None, window: int | None = None, softcap: float = 0.0,
                 sinks="layer", importance: bool = True) -> np.ndarray:
    """Decode attention of ``B`` sequences' same layer: ``q [B, num_heads,
    hd]`` (a NumPy array or a CPU torch tensor), ``layers`` the ``B``
    sequences' :class:`~kvreg.LayerKvCache` of that layer (distinct
    objects, one backend, one KV mode, ``num_kv_heads`` and ``head_dim``).

    The keywords are :meth:`LayerKvCache.attend_layer`'s, applied to every
    sequence (``sinks="layer"``: each layer's learned sinks, which must be
    set on all of them or none). Returns ``[B, num_heads, hd]`` float32 whose
    row ``b`` is ``layers[b].attend_layer(q[b], ...)`` bit for bit. Sealed
    O(1) layers answer through their own step (the far field is per
    sequence); every other layer joins the one kernel call. Every argument
    is checked before any layer changes.
    """
    layers = list(layers) if not isinstance(layers, list) else layers
    if not layers:
        raise ShapeError("attend_batch needs at least one layer")
    first = layers[0]
    from .layer import LayerKvCache

    for i, layer in enumerate(layers):
        if not isinstance(layer, LayerKvCache):
            raise ConfigError(f"attend_batch: layers[{i}] is {type(layer).__name__}, not a kvreg.LayerKvCache")
    if len({id(layer) for layer in layers}) != len(layers):
        raise ShapeError("attend_batch: a layer appears twice in the batch (one entry per sequence)")
    qb = V.batch_heads("q", q, len(layers), first.head_dim)
    nh = qb.shape[1]
    with _locked(layers):
        for i, layer in enumerate(layers[1:], 1):
            if layer.backend is not first.backend:
                raise ConfigError(f"attend_batch: layers[{i}] runs on {layer.backend.describe()}, layers[0] on "
                                  f"{first.backend.describe()} (one backend per batch)")
            if (layer.num_kv_heads, layer.head_dim, layer.mode) != (first.num_kv_heads, first.head_dim, first.mode):
                raise ShapeError(f"attend_batch: layers[{i}] is {layer.num_kv_heads} KV heads x {layer.head_dim} "
                                 f"{layer.mode.value}, layers[0] {first.num_kv_heads} x {first.head_dim} "
                                 f"{first.mode.value} (one geometry and KV mode per batch)")
        args = [layer._decode_args(nh, scale, window, softcap, sinks, importance) for layer in layers]
        sealed = [layer.lifecycle is Lifecycle.SEALED for layer in layers]
        for b in np.flatnonzero(sealed):
            seal = layers[b].seal
            if not (seal.auto and seal.staged is not None):
                seal.auto_attend(qb[b])  # raises its refusal before anything changed
        open_ = [i for i, s in enumerate(sealed) if not s]
        with_sinks = [args[i]["sinks"] is not None for i in open_]
        if any(with_sinks) and not all(with_sinks):
            raise ShapeError("attend_batch: some layers have learned sinks and some do not; set them on all "
                             "or pass sinks=None")
        out = np.empty((len(layers), nh, first.head_dim), np.float32)
        if open_:
            st0 = layers[open_[0]].storage
            windows = [args[i]["window"] for i in open_]
            w = None if windows[0] is None else max(windows)   # each is clamped to its own rows: same firsts
            qk = qb[open_]
            if st0.rot_k:
                qk = first.backend.rotate_rows(qk)
            res = first.backend.attend_batch(
                np.ascontiguousarray(qk, dtype=np.float32), [layers[i].storage.view() for i in open_],
                scale=args[open_[0]]["scale"], window=w, softcap=args[open_[0]]["softcap"],
                sinks=np.stack([args[i]["sinks"] for i in open_]) if with_sinks[0] else None,
                imps=[args[i]["imp"] for i in open_])
            if st0.rot_v:
                res = first.backend.rotate_rows(res)
            out[open_] = res
            for i in open_:
                layers[i].seal.record(qb[i])
        for b in np.flatnonzero(sealed):
            out[b] = layers[b].seal.auto_attend(qb[b])
        return out


def _locked(layers) -> ExitStack:
    """Every layer's lock, in a fixed (id) order, so two threads batching
    overlapping sets cannot deadlock."""
    stack = ExitStack()
    for layer in sorted(layers, key=id):
        stack.enter_context(layer.lock)
    return stack
