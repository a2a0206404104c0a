"""The reference semantics: the tests of the Rust engine kvreg ports
(kv_cache.rs), one case each, on the backend under test.

Public API only, so they run on any backend: where the Rust test compares with
its own primitives, the case compares with the same backend's public calls
(bit for bit) or with the f64 oracle (tolerance table).
"""

import numpy as np
import pytest

from kvreg import EvictionPolicy, KvCache, KvMode, LayerKvCache, WireKind
from kvreg.nystrom import O1Rect

from . import oracle
from .data import f32, pseudo_random_row


def lay(backend, nkv, hd, mode=KvMode.F32):
    return LayerKvCache(nkv, hd, mode, backend)


@pytest.mark.quick
def test_kv_abs_max_follows_appends_truncation_and_clear(backend, check):
    heads, hd = 2, 4
    c = lay(backend, heads, hd)
    row = lambda x: np.full(heads * hd, x, np.float32)  # noqa: E731
    for _ in range(4):
        c.append(row(0.5), row(-0.25))
    check.equal("kv_abs_max", c.kv_abs_max(), (0.5, 0.25))
    c.truncate_last(2)
    c.append(row(-9.0), row(3.0))
    c.append(row(0.5), row(0.25))
    check.equal("kv_abs_max", c.kv_abs_max(), (9.0, 3.0), "rewritten rows must be rescanned")
    c.append(row(np.nan), row(0.0))
    check.equal("kv_abs_max", c.kv_abs_max()[0], np.inf)
    c.clear()
    c.append(row(1.0), row(2.0))
    check.equal("kv_abs_max", c.kv_abs_max(), (1.0, 2.0))
    c.append(row(4.0), row(1.0))
    check.equal("kv_abs_max", c.kv_abs_max_after((1, 2, 4.0, 1.0)), (4.0, 2.0))
    c.append(row(8.0), row(1.0))
    check.equal("kv_abs_max", c.kv_abs_max_after((0, 3, 0.0, 0.0)), (8.0, 2.0), "a stale `from` rescans")


def test_kv_abs_max_scans_rows_appended_after_a_trim(backend, check):
    heads, hd, w = 1, 4, 8
    c = lay(backend, heads, hd)
    row = lambda x: np.full(heads * hd, x, np.float32)  # noqa: E731
    for _ in range(2 * w + 4):
        c.append(row(0.5), row(0.5))
    assert c.kv_abs_max() == (0.5, 0.5)
    d = c.trim_window(w, 2, 2)
    assert d > 0
    c.append(row(-7.0), row(6.0))
    for _ in range(d + 3):
        c.append(row(0.5), row(0.5))
    check.equal("kv_abs_max", c.kv_abs_max(), (7.0, 6.0), "rows appended after a trim")


def test_memory_breakdown_separates_recurrent_and_attention_state(backend, check):
    cache = KvCache(1, 1, 4, 16, mode="f32", backend=backend)
    cache.layers[0].linear_state = np.zeros(8, np.float32)
    cache.layers[0].linear_scratch = np.zeros(4, np.float32)
    cache.layers[0].append(np.zeros(4), np.ones(4), [True])
    recurrent = cache.recurrent_state_bytes()
    check.equal("memory", recurrent, 12 * 4, "recurrent bytes")
    check.equal("memory", cache.attention_state_bytes() + recurrent, cache.total_memory_bytes(), "breakdown")
    assert cache.attention_state_bytes() > 0


@pytest.mark.quick
def test_wire_round_trip_reproduces_attention(backend, check):
    heads, hd = 2, 4
    a = lay(backend, heads, hd)
    for p in range(5):
        a.append(f32((p * 10 + np.arange(heads * hd)) * 0.031), f32((p * 7 + np.arange(heads * hd)) * -0.017))
    a.linear_state = f32([0.5, -0.25, 1.0])
    q = f32(0.1 * (np.arange(hd) + 1.0))
    b = lay(backend, heads, hd)
    b.linear_scratch = np.full(3, 9.0, np.float32)
    b.import_wire(a.export_wire(False))
    check.equal("wire", b.linear_scratch.size, 0, "import must discard tentative state")
    check.equal("wire", b.seq_len, a.seq_len)
    check.exact("wire", b.linear_state, a.linear_state, "linear state")
    for h in range(heads):
        oa, sa = a.attend(q, h)
        ob, sb = b.attend(q, h)
        check.exact("attend_group", ob, oa, f"wire round trip, head {h} output")
        check.exact("attend_group", sb, sa, f"wire round trip, head {h} probabilities")


def test_wire_v3_describes_q8_storage(backend):
    # The Rust engine refused to export q8 (v2 cannot describe int8 rows); wire v3
    # carries them exactly, and refuses only the f16 payload flag (which
    # would round F32 rows, and a q8 layer has none).
    c = lay(backend, 1, 4, KvMode.Q8_2F)
    c.append(f32([1, 2, 3, 4]), f32([4, 3, 2, 1]))
    blob = c.export_wire(False)
    assert blob[:4] == b"CMFS" and blob[4] == 3
    d = lay(backend, 1, 4, KvMode.Q8_2F)
    d.import_wire(blob)
    assert d.export_wire(False) == blob
    with pytest.raises(ValueError, match="f16=False"):
        c.export_wire(True)


def test_wire_refuses_unversioned_delta_state(backend):
    c = lay(backend, 1, 4)
    c.set_linear_wire_allowed(False)
    assert c.export_wire(False)[:4] == b"CMFS"
    with pytest.raises(ValueError, match="operator identity"):
        c.import_wire(bytes(4))


def test_wire_v2_round_trips_linear_and_bounded_records(backend):
    a = lay(backend, 1, 4)
    a.wire_kind = WireKind.Linear
    a.wire_identity = 0xC0FFEE
    a.linear_state = f32([0.5, -0.25, 1.0, 3.5])
    a.seq_len = 9
    blob = a.export_wire(True)
    b = lay(backend, 1, 4)
    b.wire_kind = WireKind.Linear
    b.wire_identity = 0xC0FFEE
    b.import_wire(blob)
    assert np.array_equal(b.linear_state, a.linear_state) and b.seq_len == 9
    c = lay(backend, 1, 4)
    c.wire_kind = WireKind.Linear
    with pytest.raises(ValueError, match="operator identity"):
        c.import_wire(blob)
    kvh, hd, w = 2, 4, 8
    a = lay(backend, kvh, hd)
    a.install_bounded(w)
    k = f32(np.arange(kvh * hd) * 0.125)
    for p in range(11):
        a.bounded.insert(k, k)
        a.seq_len = p + 1
    for f16 in (False, True):
        blob = a.export_wire(f16)
        b = lay(backend, kvh, hd)
        b.install_bounded(w)
        b.import_wire(blob)
        assert b.bounded.seen == 11 and b.seq_len == 11
        assert a.bounded.same_state(b.bounded), f"f16={f16}"
        c = lay(backend, kvh, hd)
        c.install_bounded(w * 2)
        with pytest.raises(ValueError):
            c.import_wire(blob)


def test_wire_import_checks_geometry(backend):
    blob = lay(backend, 2, 4).export_wire(False)
    with pytest.raises(ValueError, match="2×4"):
        lay(backend, 2, 8).import_wire(blob)


@pytest.mark.quick
def test_append_tracks_seq_len_and_layout(backend, check):
    c = lay(backend, 4, 8)
    k = np.arange(32, dtype=np.float32)
    c.append(k, np.full(32, 2.0, np.float32), [True] * 4)
    check.equal("append", (c.seq_len, c.head_len(0)), (1, 1))
    check.exact("append", c.head_keys(1).ravel(), k[8:16], "head 1 keys")
    check.equal("append", c.memory_bytes(), 256, "memory_bytes")


def test_dead_head_stores_nothing(backend, check):
    c = lay(backend, 2, 4)
    k, v = np.ones(8, np.float32), np.full(8, 2.0, np.float32)
    c.append(k, v, [True, False])
    c.append(k, v, [True, False])
    check.equal("append", (c.seq_len, c.head_len(0), c.head_len(1)), (2, 2, 0), "dead head must not store KV")
    check.equal("append", c.memory_bytes(), 2 * 2 * 4 * 4)


def test_eviction_keeps_recent(backend, check):
    cache = KvCache(2, 4, 8, 10, EvictionPolicy.Recent, mode="f32", backend=backend)
    k, v = np.ones(32, np.float32), np.full(32, 2.0, np.float32)
    for _ in range(8):
        for layer in cache.layers:
            layer.append(k, v, [True] * 4)
    assert cache.seq_len == 8 and not cache.needs_eviction()
    cache.evict(4)
    check.equal("evict", (cache.seq_len, cache.layers[0].head_len(0)), (4, 4))


def test_o1_batch_ending_on_boundary_does_not_cross_it(backend):
    B = 19
    layer = KvCache(1, 1, 4, 64, mode="f32", backend=backend).layers[0]
    layer.o1_begin_with_boundary(4, 8, 2, O1Rect.Aggregate, B, far="nystrom")
    for _ in range(B - 3):
        layer.o1_push_q(np.full(8, 0.1, np.float32))
        layer.append(np.full(4, 0.2, np.float32), np.full(4, 0.3, np.float32))
    assert not layer.o1_boundary_crossed_by(1)
    assert not layer.o1_boundary_crossed_by(3), "ends on B: exact rows only"
    assert layer.o1_boundary_crossed_by(4), "row B+1 must not be exact"
    for _ in range(3):
        layer.o1_push_q(np.full(8, 0.1, np.float32))
        layer.append(np.full(4, 0.2, np.float32), np.full(4, 0.3, np.float32))
    assert layer.o1_boundary_crossed_by(1), "at B every row is past it"


@pytest.mark.parametrize("policy", [EvictionPolicy.Recent, EvictionPolicy.Born(sink=2)], ids=["recent", "born"])
def test_collecting_o1_eviction_retains_exact_storage_until_boundary(backend, policy):
    B = 19
    cache = KvCache(1, 1, 4, 6, policy, mode="f32", backend=backend)
    layer = cache.layers[0]
    layer.o1_begin_with_boundary(4, 8, 2, O1Rect.Aggregate, B, far="nystrom")
    for pos in range(B):
        layer.o1_push_q(np.full(8, 0.1, np.float32))
        layer.append(np.full(4, 0.2, np.float32), np.full(4, 0.3, np.float32))
        if pos + 1 < B:
            cache.evict(3)
    assert layer.seq_len == B and layer.head_len(0) == B
    assert layer.o1_collecting()
    assert layer.o1_seal_checked(2)
    assert layer.reserved_bytes() == 0, "K/V released after the seal"


@pytest.mark.quick
def test_truncate_rolls_back_speculative_positions(backend, check):
    c = lay(backend, 2, 4)
    for pos in range(5):
        c.append(np.full(8, pos, np.float32), np.full(8, pos, np.float32), [True, True])
    c.truncate_last(2)
    check.equal("truncate_last", (c.seq_len, c.head_len(0)), (3, 3))
    check.equal("truncate_last", float(c.head_keys(0)[2, 0]), 2.0, "position 2 survives")


@pytest.mark.quick
def test_q8_attend_matches_f32_within_grid(backend, check):
    heads, hd = 2, 32
    f, q8 = lay(backend, heads, hd), lay(backend, heads, hd, KvMode.Q8_2F)
    i = np.arange(heads * hd)

    def synth(p, salt):
        x = ((i * 31 + p * 17 + salt * 7 + 3) % 97) / 97.0 - 0.5
        return f32(np.where(i % 2 == 0, x * 4.0, x * 0.25))

    for p in range(100):
        f.append(synth(p, 1), synth(p, 2))
        q8.append(synth(p, 1), synth(p, 2))
    q = f32(((np.arange(hd) * 13 + 5) % 89) / 89.0 - 0.5)
    for g in range(heads):
        of, pf = f.attend(q, g)
        o8, p8 = q8.attend(q, g)
        check.close("q8_vs_f32_output", o8, of, f"group {g}: q8 output vs the f32 one", relative_to_max=True)
        check.close("q8_vs_f32_probs", p8, pf, f"group {g}: q8 probabilities vs the f32 ones")
    q8.truncate_last(30)
    assert q8.head_len(0) == 70
    q8.accumulate_imp(np.arange(70, dtype=np.float32))
    q8.evict_born(20, 2, 8)
    assert q8.head_len(0) == 20
    assert np.isfinite(q8.attend(q, 0)[0]).all()
    assert q8.memory_bytes() * 3 < f.memory_bytes()


def _grouped(backend, mode, kv_heads=2, hd=32, rows=70):
    c = lay(backend, kv_heads, hd, mode)
    i = np.arange(kv_heads * hd)
    for p in range(rows):
        c.append(f32(((i * 31 + p * 17 + 3) % 97) / 97.0 - 0.5), f32(((i * 13 + p * 29 + 7) % 89) / 89.0 - 0.5))
    return c


@pytest.mark.quick
@pytest.mark.parametrize("mode", [KvMode.F32, KvMode.Q8_2F], ids=lambda m: m.value)
def test_attend_group_equals_each_head_alone_bit_for_bit(backend, check, mode):
    kv_heads, hd, hpk = 2, 32, 3
    c = _grouped(backend, mode, kv_heads, hd)
    q = f32(((np.arange(kv_heads * hpk * hd) * 11 + 5) % 83) / 83.0 - 0.5).reshape(kv_heads * hpk, hd)
    for g in range(kv_heads):
        qg = q[g * hpk:(g + 1) * hpk]
        imp = np.zeros(70, np.float32)
        out = c.attend_group(qg, g, scale=1.0 / np.sqrt(hd), imp_acc=imp)
        imp_ref = np.zeros(70, np.float32)
        for h in range(hpk):
            o, probs = c.attend(qg[h], g)
            check.exact("attend_group", out[h], o, f"{mode.value} g{g} h{h}: grouped vs per-head")
            imp_ref += probs
        check.exact("importance", imp, imp_ref, f"{mode.value} g{g}: grouped vs per-head mass")


def test_sink_attend_matches_explicit_sink_column(backend, check):
    nkv, hd, hpk, rows = 2, 8, 3, 9
    c = lay(backend, nkv, hd)
    i = np.arange(nkv * hd)
    kv = lambda r, a, m: f32((((r * a + i * 7 + 3) % m) / m - 0.5) * 2.0)  # noqa: E731
    for r in range(rows):
        c.append(kv(r, 31, 97), kv(r, 17, 89))
    q = f32((((np.arange(nkv * hpk * hd) * 11 + 5) % 83) / 83.0 - 0.5) * 3.0).reshape(nkv * hpk, hd)
    sinks = f32([0.7, -1.3, 2.5, 0.0, -4.0, 6.0])
    scale = float(1.0 / np.sqrt(np.float32(hd)))
    for upto in (1, 2, 5, 9):
        for window in (None, 3, 1):
            first = max(upto - window, 0) if window else 0
            for g in range(nkv):
                qg, sg = q[g * hpk:(g + 1) * hpk], sinks[g * hpk:(g + 1) * hpk]
                imp = np.zeros(upto, np.float32)
                out = c.attend_group_upto(qg, g, upto=upto, scale=scale, first=first, sinks=sg, imp_acc=imp)
                o, p, f0, n = oracle.attend_group_oracle(c.storage, g, qg, scale=scale, first=first, upto=upto,
                                                         sinks=sg)
                what = f"upto {upto} window {window} g{g}"
                check.close("attend_group", out, o, what)
                check.close("importance", imp, oracle.importance_delta(p, f0, n, upto), what)
                assert imp.sum() < hpk, "sinks must absorb some mass"


@pytest.mark.quick
def test_windowed_attend_equals_masked_full_row(backend, check):
    # The masked full row, observed through the public API: rows before
    # `first` get exactly zero mass, and the visible rows answer bit for bit
    # as a layer that holds only them (the -inf prefix must change nothing).
    nkv, hd, hpk, rows = 1, 16, 2, 40
    c = lay(backend, nkv, hd)
    i = np.arange(hd)
    ks = [f32(((r * 13 + i * 5) % 29) / 29.0 - 0.5) for r in range(rows)]
    vs = [f32(((r * 7 + i * 3) % 31) / 31.0 - 0.5) for r in range(rows)]
    for k, v in zip(ks, vs):
        c.append(k, v)
    q = f32(((np.arange(hpk * hd) * 19) % 23) / 23.0 - 0.5).reshape(hpk, hd)
    for w in (1, 7, 39, 40, 100):
        first = max(rows - w, 0)
        imp = np.zeros(rows, np.float32)
        out = c.attend_group(q, 0, scale=0.25, first=first, imp_acc=imp)
        only = lay(backend, nkv, hd)
        for k, v in zip(ks[first:], vs[first:]):
            only.append(k, v)
        imp_only = np.zeros(rows - first, np.float32)
        out_only = only.attend_group(q, 0, scale=0.25, imp_acc=imp_only)
        check.exact("attend_group", out, out_only, f"window {w}: windowed vs the window's rows alone")
        check.exact("importance", imp[first:], imp_only, f"window {w}: mass inside the window")
        check.exact("importance", imp[:first], np.zeros(first, np.float32), f"window {w}: mass before it")


def test_sinks_survive_clear_and_wire_import(backend, check):
    c = lay(backend, 1, 4)
    c.sinks = f32([0.5, -0.5])
    c.append(np.ones(4, np.float32), np.full(4, 2.0, np.float32))
    blob = c.export_wire(False)
    c.clear()
    check.exact("sinks", c.sinks, f32([0.5, -0.5]), "after clear")
    c.import_wire(blob)
    check.exact("sinks", c.sinks, f32([0.5, -0.5]), "after import")
    check.equal("wire", c.seq_len, 1)


@pytest.mark.parametrize("mode", [KvMode.Q8V_2F, KvMode.Q8K_2F], ids=lambda m: m.value)
def test_born_eviction_mixed_modes_stay_consistent(backend, check, mode):
    c = lay(backend, 1, 4, mode)
    for p in range(80):
        c.append(np.full(4, p * 0.01, np.float32), np.full(4, float(p), np.float32), [True])
    c.accumulate_imp(np.arange(80, dtype=np.float32))
    before = c.memory_bytes()
    c.evict_born(20, 4, 8)
    check.equal("gather_rows", c.head_len(0), 20, f"{mode.value}: rows kept")
    assert c.memory_bytes() < before / 2, "memory must shrink"
    out, _ = c.attend(np.ones(4, np.float32), 0)
    assert out[0] > 30.0, f"{mode.value}: V must come from the kept tail, got {out[0]}"


def test_born_eviction_keeps_high_mass_position(backend, check):
    cache = KvCache(1, 1, 2, 16, EvictionPolicy.Born(sink=1), mode="f32", backend=backend)
    layer = cache.layers[0]
    for pos in range(8):
        layer.append(np.full(2, pos, np.float32), np.full(2, pos + 100.0, np.float32), [True])
    imp = np.full(8, 0.05, np.float32)
    imp[3] = 5.0
    layer.accumulate_imp(imp)
    cache.evict(4)
    check.equal("gather_rows", layer.head_keys(0)[:, 0].tolist(), [0.0, 3.0, 6.0, 7.0],
                "kept = sink(0) + mass-top(3) + recent(6,7)")
    check.exact("gather_rows", layer.imp, f32([0.05, 5.0, 0.05, 0.05]), "importance follows its rows")


def test_sliding_window_trim_keeps_a_contiguous_tail(backend, check):
    nkv, hd, w, slack, align = 2, 8, 6, 2, 4
    alive = [True, False]
    full, t = lay(backend, nkv, hd), lay(backend, nkv, hd)
    trims = 0
    for p in range(100):
        k, v = pseudo_random_row(p, nkv * hd, 1), pseudo_random_row(p, nkv * hd, 2)
        full.append(k, v, alive)
        t.append(k, v, alive)
        if t.trim_window(w, slack, align) > 0:
            trims += 1
            assert w + slack <= t.seq_len < w + slack + align
        assert t.seq_len <= 2 * w and t.pos_len == p + 1 and t.base % align == 0
        b = t.base
        check.exact("trim_window", t.head_keys(0), full.head_keys(0)[b:], f"pos {p} keys")
        check.exact("trim_window", t.head_values(0), full.head_values(0)[b:], f"pos {p} values")
        assert t.head_keys(1).size == 0 and t.imp.shape[0] == t.seq_len
    assert trims > 5 and t.tail_window == w and full.tail_window is None


def test_sliding_window_anchored_trim_keeps_the_rollback_window(backend, check):
    nkv, hd, w, slack, align, anchor = 1, 4, 6, 2, 4, 40
    full, t = lay(backend, nkv, hd), lay(backend, nkv, hd)
    for p in range(100):
        k, v = pseudo_random_row(p, nkv * hd, 1), pseudo_random_row(p, nkv * hd, 2)
        full.append(k, v)
        t.append(k, v)
        t.trim_window_anchored(w, slack, align, anchor)
        assert t.base + w <= anchor - slack + 1, f"base {t.base} at {p}"
    back = anchor - slack
    t.truncate_last(t.pos_len - back)
    full.truncate_last(full.pos_len - back)
    assert t.pos_len == back and t.seq_len >= w - 1
    check.exact("trim_window", t.head_keys(0), full.head_keys(0)[t.base:], "keys after rollback")
    check.exact("trim_window", t.head_values(0), full.head_values(0)[t.base:], "values after rollback")
    for p in range(back, back + 3 * w):
        t.append(pseudo_random_row(p, nkv * hd, 1), pseudo_random_row(p, nkv * hd, 2))
        t.trim_window_anchored(w, slack, align, None)
    assert t.seq_len <= 2 * w


@pytest.mark.parametrize("mode", [KvMode.F32, KvMode.Q8_2F], ids=lambda m: m.value)
@pytest.mark.parametrize("w,slack,align", [(40, 2, 4), (37, 5, 16), (64, 64, 64)])
def test_sliding_window_trimmed_attend_equals_untrimmed(backend, check, mode, w, slack, align):
    nkv, hd, hpk = 2, 16, 2
    full, t = lay(backend, nkv, hd, mode), lay(backend, nkv, hd, mode)
    trims = 0
    for p in range(400):
        k, v = pseudo_random_row(p, nkv * hd, 3), pseudo_random_row(p, nkv * hd, 4)
        full.append(k, v)
        t.append(k, v)
        q = pseudo_random_row(p, nkv * hpk * hd, 5).reshape(nkv * hpk, hd)
        for g in range(nkv):
            qg = q[g * hpk:(g + 1) * hpk]
            nf, nt = full.head_len(g), t.head_len(g)
            imf, imt = np.zeros(nf, np.float32), np.zeros(nt, np.float32)
            of = full.attend_group(qg, g, scale=0.3, first=max(nf - w, 0), imp_acc=imf)
            ot = t.attend_group(qg, g, scale=0.3, first=max(nt - w, 0), imp_acc=imt)
            check.exact("attend_group", ot, of, f"{mode.value} w {w} pos {p} group {g}: trimmed vs untrimmed")
            check.exact("importance", imt, imf[t.base:], f"{mode.value} w {w} pos {p} group {g}")
            full.accumulate_imp(imf)
            t.accumulate_imp(imt)
        if t.trim_window(w, slack, align) > 0:
            trims += 1
        check.exact("trim_window", t.imp, full.imp[t.base:], f"pos {p}: importance after the trim")
    assert trims > 0, f"{mode.value} w {w}: never trimmed"


def test_sliding_window_truncate_after_trim(backend, check):
    nkv, hd, w = 1, 8, 10
    full, t = lay(backend, nkv, hd), lay(backend, nkv, hd)
    p = 0
    for rnd in range(60):
        for _ in range(3):
            full.append(pseudo_random_row(p, hd, 6), pseudo_random_row(p, hd, 7))
            t.append(pseudo_random_row(p, hd, 6), pseudo_random_row(p, hd, 7))
            p += 1
        t.trim_window(w, 2, 4)
        full.truncate_last(2)
        t.truncate_last(2)
        p -= 2
        assert t.pos_len == full.seq_len
        for _ in range(2):
            k, v = pseudo_random_row(p, hd, 8 + rnd), pseudo_random_row(p, hd, 9 + rnd)
            full.append(k, v)
            t.append(k, v)
            p += 1
        q = pseudo_random_row(p, hd, 10)
        nf, nt = full.head_len(0), t.head_len(0)
        of = full.attend_group(q, 0, scale=0.5, first=nf - min(w, nf))
        ot = t.attend_group(q, 0, scale=0.5, first=nt - min(w, nt))
        check.exact("attend_group", ot, of, f"round {rnd}: truncate after trim")
    assert t.base > 0


@pytest.mark.parametrize("policy", [EvictionPolicy.Recent, EvictionPolicy.Born(sink=1)], ids=["recent", "born"])
def test_sliding_window_evict_skips_the_tail(backend, policy):
    c = KvCache(2, 1, 4, 30, policy, mode="f32", backend=backend)
    for p in range(25):
        for layer in c.layers:
            layer.append(pseudo_random_row(p, 4, 1), pseudo_random_row(p, 4, 2))
        c.layers[0].trim_window(8, 2, 4)
    t_rows, t_base = c.layers[0].seq_len, c.layers[0].base
    assert t_base > 0 and not c.needs_eviction()
    for p in range(25, 30):
        for layer in c.layers:
            layer.append(pseudo_random_row(p, 4, 1), pseudo_random_row(p, 4, 2))
    assert c.needs_eviction()
    gen0 = c.layers[0].generation
    c.evict(10)
    assert c.layers[0].seq_len == t_rows + 5 and c.layers[0].base == t_base
    assert c.layers[0].generation == gen0
    assert c.layers[1].seq_len == 10 and c.seq_len == 30


def test_generation_changes_exactly_when_storage_is_replaced_or_moved(backend):
    layer = lay(backend, 1, 4)
    g0 = layer.generation
    assert lay(backend, 1, 4).generation != g0, "fresh caches differ"
    for p in range(20):
        layer.append(pseudo_random_row(p, 4, 1), pseudo_random_row(p, 4, 2))
    assert layer.generation == g0, "append"
    layer.truncate_last(2)
    assert layer.generation == g0, "truncate_last"
    assert layer.trim_window(10, 2, 4) == 0 and layer.generation == g0, "a no-op trim"
    for p in range(18, 21):
        layer.append(pseudo_random_row(p, 4, 1), pseudo_random_row(p, 4, 2))
    assert layer.trim_window(10, 2, 4) > 0
    g1 = layer.generation
    assert g1 != g0, "trim"
    snap, snap_gen = layer.export_wire(False), layer.generation
    layer.clear()
    assert layer.generation != g1, "clear"
    assert (layer.base, layer.pos_len, layer.tail_window) == (0, 0, 10)
    e = lay(backend, 1, 4)
    for p in range(12):
        e.append(pseudo_random_row(p, 4, 1), pseudo_random_row(p, 4, 2))
    ge = e.generation
    e.evict(20)
    assert e.generation == ge, "an eviction that does nothing"
    e.evict(6)
    assert e.generation != ge, "evict"
    ge = e.generation
    e.evict_born(3, 1, 1)
    assert e.generation != ge, "evict_born"
    i = lay(backend, 1, 4)
    gi = i.generation
    i.import_wire(snap)
    assert i.generation != gi and i.generation != snap_gen, "an import is new storage"


def test_wire_full_tail_record_round_trips(backend, check):
    nkv, hd, w = 2, 4, 6
    a = lay(backend, nkv, hd)
    for p in range(5):
        a.append(pseudo_random_row(p, nkv * hd, 1), pseudo_random_row(p, nkv * hd, 2))
    plain = a.export_wire(False)
    assert plain[20] == WireKind.Full and int.from_bytes(plain[24:32], "little") == 5
    for p in range(5, 40):
        a.append(pseudo_random_row(p, nkv * hd, 1), pseudo_random_row(p, nkv * hd, 2))
        a.trim_window(w, 2, 4)
    assert a.base > 0
    for f16 in (False, True):
        blob = a.export_wire(f16)
        assert blob[20] == WireKind.FullTail and int.from_bytes(blob[24:32], "little") == 40
        b = lay(backend, nkv, hd)
        b.import_wire(blob)
        assert (b.base, b.seq_len, b.pos_len) == (a.base, a.seq_len, 40)
        if not f16:
            q = pseudo_random_row(99, 2 * hd, 3).reshape(2, hd)
            for g in range(nkv):
                n = a.head_len(g)
                oa = a.attend_group(q, g, scale=0.5, first=n - w)
                ob = b.attend_group(q, g, scale=0.5, first=n - w)
                check.exact("attend_group", ob, oa, f"FullTail round trip, group {g}")
            b.import_wire(plain)
            assert (b.base, b.pos_len) == (0, 5)
    bad = bytearray(a.export_wire(False))
    bad[24:32] = (41).to_bytes(8, "little")
    with pytest.raises(ValueError):
        lay(backend, nkv, hd).import_wire(bytes(bad))
    r = lay(backend, nkv, hd)
    r.install_bounded(8)
    with pytest.raises(ValueError, match="does not match"):
        r.import_wire(a.export_wire(False))


@pytest.mark.parametrize("window", [None, 16, 200], ids=["full", "w16", "w200"])
def test_attend_chunk_matches_naive_attention(backend, check, window):
    nkv, hd, hpk, s0, b = 2, 32, 3, 40, 48
    nh, n = nkv * hpk, s0 + b
    scale = 1.0 / np.sqrt(hd)
    i = np.arange(nkv * hd)
    c = lay(backend, nkv, hd)
    for p in range(n):
        c.append(f32(((i * 31 + p * 17 + 3) % 97) / 97.0 - 0.5), f32(((i * 13 + p * 29 + 7) % 89) / 89.0 - 0.5))
    q = f32(((np.arange(b * nh * hd) * 11 + 5) % 83) / 83.0 - 0.5).reshape(b, nh, hd)
    imp0 = c.imp.astype(np.float64)
    out = c.attend_chunk(q, b, s0, hpk, scale=scale, window=window)
    keys = [oracle.head_keys64(c.storage, g) for g in range(nkv)]
    vals = [oracle.head_values64(c.storage, g) for g in range(nkv)]
    o, imp = oracle.attend_chunk_oracle(keys, vals, q, s0=s0, b=b, hpk=hpk, scale=scale, window=window)
    check.close("attend_chunk", out, o, f"window {window}")
    check.close("attend_chunk_importance", c.imp, imp0 + imp, f"window {window}")
