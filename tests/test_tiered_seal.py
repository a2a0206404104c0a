"""The tiered far field of the O(1) seal (``far="tiered"``, kvreg.tiered_seal):
attention over exact and 4-bit rows under one softmax, rows chosen by mass
all along decode, constant memory, the seed's lifecycle and refusals."""

import numpy as np
import pytest

import kvreg
from kvreg.errors import ConfigError, ShapeError, StateError
from kvreg.quant import fwht
from kvreg.tiered_seal import Tier, TieredSeal, equal_rows, far_rows, seal_bytes

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


def _decoded(tier):
    """A tier's rows as float32, un-rotated (an independent reading of its format)."""
    k, v = tier.read()
    return (fwht(k), fwht(v)) if tier.rotated else (k, v)


def _expected(state, k, v, q):
    """Softmax attention over the rows the state holds plus the new one (as
    the exact tier stores it), each tier as its reconstruction (float64)."""
    new = Tier(state.exact.fmt, NKV, 1, HD)
    new.put(slice(0, 1), k[:, None], v[:, None])
    new.n = 1
    parts = [_decoded(state.exact), _decoded(new), _decoded(state.far)]
    ks = np.concatenate([p[0] for p in parts], axis=1)
    vs = np.concatenate([p[1] for p in parts], axis=1)
    out = np.empty((NH, HD))
    for g in range(NKV):
        for j in range(HPK):
            s = ks[g].astype(np.float64) @ q[g * HPK + j] / np.sqrt(HD)
            p = np.exp(s - s.max())
            out[g * HPK + j] = (p / p.sum()) @ vs[g]
    return out


@pytest.mark.parametrize("mode, fmt", [("f32", "f32"), ("f16", "f16"), ("bf16", "bf16"), ("q8", "int8"),
                                       ("q4", "int8")])
def test_a_step_is_softmax_over_both_tiers_as_they_store_their_rows(mode, fmt):
    layer, rng, _ = _layer(8, 8, 2, 60, mode=mode)
    for _ in range(80):
        k, v, q = _token(rng)
        layer.append(k, v)
        state = layer.seal.phase.tiered
        want = _expected(state, k, v, q)
        got = layer.attend_layer(q)
        np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert state.exact.fmt == fmt and state.far.fmt == "int4"
    assert state.far.n == state.far_budget and state.dropped > 0


def test_far_rows_are_four_bit_copies_of_the_rows_that_left():
    layer, rng, rows = _layer(8, 8, 2, 60)
    for t in range(60, 120):
        k, v, q = _token(rng)
        rows[t] = (k, v)
        layer.append(k, v)
        layer.attend_layer(q)
    state = layer.seal.phase.tiered
    far = _decoded(state.far)
    for side in (0, 1):
        for g in range(NKV):
            for i, p in enumerate(state.far.pos[g, :state.far.n]):
                want = rows[int(p)][side][g]
                assert np.linalg.norm(far[side][g, i] - want) < 0.2 * np.linalg.norm(want)
    for g in range(NKV):    # an f32 layer's exact tier holds its rows bit for bit
        for i, p in enumerate(state.exact.pos[g, :state.exact.n]):
            assert state.exact.k[g, i].tobytes() == rows[int(p)][0][g].tobytes()
            assert state.exact.v[g, i].tobytes() == rows[int(p)][1][g].tobytes()


def test_rows_are_chosen_by_mass_as_they_leave_the_window():
    layer, rng, _ = _layer(4, 6, 2, 40, heavy=5)
    for _ in range(50):
        layer.append(*_token(rng)[:2])
        state = layer.seal.phase.tiered
        e, f = state.exact, state.far
        before = (e.pos[:, :e.n].copy(), e.mass[:, :e.n].copy())
        layer.attend_layer(_token(rng)[2])
        seen, pos = state.seen, e.pos[:, :e.n]
        assert e.n == state.budget == 2 + 6 + 5 and f.n == state.far_budget
        for g in range(NKV):
            held = set(pos[g].tolist())
            assert set(range(2)) <= held and set(range(seen - 6, seen)) <= held
            # what left the exact tier had no more mass (before this step) than any heavy row kept
            left = set(before[0][g].tolist()) - held
            heavy = [i for i in range(e.n) if 2 <= pos[g, i] < seen - 6]
            for p in left:
                m_left = before[1][g][before[0][g] == p][0]
                assert all(m_left <= e.mass[g, i] for i in heavy)
            assert len(left) == 1   # one row leaves per step, into the far tier (which may drop it as its lightest)
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
    e, f = state.exact, state.far
    assert e.pos[0, :e.n].tolist() == [t - 1]
    assert 3 not in f.pos[0, :f.n] and f.n == state.far_budget and state.dropped == 1
    lightest = int(f.pos[0, np.argmin(f.mass[0, :f.n])])
    zero = np.zeros((1, 4), np.float32)
    state.step(zero, zero, zero)
    assert lightest not in f.pos[0, :f.n] and t - 1 in f.pos[0, :f.n] and state.dropped == 2


@pytest.mark.parametrize("mode, fmt", [("f32", "f32"), ("f16", "f16"), ("bf16", "bf16"), ("q8", "int8"),
                                       ("q8k_2f", "int8"), ("q4", "int8")])
def test_memory_is_constant_in_context(mode, fmt):
    layer, rng, _ = _layer(8, 16, 4, 64, mode=mode)
    sizes = []
    for i in range(300):
        k, v, q = _token(rng)
        layer.append(k, v)
        layer.attend_layer(q)
        if i in (10, 299):
            sizes.append(layer.memory_bytes())
    state = layer.seal.phase.tiered
    assert layer.o1_sealed() and layer.seq_len == 364
    # per row of a group: K and V, then 12 bytes of position and mass; the
    # integer formats add a float16 scale per 32 channels (int4 V: per 64)
    exact = {"f32": 2 * HD * 4, "f16": 2 * HD * 2, "bf16": 2 * HD * 2, "int8": 2 * HD + 4}[fmt] + 12
    far = HD + 4 + 12
    assert state.exact.fmt == fmt
    assert sizes[0] == sizes[1] == NKV * ((state.budget + 1) * exact + (state.far_budget + 1) * far)
    assert state.far_budget == (8 * (2 * HD * 4 + 12)) // far == far_rows(8, HD)
    assert seal_bytes(8, 16, 4, HD, NKV, fmt=fmt) == sizes[0]
    rows = equal_rows(8, 16, 4, HD, NKV, fmt=fmt)
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
    with pytest.raises(ConfigError, match="far must be one of 'tiered', 'nystrom'"):
        layer.o1_begin(8, 8, 2, auto=True, far="landmarks")
    assert layer.lifecycle is kvreg.Lifecycle.PLAIN
    layer, rng, _ = _layer(8, 8, 2, 40)
    k, v, q = _token(rng)
    layer.append(k, v)
    layer.attend_layer(q)
    state = layer.seal.phase.tiered
    arrays = state.exact.arrays() + state.far.arrays()
    before = [a.copy() for a in arrays]
    bad = k.copy()
    bad[0, 0] = np.nan
    with pytest.raises(ShapeError, match="finite"):
        layer.append(bad, v)
    with pytest.raises(ShapeError, match="query heads"):
        layer.o1_step(np.zeros((NKV, HD), np.float32), k, v, NKV)
    with pytest.raises(StateError, match="append"):
        layer.attend_layer(q)
    assert all(a.tobytes() == b.tobytes() for a, b in zip(before, arrays))
    with pytest.raises(ConfigError, match="hpk"):
        TieredSeal(8, 8, 2, 8, num_kv_heads=1, hpk=0, head_dim=4, scale=1.0)
    with pytest.raises(ConfigError, match="exact tier's format"):
        TieredSeal(8, 8, 2, 8, num_kv_heads=1, hpk=1, head_dim=4, scale=1.0, fmt="int4")


# ── far formats, per-group mass, the observation window ──

@pytest.mark.parametrize("fmt, bits", [("int2", 2), ("int4", 4), ("int8", 8)])
def test_far_formats_reconstruct_within_their_step(fmt, bits):
    rng = np.random.default_rng(3)
    tier = Tier(fmt, NKV, 8, HD)
    k, v = rng.standard_normal((2, NKV, 8, HD)).astype(np.float32)
    tier.put(slice(0, 8), k, v)
    tier.n = 8
    got_k, got_v = _decoded(tier)
    for want, got in ((k, got_k), (v, got_v)):
        # each value within a step of its group's range (rotation spreads it over 16 channels)
        span = np.abs(fwht(want.reshape(-1, HD)) if tier.rotated else want).max()
        assert np.abs(got - want).max() <= 2 * span / (2 ** bits - 1) + 1e-3
    assert Tier.row_bytes(fmt, HD) < Tier.row_bytes("f32", HD)


def test_int2_rows_cost_less_than_int4_and_fill_more_rows():
    assert Tier.row_bytes("int2", 64) < Tier.row_bytes("int4", 64)
    assert far_rows(64, 64, "int2") > far_rows(64, 64) > far_rows(64, 64, "int8")
    int2_row = Tier.row_bytes("int2", HD) * NKV
    assert seal_bytes(8, 16, 4, HD, NKV, far_format="int2") <= seal_bytes(8, 16, 4, HD, NKV) + int2_row


def test_a_per_group_mass_chooses_rows_per_group():
    rng = np.random.default_rng(0)
    t = 40
    k, v = rng.standard_normal((2, NKV, t, HD)).astype(np.float32)
    mass = np.zeros((NKV, t), np.float32)
    mass[0, 10], mass[1, 20] = 5.0, 5.0
    state = TieredSeal(0, 4, 2, 1, num_kv_heads=NKV, hpk=HPK, head_dim=HD, scale=0.25)
    state.seal(k, v, mass)
    held = [sorted(state.exact.pos[g, :state.exact.n].tolist()) for g in range(NKV)]
    assert held[0] == [0, 1, 10, 36, 37, 38, 39] and held[1] == [0, 1, 20, 36, 37, 38, 39]
    assert state.far.n == 0 and state.far_budget == 0


def test_a_mass_of_the_wrong_shape_is_refused():
    state = TieredSeal(8, 4, 2, 1, num_kv_heads=NKV, hpk=HPK, head_dim=HD, scale=0.25)
    k = np.zeros((NKV, 20, HD), np.float32)
    with pytest.raises(ShapeError, match="mass"):
        state.seal(k, k, np.zeros((NKV + 1, 20), np.float32))


def test_observed_mass_is_the_windows_causal_attention_per_group():
    from kvreg.eviction import observed_mass

    rng = np.random.default_rng(1)
    t, n = 12, 3
    q = rng.standard_normal((n, NH, HD)).astype(np.float32)
    k = rng.standard_normal((NKV, t, HD)).astype(np.float32)
    want = np.zeros((NKV, t))
    for i in range(n):
        upto = t - n + i + 1
        for h in range(NH):
            s = k[h // HPK, :upto].astype(np.float64) @ q[i, h] * 0.5
            p = np.exp(s - s.max())
            want[h // HPK, :upto] += p / p.sum()
    np.testing.assert_allclose(observed_mass(q, k, 0.5), want, rtol=1e-5)
    pooled = observed_mass(q, k, 0.5, pool=3)
    np.testing.assert_allclose(pooled[:, 5], np.maximum(want[:, 5], want[:, 4:7].mean(axis=1)), rtol=1e-5)


def test_observe_keeps_the_rows_the_last_queries_read():
    """A key the prompt's last query points at survives the seal in every
    group whose heads read it, though the mass of the whole prompt lies elsewhere."""
    t, hot = 64, 30
    layer = kvreg.LayerKvCache(NKV, HD, mode="f32")
    layer.o1_begin(0, 4, 2, heavy=2, auto=True, observe=1)
    k = np.zeros((NKV, t, HD), np.float32)
    k[:, hot, 0] = 10.0
    q = np.zeros((t, NH, HD), np.float32)
    q[-1, :, 0] = 10.0
    layer.extend(k, k, layout="hnd")
    layer.attend_chunk(q, b=t, s0=0, heads_per_kv=HPK)
    assert layer.seal.seal_if_ready() and layer.o1_sealed()
    state = layer.seal.phase.tiered
    assert all(hot in state.exact.pos[g, :state.exact.n] for g in range(NKV))
    assert layer.memory_bytes() == state.memory_bytes()


@pytest.mark.parametrize("kw, error, match", [({"far_format": "int3"}, ConfigError, "far_format"),
                                              ({"observe": -1}, ShapeError, "observe"),
                                              ({"far": "nystrom", "observe": 4}, ConfigError, "tiered")])
def test_bad_seal_options_are_refused_before_anything_changes(kw, error, match):
    layer = kvreg.LayerKvCache(NKV, HD, mode="f32")
    layer.append(np.ones((NKV, HD), np.float32), np.ones((NKV, HD), np.float32))
    with pytest.raises(error, match=match):
        layer.o1_begin(8, 4, 2, auto=True, **kw)
    assert not layer.o1_collecting() and layer.seq_len == 1
