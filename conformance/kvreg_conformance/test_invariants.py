"""Invariants bit for bit WITHIN the backend under test (docs/kernels.md).

Each compares two answers of the same backend that the contract says are the
same bits: a group vs its heads, a layer call vs its groups, a window vs the
window's rows alone, a trimmed layer vs the untrimmed one, ``upto`` vs the
sequential call, a wire round trip vs the original, and an attend after a
truncate-then-append vs a layer that never held the dropped rows.
"""

import numpy as np
import pytest

from kvreg import KvMode, LayerKvCache

from .data import AGELESS_MODES, ALL_MODES, EXACT_ROWS, filled, queries, rng_rows

# Each case runs at the backend's tunables and at its small ones (conftest.py).
pytestmark = pytest.mark.usefixtures("tunables")

MODE_IDS = [m.value for m in ALL_MODES]
OPTS = {
    "plain": {},
    "window": {"first": 25},
    "window_in_exact": {"first": 2},
    "softcap": {"softcap": 2.0},
    "sinks": {"sinks": True},
    "all": {"first": 7, "softcap": 3.0, "sinks": True},
}


def _sinks(hpk, seed):
    return rng_rows(seed + 500, 1, hpk, 2.0)[0]


@pytest.mark.quick
@pytest.mark.parametrize("mode", ALL_MODES, ids=MODE_IDS)
@pytest.mark.parametrize("hpk", [1, 3, 8])
@pytest.mark.parametrize("opt", list(OPTS), ids=list(OPTS))
def test_grouped_attend_equals_each_head_alone(backend, check, mode, hpk, opt):
    nkv, hd, rows = 2, 40, 70
    c, _, _ = filled(backend, nkv, hd, mode, rows, seed=hpk)
    o = OPTS[opt]
    sinks = _sinks(hpk, hpk) if o.get("sinks") else None
    first = o.get("first", 0)
    softcap = o.get("softcap", 0.0)
    for g in range(nkv):
        q = queries(g, hpk, hd, 2.0)
        imp = np.zeros(rows, np.float32)
        out = c.attend_group(q, g, scale=0.15, first=first, softcap=softcap, sinks=sinks, imp_acc=imp)
        imp_heads = np.zeros(rows, np.float32)
        for h in range(hpk):
            oh = c.attend_group(q[h:h + 1], g, scale=0.15, first=first, softcap=softcap,
                                sinks=None if sinks is None else sinks[h:h + 1], imp_acc=imp_heads)
            check.exact("attend_group", out[h], oh[0], f"{mode.value} {opt} g{g} h{h}: grouped vs alone")
        check.exact("importance", imp, imp_heads, f"{mode.value} {opt} g{g}: grouped vs heads in order")


@pytest.mark.quick
@pytest.mark.parametrize("mode", ALL_MODES, ids=MODE_IDS)
@pytest.mark.parametrize("window", [None, 1, 9, 70, 500], ids=lambda w: f"w{w}")
def test_attend_layer_equals_attend_group_per_group(backend, check, mode, window):
    nkv, hd, hpk, rows = 3, 24, 2, 70
    c, _, _ = filled(backend, nkv, hd, mode, rows, seed=4, alive=None)
    # a shorter head: per-group windows start at different rows
    c.append(rng_rows(9, 1, nkv * hd)[0], rng_rows(10, 1, nkv * hd)[0], [True, False, True])
    rows += 1
    sinks = _sinks(nkv * hpk, 4)
    q = queries(4, nkv * hpk, hd, 2.0)
    c.sinks = sinks
    before = c.imp.copy()
    out = c.attend_layer(q, scale=0.2, window=window, softcap=4.0)
    imp_layer = c.imp - before
    imp_groups = np.zeros(rows, np.float32)
    for g in range(nkv):
        n = c.head_len(g)
        first = max(0, n - window) if window else 0
        hs = slice(g * hpk, (g + 1) * hpk)
        og = c.attend_group(q[hs], g, scale=0.2, first=first, softcap=4.0, sinks=sinks[hs], imp_acc=imp_groups)
        check.exact("attend_layer", out[hs], og, f"{mode.value} window {window} group {g}: layer vs group")
    # The Rust engine compares this mass within a tolerance, not bitwise: a
    # layer kernel may add the groups' contributions to a row in another order.
    check.close("importance", imp_layer, imp_groups, f"{mode.value} window {window}: layer call vs per group")


@pytest.mark.quick
@pytest.mark.parametrize("w", [1, 2, 7, 33, 59, 60, 200])
def test_windowed_attend_equals_the_window_rows_alone(backend, check, w):
    # F32: a fresh layer holding exactly rows [first, n) stores the same bits
    # at other offsets, so the windowed call must answer as it does (the
    # -inf-masked prefix changes nothing), and give the prefix exactly 0.
    nkv, hd, hpk, rows = 2, 48, 4, 60
    c, k, v = filled(backend, nkv, hd, KvMode.F32, rows, seed=11)
    first = max(rows - w, 0)
    only = LayerKvCache(nkv, hd, KvMode.F32, backend)
    for p in range(first, rows):
        only.append(k[p], v[p])
    sinks = _sinks(hpk, 11)
    for g in range(nkv):
        q = queries(11 + g, hpk, hd, 2.0)
        imp = np.zeros(rows, np.float32)
        out = c.attend_group(q, g, scale=0.2, first=first, softcap=5.0, sinks=sinks, imp_acc=imp)
        imp_only = np.zeros(rows - first, np.float32)
        out_only = only.attend_group(q, g, scale=0.2, softcap=5.0, sinks=sinks, imp_acc=imp_only)
        check.exact("attend_group", out, out_only, f"window {w} group {g}: windowed vs window rows alone")
        check.exact("importance", imp[first:], imp_only, f"window {w} group {g}: mass in the window")
        check.exact("importance", imp[:first], np.zeros(first, np.float32), f"window {w} group {g}: masked prefix")


@pytest.mark.parametrize("mode", [KvMode.Q8K, KvMode.Q8V], ids=["q8k", "q8v"])
def test_trimmed_attend_equals_untrimmed_in_mixed_modes(backend, check, mode):
    nkv, hd, hpk, w = 2, 16, 2, 24
    full = LayerKvCache(nkv, hd, mode, backend, q8_exact_rows=EXACT_ROWS)
    t = LayerKvCache(nkv, hd, mode, backend, q8_exact_rows=EXACT_ROWS)
    k, v = rng_rows(60, 200, nkv * hd), rng_rows(61, 200, nkv * hd)
    trims = 0
    for p in range(200):
        full.append(k[p], v[p])
        t.append(k[p], v[p])
        trims += t.trim_window(w, 3, 8) > 0
        if p % 5 == 0:
            for g in range(nkv):
                q = queries(p + g, hpk, hd)
                nf, nt = full.head_len(g), t.head_len(g)
                of = full.attend_group(q, g, scale=0.3, first=max(nf - w, 0))
                ot = t.attend_group(q, g, scale=0.3, first=max(nt - w, 0))
                check.exact("attend_group", ot, of, f"{mode.value} pos {p} group {g}: trimmed vs untrimmed")
    assert trims > 0


@pytest.mark.quick
@pytest.mark.parametrize("mode", AGELESS_MODES, ids=[m.value for m in AGELESS_MODES])
def test_attend_upto_equals_the_sequential_call(backend, check, mode):
    nkv, hd, hpk, rows = 2, 20, 3, 110
    c = LayerKvCache(nkv, hd, mode, backend, q8_exact_rows=EXACT_ROWS)
    k, v = rng_rows(70, rows, nkv * hd), rng_rows(71, rows, nkv * hd)
    sinks = _sinks(hpk, 70)
    q = queries(70, hpk, hd, 2.0)
    # Under q8 the field freeze (append 65) requantizes stored rows: only
    # calls made after it see rows that never change again.
    settled = 0 if mode is KvMode.F32 else 65
    seen = {}
    for p in range(rows):
        c.append(k[p], v[p])
        i = p + 1
        if i >= settled and i % 7 == 0:
            first = max(0, i - 13) if i % 2 else 2   # some windows start inside the exact rows
            imp = np.zeros(i, np.float32)
            seen[i] = (first, c.attend_group(q, 1, scale=0.25, first=first, softcap=2.5, sinks=sinks, imp_acc=imp),
                       imp)
    assert seen
    for i, (first, want, want_imp) in seen.items():
        imp = np.zeros(i, np.float32)
        got = c.attend_group_upto(q, 1, upto=i, scale=0.25, first=first, softcap=2.5, sinks=sinks, imp_acc=imp)
        check.exact("attend_group", got, want, f"{mode.value} upto {i}: vs the call at {i} rows")
        check.exact("importance", imp, want_imp, f"{mode.value} upto {i}")


@pytest.mark.quick
@pytest.mark.parametrize("trim", [False, True], ids=["full", "tail"])
def test_wire_round_trip_answers_identically(backend, check, trim):
    nkv, hd, hpk = 2, 32, 4
    a, _, _ = filled(backend, nkv, hd, KvMode.F32, 90, seed=80, alive=[True, False])
    if trim:
        assert a.trim_window(30, 2, 4) > 0
    b = LayerKvCache(nkv, hd, KvMode.F32, backend)
    b.import_wire(a.export_wire(False))
    q = queries(80, nkv * hpk, hd, 2.0)
    for h in range(nkv):
        oa, pa = a.attend(q[h], h)
        ob, pb = b.attend(q[h], h)
        check.exact("attend_group", ob, oa, f"imported vs original, head {h}")
        check.exact("attend_probs", pb, pa, f"imported vs original, head {h}")
    check.exact("attend_layer", b.attend_layer(q, window=20, importance=False),
                a.attend_layer(q, window=20, importance=False), "imported vs original")


@pytest.mark.quick
@pytest.mark.parametrize("mode", ALL_MODES, ids=MODE_IDS)
@pytest.mark.parametrize("rows", [80, 5], ids=lambda r: f"rows{r}")
def test_attend_after_truncate_then_append_sees_the_new_rows(backend, check, mode, rows):
    # Same generation, same row count, different rows: a device copy keyed on
    # (generation, rows) alone answers from the rows truncate dropped. With 5
    # rows the truncation rewrites q8 exact rows too.
    nkv, hd, hpk = 2, 16, 2
    c, k, v = filled(backend, nkv, hd, mode, rows, seed=90)
    q = queries(90, nkv * hpk, hd, 2.0)
    for g in range(nkv):
        c.attend_group(q[g * hpk:(g + 1) * hpk], g, scale=0.25)   # warm any device copy
    c.attend_layer(q, importance=False)
    c.attend(q[0], 0)
    c.truncate_last(3)
    k2, v2 = rng_rows(91, 3, nkv * hd, 3.0), rng_rows(92, 3, nkv * hd, 3.0)
    for p in range(3):
        c.append(k2[p], v2[p])
    fresh = LayerKvCache(nkv, hd, mode, backend, q8_exact_rows=EXACT_ROWS)
    for p in range(rows - 3):
        fresh.append(k[p], v[p])
    for p in range(3):
        fresh.append(k2[p], v2[p])
    for g in range(nkv):
        qg = q[g * hpk:(g + 1) * hpk]
        check.exact("attend_group", c.attend_group(qg, g, scale=0.25), fresh.attend_group(qg, g, scale=0.25),
                    f"{mode.value} group {g}: after truncate(3) + 3 appends vs a fresh layer")
    check.exact("attend_layer", c.attend_layer(q, importance=False), fresh.attend_layer(q, importance=False),
                f"{mode.value}: after truncate(3) + 3 appends vs a fresh layer")
    check.exact("attend_group", c.attend(q[0], 0)[0], fresh.attend(q[0], 0)[0],
                f"{mode.value}: attend after truncate(3) + 3 appends vs a fresh layer")
