"""The tiered far field of the O(1) seal (``far="tiered"``, kvreg.tiered_seal):
attention over exact and 4-bit rows under one softmax, rows chosen by mass
all along decode, constant memory, the seed's lifecycle and refusals."""

import numpy as np
import pytest

import kvreg
from kvreg.errors import ConfigError, ShapeError, StateError
from kvreg.modes import Q4_K_GROUP, Q4_V_GROUP
from kvreg.quant import dequantize_half_scaled, fwht, unpack_int4
from kvreg.tiered_seal import TieredSeal, equal_rows, far_rows, seal_bytes

NKV, HD, NH = 2, 16, 6
HPK = NH // NKV


def _layer(m, w, sink, t, seed=0, mode="f32", **kw):
    """A self-sealing tiered layer fed a ``t``-row prompt; returns it, the rng and
    every row it was given, by position (``[nkv, hd]`` K and V)."""
    rng = np.random.default_rng(seed)
    layer = kvreg.LayerKvCache(NKV, HD, mode=mode)
    layer.o1_begin(m, w, sink, auto=True, far="tiered", **kw)
    k = rng.standard_normal((NKV, t, HD)).astype(np.float32)
    v = rng.standard_normal((NKV, t, HD)).astype(np.float32)
    layer.extend(k, v, layout="hnd")
    layer.attend_chunk(rng.standard_normal((t, NH, HD)).astype(np.float32), b=t, s0=0, heads_per_kv=HPK)
    return layer, rng, {p: (k[:, p], v[:, p]) for p in range(t)}


def _token(rng):
    k, v = rng.standard_normal((2, NKV, HD)).astype(np.float32)
    return k, v, rng.standard_normal((NH, HD)).astype(np.float32)


def _far(state, codes, scales, group):
    n = state.far
    c = unpack_int4(codes[:, :n].reshape(NKV * n, -1), HD)
    return fwht(dequantize_half_scaled(c, scales[:, :n].reshape(NKV * n, -1), group)).reshape(NKV, n, HD)


def _expected(state, k, v, q):
    """Softmax attention over the rows the state holds plus the new one, the
    far tier as its 4-bit reconstruction (float64)."""
    n = state.rows
    ks = [np.concatenate([state.k[:, :n], k[:, None], _far(state, state.kq, state.ks, Q4_K_GROUP)], axis=1)]
    vs = [np.concatenate([state.v[:, :n], v[:, None], _far(state, state.vq, state.vs, Q4_V_GROUP)], axis=1)]
    out = np.empty((NH, HD))
    for g in range(NKV):
        for j in range(HPK):
            s = ks[0][g].astype(np.float64) @ q[g * HPK + j] / np.sqrt(HD)
            p = np.exp(s - s.max())
            out[g * HPK + j] = (p / p.sum()) @ vs[0][g]
    return out


def test_a_step_is_softmax_over_exact_rows_and_the_far_tiers_reconstruction():
    layer, rng, _ = _layer(8, 8, 2, 60)
    for i in range(80):
        k, v, q = _token(rng)
        layer.append(k, v)
        state = layer._o1.phase.tiered
        want = _expected(state, k, v, q)
        got = layer.attend_layer(q)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert state.far == state.far_budget and state.dropped > 0


def test_far_rows_are_four_bit_copies_of_the_rows_that_left():
    layer, rng, rows = _layer(8, 8, 2, 60)
    for t in range(60, 120):
        k, v, q = _token(rng)
        rows[t] = (k, v)
        layer.append(k, v)
        layer.attend_layer(q)
    state = layer._o1.phase.tiered
    for side, (codes, scales, group) in enumerate(((state.kq, state.ks, Q4_K_GROUP),
                                                   (state.vq, state.vs, Q4_V_GROUP))):
        got = _far(state, codes, scales, group)
        for g in range(NKV):
            for i, p in enumerate(state.fpos[g, :state.far]):
                want = rows[int(p)][side][g]
                assert np.linalg.norm(got[g, i] - want) < 0.2 * np.linalg.norm(want)
    for g in range(NKV):    # the exact tier holds its rows bit for bit
        for i, p in enumerate(state.pos[g, :state.rows]):
            assert state.k[g, i].tobytes() == rows[int(p)][0][g].tobytes()


def test_rows_are_chosen_by_mass_as_they_leave_the_window():
    layer, rng, _ = _layer(4, 6, 2, 40, heavy=5)
    for _ in range(50):
        layer.append(*_token(rng)[:2])
        state = layer._o1.phase.tiered
        before = (state.pos[:, :state.rows].copy(), state.mass[:, :state.rows].copy(),
                  state.fpos[:, :state.far].copy(), state.fmass[:, :state.far].copy())
        layer.attend_layer(_token(rng)[2])
        seen, pos = state.seen, state.pos[:, :state.rows]
        assert state.rows == state.budget == 2 + 6 + 5 and state.far == state.far_budget
        for g in range(NKV):
            held = set(pos[g].tolist())
            assert set(range(2)) <= held and set(range(seen - 6, seen)) <= held
            # what left the exact tier had no more mass (before this step) than any heavy row kept
            left = set(before[0][g].tolist()) - held
            heavy = [i for i in range(state.rows) if 2 <= pos[g, i] < seen - 6]
            for p in left:
                m_left = before[1][g][before[0][g] == p][0]
                assert all(m_left <= state.mass[g, i] for i in heavy)
            assert len(left) == 1   # one row leaves per step; it went to the far tier or was its lightest
            assert left <= set(state.fpos[g, :state.far].tolist()) or state.far == state.far_budget
    assert state.dropped == 40 + 50 - state.budget - state.far_budget


def test_the_far_tier_drops_its_lightest_row():
    state = TieredSeal(4, 1, 0, 0, num_kv_heads=1, hpk=1, head_dim=4, scale=1.0)
    assert state.far_budget == far_rows(4, 4)
    t = state.far_budget + 2
    k = np.tile(np.eye(4, dtype=np.float32), (t // 4 + 1, 1))[:t][None]
    mass = np.arange(t, dtype=np.float32)
    mass[3] = -1.0
    state.seal(k, k, mass)
    # the window keeps the newest row, the far tier the next F by mass: row 3 is dropped
    assert state.pos[0, :state.rows].tolist() == [t - 1]
    assert 3 not in state.fpos[0, :state.far] and state.far == state.far_budget and state.dropped == 1
    lightest = int(state.fpos[0, np.argmin(state.fmass[0, :state.far])])
    zero = np.zeros((1, 4), np.float32)
    state.step(zero, zero, zero)
    assert lightest not in state.fpos[0, :state.far] and t - 1 in state.fpos[0, :state.far]


@pytest.mark.parametrize("mode", ["f32", "f16", "q8", "q4"])
def test_memory_is_constant_in_context(mode):
    layer, rng, _ = _layer(8, 16, 4, 64, mode=mode)
    sizes = []
    for i in range(300):
        k, v, q = _token(rng)
        layer.append(k, v)
        layer.attend_layer(q)
        if i in (10, 299):
            sizes.append(layer.memory_bytes())
    state = layer._o1.phase.tiered
    assert layer.o1_sealed() and layer.seq_len == 364
    exact, far = 2 * HD * 4 + 12, HD + 2 * (-(-HD // Q4_K_GROUP) - (-HD // Q4_V_GROUP)) + 12
    assert sizes[0] == sizes[1] == NKV * ((state.budget + 1) * exact + (state.far_budget + 1) * far)
    assert state.far_budget == (8 * exact) // far
    assert seal_bytes(8, 16, 4, HD, NKV) == sizes[0]
    rows = equal_rows(8, 16, 4, HD, NKV)
    assert (rows - 1) * 2 * HD * NKV * 4 < sizes[0] <= rows * 2 * HD * NKV * 4


def test_same_inputs_same_bits():
    outs = []
    for _ in range(2):
        layer, rng, _ = _layer(8, 8, 2, 40)
        res = []
        for _ in range(30):
            k, v, q = _token(rng)
            layer.append(k, v)
            res.append(layer.attend_layer(q))
        outs.append(np.stack(res))
    assert outs[0].tobytes() == outs[1].tobytes()


def test_refusals_change_nothing():
    layer = kvreg.LayerKvCache(NKV, HD)
    with pytest.raises(ConfigError, match="far must be one of 'nystrom', 'tiered'"):
        layer.o1_begin(8, 8, 2, auto=True, far="landmarks")
    assert layer.lifecycle is kvreg.Lifecycle.PLAIN
    layer, rng, _ = _layer(8, 8, 2, 40)
    k, v, q = _token(rng)
    layer.append(k, v)
    layer.attend_layer(q)
    state = layer._o1.phase.tiered
    before = [a.copy() for a in state._arrays()]
    bad = k.copy()
    bad[0, 0] = np.nan
    with pytest.raises(ShapeError, match="finite"):
        layer.append(bad, v)
    with pytest.raises(ShapeError, match="query heads"):
        layer.o1_step(np.zeros((NKV, HD), np.float32), k, v, NKV)
    with pytest.raises(StateError, match="append"):
        layer.attend_layer(q)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(before, state._arrays()))
    with pytest.raises(ConfigError, match="hpk"):
        TieredSeal(8, 8, 2, 8, num_kv_heads=1, hpk=0, head_dim=4, scale=1.0)
