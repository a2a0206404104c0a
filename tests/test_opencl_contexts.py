"""OpenCL program and scratch caches follow the context, not the device:
two selectors of one device, and backends made after ``reset_device()``,
launch fine (not INVALID_CONTEXT)."""

import numpy as np
import pytest

import kvreg

device = pytest.importorskip("kvreg_opencl.device")
programs = pytest.importorskip("kvreg_opencl.programs")


@pytest.fixture(scope="module")
def selector():
    try:
        ok, why = device.usable_devices()
    except kvreg.KvregError as exc:
        pytest.skip(f"no OpenCL device: {exc}")
    if not ok:
        pytest.skip(f"no usable OpenCL device: {'; '.join(why.values())}")
    return ok[0].selector


def answer(backend):
    c = kvreg.LayerKvCache(2, 8, "f32", backend)
    for i in range(5):
        c.append(np.full(16, i, np.float32), np.full(16, i * 0.5, np.float32))
    return c.attend_layer(np.ones((4, 8), np.float32))


@pytest.fixture
def fresh():
    device.reset_device()
    yield
    device.reset_device()


def test_default_and_explicit_selector_of_one_device_share_a_context(selector, fresh):
    from kvreg_opencl.backend import OpenCLBackend

    a = OpenCLBackend(None)
    want = answer(a)
    b = OpenCLBackend(selector)
    assert b._dev is a._dev and b._dev.context is a._dev.context
    np.testing.assert_array_equal(answer(b), want)
    np.testing.assert_array_equal(answer(a), want)


def test_backends_made_after_reset_device_launch(selector, fresh):
    first = answer(kvreg.get_backend("opencl", selector))
    old_ctx = kvreg.get_backend("opencl", selector)._dev.context
    device.reset_device()
    be = kvreg.get_backend("opencl", selector)
    assert be._dev.context is not old_ctx
    np.testing.assert_array_equal(answer(be), first)
    np.testing.assert_array_equal(answer(kvreg.get_backend("opencl", None)), first)


def test_programs_are_cached_per_context_and_clear_empties_them(selector, fresh):
    be = kvreg.get_backend("opencl", selector)
    want = answer(be)
    prg = programs.attend_program(be._dev, 4)
    assert programs.attend_program(be._dev, 4) is prg
    programs.clear()
    assert programs.attend_program(be._dev, 4) is not prg
    np.testing.assert_array_equal(answer(be), want)


def test_a_backend_opened_before_reset_device_still_launches_beside_a_new_one(selector, fresh):
    """The scratch buffers are the context's: the backend that predates the
    reset (a session fixture in the OpenCL tests holds one) must not receive
    the new context's buffers (INVALID_CONTEXT when they were per device)."""
    old = kvreg.get_backend("opencl", selector)
    want = answer(old)
    device.reset_device()
    new = kvreg.get_backend("opencl", selector)
    assert new._dev.context is not old._dev.context
    np.testing.assert_array_equal(answer(new), want)
    np.testing.assert_array_equal(answer(old), want)
    np.testing.assert_array_equal(answer(new), want)


def test_kernels_declare_their_scalar_argument_types(selector, fresh):
    """The cached kernels know their scalar arguments' types (from the
    program's argument info), so pyopencl packs a launch's arguments without
    trying each type: a plain Python int is accepted where a bare kernel
    refuses it."""
    import pyopencl as cl

    from kvreg_opencl import kernels

    be = kvreg.get_backend("opencl", selector)
    prg = programs.attend_program(be._dev, 4)
    buf = kernels.scratch(be._dev).put("probe", np.zeros(1024, np.int32))   # bounds 0: nothing to do
    args = (buf, buf, buf, buf, 1, 1, 8)   # probs: scores, mz, nlim, firsts, then ng, hpk, sstride
    programs.kernel(prg, "probs")(be._dev.queue, (1, 1, 1), None, *args)
    be._dev.queue.finish()
    with pytest.raises(cl.LogicError):
        cl.Kernel(prg, "probs")(be._dev.queue, (1, 1, 1), None, *args)
