"""The O(1) seal lifecycle on a layer: validation, latch, memory (the Rust engine's tests of it:
kvreg_conformance/test_reference_semantics.py)."""

import numpy as np
import pytest

from kvreg import KvMode, LayerKvCache, Lifecycle, SealError, ShapeError, StateError
from kvreg.nystrom import O1Rect
from kvreg_conformance.data import realistic_qkv
from kvreg_conformance.oracle import attention_oracle


def layer(nkv=1, hd=4, mode=KvMode.F32):
    return LayerKvCache(nkv, hd, mode, "reference")


def test_walk_boundary_env_walks_a_batch_ending_on_it(monkeypatch):
    lay = layer()
    lay.o1_begin_with_boundary(4, 8, 2, O1Rect.Aggregate, 5, far="nystrom")
    monkeypatch.setenv("KVREG_O1_WALK_BOUNDARY", "1")
    assert lay.o1_boundary_crossed_by(5)
    monkeypatch.delenv("KVREG_O1_WALK_BOUNDARY")
    assert not lay.o1_boundary_crossed_by(5)


def _prompt(t=96, nh=4, nkv=2, hd=16, seed=0):
    d = realistic_qkv(t + 8, nh, nkv, hd, seed=seed)
    return d


def _collect(lay, d, t, nh):
    for p in range(t):
        lay.o1_push_q(d.q[p].ravel())
        lay.append(d.k[p], d.v[p])


def _sealed(nh=4, nkv=2, hd=16, t=64):
    d = _prompt(t, nh, nkv, hd)
    lay = layer(nkv, hd)
    lay.o1_begin(4, 16, 2, far="nystrom")
    _collect(lay, d, t, nh)
    assert lay.o1_seal(nh)
    return lay, d


def test_seal_then_step_tracks_exact_attention_on_a_short_far_field():
    nh, nkv, hd, t = 4, 2, 16, 96
    d = _prompt(t, nh, nkv, hd)
    lay = layer(nkv, hd)
    lay.o1_begin(16, 32, 4, far="nystrom")
    _collect(lay, d, t, nh)
    mem_before = lay.memory_bytes()
    assert lay.o1_seal(nh)
    assert lay.o1_sealed() and lay.take_o1_transition() and not lay.take_o1_transition()
    assert lay.memory_bytes() < mem_before
    out = lay.o1_step(d.q[t], d.k[t], d.v[t], nh)
    ref = attention_oracle(d.q[t:t + 1], d.k[:t + 1], d.v[:t + 1], 1 / np.sqrt(hd))[0]
    err = np.linalg.norm(out - ref) / np.linalg.norm(ref)
    assert err < 0.5, f"sealed step far from exact attention: {err}"
    assert lay.seq_len == t + 1


def test_seal_is_idempotent_and_a_plain_layer_is_not_a_participant():
    lay, _ = _sealed()
    groups = lay.seal.phase.groups
    assert lay.o1_seal(4) and lay.seal.phase.groups is groups
    assert not layer(2, 16).o1_seal(4)


def test_seal_defers_below_the_boundary_floor():
    lay = layer(1, 4)
    lay.o1_begin(4, 8, 2, far="nystrom")
    for _ in range(10):
        lay.o1_push_q(np.ones(4, np.float32))
        lay.append(np.ones(4, np.float32), np.ones(4, np.float32))
    assert not lay.o1_seal(1)
    assert lay.o1_pending_boundary() == 8 + 2 + 4 + 1
    assert lay.o1_collecting() and lay.take_o1_error() is None


@pytest.mark.parametrize("case,match", [
    ("gqa", "GQA geometry"),
    ("trace", "query trace"),
    ("dead", "densely populated"),
    ("m", "invalid geometry"),
])
def test_a_malformed_seal_latches_clears_and_refuses_appends(case, match):
    hd = 32
    lay = layer(2, hd)
    lay.o1_begin(2 if case == "m" else 4, 8, 2, far="nystrom")
    rows = 30
    for p in range(rows):
        if not (case == "trace" and p == 0):
            lay.o1_push_q(np.full(4 * hd, 0.01, np.float32))
        alive = [True, p > 0] if case == "dead" else None
        lay.append(np.full(2 * hd, 0.1 * (p % 3), np.float32), np.ones(2 * hd, np.float32), alive)
    with pytest.raises(SealError, match=match):
        lay.o1_seal_checked(3 if case == "gqa" else 4)
    assert lay.seq_len == rows, "the checked seal changes nothing"
    assert not lay.o1_seal(3 if case == "gqa" else 4)
    assert match in lay.take_o1_error()
    assert lay.seq_len == 0 and lay.head_len(0) == 0
    with pytest.raises(SealError):
        lay.append(np.ones(2 * hd, np.float32), np.ones(2 * hd, np.float32))
    assert lay.take_o1_error() is not None, "observing the error does not consume it"
    lay.clear()
    lay.append(np.ones(2 * hd, np.float32), np.ones(2 * hd, np.float32))
    assert lay.seq_len == 1


def test_sealed_layer_bypasses_trim_and_eviction_and_refuses_append():
    lay, d = _sealed()
    assert lay.trim_window(4, 0, 1) == 0
    lay.evict(3)
    lay.evict_born(3, 1, 1)
    assert lay.seq_len == 64
    with pytest.raises(StateError, match="o1_step"):
        lay.append(d.k[64], d.v[64])


def test_o1_memory_constant_in_context_after_the_seal():
    nh, nkv, hd = 4, 2, 16
    sizes = []
    for t in (128, 512):
        d = realistic_qkv(t, nh, nkv, hd, seed=1)
        lay = layer(nkv, hd)
        lay.o1_begin(8, 32, 4, far="nystrom")
        _collect(lay, d, t, nh)
        assert lay.o1_seal(nh)
        sizes.append(lay.o1_memory_bytes())
        assert lay.memory_bytes() == sizes[-1]
    assert sizes[0] == sizes[1]


def test_query_stride_traces_one_row_in_stride():
    nh, nkv, hd, t = 2, 1, 8, 41
    d = realistic_qkv(t, nh, nkv, hd, seed=2)
    lay = layer(nkv, hd)
    lay.o1_begin(4, 8, 2, far="nystrom")
    lay.o1_set_q_stride(4)
    for p in range(t):
        if p % 4 == 0:
            lay.o1_push_q(d.q[p].ravel())
        lay.append(d.k[p], d.v[p])
    assert lay.o1_seal_checked(nh)


def test_o1_step_on_an_unsealed_layer_is_refused():
    with pytest.raises(StateError):
        layer(1, 4).o1_step(np.ones(4), np.ones(4), np.ones(4), 1)


def test_a_refused_o1_step_leaves_every_group_where_it_was():
    lay, d = _sealed()
    seen = [g.seen for g in lay.seal.phase.groups]
    k = d.k[64].copy()
    k[1, 0] = np.nan                      # group 1's row: group 0 must not have stepped
    with pytest.raises(ShapeError, match="finite"):
        lay.o1_step(d.q[64], k, d.v[64], 4)
    assert [g.seen for g in lay.seal.phase.groups] == seen and lay.seq_len == 64


def test_o1_recollect_validates_before_it_releases_the_seal():
    lay, d = _sealed()
    with pytest.raises(ShapeError, match="stride"):
        lay.o1_recollect(d.k[:64], d.v[:64], d.q[:64], None, 64)
    assert lay.o1_sealed() and lay.head_len(0) == 0
    assert lay.o1_recollect(d.k[:64], d.v[:64], d.q[:64], 1, 64)
    assert lay.o1_collecting() and lay.head_len(1) == 64
    assert np.array_equal(lay.head_keys(1), d.k[:64, 1])
    assert lay.o1_seal(4)


def test_o1_push_q_takes_what_append_takes():
    lay = layer(1, 4)
    lay.o1_begin(4, 8, 2, far="nystrom")
    lay.o1_push_q([0.1, 0.2, 0.3, 0.4])
    assert lay.o1_q_trace().dtype == np.float32 and lay.o1_q_trace().size == 4


@pytest.mark.parametrize("hd", [6, 96, 112, 128])
def test_default_scale_is_one_value_everywhere(hd):
    c = LayerKvCache(1, hd, "f32", "reference")
    rng = np.random.default_rng(hd)
    for _ in range(5):
        c.append(rng.standard_normal(hd).astype(np.float32), rng.standard_normal(hd).astype(np.float32))
    q = rng.standard_normal(hd).astype(np.float32)
    out, _ = c.attend(q, 0)
    assert np.array_equal(out, c.attend_layer(q[None], importance=False)[0])
    assert c.default_scale == np.float32(1) / np.sqrt(np.float32(hd))


def test_heavy_rows_per_group_follow_o1_begin():
    nh, nkv, hd, t = 4, 2, 16, 64
    d = _prompt(t, nh, nkv, hd)
    sizes = {}
    for heavy in (None, 0, 2):
        lay = layer(nkv, hd)
        lay.o1_begin(4, 16, 2, heavy=heavy, far="nystrom")
        _collect(lay, d, t, nh)
        assert lay.o1_seal(nh)
        assert [g.n_heavy for g in lay.seal.phase.groups] == [4 if heavy is None else heavy] * nkv
        sizes[heavy] = lay.memory_bytes()
    assert sizes[None] - sizes[0] == 2 * (sizes[2] - sizes[0]) == nkv * 4 * 2 * hd * 4
    with pytest.raises(ShapeError, match="heavy"):
        layer(nkv, hd).o1_begin(4, 16, 2, heavy=-1, far="nystrom")


def test_the_lifecycle_is_one_explicit_state_through_every_transition():
    from kvreg import Lifecycle

    nh, nkv, hd, t = 4, 2, 16, 64
    d = _prompt(t, nh, nkv, hd)
    lay = layer(nkv, hd)
    assert lay.lifecycle is Lifecycle.PLAIN
    lay.o1_begin(4, 16, 2, far="nystrom")
    assert lay.lifecycle is Lifecycle.COLLECTING and lay.o1_collecting() and not lay.o1_sealed()
    _collect(lay, d, t, nh)
    assert lay.o1_seal(nh)
    assert lay.lifecycle is Lifecycle.SEALED and lay.o1_sealed() and not lay.o1_collecting()
    with pytest.raises(StateError, match="sealed"):
        lay.append(d.k[0], d.v[0])
    lay.clear()
    assert lay.lifecycle is Lifecycle.PLAIN
    lay.o1_begin(4, 16, 2, far="nystrom")
    lay.o1_abort("a test abort")
    assert lay.lifecycle is Lifecycle.FAILED and lay.take_o1_error() == "a test abort"
    with pytest.raises(SealError, match="a test abort"):
        lay.append(d.k[0], d.v[0])
    lay.clear()
    assert lay.lifecycle is Lifecycle.PLAIN
    lay.install_bounded(8)
    assert lay.lifecycle is Lifecycle.BOUNDED
    lay.clear()
    assert lay.lifecycle is Lifecycle.BOUNDED, "the ring is the layer's: clear keeps it"
    with pytest.raises(StateError, match="bounded"):
        lay.append(d.k[0], d.v[0])


# ── self-sealing: the seal inside the ordinary append + attend protocol ──

def _explicit(mode, d, t, nh, nkv, hd, steps):
    lay = layer(nkv, hd, mode)
    lay.o1_begin(8, 16, 2, far="nystrom")
    lay.extend(d.k[:t], d.v[:t])
    lay.o1_set_q_trace(d.q[:t])
    assert lay.o1_seal(nh)
    return [lay.o1_step(d.q[p], d.k[p], d.v[p], nh) for p in range(t, t + steps)], lay


def _auto(mode, d, t, nh, nkv, hd, steps):
    lay = layer(nkv, hd, mode)
    lay.o1_begin(8, 16, 2, auto=True, far="nystrom")
    lay.extend(d.k[:t], d.v[:t])
    lay.attend_chunk(d.q[:t], t, 0, nh // nkv)
    outs = []
    for p in range(t, t + steps):
        lay.append(d.k[p], d.v[p])
        outs.append(lay.attend_layer(d.q[p]))
    return outs, lay


def test_a_self_sealing_layer_answers_as_the_explicit_calls_bit_for_bit():
    from kvreg import Lifecycle

    nh, nkv, hd, t = 4, 2, 16, 80
    d = _prompt(t, nh, nkv, hd)
    want, a = _explicit(KvMode.F32, d, t, nh, nkv, hd, 6)
    got, b = _auto(KvMode.F32, d, t, nh, nkv, hd, 6)
    assert b.lifecycle is Lifecycle.SEALED and b.seq_len == a.seq_len == t + 6
    for x, y in zip(got, want):
        assert np.array_equal(x.view(np.uint32), y.view(np.uint32))
    assert b.memory_bytes() == a.memory_bytes()


def test_a_self_sealing_layer_refuses_what_a_sealed_layer_cannot_do():
    nh, nkv, hd, t = 4, 2, 16, 80
    d = _prompt(t, nh, nkv, hd)
    _, lay = _auto(KvMode.F32, d, t, nh, nkv, hd, 1)
    with pytest.raises(StateError, match=r"append\(k, v\)"):
        lay.attend_layer(d.q[t + 1])
    lay.append(d.k[t + 1], d.v[t + 1])
    with pytest.raises(StateError, match="window"):
        lay.attend_layer(d.q[t + 1], window=8)
    with pytest.raises(StateError, match="sealed"):
        lay.extend(d.k[:2], d.v[:2], layout="nhd")
    lay.attend_layer(d.q[t + 1])  # the staged row survived the refusals


def test_a_short_prompt_stays_exact_until_the_boundary():
    from kvreg import Lifecycle

    nh, nkv, hd = 4, 2, 16
    d = _prompt(40, nh, nkv, hd)
    lay = layer(nkv, hd)
    lay.o1_begin(8, 16, 2, auto=True, far="nystrom")  # boundary: w + sink + m + 1 = 27 rows
    lay.extend(d.k[:10], d.v[:10])
    lay.attend_chunk(d.q[:10], 10, 0, nh // nkv)
    for p in range(10, 30):
        lay.append(d.k[p], d.v[p])
        lay.attend_layer(d.q[p])
    assert lay.lifecycle is Lifecycle.SEALED and lay.seq_len == 30


def test_a_seal_that_cannot_be_made_leaves_a_self_sealing_layer_exact():
    from kvreg import Lifecycle

    nh, nkv, hd, t = 4, 2, 16, 40
    d = _prompt(t, nh, nkv, hd)
    lay = layer(nkv, hd)
    lay.o1_begin(2, 16, 2, auto=True, far="nystrom")  # m < 4: the seal refuses its geometry
    lay.extend(d.k[:t], d.v[:t])
    lay.attend_chunk(d.q[:t], t, 0, nh // nkv)
    with pytest.warns(UserWarning, match="stays exact"):
        lay.append(d.k[t], d.v[t])
    assert lay.lifecycle is Lifecycle.PLAIN and lay.seq_len == t + 1


# The far-field fit passes the rows' rounding on (a few times the mode's own
# relative error: f16 ~5e-4, bf16 ~4e-3 per element).
@pytest.mark.parametrize("mode,tol", [(KvMode.F16, 5e-3), (KvMode.BF16, 3e-2), (KvMode.Q8, 3e-2),
                                      (KvMode.Q4, 0.15)])
def test_the_seal_runs_on_every_kv_mode(mode, tol):
    nh, nkv, hd, t = 4, 2, 16, 80
    d = _prompt(t, nh, nkv, hd)
    want, a = _auto(KvMode.F32, d, t, nh, nkv, hd, 4)
    got, b = _auto(mode, d, t, nh, nkv, hd, 4)
    assert b.o1_sealed()
    for x, y in zip(got, want):
        assert np.abs(x - y).max() <= tol * np.abs(y).max(), mode


def test_o1_begin_arms_the_tiered_seal_by_default():
    # The recommended far field: it needs no query trace, and the seal holds
    # the same bytes whatever the context.
    lay = layer(2, 32)
    lay.o1_begin(8, 16, 2)
    assert lay.seal.far == "tiered"
    rng = np.random.default_rng(1)
    for _ in range(40):
        lay.append(rng.standard_normal(64).astype(np.float32), rng.standard_normal(64).astype(np.float32))
    assert lay.o1_seal(4) and lay.lifecycle is Lifecycle.SEALED
    held = lay.memory_bytes()
    for _ in range(50):
        lay.o1_step(rng.standard_normal((4, 32)).astype(np.float32), rng.standard_normal((2, 32)).astype(np.float32),
                    rng.standard_normal((2, 32)).astype(np.float32), 4)
    assert lay.memory_bytes() == held and lay.seq_len == 90
