"""Shared pieces of the kvreg asv suite: backend parameters, seeded cached
data, and the machine references a ``track_`` ratio divides by.

Every benchmark class takes the backend as its first parameter (the names
registered when asv discovers the suite); a combination a backend cannot run
raises ``NotImplementedError`` in ``setup``, which asv records as skipped.
Data comes from seeded generators cached per process, so a benchmark's
``setup`` pays for generation once per geometry.
"""

from __future__ import annotations

import functools

import numpy as np

#: The decode geometry of the suite: a Llama-3-8B-like layer.
NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 32, 8, 128


def backend_names() -> list[str]:
    """Registered backend names (``reference`` first), for ``params``."""
    from kvreg import registry

    names = sorted(registry.backends())
    return sorted(names, key=lambda n: n != "reference")


def backend(name: str):
    """The backend ``name``, or ``NotImplementedError`` (asv: skipped) when it
    cannot start on this machine."""
    from kvreg import get_backend
    from kvreg.errors import BackendError

    try:
        return get_backend(name)
    except BackendError as exc:
        raise NotImplementedError(f"backend {name!r} unavailable: {exc}") from None


def layer(name: str, rows: int, *, mode="f32", nkv=NUM_KV_HEADS, hd=HEAD_DIM, seed=0):
    """A layer of ``rows`` rows on backend ``name`` (bulk-filled, see
    :mod:`kvreg_conformance.fill`); cached per process."""
    return _layer(name, rows, str(mode), nkv, hd, seed)


def cold_layers(name: str, rows: int, q, *, mode="f32", nkv=NUM_KV_HEADS, hd=HEAD_DIM, max_copies=16):
    """Copies of :func:`layer` taken in turn (``kvreg_tools.bench.ColdRing``:
    ``.next()``), past twice the last-level cache (at most ``max_copies``):
    each decode reads its layer from memory, as in a model. Each copy has
    attended ``q`` once (JIT compile, device upload). Not cached."""
    from kvreg_tools.bench import ColdRing

    return ColdRing.of_layers(lambda: _new_layer(name, rows, str(mode), nkv, hd, 0), q, max_copies=max_copies)


def _new_layer(name, rows, mode, nkv, hd, seed):
    from kvreg.errors import KvregError
    from kvreg_conformance.fill import filled_layer

    be = backend(name)
    try:
        return filled_layer(rows, nkv, hd, mode=mode, backend=be, seed=seed)
    except (KvregError, NotImplementedError) as exc:
        raise NotImplementedError(f"{name}: {exc}") from None


_layer = functools.lru_cache(maxsize=2)(_new_layer)


@functools.lru_cache(maxsize=8)
def queries(rows: int, num_heads: int = NUM_HEADS, hd: int = HEAD_DIM, seed: int = 1) -> np.ndarray:
    """Seeded float32 queries ``[rows, num_heads, hd]`` (read-only)."""
    q = np.random.default_rng(seed).standard_normal((rows, num_heads, hd), dtype=np.float32)
    q.flags.writeable = False
    return q


def best_time(fn, *, min_time: float = 0.05, repeats: int = 3) -> float:
    """Best-of-``repeats`` seconds per call, each repeat at least ``min_time``
    (for the ``track_`` ratios, measured in the same process as the reference)."""
    from kvreg_tools.bench import time_call

    return time_call(fn, min_time=min_time, repeats=repeats)


def beside_probe(measure) -> tuple[float, float]:
    """``(measure(), GB/s)``: the machine's streaming-read probe run right
    before and after ``measure`` and averaged (``kvreg_tools.bench.
    time_beside_probe``: on a shared machine the probe moves with the
    neighbours within minutes)."""
    from kvreg_tools.bench import QUICK, time_beside_probe

    return time_beside_probe(measure, QUICK.bandwidth_bytes)


@functools.lru_cache(maxsize=1)
def matmul_flops() -> float:
    """numpy float32 matmul FLOP/s, measured once per process."""
    from kvreg_tools.bench import matmul_flops as mf

    return mf(quick=True)
