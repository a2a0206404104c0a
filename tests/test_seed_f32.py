"""The seed's F32 tests of `kv_cache.rs`, ported one for one."""

import numpy as np
import pytest

from kvreg import EvictionPolicy, KvCache, KvMode, LayerKvCache
from kvreg.reference import key_scores, softmax_rows, value_pass


def f32(xs):
    return np.asarray(xs, dtype=np.float32)


def bits(a):
    return np.asarray(a, dtype=np.float32).view(np.uint32)


def swa_row(p, n, salt):
    i = np.arange(n)
    return f32(((p * 7919 + i * 104_729 + salt * 1_299_709) % 2003) / 1001.5 - 1.0)


def layer(nkv, hd):
    return LayerKvCache(nkv, hd, KvMode.F32, "reference")


def test_kv_abs_max_follows_appends_truncation_and_clear():
    heads, hd = 2, 4
    c = layer(heads, hd)
    row = lambda x: np.full(heads * hd, x, np.float32)  # noqa: E731
    for _ in range(4):
        c.append(row(0.5), row(-0.25))
    assert c.kv_abs_max() == (0.5, 0.25)
    c.truncate_last(2)
    c.append(row(-9.0), row(3.0))
    c.append(row(0.5), row(0.25))
    assert c.kv_abs_max() == (9.0, 3.0), "rewritten rows were not rescanned"
    c.append(row(np.nan), row(0.0))
    assert c.kv_abs_max()[0] == np.inf
    c.clear()
    c.append(row(1.0), row(2.0))
    assert c.kv_abs_max() == (1.0, 2.0)
    c.append(row(4.0), row(1.0))
    assert c.kv_abs_max_after((1, 2, 4.0, 1.0)) == (4.0, 2.0)
    c.append(row(8.0), row(1.0))
    assert c.kv_abs_max_after((0, 3, 0.0, 0.0)) == (8.0, 2.0), "a stale `from` falls back to the scan"


def test_kv_abs_max_scans_rows_appended_after_a_trim():
    heads, hd, w = 1, 4, 8
    c = layer(heads, hd)
    row = lambda x: np.full(heads * hd, x, np.float32)  # noqa: E731
    for _ in range(2 * w + 4):
        c.append(row(0.5), row(0.5))
    assert c.kv_abs_max() == (0.5, 0.5)
    d = c.trim_window(w, 2, 2)
    assert d > 0
    first_new = c.head_len(0)
    c.append(row(-7.0), row(6.0))
    for _ in range(d + 3):
        c.append(row(0.5), row(0.5))
    assert c.head_len(0) > 2 * w + 4 - d and first_new < 2 * w + 4
    assert c.kv_abs_max() == (7.0, 6.0)


def test_memory_breakdown_separates_recurrent_and_attention_state():
    cache = KvCache(1, 1, 4, 16, mode="f32", backend="reference")
    cache.layers[0].linear_state = np.zeros(8, np.float32)
    cache.layers[0].linear_scratch = np.zeros(4, np.float32)
    cache.layers[0].append(np.zeros(4), np.ones(4), [True])
    recurrent = cache.recurrent_state_bytes()
    assert recurrent == 12 * 4
    assert cache.attention_state_bytes() + recurrent == cache.total_memory_bytes()
    assert cache.attention_state_bytes() > 0


def test_append_tracks_seq_len_and_layout():
    cache = layer(4, 8)
    k = np.arange(32, dtype=np.float32)
    cache.append(k, np.full(32, 2.0, np.float32), [True] * 4)
    assert cache.seq_len == 1
    assert cache.head_len(0) == 1
    assert np.array_equal(cache.head_keys(1).ravel(), k[8:16])
    assert cache.memory_bytes() == 256


def test_head_keys_is_a_view_not_a_copy():
    cache = layer(2, 4)
    cache.append(np.ones(8, np.float32), np.ones(8, np.float32))
    view = cache.head_keys(0)
    assert np.shares_memory(view, cache.storage.k)
    assert not view.flags.writeable


def test_dead_head_stores_nothing():
    cache = layer(2, 4)
    k, v = np.ones(8, np.float32), np.full(8, 2.0, np.float32)
    cache.append(k, v, [True, False])
    cache.append(k, v, [True, False])
    assert cache.seq_len == 2
    assert cache.head_len(0) == 2
    assert cache.head_len(1) == 0, "dead head must not store KV"
    assert cache.memory_bytes() == 2 * 2 * 4 * 4


def test_eviction_keeps_recent():
    cache = KvCache(2, 4, 8, 10, EvictionPolicy.Recent, mode="f32", backend="reference")
    k, v = np.ones(32, np.float32), np.full(32, 2.0, np.float32)
    for _ in range(8):
        for lay in cache.layers:
            lay.append(k, v, [True] * 4)
    assert cache.seq_len == 8
    assert not cache.needs_eviction()
    cache.evict(4)
    assert cache.seq_len == 4
    assert cache.layers[0].head_len(0) == 4


def test_recent_eviction_keeps_the_newest_rows_in_order():
    c = layer(1, 2)
    for p in range(6):
        c.append(np.full(2, p, np.float32), np.full(2, p, np.float32))
    c.evict(3)
    assert c.head_keys(0)[:, 0].tolist() == [3.0, 4.0, 5.0]


def test_truncate_rolls_back_speculative_positions():
    cache = layer(2, 4)
    for pos in range(5):
        cache.append(np.full(8, pos, np.float32), np.full(8, pos, np.float32), [True, True])
    cache.truncate_last(2)
    assert cache.seq_len == 3
    assert cache.head_len(0) == 3
    assert cache.head_keys(0)[2, 0] == 2.0, "position 2 survives"


def _grouped_fixture(mode, kv_heads=2, hd=32, rows=70):
    c = LayerKvCache(kv_heads, hd, mode, "reference")
    i = np.arange(kv_heads * hd)
    for p in range(rows):
        c.append(f32(((i * 31 + p * 17 + 3) % 97) / 97.0 - 0.5), f32(((i * 13 + p * 29 + 7) % 89) / 89.0 - 0.5))
    return c


@pytest.mark.parametrize("mode", [KvMode.F32, KvMode.Q8])
def test_attend_group_equals_per_head_attend_bitexact(mode):
    kv_heads, hd, hpk = 2, 32, 3
    c = _grouped_fixture(mode, kv_heads, hd)
    q = f32(((np.arange(kv_heads * hpk * hd) * 11 + 5) % 83) / 83.0 - 0.5)
    for g in range(kv_heads):
        qg = q[g * hpk * hd:(g + 1) * hpk * hd]
        imp = np.zeros(70, np.float32)
        out = c.attend_group(qg, g, scale=1.0 / np.sqrt(hd), imp_acc=imp)
        imp_ref = np.zeros(70, np.float32)
        for h in range(hpk):
            o, probs = c.attend(qg[h * hd:(h + 1) * hd], g)
            assert np.array_equal(bits(out[h]), bits(o)), f"{mode} g{g} h{h}: grouped attend must be bit-identical"
            imp_ref += probs
        assert np.array_equal(bits(imp), bits(imp_ref)), f"{mode} g{g}: attention mass must match"


def test_attend_layer_equals_attend_group_per_group_bitexact():
    c = _grouped_fixture(KvMode.F32, 2, 32)
    q = np.random.default_rng(0).standard_normal((6, 32)).astype(np.float32)
    sinks = f32([0.3, -1.0, 2.0, 0.0, 1.5, -0.5])
    imp_layer = np.zeros(70, np.float32)
    c.sinks = sinks
    before = c.imp.copy()
    out = c.attend_layer(q, scale=0.2, window=17, softcap=5.0)
    imp_layer = c.imp - before
    imp_ref = np.zeros(70, np.float32)
    for g in range(2):
        og = c.attend_group(q[g * 3:(g + 1) * 3], g, scale=0.2, first=70 - 17, softcap=5.0,
                            sinks=sinks[g * 3:(g + 1) * 3], imp_acc=imp_ref)
        assert np.array_equal(bits(out[g * 3:(g + 1) * 3]), bits(og))
    assert np.allclose(imp_layer, imp_ref, atol=1e-6)


def test_sink_attend_matches_explicit_sink_column():
    nkv, hd, hpk, rows = 2, 8, 3, 9
    c = layer(nkv, hd)
    kv = lambda r, i, a, m: f32((((r * a + i * 7 + 3) % m) / m - 0.5) * 2.0)  # noqa: E731
    i = np.arange(nkv * hd)
    ks, vs = [], []
    for r in range(rows):
        k, v = kv(r, i, 31, 97), kv(r, i, 17, 89)
        c.append(k, v)
        ks.append(k)
        vs.append(v)
    q = f32((((np.arange(nkv * hpk * hd) * 11 + 5) % 83) / 83.0 - 0.5) * 3.0)
    sinks = f32([0.7, -1.3, 2.5, 0.0, -4.0, 6.0])
    scale = 1.0 / np.sqrt(np.float32(hd))
    checked = 0
    for upto in (1, 2, 5, 9):
        for window in (None, 3, 1):
            first = max(upto - window, 0) if window else 0
            for g in range(nkv):
                qg = q[g * hpk * hd:(g + 1) * hpk * hd].reshape(hpk, hd)
                sg = sinks[g * hpk:(g + 1) * hpk]
                imp = np.zeros(upto, np.float32)
                out = c.attend_group_upto(qg, g, upto=upto, scale=scale, first=first, sinks=sg, imp_acc=imp)
                imp_ref = np.zeros(upto)
                for h in range(hpk):
                    z = [float(np.dot(qg[h].astype(np.float64), ks[p][g * hd:(g + 1) * hd].astype(np.float64)))
                         * float(scale) for p in range(first, upto)]
                    z.append(float(sg[h]))
                    e = np.exp(np.array(z) - max(z))
                    p = e / e.sum()
                    want = sum(p[r - first] * vs[r][g * hd:(g + 1) * hd].astype(np.float64)
                               for r in range(first, upto))
                    assert np.abs(out[h] - want).max() < 1e-6, (upto, window, g, h)
                    for r in range(first, upto):
                        imp_ref[r] += p[r - first]
                    checked += 1
                assert np.abs(imp - imp_ref).max() < 1e-6
                assert imp.sum() < hpk, "sinks must absorb some mass"
    assert checked == 4 * 3 * nkv * hpk


def test_windowed_attend_equals_masked_full_row():
    nkv, hd, hpk, rows = 1, 16, 2, 40
    c = layer(nkv, hd)
    i = np.arange(hd)
    for r in range(rows):
        c.append(f32(((r * 13 + i * 5) % 29) / 29.0 - 0.5), f32(((r * 7 + i * 3) % 31) / 31.0 - 0.5))
    q = f32(((np.arange(hpk * hd) * 19) % 23) / 23.0 - 0.5).reshape(hpk, hd)
    scale = np.float32(0.25)
    st = c.storage
    for w in (1, 7, 39, 40, 100):
        first = max(rows - w, 0)
        imp = np.zeros(rows, np.float32)
        out = c.attend_group(q, 0, scale=scale, first=first, imp_acc=imp)
        # Reference: the whole row scored, -inf before the window, softmax over
        # the full row; the library's own score/value primitives on the rows.
        s = np.full((hpk, rows), -np.inf, np.float32)
        s[:, first:] = key_scores(st, 0, q, first, rows) * scale
        p = softmax_rows(s, None)
        assert (p[:, :first] == 0).all()
        out_ref = value_pass(st, 0, p[:, first:], first, rows)
        imp_ref = p.sum(axis=0, dtype=np.float32) if hpk == 1 else (p[0] + p[1])
        assert np.array_equal(bits(out), bits(out_ref)), f"out window {w}"
        assert np.array_equal(bits(imp), bits(imp_ref)), f"imp window {w}"


def test_born_eviction_keeps_high_mass_position():
    cache = KvCache(1, 1, 2, 16, EvictionPolicy.Born(sink=1), mode="f32", backend="reference")
    lay = cache.layers[0]
    for pos in range(8):
        lay.append(np.full(2, pos, np.float32), np.full(2, pos + 100.0, np.float32), [True])
    imp = np.full(8, 0.05, np.float32)
    imp[3] = 5.0
    lay.accumulate_imp(imp)
    cache.evict(4)  # sink 1 + recent 2 + 1 top-mass slot
    assert lay.seq_len == 4
    assert lay.head_keys(0)[:, 0].tolist() == [0.0, 3.0, 6.0, 7.0], "kept = sink(0) + mass-top(3) + recent(6,7)"
    assert lay.imp.tolist() == pytest.approx([0.05, 5.0, 0.05, 0.05])
    assert lay.head_len(0) == 4


def test_swa_trim_keeps_contiguous_tail():
    nkv, hd, w, slack, align = 2, 8, 6, 2, 4
    alive = [True, False]
    full, t = layer(nkv, hd), layer(nkv, hd)
    trims = 0
    for p in range(100):
        k, v = swa_row(p, nkv * hd, 1), swa_row(p, nkv * hd, 2)
        full.append(k, v, alive)
        t.append(k, v, alive)
        if t.trim_window(w, slack, align) > 0:
            trims += 1
            assert w + slack <= t.seq_len < w + slack + align
        assert t.seq_len <= 2 * w
        assert t.pos_len == p + 1
        assert t.base % align == 0
        assert t.base + t.seq_len == full.seq_len
        b = t.base
        assert np.array_equal(t.head_keys(0), full.head_keys(0)[b:])
        assert np.array_equal(t.head_values(0), full.head_values(0)[b:])
        assert t.head_keys(1).size == 0 and t.head_values(1).size == 0
        assert t.imp.shape[0] == t.seq_len
    assert trims > 5
    assert t.tail_window == w
    assert full.tail_window is None


def test_swa_anchored_trim_keeps_the_rollback_window():
    nkv, hd, w, slack, align = 1, 4, 6, 2, 4
    full, t = layer(nkv, hd), layer(nkv, hd)
    anchor = 40
    for p in range(100):
        k, v = swa_row(p, nkv * hd, 1), swa_row(p, nkv * hd, 2)
        full.append(k, v)
        t.append(k, v)
        t.trim_window_anchored(w, slack, align, anchor)
        assert t.base + w <= anchor - slack + 1, f"base {t.base} at {p}"
    back = anchor - slack
    t.truncate_last(t.pos_len - back)
    full.truncate_last(full.pos_len - back)
    assert t.pos_len == back
    b = t.base
    assert t.seq_len >= w - 1
    assert np.array_equal(t.head_keys(0), full.head_keys(0)[b:])
    assert np.array_equal(t.head_values(0), full.head_values(0)[b:])
    for p in range(back, back + 3 * w):
        t.append(swa_row(p, nkv * hd, 1), swa_row(p, nkv * hd, 2))
        t.trim_window_anchored(w, slack, align, None)
    assert t.seq_len <= 2 * w


@pytest.mark.parametrize("mode", [KvMode.F32, KvMode.Q8])
@pytest.mark.parametrize("w,slack,align", [(40, 2, 4), (37, 5, 16), (64, 64, 64)])
def test_swa_trimmed_attend_equals_untrimmed(mode, w, slack, align):
    nkv, hd, hpk = 2, 16, 2
    full = LayerKvCache(nkv, hd, mode, "reference")
    t = LayerKvCache(nkv, hd, mode, "reference")
    scale = 0.3
    trims = 0
    for p in range(400):
        k, v = swa_row(p, nkv * hd, 3), swa_row(p, nkv * hd, 4)
        full.append(k, v)
        t.append(k, v)
        q = swa_row(p, nkv * hpk * hd, 5)
        for g in range(nkv):
            qg = q[g * hpk * hd:(g + 1) * hpk * hd]
            nf, nt = full.head_len(g), t.head_len(g)
            imf, imt = np.zeros(nf, np.float32), np.zeros(nt, np.float32)
            of = full.attend_group(qg, g, scale=scale, first=max(nf - w, 0), imp_acc=imf)
            ot = t.attend_group(qg, g, scale=scale, first=max(nt - w, 0), imp_acc=imt)
            assert np.array_equal(bits(of), bits(ot)), f"{mode} w {w} pos {p} group {g}"
            assert np.array_equal(bits(imf[t.base:]), bits(imt))
            full.accumulate_imp(imf)
            t.accumulate_imp(imt)
        if t.trim_window(w, slack, align) > 0:
            trims += 1
        assert np.array_equal(bits(full.imp[t.base:]), bits(t.imp))
    assert trims > 0, f"{mode} w {w}: never trimmed"


def test_swa_truncate_after_trim():
    nkv, hd, w = 1, 8, 10
    full, t = layer(nkv, hd), layer(nkv, hd)
    p = 0
    for rnd in range(60):
        for _ in range(3):
            full.append(swa_row(p, hd, 6), swa_row(p, hd, 7))
            t.append(swa_row(p, hd, 6), swa_row(p, hd, 7))
            p += 1
        t.trim_window(w, 2, 4)
        full.truncate_last(2)
        t.truncate_last(2)
        p -= 2
        assert t.pos_len == full.seq_len
        for _ in range(2):
            k, v = swa_row(p, hd, 8 + rnd), swa_row(p, hd, 9 + rnd)
            full.append(k, v)
            t.append(k, v)
            p += 1
        q = swa_row(p, hd, 10)
        nf, nt = full.head_len(0), t.head_len(0)
        of = full.attend_group(q, 0, scale=0.5, first=nf - min(w, nf))
        ot = t.attend_group(q, 0, scale=0.5, first=nt - min(w, nt))
        assert np.array_equal(bits(of), bits(ot)), f"round {rnd}"
    assert t.base > 0


@pytest.mark.parametrize("policy", [EvictionPolicy.Recent, EvictionPolicy.Born(sink=1)])
def test_swa_evict_skips_tail(policy):
    c = KvCache(2, 1, 4, 30, policy, mode="f32", backend="reference")
    for p in range(25):
        for lay in c.layers:
            lay.append(swa_row(p, 4, 1), swa_row(p, 4, 2))
        c.layers[0].trim_window(8, 2, 4)
    t_rows, t_base = c.layers[0].seq_len, c.layers[0].base
    assert t_base > 0
    assert not c.needs_eviction(), "25 rows < cap 30"
    for p in range(25, 30):
        for lay in c.layers:
            lay.append(swa_row(p, 4, 1), swa_row(p, 4, 2))
    assert c.needs_eviction()
    gen0 = c.layers[0].generation
    c.evict(10)
    assert c.layers[0].seq_len == t_rows + 5, "tail evicted"
    assert c.layers[0].base == t_base
    assert c.layers[0].generation == gen0
    assert c.layers[1].seq_len == 10, "full layer not evicted"
    assert c.seq_len == 30, "absolute depth from the tail"


def test_swa_gen_bumps():
    lay = layer(1, 4)
    g0 = lay.generation
    assert layer(1, 4).generation != g0, "fresh caches differ"
    for p in range(20):
        lay.append(swa_row(p, 4, 1), swa_row(p, 4, 2))
    assert lay.generation == g0, "append"
    lay.truncate_last(2)
    assert lay.generation == g0, "truncate_last"
    assert lay.trim_window(10, 2, 4) == 0, "18 rows <= 2w: no trim"
    assert lay.generation == g0, "a no-op trim"
    for p in range(18, 21):
        lay.append(swa_row(p, 4, 1), swa_row(p, 4, 2))
    assert lay.trim_window(10, 2, 4) > 0
    g1 = lay.generation
    assert g1 != g0, "trim"
    snap_wire = lay.export_wire(False)
    snap_gen = lay.generation
    lay.clear()
    assert lay.generation != g1, "clear"
    assert (lay.base, lay.pos_len, lay.tail_window) == (0, 0, 10)
    e = layer(1, 4)
    for p in range(12):
        e.append(swa_row(p, 4, 1), swa_row(p, 4, 2))
    ge = e.generation
    e.evict(20)
    assert e.generation == ge, "an eviction that does nothing"
    e.evict(6)
    assert e.generation != ge, "evict"
    ge = e.generation
    e.evict_born(3, 1, 1)
    assert e.generation != ge, "evict_born"
    i = layer(1, 4)
    gi = i.generation
    i.import_wire(snap_wire)
    assert i.generation != gi, "import"
    assert i.generation != snap_gen, "an import is new storage"


def test_attend_chunk_matches_naive_attention():
    nkv, hd, hpk = 2, 32, 3
    nh = nkv * hpk
    s0, b = 40, 48
    n = s0 + b
    scale = 1.0 / np.sqrt(hd)
    i = np.arange(nkv * hd)
    for window in (None, 16, 200):
        c = layer(nkv, hd)
        for p in range(n):
            c.append(f32(((i * 31 + p * 17 + 3) % 97) / 97.0 - 0.5), f32(((i * 13 + p * 29 + 7) % 89) / 89.0 - 0.5))
        q = f32(((np.arange(b * nh * hd) * 11 + 5) % 83) / 83.0 - 0.5)
        imp0 = c.imp.astype(np.float64)
        out = c.attend_chunk(q, b, s0, hpk, scale=scale, window=window)
        expect = np.zeros((b, nh, hd))
        imp_ref = imp0.copy()
        qq = q.reshape(b, nh, hd).astype(np.float64)
        for bi in range(b):
            lim = s0 + bi + 1
            lo = max(lim - window, 0) if window else 0
            for hh in range(nh):
                g = hh // hpk
                kr = c.head_keys(g)[lo:lim].astype(np.float64)
                sc = kr @ qq[bi, hh] * scale
                e = np.exp(sc - sc.max())
                pr = e / e.sum()
                imp_ref[lo:lim] += pr
                expect[bi, hh] = pr @ c.head_values(g)[lo:lim].astype(np.float64)
        assert np.abs(out - expect).max() <= 1e-4, f"window {window}"
        assert c.imp.shape[0] == imp0.shape[0]
        assert np.all(np.abs(c.imp - imp_ref) <= 1e-3 * (1 + np.abs(imp_ref))), f"window {window}"
