"""quantize_rows: exact class, bit-for-bit with the contract."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as hs
from hypothesis.extra import numpy as hnp
from ocl_helpers import quantize_ref

from kvreg_opencl import kernels


def same_bits(dev, x, col, group):
    q, s = kernels.quantize_rows(dev, x, col, group)
    rq, rs = quantize_ref(x, col, group)
    np.testing.assert_array_equal(q, rq)
    np.testing.assert_array_equal(s.view(np.int32), rs.view(np.int32))
    try:  # the core's own implementation, once it exists
        from kvreg import quant
    except ImportError:
        return q, s
    cq, cs = quant.quantize_rows(np.asarray(x, np.float32), col, group)
    np.testing.assert_array_equal(q, cq)
    np.testing.assert_array_equal(s.view(np.int32), np.asarray(cs, np.float32).view(np.int32))
    return q, s


def test_ties_round_half_away_from_zero(dev):
    # absmax 127 makes the scale exactly 1.0, so r / s are the values themselves
    x = np.zeros((1, 40), np.float32)
    x[0, :7] = [127.0, 0.5, 1.5, -2.5, 2.5, -0.5, 126.5]
    q, s = same_bits(dev, x, None, 32)
    assert s[0, 0] == 1.0
    assert list(q[0, :7]) == [127, 1, 2, -3, 3, -1, 127]


def test_just_below_half_rounds_down(dev):
    x = np.zeros((1, 32), np.float32)
    x[0, 0] = 127.0
    x[0, 1] = np.nextafter(np.float32(0.5), np.float32(0))  # 0.49999997f
    x[0, 2] = -np.nextafter(np.float32(0.5), np.float32(0))
    q, _ = same_bits(dev, x, None, 32)
    assert q[0, 1] == 0 and q[0, 2] == 0


def test_nan_quantizes_to_zero_and_is_ignored_by_absmax(dev):
    x = np.array([[np.nan, 2.0, -4.0] + [0.0] * 37], np.float32)
    q, s = same_bits(dev, x, None, 32)
    assert q[0, 0] == 0 and q[0, 2] == -127
    assert s[0, 0] == np.float32(4.0) / np.float32(127.0)


def test_zero_row_uses_the_scale_floor(dev):
    q, s = same_bits(dev, np.zeros((2, 8), np.float32), None, 8)
    assert np.all(q == 0) and np.all(s == np.float32(1e-12))


@pytest.mark.parametrize("hd,group", [(40, 32), (40, 40), (128, 32), (33, 32), (7, 7)])
def test_random_rows_with_field_bit_exact(dev, hd, group):
    rng = np.random.default_rng(hd * 100 + group)
    x = (rng.standard_normal((64, hd)) * rng.uniform(0.01, 50, (64, 1))).astype(np.float32)
    col = rng.uniform(0.05, 3.0, hd).astype(np.float32)
    same_bits(dev, x, None, group)
    same_bits(dev, x, col, group)
    same_bits(dev, x, rng.uniform(0.05, 3.0, (64, hd)).astype(np.float32), group)  # per-row field


@settings(max_examples=40, deadline=None)
@given(hnp.arrays(np.float32, hnp.array_shapes(min_dims=2, max_dims=2, max_side=70),
                  elements=hs.floats(-1e6, 1e6, width=32)),
       hs.sampled_from([32, 5]))
def test_hypothesis_bit_exact(dev, x, group):
    same_bits(dev, x, None, group)


def test_the_backend_quantizes_a_few_rows_on_the_host_of_a_cpu_device_and_many_on_the_device(dev, monkeypatch):
    """Decode appends are a few rows: on a CPU device NumPy is ~5x cheaper
    than a launch and a read-back, so they stay on the host; a prefill's
    thousands of rows go to the device. Same bits either way (exact class)."""
    from kvreg import quant
    from kvreg_opencl import config
    from kvreg_opencl.backend import OpenCLBackend

    be = OpenCLBackend()
    launches = []
    real = kernels.quantize_rows
    monkeypatch.setattr(kernels, "quantize_rows", lambda *a: launches.append(a[1].shape[0]) or real(*a))
    rng = np.random.default_rng(3)
    for n in (8, config.HOST_QUANT_ROWS):
        x = rng.standard_normal((n, 64)).astype(np.float32)
        col = rng.random((n, 64)).astype(np.float32) + 0.5
        q, s = be.quantize_rows(x, col, group=32)
        rq, rs = quant.quantize_rows(x, col, 32)
        np.testing.assert_array_equal(q, rq)
        np.testing.assert_array_equal(s.view(np.int32), rs.view(np.int32))
    device_rows = [config.HOST_QUANT_ROWS] if dev.info.kind == "CPU" else [8, config.HOST_QUANT_ROWS]
    assert launches == (device_rows if be._native_quant else [])
