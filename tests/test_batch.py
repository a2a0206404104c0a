"""kvreg.attend_batch: what it refuses (before any layer changes) and how it
treats sealed layers. Bit-identity per backend is the conformance suite's
(kvreg_conformance/test_batch.py)."""

import copy

import numpy as np
import pytest

import kvreg
from kvreg import LayerKvCache, ShapeError, StateError

NKV, HD = 2, 16


def _layer(n, mode="f32", backend="reference", seed=0):
    rng = np.random.default_rng(seed)
    lay = LayerKvCache(NKV, HD, mode, backend)
    for _ in range(n):
        lay.append(rng.standard_normal(NKV * HD).astype(np.float32), rng.standard_normal(NKV * HD).astype(np.float32))
    return lay


def _q(b, nh=4, seed=1):
    return np.random.default_rng(seed).standard_normal((b, nh, HD)).astype(np.float32)


def _snapshot(layers):
    return [(lay.export_wire(), lay.imp.copy()) for lay in layers]


@pytest.mark.parametrize("case", ["empty", "shape", "mode", "geometry", "twice", "backend", "not_a_layer",
                                  "mixed_sinks", "heads", "window"])
def test_refusals_change_nothing(case):
    layers = [_layer(5, seed=1), _layer(9, seed=2)]
    q = _q(2)
    kw = {}
    err = ShapeError
    if case == "empty":
        layers, q = [], _q(1)
    elif case == "shape":
        q = _q(3)
    elif case == "mode":
        layers[1] = _layer(3, mode="q8")
    elif case == "geometry":
        layers[1] = LayerKvCache(NKV, HD * 2, "f32", "reference")
    elif case == "twice":
        layers = [layers[0], layers[0]]
    elif case == "backend":
        layers[1] = _layer(3, backend="numba")
        err = kvreg.ConfigError
    elif case == "not_a_layer":
        layers[1] = object()
        err = kvreg.ConfigError
    elif case == "mixed_sinks":
        layers[0].sinks = np.zeros(4, np.float32)
    elif case == "heads":
        q = _q(2, nh=3)
    elif case == "window":
        kw = {"window": 0}
    real = [lay for lay in layers if isinstance(lay, LayerKvCache)]
    before = _snapshot(real)
    with pytest.raises(err):
        kvreg.attend_batch(q, layers, **kw)
    for (wire, imp), (wire0, imp0) in zip(_snapshot(real), before):
        assert wire == wire0 and np.array_equal(imp, imp0)


def test_a_torch_batch_of_queries_is_read_in_place():
    torch = pytest.importorskip("torch")
    layers = [_layer(5, seed=1), _layer(9, seed=2)]
    twins = copy.deepcopy(layers)
    q = _q(2)
    got = kvreg.attend_batch(torch.from_numpy(q), layers)
    assert np.array_equal(got, kvreg.attend_batch(q, twins))


@pytest.mark.parametrize("far", ["nystrom", "tiered"])
def test_sealed_layers_step_on_their_own_inside_a_batch(far):
    plain = _layer(30, seed=3)
    sealing = LayerKvCache(NKV, HD, "f32", "reference")
    sealing.o1_begin(4, 8, 2, auto=True, far=far)
    rng = np.random.default_rng(4)
    k = rng.standard_normal((24, NKV, HD)).astype(np.float32)
    sealing.extend(k, k * 0.5, layout="nhd")
    sealing.attend_chunk(_q(24, seed=5), 24, 0, 2)
    twin = copy.deepcopy(sealing)
    row = rng.standard_normal(NKV * HD).astype(np.float32)
    for lay in (sealing, twin):
        lay.append(row, row)           # the first decode row: the seal
    assert sealing.lifecycle is kvreg.Lifecycle.SEALED
    q = _q(2, seed=6)
    plain_twin = copy.deepcopy(plain)
    out = kvreg.attend_batch(q, [plain, sealing], sinks=None)
    assert np.array_equal(out[1], twin.attend_layer(q[1], sinks=None))
    assert np.array_equal(out[0], plain_twin.attend_layer(q[0], sinks=None))
    # a sealed layer without its position's row is refused before the plain one attends
    imp = plain.imp.copy()
    with pytest.raises(StateError, match="append"):
        kvreg.attend_batch(q, [plain, sealing], sinks=None)
    assert np.array_equal(plain.imp, imp)
