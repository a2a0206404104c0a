"""nystrom_step on the device (float64): the oracle, the reference, and the
fp64 condition that decides whether the backend runs it at all."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from kvreg.nystrom import NystromState, nystrom_step
from kvreg_conformance.oracle import nystrom_oracle
from kvreg_conformance.tolerances import tolerance

RTOL, ATOL, _ = tolerance("nystrom_step")


@pytest.fixture(scope="module")
def fp64_dev(dev):
    if not dev.info.fp64:
        pytest.skip(f"{dev.info.name!r} has no fp64: nystrom_step stays on the reference")
    return dev


def assert_close(got, want, what, rtol=RTOL, atol=ATOL):
    err = np.abs(got - want) - (atol + rtol * np.abs(want))
    assert err.max() <= 0, f"{what}: worst excess {err.max():.3g}"


def sealed(seed, *, t0, hd, hpk, m, w, sink, scale, rcond=1e-3):
    rng = np.random.default_rng(seed)
    trace = (1.5 * rng.standard_normal((hpk, t0, hd))).astype(np.float32)
    k = rng.standard_normal((t0 + 40, hd)).astype(np.float32)
    v = rng.standard_normal((t0 + 40, hd)).astype(np.float32)
    st = NystromState(m, w, sink, hpk, scale=scale, rcond=rcond)
    st.prefill_group(trace, k[:t0], v[:t0])
    return st, trace, k, v, rng


def test_decode_steps_match_the_oracle(fp64_dev):
    from kvreg_opencl import nystrom as dn

    hd, hpk, t0, m, w, sink = 16, 3, 60, 6, 10, 3
    scale = hd ** -0.5
    st, trace, k, v, rng = sealed(1, t0=t0, hd=hd, hpk=hpk, m=m, w=w, sink=sink, scale=scale)
    for p in range(t0, t0 + 15):  # the window fills, then rows move into the far sums
        st._insert(k[p], v[p])
        q = (1.5 * rng.standard_normal((hpk, hd))).astype(np.float32)
        ke, ve = st.exact_rows()
        got = dn.nystrom_step(fp64_dev, q, ke, ve, st.far, scale)
        assert got.dtype == np.float32 and got.shape == (hpk, hd)
        want = nystrom_oracle(trace, k, v, t0, p, q, m=m, w=w, sink=sink, scale=scale, rcond=1e-3)
        assert_close(got, want, f"oracle at {p}")
        assert_close(got, nystrom_step(q, ke, ve, st.far, scale), f"reference at {p}", rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("lanes", [1, 3, 64])
def test_a_wide_state_matches_the_reference_for_any_work_group_size(fp64_dev, monkeypatch, lanes):
    # hd 128, 32 landmarks, 260 exact rows: strided loops with a remainder
    from kvreg_opencl import config
    from kvreg_opencl import nystrom as dn

    monkeypatch.setattr(config, "LOCAL_SIZE", lanes)
    hd, hpk = 128, 4
    scale = hd ** -0.5
    st, _, k, v, rng = sealed(2, t0=2000, hd=hd, hpk=hpk, m=32, w=256, sink=4, scale=scale)
    for p in range(2000, 2010):
        st._insert(k[p], v[p])
    q = rng.standard_normal((hpk, hd)).astype(np.float32)
    ke, ve = st.exact_rows()
    assert_close(dn.nystrom_step(fp64_dev, q, ke, ve, st.far, scale),
                 nystrom_step(q, ke, ve, st.far, scale), "reference", rtol=1e-6, atol=1e-7)


def test_an_exact_only_state_and_a_clamped_far_part(fp64_dev):
    from kvreg_opencl import nystrom as dn

    hd, hpk = 8, 2
    rng = np.random.default_rng(3)
    q = rng.standard_normal((hpk, hd)).astype(np.float32)
    ke = rng.standard_normal((5, hd)).astype(np.float32)
    ve = rng.standard_normal((5, hd)).astype(np.float32)
    assert_close(dn.nystrom_step(fp64_dev, q, ke, ve, None, 0.3), nystrom_step(q, ke, ve, None, 0.3),
                 "no far field", rtol=1e-6, atol=1e-7)
    st, *_ = sealed(4, t0=40, hd=hd, hpk=hpk, m=4, w=5, sink=1, scale=0.3)
    far = dataclasses.replace(st.far, z=np.full_like(st.far.z, -1.0))  # every far denominator negative
    ke, ve = st.exact_rows()
    # with the pooling prior the read falls back to the pooled estimate ...
    assert_close(dn.nystrom_step(fp64_dev, q, ke, ve, far, 0.3), nystrom_step(q, ke, ve, far, 0.3),
                 "pooled fallback", rtol=1e-6, atol=1e-7)
    # ... without it the far part must vanish
    bare = dataclasses.replace(far, count=None, vsum=None, vlo=None, vhi=None, last_logit=None)
    got = dn.nystrom_step(fp64_dev, q, ke, ve, bare, 0.3)
    assert_close(got, nystrom_step(q, ke, ve, None, 0.3), "clamped far part", rtol=1e-6, atol=1e-7)


def test_the_backend_runs_it_only_with_fp64(dev, monkeypatch):
    from kvreg_opencl import config
    from kvreg_opencl.backend import OpenCLBackend

    be = OpenCLBackend()
    assert "nystrom_step" in OpenCLBackend.native_kernels()
    assert be._native_nystrom == dev.info.fp64
    assert ("nystrom_step on the reference" in be.describe()) != dev.info.fp64
    monkeypatch.setattr(config, "NYSTROM_ON_DEVICE", False)
    off = OpenCLBackend()
    assert not off._native_nystrom and "config.NYSTROM_ON_DEVICE" in off.describe() or not dev.info.fp64
    hd, hpk = 8, 2
    st, *_ = sealed(5, t0=40, hd=hd, hpk=hpk, m=4, w=5, sink=1, scale=0.3)
    q = np.ones((hpk, hd), np.float32)
    ke, ve = st.exact_rows()
    np.testing.assert_array_equal(off.nystrom_step(q, ke, ve, st.far, scale=0.3),
                                  nystrom_step(q, ke, ve, st.far, 0.3))


def test_a_sealed_layer_decodes_on_the_device_like_the_reference(fp64_dev):
    from kvreg import KvMode, LayerKvCache
    from kvreg.reference import ReferenceBackend
    from kvreg_opencl.backend import OpenCLBackend

    nkv, hd, hpk, t0 = 2, 16, 2, 50
    nh = nkv * hpk
    scale = hd ** -0.5
    rng = np.random.default_rng(6)
    k = rng.standard_normal((t0 + 10, nkv * hd)).astype(np.float32)
    v = rng.standard_normal((t0 + 10, nkv * hd)).astype(np.float32)
    q = rng.standard_normal((t0 + 10, nh * hd)).astype(np.float32)
    layers = []
    for be in (OpenCLBackend(), ReferenceBackend()):
        c = LayerKvCache(nkv, hd, KvMode.F32, be)
        c.o1_begin(6, 8, 2, scale=scale, far="nystrom")
        for p in range(t0):
            c.o1_push_q(q[p])
            c.append(k[p], v[p])
        assert c.o1_seal_checked(nh)
        layers.append(c)
    for p in range(t0, t0 + 10):
        a, b = (c.o1_step(q[p].reshape(nh, hd), k[p], v[p], nh) for c in layers)
        assert_close(a, b, f"layer step {p}", rtol=1e-6, atol=1e-7)
