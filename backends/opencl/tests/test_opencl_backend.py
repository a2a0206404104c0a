"""OpenCLBackend through the core's LayerKvCache, against the reference."""

from __future__ import annotations

import numpy as np
import pytest

layer_mod = pytest.importorskip("kvreg.layer", reason="the core's LayerKvCache is not there yet")


@pytest.fixture(scope="module")
def backends(dev):
    from kvreg.reference import ReferenceBackend

    from kvreg_opencl.backend import OpenCLBackend

    return OpenCLBackend(), ReferenceBackend()


def twin_layers(backends, mode, rows, nkv=2, hd=64, seed=0):
    rng = np.random.default_rng(seed)
    a = layer_mod.LayerKvCache(nkv, hd, mode, backend=backends[0])
    b = layer_mod.LayerKvCache(nkv, hd, mode, backend=backends[1])
    for _ in range(rows):
        k = rng.standard_normal((nkv, hd), dtype=np.float32)
        v = rng.standard_normal((nkv, hd), dtype=np.float32)
        a.append(k, v)
        b.append(k, v)
    return a, b, rng


def close(got, want, what, rtol=2e-5):
    err = np.abs(got - want).max()
    assert err <= rtol * max(1.0, np.abs(want).max()), f"{what}: {err:.3g}"


@pytest.mark.parametrize("mode", ["f32", "q8", "q8k"])
def test_layer_attend_matches_reference(backends, small_blocks, mode):
    # 70 rows: a q8 layer froze its field at row 64 (in-place requantize)
    a, b, rng = twin_layers(backends, mode, 70)
    if mode != "f32":
        n = 70  # rows past lens are uninitialised capacity
        np.testing.assert_array_equal(a.storage.kq[:, :n], b.storage.kq[:, :n])  # exact class
        np.testing.assert_array_equal(a.storage.ks[:, :n].view(np.int32), b.storage.ks[:, :n].view(np.int32))
    q = rng.standard_normal((6, 64)).astype(np.float32)
    for kw in ({}, {"window": 17, "softcap": 4.0}):
        close(a.attend_layer(q, **kw), b.attend_layer(q, **kw), f"{mode} {kw}")
    close(a.imp, b.imp, f"{mode} importance")


def test_truncate_then_append_matches_reference(backends, small_blocks):
    a, b, rng = twin_layers(backends, "f32", 30, seed=3)
    q = rng.standard_normal((4, 64)).astype(np.float32)
    a.attend_layer(q, importance=False)  # mirror holds 30 rows
    for layer in (a, b):
        layer.truncate_last(4)
    for _ in range(4):
        k = rng.standard_normal((2, 64), dtype=np.float32)
        v = rng.standard_normal((2, 64), dtype=np.float32)
        a.append(k, v)
        b.append(k, v)
    close(a.attend_layer(q, importance=False), b.attend_layer(q, importance=False), "after rollback")


def test_grouped_equals_per_head_through_the_layer(backends, small_blocks):
    a, _, rng = twin_layers(backends, "q8", 40, seed=5)
    q = rng.standard_normal((3, 64)).astype(np.float32)
    grouped = a.attend_group(q, 1, scale=0.1, first=3)
    for h in range(3):
        np.testing.assert_array_equal(grouped[h], a.attend_group(q[h:h + 1], 1, scale=0.1, first=3)[0])


def test_chunk_matches_reference(backends, small_blocks):
    a, b, rng = twin_layers(backends, "f32", 20, seed=7)
    q = rng.standard_normal((6, 4, 64)).astype(np.float32)
    close(a.attend_chunk(q, 6, 14, 2, window=5), b.attend_chunk(q, 6, 14, 2, window=5), "chunk")
    close(a.imp, b.imp, "chunk importance")


def test_plugin_registers_opencl(dev):
    from kvreg import registry

    import kvreg_opencl.plugin

    registry.register_plugin(kvreg_opencl.plugin)
    try:
        be = registry.get_backend("opencl")
        assert be.name == "opencl"
        assert {"attend_group", "attend_layer", "attend_chunk", "quantize_rows"} <= set(be.native_kernels())
    finally:
        registry.unregister_plugin(kvreg_opencl.plugin)
