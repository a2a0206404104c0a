"""Real attention inputs: Q/K/V captured from a trained decoder.

:func:`kvreg_conformance.data.realistic_qkv` models the features of real
attention; this module loads the real thing, small: ``data/real_qkv.npz``,
written by ``research/real_attention_capture.py``, which trains a byte-level decoder
(4 layers, d 256, 8 query heads over 2 KV heads, head dim 32, rotate-half
RoPE at theta 10000; 10 minutes on 2 CPU cores, held-out 2.61 bits/byte) on
the Python standard library's sources and captures, for 2048 bytes of one
held-out file, the post-RoPE queries ``q [rows, nh, hd]``, post-RoPE keys
and values ``k``, ``v [rows, nkv, hd]`` of layers 1 and 3 (two layers keep
the file under 3 MB): exactly what a KV cache holds and the queries that
read it. They are stored float16 and returned float32. :func:`real_meta`
gives the model, the training loss (bits per byte) and the corpus.

It is a small, briefly trained model: its heads are sharp (median entropy of
a read well under one nat) and mostly local, unlike the broad heads of a
large model. Treat it as real data of one kind, not as every model's.

Rows are causal: the first ``t`` rows are exactly what the model computes for
the first ``t`` bytes, so any prefix is a valid shorter context.
"""

from __future__ import annotations

import functools
import json
import os

import numpy as np

from kvreg.errors import ConfigError, ShapeError
from kvreg_conformance.data import RealisticQKV

__all__ = ["DATA_PATH", "real_layers", "real_meta", "real_qkv"]

#: the capture kept beside this module
DATA_PATH = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "real_qkv.npz")


def _resolve(path) -> str:
    p = DATA_PATH if path is None else os.fspath(path)
    if not os.path.isfile(p):
        raise ConfigError(
            f"real attention data not found at {p!r} (regenerate it with "
            "`python research/real_attention_capture.py --out research/data/real_qkv.npz`, needs torch)")
    return os.path.realpath(p)


@functools.lru_cache(maxsize=4)
def _load(path: str):
    try:
        with np.load(path, allow_pickle=False) as z:
            meta = json.loads(str(z["meta"]))
            arrays = {name: z[name] for name in z.files if name != "meta"}
    except (OSError, ValueError, KeyError) as exc:
        raise ConfigError(f"real attention data {path!r} cannot be read: {exc}") from None
    try:
        layers = [int(i) for i in meta["layers"]]
        rows, nh, nkv, hd = (int(meta[k]) for k in ("rows", "num_heads", "num_kv_heads", "head_dim"))
        scale = float(meta["scale"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"real attention data {path!r}: bad metadata ({exc})") from None
    if not layers or nkv < 1 or nh % nkv or not (scale > 0):
        raise ConfigError(f"real attention data {path!r}: inconsistent metadata {meta!r}")
    out = {}
    for li in layers:
        want = {"q": (rows, nh, hd), "k": (rows, nkv, hd), "v": (rows, nkv, hd)}
        got = {}
        for name, shape in want.items():
            a = arrays.get(f"{name}{li}")
            if a is None or a.shape != shape:
                raise ShapeError(
                    f"real attention data {path!r}: layer {li} {name} expected {shape}, "
                    f"got {None if a is None else a.shape}")
            got[name] = a
        out[li] = got
    return meta, out


def real_meta(*, path=None) -> dict:
    """The capture's metadata (a copy): ``layers`` (captured layer indices),
    ``rows``, ``num_heads``, ``num_kv_heads``, ``head_dim``, ``rope_theta``,
    ``scale``, training ``heldout_bits_per_byte`` and
    ``final_train_bits_per_byte``, ``corpus``, ``torch_version``, ..."""
    meta, _ = _load(_resolve(path))
    return json.loads(json.dumps(meta))


def real_layers(*, path=None) -> list[int]:
    """The captured layer indices, in order."""
    return list(_load(_resolve(path))[0]["layers"])


def _frozen(a: np.ndarray) -> np.ndarray:
    a = np.ascontiguousarray(a, dtype=np.float32)
    a.flags.writeable = False
    return a


@functools.lru_cache(maxsize=16)
def _real_cached(path: str, layer, rows: int) -> RealisticQKV:
    meta, data = _load(path)
    layers = list(data) if layer is None else [layer]
    # all layers: stacked along the head axes, layer-major, so query head
    # l*nh + h reads KV head l*nkv + h // hpk (the grouping is kept)
    q = np.concatenate([data[li]["q"][:rows] for li in layers], axis=1)
    k = np.concatenate([data[li]["k"][:rows] for li in layers], axis=1)
    v = np.concatenate([data[li]["v"][:rows] for li in layers], axis=1)
    outlier_idx = np.zeros((k.shape[1], 0), dtype=np.int64)
    outlier_idx.flags.writeable = False
    return RealisticQKV(_frozen(q), _frozen(k), _frozen(v), outlier_idx, float(meta["scale"]))


def real_qkv(layer: int | None = None, *, rows: int | None = None, path=None) -> RealisticQKV:
    """Captured real attention data as a :class:`~kvreg_conformance.data.RealisticQKV`.

    ``layer``: a captured layer index (see :func:`real_layers`) -> that
    layer's ``q [rows, nh, hd]``, ``k``/``v [rows, nkv, hd]``; ``None`` -> all
    captured layers stacked along the head axes (layer-major: ``q [rows,
    L·nh, hd]``, ``k``/``v [rows, L·nkv, hd]``; query head ``l·nh + h`` reads
    KV head ``l·nkv + h // (nh/nkv)``, the same GQA grouping). ``rows``: the
    first ``rows`` rows only (a causal prefix; default all). Arrays are
    float32 and read-only; ``outlier_idx`` is empty (``[nkv, 0]``: real
    outlier channels are not labelled); ``scale`` is ``1/sqrt(hd)``, the
    model's own logit scale.
    """
    p = _resolve(path)
    meta, _ = _load(p)
    if layer is not None:
        if isinstance(layer, bool) or not isinstance(layer, (int, np.integer)):
            raise ConfigError(f"real_qkv: layer must be an int or None, got {layer!r}")
        if int(layer) not in meta["layers"]:
            raise ConfigError(f"real_qkv: layer {layer} was not captured; captured: {meta['layers']}")
        layer = int(layer)
    total = int(meta["rows"])
    if rows is None:
        rows = total
    elif isinstance(rows, bool) or not isinstance(rows, (int, np.integer)) or not 1 <= rows <= total:
        raise ShapeError(f"real_qkv: rows must be an int in [1, {total}], got {rows!r}")
    return _real_cached(p, layer, int(rows))
