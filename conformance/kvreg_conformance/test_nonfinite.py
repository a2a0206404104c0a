"""Non-finite values: one policy on every backend (docs/kernels.md, "NaN and inf").

IEEE propagation through the contract's formulas. A head whose visible
scores hold a NaN or a +inf (or are all -inf with no sink) is *poisoned*: its
output is NaN in every channel and its probability NaN at every visible row
(so importance is NaN there). A -inf score under a finite max is probability
0. A NaN in a visible V row is NaN in that channel of the output; an inf is
inf there. Only visible rows count: a NaN before the window, after a prefill
row's causal end, or in another KV group changes nothing.

The f64 oracle takes no NaN, so each case compares with the reference: the
NaN, +inf and -inf positions exactly, the finite entries within
``nonfinite_vs_reference`` (conformance/tolerances.py). Each case also states
the policy's pattern outright, so the reference is held to it too.
"""

import numpy as np
import pytest

from kvreg import KvMode, LayerKvCache

from .data import filled, queries, rng_rows

F32 = KvMode.F32
#: q8 layers store finite rows only (a non-finite row is refused); their
#: non-finite cases come from the query and the scale.
Q_MODES = (KvMode.F32, KvMode.Q8)


def like_reference(check, kernel, got, want, what=""):
    """Same NaN / +inf / -inf positions as the reference's answer, finite
    entries within tolerance of it."""
    __tracebackhide__ = True
    g, w = np.asarray(got), np.asarray(want)
    if g.shape != w.shape:
        raise AssertionError(f"{check._head(kernel, what)}: shape {g.shape}, expected {w.shape}")
    for name, test in (("NaN", np.isnan), ("+inf", np.isposinf), ("-inf", np.isneginf)):
        gm, wm = test(g), test(w)
        if (gm != wm).any():
            idx = tuple(int(i) for i in np.argwhere(gm != wm)[0])
            raise AssertionError(
                f"{check._head(kernel, what)}: {name} where the reference disagrees, at index {idx}: "
                f"got {float(g[idx])!r}, expected {float(w[idx])!r}; "
                f"{int((gm != wm).sum())} of {g.size} elements differ (policy: docs/kernels.md)")
    fin = np.isfinite(w)
    check.close("nonfinite_vs_reference", np.where(fin, g, 0.0), np.where(fin, w, 0.0), f"{kernel}: {what}")


def policy(check, kernel, got, nan_mask, what=""):
    """``got`` is NaN exactly where ``nan_mask`` says (the policy, stated)."""
    __tracebackhide__ = True
    g = np.isnan(np.asarray(got))
    if (g != nan_mask).any():
        idx = tuple(int(i) for i in np.argwhere(g != nan_mask)[0])
        want = "NaN" if nan_mask[idx] else "not NaN"
        raise AssertionError(f"{check._head(kernel, what)}: index {idx} must be {want} "
                             f"(docs/kernels.md, NaN and inf), got {float(np.asarray(got)[idx])!r}")


def layer_from(backend, k, v, nkv, hd, mode=F32, alive=None):
    lay = LayerKvCache(nkv, hd, mode, backend, q8_exact_rows=2)
    for p in range(k.shape[0]):
        lay.append(k[p], v[p], None if alive is None else alive[p])
    return lay


def rows(seed, n, nkv, hd):
    return rng_rows(seed, n, nkv * hd), rng_rows(seed + 1, n, nkv * hd)


def both(backend, ref, k, v, nkv, hd, mode=F32, alive=None):
    return layer_from(backend, k, v, nkv, hd, mode, alive), layer_from(ref, k, v, nkv, hd, mode, alive)


def heads_of(g, hpk, nh):
    m = np.zeros(nh, bool)
    m[g * hpk:(g + 1) * hpk] = True
    return m


@pytest.mark.quick
@pytest.mark.parametrize("window", [None, 12], ids=["full", "w12"])
def test_nan_in_a_key_row_poisons_its_group_only(backend, ref, check, window):
    nkv, hd, hpk, n = 2, 16, 2, 40
    k, v = rows(300, n, nkv, hd)
    k[33, 3] = np.nan  # group 0, row 33: inside the window too
    c, r = both(backend, ref, k, v, nkv, hd)
    q = queries(300, nkv * hpk, hd, 2.0)
    out = c.attend_layer(q, window=window)
    want = r.attend_layer(q, window=window)
    poisoned = heads_of(0, hpk, nkv * hpk)
    policy(check, "attend_layer", out, np.broadcast_to(poisoned[:, None], out.shape), "NaN key row in group 0")
    like_reference(check, "attend_layer", out, want, "NaN key row in group 0")
    first = 0 if window is None else n - window
    policy(check, "importance", c.imp, np.arange(n) >= first, "visible rows of the poisoned group")
    like_reference(check, "importance", c.imp, r.imp, "NaN key row in group 0")


@pytest.mark.quick
def test_a_nan_key_row_outside_the_window_or_before_first_changes_nothing(backend, ref, check):
    nkv, hd, hpk, n = 2, 16, 2, 40
    k, v = rows(310, n, nkv, hd)
    k[5, :hd] = np.nan  # group 0, row 5
    c, r = both(backend, ref, k, v, nkv, hd)
    q = queries(310, nkv * hpk, hd, 2.0)
    out = c.attend_layer(q, window=30)
    policy(check, "attend_layer", out, np.zeros(out.shape, bool), "NaN row before the window")
    like_reference(check, "attend_layer", out, r.attend_layer(q, window=30), "NaN row before the window")
    og = c.attend_group(q[:hpk], 0, scale=0.25, first=6)
    policy(check, "attend_group", og, np.zeros(og.shape, bool), "NaN row before first")
    like_reference(check, "attend_group", og, r.attend_group(q[:hpk], 0, scale=0.25, first=6), "first=6")


@pytest.mark.quick
def test_plus_inf_score_poisons_its_head_and_minus_inf_score_is_probability_zero(backend, ref, check):
    nkv, hd, hpk, n = 1, 16, 2, 30
    k, v = rows(320, n, nkv, hd)
    k[11, 0] = np.inf
    c, r = both(backend, ref, k, v, nkv, hd)
    q = queries(320, hpk, hd)
    q[0, 0], q[1, 0] = 1.5, -1.5  # head 0 scores row 11 at +inf, head 1 at -inf
    for h in range(hpk):
        imp = np.zeros(n, np.float32)
        imp_r = np.zeros(n, np.float32)
        out = c.attend_group(q[h:h + 1], 0, scale=0.25, imp_acc=imp)
        want = r.attend_group(q[h:h + 1], 0, scale=0.25, imp_acc=imp_r)
        policy(check, "attend_group", out, np.full(out.shape, h == 0), f"head {h}")
        like_reference(check, "attend_group", out, want, f"+inf key channel, head {h}")
        policy(check, "importance", imp, np.full(n, h == 0), f"head {h}")
        like_reference(check, "importance", imp, imp_r, f"+inf key channel, head {h}")
        if h == 1:
            check.exact("importance", imp[11], np.float32(0), "a -inf score has probability exactly 0")


@pytest.mark.quick
@pytest.mark.parametrize("sinks", [False, True], ids=["nosink", "sink"])
def test_all_minus_inf_scores_are_nan_without_a_sink_and_zero_with_one(backend, ref, check, sinks):
    nkv, hd, hpk, n = 1, 8, 2, 20
    k, v = rows(330, n, nkv, hd)
    k[n - 1, 0] = -np.inf
    v[n - 1, 1] = np.nan  # probability 0, but 0 * NaN is NaN
    c, r = both(backend, ref, k, v, nkv, hd)
    q = np.abs(queries(330, hpk, hd)) + np.float32(0.5)  # positive: row n-1 scores -inf
    s = np.array([0.5, -1.0], np.float32) if sinks else None
    out = c.attend_group(q, 0, scale=0.3, first=n - 1, sinks=s)
    want = r.attend_group(q, 0, scale=0.3, first=n - 1, sinks=s)
    if sinks:
        nan = np.zeros(out.shape, bool)
        nan[:, 1] = True
        policy(check, "attend_group", out, nan, "a NaN value row of probability 0 still reaches its channel")
        check.exact("attend_group", np.where(nan, 0, out), np.zeros_like(out),
                    "the sink takes all the mass; the -inf row none")
    else:
        policy(check, "attend_group", out, np.ones(out.shape, bool), "every visible score -inf, no sink")
    like_reference(check, "attend_group", out, want, f"all -inf scores, sinks={sinks}")


@pytest.mark.quick
@pytest.mark.parametrize("mode", Q_MODES, ids=[m.value for m in Q_MODES])
def test_nan_query_head_poisons_that_head_only(backend, ref, check, mode):
    nkv, hd, hpk, n = 2, 32, 2, 70  # past the q8 freeze (64 rows)
    c, k, v = filled(backend, nkv, hd, mode, n, seed=340)
    r, _, _ = filled(ref, nkv, hd, mode, n, seed=340)
    q = queries(340, nkv * hpk, hd, 2.0)
    q[3, 7] = np.nan  # group 1, head 1
    out = c.attend_layer(q)
    want = r.attend_layer(q)
    bad = np.zeros(out.shape, bool)
    bad[3] = True
    policy(check, "attend_layer", out, bad, f"{mode.value}: NaN in q head 3")
    like_reference(check, "attend_layer", out, want, f"{mode.value}: NaN in q head 3")
    policy(check, "importance", c.imp, np.ones(n, bool), f"{mode.value}: every row visible to group 1")
    o1, p1 = c.attend(q[3], 1)
    policy(check, "attend_probs", p1, np.ones(n, bool), f"{mode.value}: attend() probabilities")
    like_reference(check, "attend_group", o1, r.attend(q[3], 1)[0], f"{mode.value}: attend()")


@pytest.mark.quick
@pytest.mark.parametrize("mode", Q_MODES, ids=[m.value for m in Q_MODES])
def test_a_scale_that_overflows_the_scores_poisons_like_the_reference(backend, ref, check, mode):
    nkv, hd, hpk, n = 2, 32, 2, 70
    c, _, _ = filled(backend, nkv, hd, mode, n, seed=350)
    r, _, _ = filled(ref, nkv, hd, mode, n, seed=350)
    q = queries(350, nkv * hpk, hd, 2.0)
    out = c.attend_layer(q, scale=1e38)  # finite in float32; |dot| > 3.4 overflows
    want = r.attend_layer(q, scale=1e38)
    policy(check, "attend_layer", out, np.ones(out.shape, bool), f"{mode.value}: +inf scores in every head")
    like_reference(check, "attend_layer", out, want, f"{mode.value}: scale 1e38")
    like_reference(check, "importance", c.imp, r.imp, f"{mode.value}: scale 1e38")


@pytest.mark.quick
def test_nan_and_inf_in_value_rows_reach_their_channels_only(backend, ref, check):
    nkv, hd, hpk, n = 2, 16, 2, 40
    k, v = rows(360, n, nkv, hd)
    v[17, 4] = np.nan        # group 0, channel 4
    v[23, hd + 6] = np.inf   # group 1, channel 6
    v[29, hd + 9] = -np.inf  # group 1, channel 9
    c, r = both(backend, ref, k, v, nkv, hd)
    q = queries(360, nkv * hpk, hd)
    out = c.attend_layer(q)
    want = r.attend_layer(q)
    bad = np.zeros(out.shape, bool)
    bad[:hpk, 4] = True
    policy(check, "attend_layer", out, bad, "NaN value in group 0 channel 4")
    like_reference(check, "attend_layer", out, want, "non-finite values")
    check.equal("attend_layer", (bool(np.isposinf(out[hpk:, 6]).all()), bool(np.isneginf(out[hpk:, 9]).all())),
                (True, True), "+inf / -inf values give +inf / -inf channels")
    policy(check, "importance", c.imp, np.zeros(n, bool), "values do not touch probabilities")
    like_reference(check, "importance", c.imp, r.imp, "non-finite values")


@pytest.mark.quick
def test_ragged_and_dead_heads_poison_only_the_group_that_holds_the_nan(backend, ref, check):
    nkv, hd, hpk, n = 3, 16, 2, 30
    k, v = rows(370, n, nkv, hd)
    alive = np.ones((n, nkv), bool)
    alive[:12, 1] = False   # head 1 lags 12 rows behind
    alive[:, 2] = False     # head 2 dead throughout
    k[20, hd + 5] = np.nan  # head 1's row 8
    c, r = both(backend, ref, k, v, nkv, hd, alive=alive)
    q = queries(370, nkv * hpk, hd, 2.0)
    out = c.attend_layer(q)
    want = r.attend_layer(q)
    bad = np.zeros(out.shape, bool)
    bad[hpk:2 * hpk] = True
    policy(check, "attend_layer", out, bad, "NaN in the lagging head 1")
    like_reference(check, "attend_layer", out, want, "ragged heads")
    check.exact("attend_layer", out[2 * hpk:], np.zeros((hpk, hd), np.float32), "dead head 2 answers zeros")
    like_reference(check, "importance", c.imp, r.imp, "ragged heads")
    policy(check, "importance", c.imp, np.arange(n) < n - 12, "the rows head 1 holds")


@pytest.mark.quick
@pytest.mark.parametrize("window", [None, 4], ids=["causal", "w4"])
@pytest.mark.parametrize("where", ["k", "v"])
def test_attend_chunk_poisons_only_the_rows_that_see_the_value(backend, ref, check, where, window):
    nkv, hd, hpk, s0, b = 2, 16, 2, 5, 10
    n = s0 + b
    k, v = rows(380, n, nkv, hd)
    bad_row = s0 + 3
    (k if where == "k" else v)[bad_row, 2] = np.nan  # group 0
    c, r = both(backend, ref, k, v, nkv, hd)
    q = queries(380, b * nkv * hpk, hd).reshape(b, nkv * hpk, hd)
    out = c.attend_chunk(q, b, s0, hpk, window=window)
    want = r.attend_chunk(q, b, s0, hpk, window=window)
    i = np.arange(b)
    sees = (s0 + i >= bad_row) & ((s0 + i - bad_row < window) if window else True)
    bad = np.zeros(out.shape, bool)
    if where == "k":
        bad[sees, :hpk, :] = True
    else:
        bad[sees, :hpk, 2] = True
    policy(check, "attend_chunk", out, bad, f"NaN {where} at row {bad_row}, window {window}")
    like_reference(check, "attend_chunk", out, want, f"NaN {where}, window {window}")
    like_reference(check, "attend_chunk_importance", c.imp, r.imp, f"NaN {where}, window {window}")
    if where == "v":
        policy(check, "attend_chunk_importance", c.imp, np.zeros(n, bool), "values do not touch probabilities")


@pytest.mark.quick
@pytest.mark.parametrize("mode", Q_MODES, ids=[m.value for m in Q_MODES])
def test_attend_chunk_nan_query_row_poisons_that_row_and_the_keys_it_sees(backend, ref, check, mode):
    nkv, hd, hpk, s0, b = 2, 32, 2, 62, 6  # crosses the q8 freeze
    c, _, _ = filled(backend, nkv, hd, mode, s0 + b, seed=390)
    r, _, _ = filled(ref, nkv, hd, mode, s0 + b, seed=390)
    q = queries(390, b * nkv * hpk, hd).reshape(b, nkv * hpk, hd)
    q[2, 1, 0] = np.nan  # chunk row 2, head 1 (group 0)
    out = c.attend_chunk(q, b, s0, hpk, window=20)
    want = r.attend_chunk(q, b, s0, hpk, window=20)
    bad = np.zeros(out.shape, bool)
    bad[2, 1] = True
    policy(check, "attend_chunk", out, bad, f"{mode.value}: NaN q row 2 head 1")
    like_reference(check, "attend_chunk", out, want, f"{mode.value}: NaN q row")
    seen = (np.arange(s0 + b) >= s0 + 3 - 20) & (np.arange(s0 + b) < s0 + 3)
    policy(check, "attend_chunk_importance", c.imp, seen, f"{mode.value}: the keys row 2 sees")
    like_reference(check, "attend_chunk_importance", c.imp, r.imp, f"{mode.value}: NaN q row")


def test_born_eviction_after_nan_importance_keeps_the_reference_rows(backend, ref, check):
    nkv, hd, hpk, n = 2, 16, 2, 60
    k, v = rows(400, n, nkv, hd)
    k[55, hd + 1] = np.nan  # group 1, appended after the finite steps
    c = layer_from(backend, k[:50], v[:50], nkv, hd)
    r = layer_from(ref, k[:50], v[:50], nkv, hd)
    for step in range(3):  # finite, distinct masses on rows [0, 50)
        q = queries(400 + step, nkv * hpk, hd, 3.0)
        c.attend_layer(q)
        r.attend_layer(q)
    for p in range(50, n):
        c.append(k[p], v[p])
        r.append(k[p], v[p])
    q = queries(410, nkv * hpk, hd, 3.0)
    c.attend_layer(q, window=20)  # group 1 sees row 55: NaN mass on rows [40, 60)
    r.attend_layer(q, window=20)
    policy(check, "importance", c.imp, np.arange(n) >= 40, "NaN mass on the window")
    like_reference(check, "importance", c.imp, r.imp, "before evict_born")
    c.evict_born(30, 4, 8)  # 18 picked from rows [4, 52); [40, 52) rank last
    r.evict_born(30, 4, 8)
    check.exact("gather_rows", c.storage.lens, r.storage.lens, "evict_born after NaN mass: lens")
    for h in range(nkv):
        m = int(r.storage.lens[h])
        check.exact("gather_rows", c.storage.k[h, :m], r.storage.k[h, :m], f"kept keys of head {h}")
        check.exact("gather_rows", c.storage.v[h, :m], r.storage.v[h, :m], f"kept values of head {h}")
    like_reference(check, "importance", c.imp, r.imp, "after evict_born")
