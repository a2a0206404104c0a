"""The decode step in one call, bit for bit WITHIN the backend under test:
``LayerKvCache.append_attend(k, v, q)`` answers and stores exactly what
``append(k, v)`` then ``attend_layer(q)`` do (a backend's fused kernel,
``Backend.append_attend_layer``, included), and a refused call stores
nothing."""

import numpy as np
import pytest

from kvreg.errors import KvregError

from .data import ALL_MODES, filled, queries, rng_rows

# Each case runs at the backend's tunables and at its small ones (conftest.py).
pytestmark = pytest.mark.usefixtures("tunables")

MODE_IDS = [m.value for m in ALL_MODES]


def _state(lay):
    return (lay.seq_len, lay.imp.copy(),
            [(lay.head_keys(h).copy(), lay.head_values(h).copy()) for h in range(lay.num_kv_heads)])


def _same_state(check, a, b, what):
    assert a[0] == b[0], f"{what}: seq_len {a[0]} != {b[0]}"
    check.exact("importance", a[1], b[1], what)
    for h, ((ka, va), (kb, vb)) in enumerate(zip(a[2], b[2])):
        check.exact("keys", ka, kb, f"{what}: head {h}")
        check.exact("values", va, vb, f"{what}: head {h}")


def _twins(backend, mode, opt, nkv, hd, hpk):
    """Two layers holding the same 61 rows (the steps then cross the first
    capacity growth and the q8 field's freeze) and the decode arguments of
    ``opt``."""
    one, _, _ = filled(backend, nkv, hd, mode, 61, seed=3)
    two, _, _ = filled(backend, nkv, hd, mode, 61, seed=3)
    kw = {"scale": 0.2, "importance": False}
    if opt == "window":
        kw["window"] = 9
    if opt == "sinks_softcap_importance":
        kw.update(softcap=3.0, importance=True)
        one.sinks = two.sinks = rng_rows(77, 1, nkv * hpk, 2.0)[0]
    return one, two, kw


@pytest.mark.quick
@pytest.mark.parametrize("mode", ALL_MODES, ids=MODE_IDS)
@pytest.mark.parametrize("opt", ["plain", "window", "sinks_softcap_importance"])
def test_append_attend_equals_append_then_attend_layer(backend, check, mode, opt):
    nkv, hd, hpk = 2, 32, 3
    one, two, kw = _twins(backend, mode, opt, nkv, hd, hpk)
    rows = rng_rows(11, 80, 2 * nkv * hd)
    for step in range(80):
        k, v = rows[step, :nkv * hd], rows[step, nkv * hd:]
        q = queries(step, nkv * hpk, hd, 2.0)
        one.append(k, v)
        want = one.attend_layer(q, **kw)
        got = two.append_attend(k, v, q, **kw)
        check.exact("append_attend", got, want, f"{mode.value} {opt} step {step}")
    _same_state(check, _state(two), _state(one), f"{mode.value} {opt} after 80 steps")


@pytest.mark.parametrize("mode", [m for m in ALL_MODES if m.value in ("f32", "f16", "q8")], ids=lambda m: m.value)
def test_append_attend_on_a_fork_leaves_the_parent_as_it_was(backend, check, mode):
    nkv, hd = 2, 32
    parent, _, _ = filled(backend, nkv, hd, mode, 70, seed=4)
    twin, _, _ = filled(backend, nkv, hd, mode, 70, seed=4)
    before = _state(parent)
    child = parent.fork()
    row = rng_rows(12, 1, 2 * nkv * hd)[0]
    q = queries(5, 2 * nkv, hd)
    got = child.append_attend(row[:nkv * hd], row[nkv * hd:], q, scale=0.3)
    twin.append(row[:nkv * hd], row[nkv * hd:])
    check.exact("append_attend", got, twin.attend_layer(q, scale=0.3), f"{mode.value} fork")
    _same_state(check, _state(parent), before, f"{mode.value}: the parent after its fork's step")
    _same_state(check, _state(child), _state(twin), f"{mode.value}: the fork")


@pytest.mark.parametrize("mode", [m for m in ALL_MODES if m.value in ("f32", "q8")], ids=lambda m: m.value)
def test_append_attend_writes_its_answer_into_out(backend, check, mode):
    nkv, hd = 2, 32
    one, _, _ = filled(backend, nkv, hd, mode, 30, seed=8)
    two, _, _ = filled(backend, nkv, hd, mode, 30, seed=8)
    out = np.full((2 * nkv, hd), np.nan, np.float32)
    for step, row in enumerate(rng_rows(14, 3, 2 * nkv * hd)):
        q = queries(20 + step, 2 * nkv, hd)
        got = one.append_attend(row[:nkv * hd], row[nkv * hd:], q, scale=0.25, out=out)
        assert got is out
        check.exact("append_attend out=", out, two.append_attend(row[:nkv * hd], row[nkv * hd:], q, scale=0.25),
                    f"{mode.value} step {step}")


@pytest.mark.quick
@pytest.mark.parametrize("mode", [m for m in ALL_MODES if m.value in ("f32", "f16", "bf16", "q8")],
                         ids=lambda m: m.value)
def test_a_refused_append_attend_stores_nothing(backend, mode):
    nkv, hd = 2, 32
    lay, _, _ = filled(backend, nkv, hd, mode, 20, seed=6)
    before = _state(lay)
    k, v = rng_rows(13, 2, nkv * hd)
    q = queries(1, 2 * nkv, hd)
    bad = [
        dict(q_all=queries(1, 2 * nkv + 1, hd)),          # heads not a multiple of the KV heads
        dict(q_all=np.zeros((4, hd + 1), np.float32)),     # wrong head_dim
        dict(k=np.zeros(nkv * hd + 1, np.float32)),        # a row of the wrong size
        dict(scale=-1.0),
        dict(window=0),
        dict(softcap=-2.0),
        dict(importance="yes"),
        dict(sinks=np.zeros(3, np.float32)),               # one sink per query head expected
        dict(out=np.zeros((2 * nkv + 1, hd), np.float32)),  # an output buffer of the wrong shape
        dict(out=np.zeros((2 * nkv, hd), np.float64)),
    ]
    # a value the mode does not store: finite past a 2-byte float's range, inf in q8
    unstorable = {"f16": 7e4, "bf16": 3.4e38, "q8": np.inf}.get(mode.value)
    if unstorable is not None:
        big = k.copy()
        big[nkv * hd - 1] = unstorable
        bad.append(dict(k=big))
    for change in bad:
        args = dict(k=k, v=v, q_all=q)
        args.update({n: change.pop(n) for n in ("k", "q_all") if n in change})
        with pytest.raises(KvregError):
            lay.append_attend(args["k"], args["v"], args["q_all"], **change)
        after = _state(lay)
        assert after[0] == before[0], f"{mode.value}: a refused call ({change or 'shape'}) stored a row"
        np.testing.assert_array_equal(after[2][0][0], before[2][0][0])


def _changes(one, two, step: int, kids: list) -> None:
    """What a host may do to a layer between two decode steps, on both layers
    alike: each sends the prepared step back through ``append_attend``."""
    nkv, hd = one.num_kv_heads, one.head_dim
    if step == 20:                       # an append outside the step
        k, v = rng_rows(15, 2, nkv * hd)
        one.append(k, v)
        two.append(k, v)
    elif step == 40:                     # an eviction
        one.evict(50)
        two.evict(50)
    elif step == 60:                     # a fork decoding on beside its parent, on the rows they share
        kids += [one.fork(), two.fork()]
    elif step == 80 and one.sinks is not None:
        one.sinks = two.sinks = rng_rows(78, 1, one.sinks.shape[0], 2.0)[0]
    elif step == 100:
        one.clear()
        two.clear()


@pytest.mark.quick
@pytest.mark.parametrize("mode", ALL_MODES, ids=MODE_IDS)
@pytest.mark.parametrize("opt", ["plain", "window", "sinks_softcap_importance"])
def test_a_decode_step_answers_and_stores_what_append_attend_does(backend, check, mode, opt):
    nkv, hd, hpk = 2, 32, 3
    one, two, kw = _twins(backend, mode, opt, nkv, hd, hpk)
    step = one.decode_step(nkv * hpk, **kw)
    rows = rng_rows(11, 120, 2 * nkv * hd)
    kids: list = []
    for i in range(120):
        _changes(one, two, i, kids)
        k, v = rows[i, :nkv * hd], rows[i, nkv * hd:]
        q = queries(i, nkv * hpk, hd, 2.0)
        got = step(k, v, q)
        assert got is step.out
        check.exact("decode step", got, two.append_attend(k, v, q, **kw), f"{mode.value} {opt} step {i}")
        if kids:
            if len(kids) == 2:
                kids.append(kids[0].decode_step(nkv * hpk, **kw))
            k, v = rows[119 - i, :nkv * hd], rows[119 - i, nkv * hd:]
            check.exact("a fork's decode step", kids[2](k, v, q), kids[1].append_attend(k, v, q, **kw),
                        f"{mode.value} {opt} step {i}")
    _same_state(check, _state(one), _state(two), f"{mode.value} {opt} after 120 steps")
    _same_state(check, _state(kids[0]), _state(kids[1]), f"{mode.value} {opt}: the fork made at step 60")


@pytest.mark.quick
@pytest.mark.parametrize("mode", [m for m in ALL_MODES if m.value in ("f32", "f16", "bf16", "q8")],
                         ids=lambda m: m.value)
def test_a_refused_decode_step_stores_nothing(backend, mode):
    nkv, hd = 2, 32
    lay, _, _ = filled(backend, nkv, hd, mode, 20, seed=6)
    step = lay.decode_step(2 * nkv, scale=0.3)
    k, v = rng_rows(13, 2, nkv * hd)
    for i in range(3):                   # past the first call: the prepared state, where a backend has one
        step(k, v, queries(i, 2 * nkv, hd))
    before = _state(lay)
    bad = [dict(q=queries(1, 2 * nkv + 2, hd)),            # not the heads the step was made for
           dict(q=np.zeros((2 * nkv, hd + 1), np.float32)),
           dict(k=np.zeros(nkv * hd + 1, np.float32))]
    unstorable = {"f16": 7e4, "bf16": 3.4e38, "q8": np.inf}.get(mode.value)
    if unstorable is not None:
        big = k.copy()
        big[-1] = unstorable
        bad.append(dict(k=big))
    for change in bad:
        args = {"k": k, "v": v, "q": queries(1, 2 * nkv, hd), **change}
        with pytest.raises(KvregError):
            step(args["k"], args["v"], args["q"])
        after = _state(lay)
        assert after[0] == before[0], f"{mode.value}: a refused step ({sorted(change)}) stored a row"
        np.testing.assert_array_equal(after[2][0][0], before[2][0][0])
    for made in (dict(num_heads=0), dict(num_heads=2 * nkv, scale=-1.0), dict(num_heads=2 * nkv, window=0),
                 dict(num_heads=2 * nkv, out=np.zeros((2 * nkv, hd), np.float64))):
        with pytest.raises(KvregError):
            lay.decode_step(**made)
