"""q8_2f quantization, freeze and gather: exact class, bit for bit."""

import numpy as np
import pytest

from kvreg_conformance.oracle import quantize_oracle
from kvreg_numba import blocks, sweeps
from kvreg_numba import quant as numba_quant

NOCOL = np.empty((0, 0), np.float32)


def _nocol(hd):
    return np.empty((0, hd), np.float32)


@pytest.mark.parametrize("hd,group", [(64, 32), (40, 32), (7, 32), (40, 40), (128, 128)])
def test_quantize_matches_contract_bit_for_bit(hd, group):
    rng = np.random.default_rng(hd)
    x = (rng.standard_normal((33, hd)) * rng.choice([1e-3, 1.0, 50.0], (33, 1))).astype(np.float32)
    x[3] = 0.0  # all-zero row: the 1e-12 scale floor
    col = (0.25 + rng.random((1, hd))).astype(np.float32)
    for c in (None, col, np.repeat(col, 33, axis=0) * np.float32(1.5)):
        q, s = numba_quant.quantize_rows(x, _nocol(hd) if c is None else c, group)
        qo, so = quantize_oracle(x, c, group)
        np.testing.assert_array_equal(q, qo)
        np.testing.assert_array_equal(s.view(np.uint32), so.view(np.uint32))


def test_ties_round_half_away_from_zero():
    # absmax 127 -> scale exactly 1, so x / s are these values exactly.
    row = np.array([127, 0.5, 1.5, -2.5, -0.5, 2.5, 126.5, -126.5, 0.49999997, -1.5], np.float32)
    q, s = numba_quant.quantize_rows(row[None], _nocol(row.size), 32)
    assert s[0, 0] == 1.0
    assert q[0].tolist() == [127, 1, 2, -3, -1, 3, 127, -127, 0, -2]


def test_nan_quantizes_to_zero_without_poisoning_the_group_scale():
    row = np.array([np.nan, 1.0, -2.0, np.nan] + [0.5] * 36, np.float32)
    q, s = numba_quant.quantize_rows(row[None], _nocol(40), 32)
    assert q[0, 0] == 0 and q[0, 3] == 0
    assert s[0, 0] == np.float32(2.0) / np.float32(127)  # Rust's f32::max ignores NaN
    assert q[0, 2] == -127
    qo, so = quantize_oracle(row[None], None, 32)
    np.testing.assert_array_equal(q, qo)
    np.testing.assert_array_equal(s, so)


def test_inf_clamps_and_its_group_goes_to_zero():
    row = np.array([np.inf, 1.0, -np.inf] + [0.0] * 37, np.float32)
    q, s = numba_quant.quantize_rows(row[None], _nocol(40), 32)
    qo, so = quantize_oracle(row[None], None, 32)
    np.testing.assert_array_equal(q, qo)
    np.testing.assert_array_equal(s, so)


def test_quantize_equals_kvreg_quant_on_finite_rows():
    quant = pytest.importorskip("kvreg.quant")
    rng = np.random.default_rng(5)
    x = (rng.standard_normal((64, 72)) * 3).astype(np.float32)
    col = (0.1 + rng.random(72)).astype(np.float32)
    for group in (32, 72):
        q, s = numba_quant.quantize_rows(x, col[None], group)
        qr, sr = quant.quantize_rows(x, col, group)
        np.testing.assert_array_equal(q, qr)
        np.testing.assert_array_equal(s.view(np.uint32), sr.view(np.uint32))


def test_freeze_field_is_rms_in_row_order_then_requantize():
    quant = pytest.importorskip("kvreg.quant")
    rng = np.random.default_rng(6)
    x = (rng.standard_normal((65, 40)) * np.linspace(0.1, 4, 40)).astype(np.float32)
    x[:, 5] = 0.0  # a dead channel: the 1e-6 floor
    q, s = numba_quant.quantize_rows(x, _nocol(40), 32)
    col, q2, s2 = numba_quant.freeze_field(q, s, 32)
    rows = quant.dequantize_rows(q, s, 32)
    col_ref = quant.field_rms(rows)
    np.testing.assert_array_equal(col.view(np.uint32), col_ref.view(np.uint32))
    qr, sr = quant.quantize_rows(rows, col_ref, 32)
    np.testing.assert_array_equal(q2, qr)
    np.testing.assert_array_equal(s2, sr)


@pytest.mark.parametrize("dtype", [np.float32, np.int8])
def test_gather_rows_is_fancy_indexing(dtype):
    rows = (np.arange(50 * 9) % 251 - 120).astype(dtype).reshape(50, 9)
    idx = np.array([0, 3, 4, 17, 49], np.int64)
    np.testing.assert_array_equal(numba_quant.gather_rows(rows, idx), rows[idx])


def test_special_values_equal_kvreg_quant():
    quant = pytest.importorskip("kvreg.quant")
    rows = np.array([
        [np.nan, 1.0, -2.0, np.nan] + [0.5] * 36,
        [np.inf, 1.0, -np.inf] + [0.0] * 37,
        [127, 0.5, 1.5, -2.5, -0.5, 2.5, 126.5, -126.5, 0.49999997, -1.5] + [0.0] * 30,
        [0.0] * 40,
    ], np.float32)
    for group in (32, 40):
        q, s = numba_quant.quantize_rows(rows, _nocol(40), group)
        with np.errstate(all="ignore"):
            qr, sr = quant.quantize_rows(rows, None, group)
        np.testing.assert_array_equal(q, qr)
        np.testing.assert_array_equal(s.view(np.uint32), sr.view(np.uint32))


@pytest.mark.parametrize("hd", [64, 128])
@pytest.mark.parametrize("nheads", [1, 3, 4, 9])
@pytest.mark.parametrize("nr", [0, 1, 17, 70])
def test_q8_rows_scored_as_stored_equal_the_dequantized_buffer(hd, nheads, nr):
    # the decode kernel scores int8 K rows in registers (_scores8); the
    # same bits as widening them into a float32 buffer first (the path any
    # other head dim takes), extreme codes and scales included
    rng = np.random.default_rng(hd + nheads + nr)
    ngk = hd // sweeps.K_GROUP
    kq = rng.integers(-127, 128, (2, nr + 3, hd)).astype(np.int8)
    kq[0, :, 0] = 127
    kq[0, :, -1] = -127
    ks = (rng.standard_normal((2, nr + 3, ngk)) * 10.0 ** rng.integers(-30, 30, (2, nr + 3, ngk))).astype(np.float32)
    q = rng.standard_normal((nheads + 2, hd)).astype(np.float32)
    want = np.full((nheads, 75), np.nan, np.float32)
    got = want.copy()
    buf = np.empty((max(nr, 1), hd), np.float32)
    blocks._dequant_k_rows(kq, ks, 1, 2, nr, buf)
    blocks.scores(q, 2, nheads, buf, nr, np.float32(0.3), want, 5)
    blocks._scores8(q, 2, nheads, kq[1, 2:2 + nr], ks[1, 2:2 + nr], nr, np.float32(0.3), got, 5)
    assert got.tobytes() == want.tobytes()
