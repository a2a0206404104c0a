"""The O(1) Nyström far-field state: estimator, lifecycle, refusals."""

import types

import numpy as np
import pytest

import kvreg.nystrom as ny
from kvreg.errors import ConfigError, ShapeError, StateError
from kvreg.nystrom import FarField, NystromState, O1Rect, o1_deferred_boundary
from kvreg_conformance.data import realistic_qkv
from kvreg_conformance.oracle import attention_oracle, nystrom_oracle


def group_data(rows, hpk=2, hd=16, seed=0):
    """One KV group of realistic data: (q [hpk, rows, hd], k, v [rows, hd], scale)."""
    d = realistic_qkv(rows, hpk, 1, hd, seed=seed)
    return np.ascontiguousarray(d.q.transpose(1, 0, 2)), d.k[:, 0], d.v[:, 0], d.scale


def sealed(t0, rows, m=8, w=16, sink=4, hpk=2, hd=16, seed=0, **kw):
    q, k, v, scale = group_data(rows, hpk, hd, seed)
    st = NystromState.new_group(m, w, sink, hpk, scale=scale, **kw)
    st.prefill_group([q[h, :t0] for h in range(hpk)], k[:t0], v[:t0])
    return st, q, k, v, scale


def exact_out(q, k, v, scale, pos):
    """Exact attention of q[:, pos] over rows [0, pos]: [hpk, hd] float64."""
    return attention_oracle(q[:, pos][None], k[:pos + 1, None], v[:pos + 1, None], scale)[0]


def rel(a, b):
    return np.linalg.norm(a - b, axis=-1) / np.linalg.norm(b, axis=-1)


# ── the estimator

def test_steps_match_f64_oracle():
    t0, rows = 120, 160
    st, q, k, v, scale = sealed(t0, rows)
    for p in range(t0, rows):
        out = st.step_group(q[:, p], k[p], v[p])
        if p % 8 == 0 or p == rows - 1:
            ref = nystrom_oracle(q[:, :t0], k, v, t0, p, q[:, p], m=8, w=16, sink=4, scale=scale,
                                 rcond=st.rcond)
            assert rel(out, ref).max() < 1e-4, p


def test_attend_right_after_seal_matches_oracle():
    st, q, k, v, scale = sealed(100, 100)
    ref = nystrom_oracle(q[:, :100], k, v, 100, 99, q[:, 99], m=8, w=16, sink=4, scale=scale,
                                 rcond=st.rcond)
    assert rel(st.attend_group(q[:, 99]), ref).max() < 1e-4


def test_exact_only_state_equals_exact_attention():
    # t0 = 12 <= sink + w = 20: no far rows, every step stays within the window
    st, q, k, v, scale = sealed(12, 20)
    assert st.exact_only
    for p in range(12, 20):
        out = st.step_group(q[:, p], k[p], v[p])
        assert rel(out, exact_out(q, k, v, scale, p)).max() < 1e-5


@pytest.mark.parametrize("rcond", [1e-12, 1e-3, 0.5])
def test_one_far_row_per_landmark_is_exact(rcond):
    # far rows == m: K̃ are the rows themselves, the pooling prior W₀ is the
    # exact far field and the fit's residual F̂ − Φ·W₀ is zero, so the
    # estimate is exact however strong the ridge
    m, w, sink = 8, 16, 4
    t = sink + w + m
    st, q, k, v, scale = sealed(t, t, m=m, w=w, sink=sink, rcond=rcond, heavy=0)
    assert st.m_eff == m and st.far.rows == m
    out = st.attend_group(q[:, t - 1])
    assert rel(out, exact_out(q, k, v, scale, t - 1)).max() < 1e-5


def test_heavy_rows_leave_one_far_row_and_the_read_stays_exact():
    # far rows == m with the default heavy = m: m - 1 rows kept exact, one
    # row left to the landmarks (at least one stays far), still exact
    m, w, sink = 8, 16, 4
    t = sink + w + m
    st, q, k, v, scale = sealed(t, t, m=m, w=w, sink=sink)
    assert st.n_heavy == m - 1 and st.far.rows == 1 and st.m_eff == 1
    out = st.attend_group(q[:, t - 1])
    assert rel(out, exact_out(q, k, v, scale, t - 1)).max() < 1e-5


def test_estimate_is_not_trivially_exact_with_many_far_rows():
    # the counterpart of the test above: with far rows >> m the estimate is
    # an approximation, so the oracle comparisons are not vacuous
    st, q, k, v, scale = sealed(200, 200)
    out = st.attend_group(q[:, 199])
    assert rel(out, exact_out(q, k, v, scale, 199)).max() > 1e-4


def test_negative_far_denominator_drops_the_far_part():
    rng = np.random.default_rng(0)
    hpk, m, hd, e = 2, 4, 8, 5
    q = rng.standard_normal((hpk, hd))
    ke, ve = rng.standard_normal((e, hd)), rng.standard_normal((e, hd))
    far = FarField(
        k_tilde=rng.standard_normal((m, hd)), probes=rng.standard_normal((hpk, m, hd)),
        m_hat=np.tile(np.eye(m), (hpk, 1, 1)), r=np.zeros((hpk, m)), c=np.zeros((hpk, m)),
        z=-np.ones((hpk, m)), theta=rng.standard_normal((hpk, m, hd)) * 1e3, rows=10,
    )
    assert np.allclose(ny.nystrom_step(q, ke, ve, far, 0.3), ny.nystrom_step(q, ke, ve, None, 0.3),
                       rtol=1e-6, atol=1e-7)


def pooled_far(rng, hpk=2, m=4, hd=8, p=4):
    """A hand-built far field with the pooling prior; the correction
    ``φ·P·E`` is zero (``m_hat = 0``) unless a test sets it."""
    return FarField(
        k_tilde=rng.standard_normal((m, hd)), probes=rng.standard_normal((hpk, p, hd)),
        m_hat=np.zeros((hpk, m, p)), r=np.zeros((hpk, p)), c=np.zeros((hpk, p)),
        z=np.ones((hpk, p)), theta=rng.standard_normal((hpk, p, hd)), rows=40,
        count=np.full(m, 10.0), vsum=10.0 * rng.uniform(-1, 1, (m, hd)), vlo=-np.ones(hd),
        vhi=np.ones(hd), last_logit=np.full((hpk, p), -1.0),
    )


def pooled_read(q, ke, ve, far, scale):
    """Exact sinks + window plus the pooled estimate φ(q)·W₀, directly."""
    q = q.astype(np.float64)
    lg = scale * np.concatenate([q @ ke.T, q @ far.k_tilde.T], axis=1)
    e = np.exp(lg - lg.max(axis=1, keepdims=True))
    ee, ea = e[:, :ke.shape[0]], e[:, ke.shape[0]:]
    return (ee @ ve + ea @ far.vsum) / (ee.sum(1) + ea @ far.count)[:, None]


def test_pooled_prior_alone_is_segment_pooling():
    # m_hat = 0: no correction, the estimate is the pooled one (it passes both checks)
    rng = np.random.default_rng(4)
    far = pooled_far(rng)
    q = rng.standard_normal((2, 8))
    ke, ve = rng.standard_normal((5, 8)), rng.standard_normal((5, 8))
    assert np.allclose(ny.nystrom_step(q, ke, ve, far, 0.3), pooled_read(q, ke, ve, far, 0.3),
                       rtol=1e-6, atol=1e-7)


def test_far_denominator_below_the_pooled_one_takes_the_pooled_estimate():
    # the correction pulls the far denominator below the pooled (Jensen) bound
    rng = np.random.default_rng(5)
    far = pooled_far(rng)
    far.m_hat[:] = -0.2  # φ·P < 0 against positive residuals: a negative correction
    far.theta[:] = 0.0  # and none to the numerator, so the box check alone would pass
    q = rng.standard_normal((2, 8))
    ke, ve = rng.standard_normal((5, 8)), rng.standard_normal((5, 8))
    *_, den_f = ny.nystrom_parts(q, ke, ve, far, 0.3)
    assert np.all(den_f > 0)
    assert np.allclose(ny.nystrom_step(q, ke, ve, far, 0.3), pooled_read(q, ke, ve, far, 0.3),
                       rtol=1e-6, atol=1e-7)


def test_far_average_outside_the_value_box_takes_the_pooled_estimate():
    rng = np.random.default_rng(6)
    far = pooled_far(rng)
    far.theta[:] = 0.0
    far.theta[:, :, 3] = 1e3  # numerator far beyond vhi·den in channel 3, denominator fine
    far.m_hat[:] = 0.1
    q = rng.standard_normal((2, 8))
    ke, ve = rng.standard_normal((5, 8)), rng.standard_normal((5, 8))
    want = pooled_read(q, ke, ve, far, 0.3)
    assert np.allclose(ny.nystrom_step(q, ke, ve, far, 0.3), want, rtol=1e-6, atol=1e-7)
    far.theta[:, :, 3] = 0.5  # inside the box: the fit's estimate stands
    assert not np.allclose(ny.nystrom_step(q, ke, ve, far, 0.3), want, rtol=1e-3, atol=1e-4)


def test_far_field_pooling_fields_are_all_or_none():
    rng = np.random.default_rng(7)
    far = pooled_far(rng)
    with pytest.raises(ShapeError, match="all or none"):
        FarField(far.k_tilde, far.probes, far.m_hat, far.r, far.c, far.z, far.theta, 40,
                 count=far.count)


def test_far_part_contributes_when_denominator_positive():
    rng = np.random.default_rng(0)
    hpk, m, hd, e = 2, 4, 8, 5
    q = rng.standard_normal((hpk, hd))
    ke, ve = rng.standard_normal((e, hd)), rng.standard_normal((e, hd))
    far = FarField(
        k_tilde=rng.standard_normal((m, hd)), probes=rng.standard_normal((hpk, m, hd)),
        m_hat=np.tile(np.eye(m), (hpk, 1, 1)), r=np.zeros((hpk, m)), c=np.zeros((hpk, m)),
        z=np.ones((hpk, m)), theta=np.full((hpk, m, hd), 50.0), rows=10,
    )
    with_far = ny.nystrom_step(q, ke, ve, far, 0.3)
    assert not np.allclose(with_far, ny.nystrom_step(q, ke, ve, None, 0.3))


# ── kernels

def test_chunked_prefill_equals_single_block(monkeypatch):
    rng = np.random.default_rng(1)
    qt = rng.standard_normal((2, 4, 8))
    kf, vf = rng.standard_normal((50, 8)), rng.standard_normal((50, 8))
    whole = ny.nystrom_prefill(qt, kf, vf, 0.5)
    monkeypatch.setattr(ny.estimator, "PREFILL_CHUNK", 7)
    chunked = ny.nystrom_prefill(qt, kf, vf, 0.5)
    for a, b in zip(whole, chunked):
        assert np.allclose(a, b, rtol=1e-12, atol=0)


def test_absorb_equals_prefill_over_one_more_row():
    rng = np.random.default_rng(2)
    qt = rng.standard_normal((2, 4, 8))
    kf, vf = rng.standard_normal((30, 8)) * 3, rng.standard_normal((30, 8))
    c, z, th = ny.nystrom_prefill(qt, kf[:29], vf[:29], 0.5)
    far = FarField(np.zeros((4, 8)), qt, np.zeros((2, 4, 4)), np.zeros((2, 4)), c, z, th, 29)
    before = far
    far = ny.nystrom_absorb(far, kf[29], vf[29], 0.5)
    assert before.rows == 29 and before.c is c, "absorb returns a new far field, the old one unchanged"
    c2, z2, th2 = ny.nystrom_prefill(qt, kf, vf, 0.5)
    # same stabilizer, so the sums compare directly
    assert np.array_equal(far.c, c2) and far.rows == 30
    assert np.allclose(far.z, z2, rtol=1e-12) and np.allclose(far.theta, th2, rtol=1e-12)


def test_absorb_moves_the_row_into_the_last_segment_and_the_value_box():
    rng = np.random.default_rng(8)
    far = pooled_far(rng)
    count, vsum, z = far.count.copy(), far.vsum.copy(), far.z.copy()
    v_row = np.full(8, 2.5)
    v_row[0] = -3.0
    k_row = rng.standard_normal(8)
    far = ny.nystrom_absorb(far, k_row, v_row.astype(np.float32), 0.3)
    assert np.array_equal(far.count, count + np.r_[0.0, 0.0, 0.0, 1.0])
    assert np.allclose(far.vsum[:-1], vsum[:-1]) and np.allclose(far.vsum[-1], vsum[-1] + v_row)
    assert far.vhi[1] == 2.5 and far.vlo[0] == -3.0 and far.vlo[1] == -1.0 and far.rows == 41
    # the residual gains the row's kernel value minus its stand-in's (last_logit)
    lg = 0.3 * far.probes @ k_row
    c = np.maximum(0.0, lg)
    assert np.allclose(far.c, c)
    assert np.allclose(far.z, z * np.exp(-c) + np.exp(lg - c) - np.exp(-1.0 - c), rtol=1e-12)


def test_a_sealed_states_residuals_match_a_recomputation():
    # E = F̂ − Φ·W₀ after some absorbs, recomputed from the rows far now
    t0, rows, m, w, sink = 80, 110, 8, 16, 4
    st, q, k, v, scale = sealed(t0, rows, m=m, w=w, sink=sink)
    assert st.n_heavy == m
    for p in range(t0, rows):
        st.step_group(q[:, p], k[p], v[p])
    far = st.far
    # the rows far now: the heavy rows are not among them
    far_rows = np.setdiff1d(np.arange(sink, rows - w), st.heavy_pos)
    kf, vf = k[far_rows].astype(np.float64), v[far_rows].astype(np.float64)
    f_z = np.exp(scale * far.probes @ kf.T - far.c[:, :, None])  # [hpk, p, n]
    stand_in = np.exp(scale * far.probes @ far.k_tilde.T - far.c[:, :, None])
    b = ny.segment_bounds(t0 - w - sink - m, m)
    b[-1] = far_rows.size  # later rows joined the last segment
    assert np.array_equal(far.count, np.diff(b))
    assert np.allclose(far.z, f_z.sum(2) - stand_in @ far.count, rtol=1e-9, atol=1e-12)
    assert np.allclose(far.theta, f_z @ vf - stand_in @ far.vsum, rtol=1e-9, atol=1e-12)


def test_far_fit_solves_the_ridge_normal_equations():
    rng = np.random.default_rng(9)
    probes, kt = rng.standard_normal((2, 7, 6)), rng.standard_normal((5, 6))
    nu = rng.uniform(1.0, 2.0, (2, 7))
    p_mat = ny.far_fit(probes, kt, nu, 0.4, 1e-2)
    for h in range(2):
        phi = np.exp(0.4 * probes[h] @ kt.T - nu[h][:, None])
        gram = phi.T @ phi
        lam = 1e-2 * np.linalg.eigvalsh(gram).max()
        assert np.allclose((gram + lam * np.eye(5)) @ p_mat[h], phi.T, atol=1e-12)


def test_recent_queries_count_a_run_of_equal_rows_once(monkeypatch):
    monkeypatch.setattr(ny.estimator, "RECENT_BLOCK", 5)  # runs cross block edges
    rows = np.repeat(np.arange(10, dtype=np.float32), 3)  # a trace recorded with stride 3
    q = np.stack([np.stack([rows, -rows], axis=1), np.stack([2 * rows, rows], axis=1)])  # [2, 30, 2]
    got = ny.recent_queries(q, 4)
    assert got.dtype == np.float64 and np.array_equal(got[0, :, 0], [6, 7, 8, 9])
    assert np.array_equal(got[1, :, 0], [12, 14, 16, 18])
    assert ny.recent_queries(q, 50).shape == (2, 10, 2)  # fewer distinct rows: all of them


def test_probes_are_segment_mean_queries_then_recent_queries():
    st, q, k, _, _ = sealed(100, 100, m=8, w=16, sink=4)
    qt, _ = ny.landmarks(q[:, 4:84], k[4:84], 4)
    assert st.far.probes.shape == (2, 8, 16)
    assert np.allclose(st.far.probes[:, :4], qt) and np.array_equal(st.far.probes[:, 4:], q[:, 96:100])


def test_landmarks_are_segment_means():
    k = np.arange(10, dtype=np.float64)[:, None] * np.ones((1, 2))
    q = np.stack([k, -k])
    qt, kt = ny.landmarks(q, k, 3)  # segments [0,3) [3,6) [6,10)
    assert np.allclose(kt[:, 0], [1.0, 4.0, 7.5]) and np.allclose(qt[1, :, 0], [-1.0, -4.0, -7.5])


def test_state_uses_its_kernels_object():
    calls = []

    def step(*args, **kw):
        calls.append("step")
        return ny.nystrom_step(*args, **kw)

    kern = types.SimpleNamespace(nystrom_prefill=ny.nystrom_prefill,
                                 nystrom_absorb=ny.nystrom_absorb, nystrom_step=step)
    st, q, k, v, _ = sealed(60, 61, kernels=kern)
    st.step_group(q[:, 60], k[60], v[60])
    assert calls == ["step"]


# ── lifecycle: window, sinks, memory

def test_window_holds_last_w_rows_after_steps():
    t0, rows, w, sink = 60, 97, 16, 4
    st, q, k, v, _ = sealed(t0, rows, w=w, sink=sink)
    for p in range(t0, rows):
        st.step_group(q[:, p], k[p], v[p])
    wk, wv = st.window_rows()
    assert np.array_equal(wk, k[rows - w:rows]) and np.array_equal(wv, v[rows - w:rows])
    sk, sv = st.sink_rows()
    assert np.array_equal(sk, k[:sink]) and np.array_equal(sv, v[:sink])


def test_rows_leaving_the_window_join_the_far_field():
    t0, steps = 60, 25
    st, q, k, v, _ = sealed(t0, t0 + steps)
    for p in range(t0, t0 + steps):
        st.step_group(q[:, p], k[p], v[p])
    assert st.far.rows == t0 + steps - 4 - 16 - st.n_heavy and st.seen == t0 + steps
    assert st.n_heavy == 8 and np.array_equal(st.heavy_rows()[0], k[st.heavy_pos])


def test_memory_bytes_same_at_2k_and_8k_context():
    sizes = []
    for t in (2048, 8192):
        q, k, v, scale = group_data(t, hpk=4, hd=64)
        st = NystromState.new_group(16, 256, 4, 4, scale=scale)
        st.prefill_group(q, k, v)
        sizes.append(st.memory_bytes())
    assert sizes[0] == sizes[1] > 0


def test_steps_grow_no_array():
    st, q, k, v, _ = sealed(60, 140)

    def shapes():
        arrs = [st.exact_k, st.exact_v] + [getattr(st.far, f) for f in
                                           ("k_tilde", "probes", "m_hat", "r", "c", "z", "theta",
                                            "count", "vsum", "vlo", "vhi", "last_logit")]
        return [a.shape for a in arrs], st.memory_bytes()

    before = shapes()
    for p in range(60, 140):
        st.step_group(q[:, p], k[p], v[p])
    assert shapes() == before


def test_exact_only_state_drops_rows_leaving_a_full_window():
    st, q, k, v, _ = sealed(12, 30)
    for p in range(12, 30):
        st.step_group(q[:, p], k[p], v[p])
    assert st.dropped == 30 - 20 and np.array_equal(st.window_rows()[0], k[14:30])


def test_prompt_shorter_than_sink_fills_sinks_first():
    st, q, k, v, _ = sealed(2, 8, sink=4)
    for p in range(2, 8):
        st.step_group(q[:, p], k[p], v[p])
    assert np.array_equal(st.sink_rows()[0], k[:4]) and np.array_equal(st.window_rows()[0], k[4:8])


def test_m_eff_is_far_rows_when_fewer_than_m():
    st, *_ = sealed(4 + 16 + 3, 23, m=8, heavy=0)
    assert st.m_eff == 3
    st, *_ = sealed(4 + 16 + 3, 23, m=8)  # heavy = m: all but one far row kept exact
    assert st.n_heavy == 2 and st.m_eff == 1


# ── heavy rows

def test_heavy_rows_are_the_far_rows_of_largest_recent_mass():
    # a far key aligned with the recent queries takes their mass: it is kept
    # exact, and left out of the landmarks, the pooling prior and the box
    t0, m, w, sink = 200, 8, 16, 4
    q, k, v, scale = group_data(t0)
    k, v = k.copy(), v.copy()
    needle = 57
    k[needle] = 4.0 * q[:, t0 - 8:].mean(axis=(0, 1)) / scale / np.linalg.norm(q[:, t0 - 8:].mean(axis=(0, 1)))
    v[needle] = 50.0
    st = NystromState.new_group(m, w, sink, 2, scale=scale)
    st.prefill_group(q, k, v)
    assert needle in st.heavy_pos and st.heavy_pos.size == m
    assert np.all(np.diff(st.heavy_pos) > 0) and st.heavy_pos.min() >= sink
    assert st.heavy_pos.max() < t0 - w
    hk, hv = st.heavy_rows()
    assert np.array_equal(hk, k[st.heavy_pos]) and np.array_equal(hv, v[st.heavy_pos])
    far_rows = np.setdiff1d(np.arange(sink, t0 - w), st.heavy_pos)
    assert st.far.rows == far_rows.size and st.far.vhi.max() < 50.0
    assert np.allclose(st.far.k_tilde, ny.segment_means(k[far_rows], m))
    assert np.allclose(st.far.count.sum(), far_rows.size)
    # the heavy rows are where the exact rows sit between the sinks and the window
    ke, _ = st.exact_rows()
    assert ke.shape[0] == sink + m + w and np.array_equal(ke[sink:sink + m], hk)


def test_heavy_mass_is_the_causal_attention_mass(monkeypatch):
    q, k, _, scale = group_data(90)
    pos = np.array([5, 30, 70, 89])
    want = np.zeros(90)
    for p in pos:
        for h in range(q.shape[0]):
            s = scale * (q[h, p].astype(np.float64) @ k[:p + 1].astype(np.float64).T)
            e = np.exp(s - s.max())
            want[:p + 1] += e / e.sum()
    got = ny.heavy_mass(q, k, pos, 4, 74, scale)
    assert np.allclose(got, want[4:74], rtol=1e-4, atol=1e-7)
    monkeypatch.setattr(ny.estimator, "HEAVY_BLOCK", 100)  # one query per block
    assert np.allclose(ny.heavy_mass(q, k, pos, 4, 74, scale), got, rtol=1e-5, atol=1e-9)


def test_heavy_sample_takes_recent_positions_and_optionally_evenly_spaced(monkeypatch):
    q, *_ = group_data(100)
    assert np.array_equal(ny.heavy_sample(q, 4, 6), np.arange(94, 100))
    monkeypatch.setattr(ny.estimator, "HEAVY_EVEN", 2)
    assert np.array_equal(ny.heavy_sample(q, 4, 6), [35, 67, 97, 98, 99])


def test_heavy_rows_cost_their_exact_bytes():
    q, k, v, scale = group_data(300, hd=16)
    sizes = {}
    for h in (0, 5, None):
        st = NystromState.new_group(8, 32, 4, 2, scale=scale, heavy=h)
        st.prefill_group(q, k, v)
        sizes[h] = st.memory_bytes()
    assert sizes[5] - sizes[0] == 5 * 2 * 16 * 4 and sizes[None] - sizes[0] == 8 * 2 * 16 * 4


@pytest.mark.parametrize("heavy", [0, 3, None])
def test_steps_with_heavy_rows_match_f64_oracle(heavy):
    t0, rows = 110, 150
    st, q, k, v, scale = sealed(t0, rows, heavy=heavy)
    for p in range(t0, rows):
        out = st.step_group(q[:, p], k[p], v[p])
        if p % 13 == 0 or p == rows - 1:
            ref = nystrom_oracle(q[:, :t0], k, v, t0, p, q[:, p], m=8, w=16, sink=4, scale=scale,
                                 rcond=st.rcond, heavy=heavy)
            assert rel(out, ref).max() < 1e-4, p


def test_deferred_boundary_is_w_plus_sink_plus_m_plus_one():
    assert o1_deferred_boundary(8, 2, 4) == 15


def test_deferred_boundary_refuses_negative():
    with pytest.raises(ConfigError, match="w must be an int >= 0"):
        o1_deferred_boundary(-1, 2, 4)


def test_rect_aggregate_is_the_default():
    st = NystromState.new_group(4, 8, 2, 1, scale=1.0)
    assert st.rect is O1Rect.Aggregate


# ── refusals change nothing

@pytest.mark.parametrize("kw, msg", [
    (dict(m=0), "m must be"), (dict(w=0), "w must be"), (dict(sink=-1), "sink must be"),
    (dict(hpk=0), "hpk must be"), (dict(scale=0.0), "scale must be"), (dict(rcond=0.0), "rcond"),
    (dict(heavy=-1), "heavy must be"), (dict(heavy=True), "heavy must be"),
    (dict(heavy=2.0), "heavy must be"),
])
def test_bad_config_refused(kw, msg):
    args = dict(m=4, w=8, sink=2, hpk=1, scale=1.0) | kw
    with pytest.raises(ConfigError, match=msg):
        NystromState(args.pop("m"), args.pop("w"), args.pop("sink"), args.pop("hpk"), **args)


def test_prefill_with_wrong_query_count_refused_and_state_untouched():
    q, k, v, scale = group_data(50)
    st = NystromState.new_group(4, 8, 2, 2, scale=scale)
    with pytest.raises(ShapeError, match="expected 2 query traces"):
        st.prefill_group([q[0]], k, v)
    assert not st.prefilled and st.memory_bytes() == 0


def test_prefill_with_nan_refused():
    q, k, v, scale = group_data(50)
    k = k.copy()
    k[10, 3] = np.nan
    st = NystromState.new_group(4, 8, 2, 2, scale=scale)
    with pytest.raises(ShapeError, match="finite"):
        st.prefill_group(q, k, v)
    assert not st.prefilled


def test_second_prefill_refused():
    st, q, k, v, _ = sealed(50, 50)
    with pytest.raises(StateError, match="already prefilled"):
        st.prefill_group(q, k, v)


def test_step_before_prefill_refused():
    st = NystromState.new_group(4, 8, 2, 2, scale=1.0)
    with pytest.raises(StateError, match="before prefill"):
        st.step_group(np.zeros((2, 16)), np.zeros(16), np.zeros(16))


def test_step_with_bad_k_refused_and_state_untouched():
    st, q, k, v, _ = sealed(60, 61)
    far_before = st.far.z.copy(), st.far.rows
    win_before = st.window_rows()
    with pytest.raises(ShapeError, match=r"k_new \[16\]"):
        st.step_group(q[:, 60], k[60, :8], v[60])
    assert st.seen == 60 and st.far.rows == far_before[1]
    assert np.array_equal(st.far.z, far_before[0])
    assert np.array_equal(st.window_rows()[0], win_before[0])


def test_step_with_nonfinite_v_refused():
    st, q, k, v, _ = sealed(60, 61)
    with pytest.raises(ShapeError, match="finite"):
        st.step_group(q[:, 60], k[60], np.full(16, np.inf, dtype=np.float32))
    assert st.seen == 60
