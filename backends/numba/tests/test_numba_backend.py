"""NumbaBackend through the core's objects (skipped until the core is there)."""

import numpy as np
import pytest

kvreg = pytest.importorskip("kvreg")
backend_mod = pytest.importorskip("kvreg_numba.backend")
reference = pytest.importorskip("kvreg.reference")
layer_mod = pytest.importorskip("kvreg.layer")


def _layers(mode, rows=80, nkv=2, hd=64, seed=0):
    rng = np.random.default_rng(seed)
    nb = backend_mod.NumbaBackend()
    a = layer_mod.LayerKvCache(nkv, hd, mode=mode, backend=nb)
    r = layer_mod.LayerKvCache(nkv, hd, mode=mode, backend=reference.ReferenceBackend())
    for _ in range(rows):
        k = rng.standard_normal((nkv, hd)).astype(np.float32)
        v = rng.standard_normal((nkv, hd)).astype(np.float32)
        a.append(k, v)
        r.append(k, v)
    return a, r


def test_native_kernels_are_listed():
    native = backend_mod.NumbaBackend.native_kernels()
    for k in ("attend_group", "attend_layer", "attend_chunk", "quantize_rows", "gather_rows"):
        assert k in native


@pytest.mark.parametrize("mode", ["f32", "q8"])
def test_the_kept_kernel_arguments_follow_every_reallocation_and_fork(mode):
    """The decode kernel's storage arguments are kept on the rows' owner
    between calls: a reallocation (growth past the capacity, a fork's first
    write) must never be read through the old arrays, and drops them."""
    rng = np.random.default_rng(4)
    a, r = _layers(mode, rows=30)
    q = rng.standard_normal((8, 64)).astype(np.float32)
    owner = a.storage.view().owner
    np.testing.assert_allclose(a.attend_layer(q), r.attend_layer(q), rtol=1e-4, atol=1e-5)
    view = a.storage.view()
    assert owner.memo is not None and owner.memo[0] is (view.q8.kq if mode == "q8" else view.dense.k)
    fork = a.fork()

    def append_one():
        k = rng.standard_normal((2, 64)).astype(np.float32)
        v = rng.standard_normal((2, 64)).astype(np.float32)
        a.append(k, v)
        r.append(k, v)

    append_one()                     # the fork's first write: a copies the rows
    np.testing.assert_allclose(a.attend_layer(q), r.attend_layer(q), rtol=1e-4, atol=1e-5)
    assert a.storage._rows.memo is not None
    cap = a.storage.cap
    while a.storage.cap == cap:          # past the capacity: new arrays
        append_one()
    assert a.storage._rows.memo is None  # dropped with the old arrays
    np.testing.assert_allclose(a.attend_layer(q), r.attend_layer(q), rtol=1e-4, atol=1e-5)
    # the fork kept the 30 rows and reads its own
    r30, _ = _layers(mode, rows=30)
    np.testing.assert_array_equal(fork.attend_layer(q), r30.attend_layer(q))


def test_the_decode_kernel_refuses_a_scratch_too_small_for_its_rows():
    from kvreg_numba import args, decode, dispatch

    rng = np.random.default_rng(5)
    k = rng.standard_normal((1, 100, 64)).astype(np.float32)
    lens = args.frozen_counts(np.array([100]))
    kv = args.kv_args(k, None, None, None, None, k, None, None, None, None, None, None, None)
    _, need = dispatch.plan_sizes([100], 0, -1, 16, 4, 64, 8)
    q = np.ones((4, 64), np.float32)
    call = lambda scratch, window: decode.attend_groups(  # noqa: E731
        q, 4, np.arange(1, dtype=np.int64), dispatch._zeros(1), lens, *kv, np.float32(0.1), np.float32(0),
        np.empty(0, np.float32), 16, window, -1, np.empty(0, np.float32), np.empty((4, 64), np.float32), scratch,
        decode.NO_STATE, decode.NO_HELPERS)
    with pytest.raises(ValueError, match="scratch"):
        call(np.empty(need - 1, np.float32), 0)
    call(np.empty(need, np.float32), 0)
    _, narrow = dispatch.plan_sizes([100], 20, -1, 16, 4, 64, 8)   # a window needs less: sized by the visible rows
    assert narrow < need
    call(np.empty(narrow, np.float32), 20)


@pytest.mark.parametrize("cpu, want", [("znver5", 8192), ("znver4", 0), ("znver3", 8192), ("rocketlake", 2048),
                                       ("sapphirerapids", 2048), ("", 2048)])
def test_the_prefetch_distance_follows_the_measured_cpus(monkeypatch, cpu, want):
    from llvmlite import binding

    from kvreg_numba import config

    monkeypatch.setattr(binding, "get_host_cpu_name", lambda: cpu)
    assert config._prefetch_bytes() == want
