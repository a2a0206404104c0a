"""Nyström kernels: each against the reference's float64 kernel, and a
sealed state against the f64 oracle."""

import numpy as np
import pytest

from kvreg import nystrom as ref
from kvreg.nystrom import FarField, NystromState, landmark_inverse, landmarks
from kvreg_conformance.oracle import nystrom_oracle
from kvreg_numba import nystrom as nb
from kvreg_numba.backend import NumbaBackend


def far_field(n=61, hd=18, hpk=3, m=6, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((hpk, n, hd)).astype(np.float32)
    k = rng.standard_normal((n, hd)).astype(np.float32)
    v = rng.standard_normal((n, hd)).astype(np.float32)
    qt, kt = landmarks(q, k, m)
    m_hat, r = landmark_inverse(qt, kt, 0.3, 1e-3)
    return qt, kt, m_hat, r, k, v


def test_prefill_matches_the_reference_over_many_steps(small_blocks):
    qt, _, _, _, k, v = far_field()  # 61 rows in steps of 7, 18 landmark rows: every tile edge
    for got, want in zip(NumbaBackend().nystrom_prefill(qt, k, v, scale=0.3), ref.nystrom_prefill(qt, k, v, 0.3)):
        assert got.dtype == np.float64 and got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_absorb_returns_the_far_field_the_reference_returns_and_leaves_its_input():
    qt, kt, m_hat, r, k, v = far_field()
    c, z, th = ref.nystrom_prefill(qt, k[:40], v[:40], 0.3)
    mine = first = FarField(kt, qt, m_hat, r, c.copy(), z.copy(), th.copy(), 40)
    theirs = FarField(kt, qt, m_hat, r, c.copy(), z.copy(), th.copy(), 40)
    for p in range(40, 61):
        mine = NumbaBackend().nystrom_absorb(mine, k[p], v[p], scale=0.3)
        theirs = ref.nystrom_absorb(theirs, k[p], v[p], 0.3)
    assert mine.rows == theirs.rows == 61 and first.rows == 40
    assert np.array_equal(first.z, z) and np.array_equal(first.theta, th), "the input far field is unchanged"
    for name in ("c", "z", "theta"):
        np.testing.assert_allclose(getattr(mine, name), getattr(theirs, name), rtol=1e-12, atol=1e-13)


@pytest.mark.parametrize("with_far", [True, False])
def test_step_matches_the_reference(with_far):
    qt, kt, m_hat, r, k, v = far_field()
    c, z, th = ref.nystrom_prefill(qt, k[:40], v[:40], 0.3)
    far = FarField(kt, qt, m_hat, r, c, z, th, 40) if with_far else None
    q = np.random.default_rng(9).standard_normal((3, 18)).astype(np.float32)
    got = NumbaBackend().nystrom_step(q, k[40:], v[40:], far, scale=0.3)
    assert got.dtype == np.float32 and got.shape == (3, 18)
    np.testing.assert_allclose(got, ref.nystrom_step(q, k[40:], v[40:], far, 0.3), rtol=1e-5, atol=1e-6)


def test_absorb_keeps_the_far_field_size_constant_in_context():
    qt, kt, m_hat, r, k, v = far_field()
    c, z, th = ref.nystrom_prefill(qt, k, v, 0.3)
    far = FarField(kt, qt, m_hat, r, c, z, th, 61)
    size = far.nbytes()
    for p in range(50):
        far = NumbaBackend().nystrom_absorb(far, k[p % 61], v[p % 61], scale=0.3)
    assert far.nbytes() == size and far.rows == 111


def test_sealed_state_matches_the_f64_oracle(small_blocks):
    hd, hpk, t0, steps, m, w, sink, scale = 16, 2, 60, 12, 6, 10, 3, 0.25
    rng = np.random.default_rng(4)
    k = rng.standard_normal((t0 + steps, hd)).astype(np.float32)
    v = rng.standard_normal((t0 + steps, hd)).astype(np.float32)
    q = (1.5 * rng.standard_normal((t0 + steps, hpk, hd))).astype(np.float32)
    st = NystromState(m, w, sink, hpk, scale=scale, kernels=NumbaBackend())
    trace = np.ascontiguousarray(q[:t0].transpose(1, 0, 2))
    st.prefill_group(trace, k[:t0], v[:t0])
    for p in range(t0, t0 + steps):
        out = st.step_group(q[p], k[p], v[p])
        want = nystrom_oracle(trace, k, v, t0, p, q[p], m=m, w=w, sink=sink, scale=scale, rcond=1e-3)
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-5)


def test_fexp64_is_within_4e16_relative():
    from numba import njit

    @njit
    def apply(x):
        out = np.empty_like(x)
        for i in range(x.shape[0]):
            out[i] = nb.fexp64(x[i])
        return out

    x = -np.concatenate([np.linspace(0, 700, 200001), np.random.default_rng(0).random(10000) * 700])
    assert np.max(np.abs(apply(x) - np.exp(x)) / np.exp(x)) < 4e-16
    assert list(apply(np.array([0.0, -np.inf, -709.0]))) == [1.0, 0.0, 0.0]
