"""The q8_2f cache: the seed's q8 tests, the quantizer's exact arithmetic, the
field freeze, storage consistency per mode and refusals."""

import numpy as np
import pytest

from kvreg import ConfigError, KvMode, LayerKvCache, ShapeError, WireError
from kvreg.modes import KV_K_GROUP, Q8_EXACT_ROWS
from kvreg.quant import quantize_rows
from kvreg_conformance.oracle import attention_oracle

Q8_MODES = [KvMode.Q8_2F, KvMode.Q8K_2F, KvMode.Q8V_2F]
F1E12 = np.float32(1e-12)


def f32(xs):
    return np.asarray(xs, dtype=np.float32)


def layer(nkv, hd, mode, exact_rows=Q8_EXACT_ROWS):
    return LayerKvCache(nkv, hd, mode, "reference", q8_exact_rows=exact_rows)


def rand_rows(n, nkv, hd, seed=0):
    rng = np.random.default_rng(seed)
    # channel structure (a few loud channels) so the field is not ~1
    amp = np.where(np.arange(hd) % 7 == 0, 6.0, 1.0)
    return (rng.standard_normal((n, nkv, hd)) * amp).astype(np.float32)


# ── an independent recomputation of the q8_2f arithmetic ──

def ref_round(x):
    # float32 in, float64 arithmetic: |x| + 0.5 is exact for every float32
    # magnitude the quantizer produces (|x| <= ~127), so floor is the tie rule.
    x = np.asarray(x, dtype=np.float64)
    return np.sign(x) * np.floor(np.abs(x) + 0.5)


def ref_quantize(x, col, group):
    x = np.asarray(x, dtype=np.float32)
    r = x if col is None else (x / np.asarray(col, dtype=np.float32)).astype(np.float32)
    n, hd = r.shape
    ng = -(-hd // group)
    q = np.zeros((n, hd), dtype=np.int8)
    s = np.zeros((n, ng), dtype=np.float32)
    for j in range(ng):
        blk = r[:, j * group:(j + 1) * group]
        absmax = np.where(np.isnan(blk), np.float32(0), np.abs(blk)).max(axis=1).astype(np.float32)
        sj = np.maximum(absmax / np.float32(127), F1E12).astype(np.float32)
        qf = ref_round((blk / sj[:, None]).astype(np.float32))
        qf = np.nan_to_num(np.clip(qf, -127, 127), nan=0.0)
        q[:, j * group:(j + 1) * group] = qf.astype(np.int8)
        s[:, j] = sj
    return q, s


def ref_dequant(q, s, group):
    hd = q.shape[1]
    return (q.astype(np.float32) * s[:, np.arange(hd) // group]).astype(np.float32)


def ref_field(rows):
    sq = (rows * rows).astype(np.float32)
    acc = np.cumsum(sq, axis=0, dtype=np.float32)[-1]     # row order, float32
    return np.maximum(np.sqrt(acc / np.float32(rows.shape[0])), np.float32(1e-6)).astype(np.float32)


def stored(c, h):
    """(kq, ks, vq, vs, k, v) of head h as copies (None where absent)."""
    st = c.storage
    n = c.head_len(h)
    return {name: getattr(st, name)[h, :n].copy() for name in st.block_names()}


def exact_rows(c, h):
    """The exact (float32, field space) rows of head h as copies, by side."""
    st = c.storage
    xl = int(st.xlen[h])
    return {name: getattr(st, name)[h, :xl].copy() for name in ("xk", "xv") if getattr(st, name) is not None}


def snapshot(c):
    st = c.storage
    return dict(seq_len=c.seq_len, lens=[c.head_len(h) for h in range(c.num_kv_heads)], gen=c.generation,
                mem=c.memory_bytes(), frozen=st.field_frozen(), kcol=st.kcol.copy(), vcol=st.vcol.copy(),
                rows=[stored(c, h) for h in range(c.num_kv_heads)])


def assert_same_state(a, b):
    for key in ("seq_len", "lens", "gen", "mem", "frozen"):
        assert a[key] == b[key], key
    assert np.array_equal(a["kcol"], b["kcol"]) and np.array_equal(a["vcol"], b["vcol"])
    for ra, rb in zip(a["rows"], b["rows"]):
        for name in ra:
            assert np.array_equal(ra[name], rb[name]), name


def expected_bytes(mode, lens, hd, frozen_heads, exact=()):
    """The seed's memory_bytes, plus 4 bytes per element of the exact rows
    (``exact``: their count per head) on each quantized side."""
    rows = sum(lens)
    ngk = -(-hd // 32)
    k = rows * (ngk * 4 + hd) if mode.quant_k else rows * hd * 4
    v = rows * (4 + hd) if mode.quant_v else rows * hd * 4
    cols = frozen_heads * hd * 4 * (int(mode.quant_k) + int(mode.quant_v))
    return k + v + cols + sum(exact) * hd * 4 * (int(mode.quant_k) + int(mode.quant_v))


# ── the seed's q8 tests ──

def test_q8_attend_matches_f32_within_grid():
    heads, hd = 2, 32
    f = layer(heads, hd, KvMode.F32)
    q8 = layer(heads, hd, KvMode.Q8_2F)

    def synth(p, salt):
        i = np.arange(heads * hd)
        x = f32((i * 31 + p * 17 + salt * 7 + 3) % 97) / np.float32(97.0) - np.float32(0.5)
        # channel structure: even channels x4 (checks the 2f field)
        return np.where(i % 2 == 0, x * np.float32(4.0), x * np.float32(0.25)).astype(np.float32)

    for p in range(100):
        k, v = synth(p, 1), synth(p, 2)
        f.append(k, v)
        q8.append(k, v)
    q = f32((np.arange(hd) * 13 + 5) % 89) / np.float32(89.0) - np.float32(0.5)
    for g in range(heads):
        of, pf = f.attend(q, g)
        o8, p8 = q8.attend(q, g)
        scale = max(float(np.abs(of).max()), 1e-6)
        assert (np.abs(of - o8) <= scale * 0.03 + 1e-3).all(), (g, of, o8)
        assert (np.abs(pf - p8) < 0.02).all(), g
    # rollback + eviction live on the q8 storage
    q8.truncate_last(30)
    assert q8.head_len(0) == 70
    q8.accumulate_imp(np.arange(70, dtype=np.float32))
    q8.evict_born(20, 2, 8)
    assert q8.head_len(0) == 20
    o, _ = q8.attend(q, 0)
    assert np.isfinite(o).all()
    # memory: q8 ~ 1 byte/element + scales (vs 4 for f32)
    assert q8.memory_bytes() * 3 < f.memory_bytes()


@pytest.mark.parametrize("mode", [KvMode.Q8V_2F, KvMode.Q8K_2F])
def test_born_eviction_mixed_modes_stay_consistent(mode):
    c = layer(1, 4, mode)
    for p in range(80):
        c.append(np.full(4, np.float32(p) * np.float32(0.01), np.float32), np.full(4, p, np.float32))
    c.accumulate_imp(np.arange(80, dtype=np.float32))
    before = c.memory_bytes()
    c.evict_born(20, 4, 8)
    assert c.head_len(0) == 20
    assert c.memory_bytes() < before / 2, "memory must shrink"
    out, _ = c.attend(f32([1, 1, 1, 1]), 0)
    assert out[0] > 30.0, f"V from the kept tail, not the stale head (out {out[0]})"


# ── the quantizer, exactly ──

def test_quantize_rounds_half_away_from_zero_on_ties():
    for s in (1.0, 2.0, 0.5):
        ties = f32([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5, -126.5]) * np.float32(s)
        x = np.zeros((1, 32), np.float32)
        x[0, 0] = 127 * s                       # absmax: the scale is exactly s
        x[0, 1:9] = ties
        q, sc = quantize_rows(x, None, 32)
        assert sc[0, 0] == np.float32(s)
        assert q[0, :9].tolist() == [127, 1, 2, 3, -1, -2, -3, 127, -127], f"scale {s}"


def test_quantize_clamps_to_127_and_never_minus_128():
    rng = np.random.default_rng(1)
    x = (rng.standard_normal((500, 64)) * np.exp(rng.uniform(-20, 80, (500, 1)))).astype(np.float32)
    # a negative absmax on even rows (scales stay above the 1e-12 floor)
    x[::2, 5] = -np.abs(x[::2]).max(axis=1) * np.float32(1.5)
    q, s = quantize_rows(x, None, 32)
    assert q.min() >= -127 and q.max() <= 127
    assert (q[::2, 5] == -127).all()
    rq, rs = ref_quantize(x, None, 32)
    assert np.array_equal(q, rq) and np.array_equal(s, rs)


def test_all_zero_row_takes_the_scale_floor():
    q, s = quantize_rows(np.zeros((2, 64), np.float32), None, 32)
    assert (s == F1E12).all() and not q.any()
    tiny = np.full((1, 32), 1e-20, np.float32)
    q, s = quantize_rows(tiny, None, 32)
    assert s[0, 0] == F1E12 and not q.any(), "1e-20 / 1e-12 rounds to 0"


def test_nan_quantizes_to_zero_and_is_ignored_by_absmax():
    x = np.zeros((2, 64), np.float32)
    x[0, 0] = np.nan
    x[0, 1] = 127.0
    x[0, 2] = -63.5
    x[1, 32:] = np.nan                           # a whole group of NaN
    x[1, 0] = 2.0
    q, s = quantize_rows(x, None, 32)
    assert s[0, 0] == np.float32(1.0), "NaN must not poison the absmax (Rust f32::max ignores it)"
    assert q[0, :3].tolist() == [0, 127, -64]
    assert s[1, 1] == F1E12 and not q[1, 32:].any()
    assert q[1, 0] == 127


def test_last_short_group_has_its_own_scale():
    hd = 40                                      # groups of 32 + 8
    x = np.zeros((3, hd), np.float32)
    x[:, :32] = 100.0
    x[:, 32:] = f32([0.5, -1.0, 0.25, 0.125, 1.0, -0.75, 0.0, 0.3])
    q, s = quantize_rows(x, None, 32)
    assert s.shape == (3, 2)
    assert (s[:, 1] == np.float32(1.0) / np.float32(127)).all(), "the short group's scale reads its 8 channels only"
    assert (np.abs(q[:, 32:]).max(axis=1) == 127).all()
    rq, rs = ref_quantize(x, None, 32)
    assert np.array_equal(q, rq) and np.array_equal(s, rs)


def test_quantize_against_a_field_matches_the_independent_recomputation():
    x = rand_rows(50, 1, 40, seed=3)[:, 0]
    col = np.abs(rand_rows(1, 1, 40, seed=4)[0, 0]) + np.float32(0.1)
    for group in (32, 40):
        q, s = quantize_rows(x, col, group)
        rq, rs = ref_quantize(x, col, group)
        assert np.array_equal(q, rq) and np.array_equal(s, rs), group


# ── the field freeze ──

@pytest.mark.parametrize("mode", Q8_MODES)
def test_field_freezes_at_the_start_of_the_append_after_64_rows(mode):
    nkv, hd = 2, 40
    c = layer(nkv, hd, mode)
    x = rand_rows(66, nkv, hd, seed=5)
    y = rand_rows(66, nkv, hd, seed=6)
    x[:, :, 3] = y[:, :, 3] = 0.0                # a silent channel: the field floor
    for p in range(64):
        c.append(x[p], y[p])
    st = c.storage
    assert not st.field_frozen() and not st.kcol_set.any() and not st.vcol_set.any(), "no field after 64 appends"
    before = [stored(c, h) for h in range(nkv)]
    gen = c.generation
    c.append(x[64], y[64])
    assert c.generation == gen, "the freeze is part of an append (generation kept, as the seed)"
    for h in range(nkv):
        assert bool(st.kcol_set[h]) == mode.quant_k and bool(st.vcol_set[h]) == mode.quant_v
        for quant, qn, sn, coln, group, src in ((mode.quant_k, "kq", "ks", "kcol", 32, x),
                                                 (mode.quant_v, "vq", "vs", "vcol", hd, y)):
            if not quant:
                continue
            # before the freeze: quantized against col = 1
            s_old = before[h][sn] if before[h][sn].ndim == 2 else before[h][sn][:, None]
            rq, rs = ref_quantize(src[:64, h], None, group)
            assert np.array_equal(before[h][qn], rq) and np.array_equal(s_old, rs)
            # the field: RMS of the 64 dequantized rows, floor 1e-6
            deq = ref_dequant(rq, rs, group)
            col = ref_field(deq)
            assert np.array_equal(getattr(st, coln)[h], col), (h, qn)
            assert getattr(st, coln)[h][3] == np.float32(1e-6)
            # every stored row requantized against it, the 65th quantized against it
            nq, ns = ref_quantize(deq, col, group)
            q65, s65 = ref_quantize(src[64:65, h], col, group)
            got_q = getattr(st, qn)[h, :65]
            got_s = getattr(st, sn)[h, :65]
            got_s = got_s if got_s.ndim == 2 else got_s[:, None]
            assert np.array_equal(got_q[:64], nq) and np.array_equal(got_s[:64], ns)
            assert np.array_equal(got_q[64:], q65) and np.array_equal(got_s[64:], s65)
    # frozen once: the 66th append changes no field
    kcol, vcol = st.kcol.copy(), st.vcol.copy()
    c.append(x[65], y[65])
    assert np.array_equal(st.kcol, kcol) and np.array_equal(st.vcol, vcol)


def test_rows_of_a_dead_head_never_freeze_its_field():
    nkv, hd = 2, 32
    c = layer(nkv, hd, KvMode.Q8_2F)
    x = rand_rows(80, nkv, hd, seed=7)
    for p in range(70):
        c.append(x[p], x[p], alive=[True, False])
    st = c.storage
    assert st.kcol_set.tolist() == [True, False] and st.vcol_set.tolist() == [True, False]
    assert c.head_len(1) == 0
    for p in range(70, 80):                      # the head wakes up after the freeze
        c.append(x[p], x[p])
    assert st.kcol_set.tolist() == [True, False], "no second freeze for a late head"
    rq, rs = ref_quantize(x[70:80, 1], None, 32)
    assert np.array_equal(st.kq[1, :10], rq) and np.array_equal(st.ks[1, :10], rs)
    o, _ = c.attend(x[0, 1], 1)
    assert np.isfinite(o).all()


def test_trim_window_is_a_noop_until_the_field_freezes():
    hd, w = 8, 20
    x = rand_rows(70, 1, hd, seed=8)
    f, c = layer(1, hd, KvMode.F32), layer(1, hd, KvMode.Q8_2F)
    for p in range(60):
        f.append(x[p], x[p])
        c.append(x[p], x[p])
    assert f.trim_window(w, 2, 1) > 0, "control: the F32 layer trims"
    gen = c.generation
    assert c.trim_window(w, 2, 1) == 0
    assert (c.seq_len, c.base, c.head_len(0), c.generation) == (60, 0, 60, gen)
    for p in range(60, 65):                      # the 65th append freezes
        c.append(x[p], x[p])
    assert c.storage.field_frozen()
    kept = stored(c, 0)
    d = c.trim_window(w, 2, 1)
    assert d == 65 - (w + 2) and c.base == d and c.head_len(0) == w + 2
    now = stored(c, 0)
    for name in now:
        assert np.array_equal(now[name], kept[name][d:]), name


# ── every storage stays consistent, each on its own ──

@pytest.mark.parametrize("xr", [0, 4])
@pytest.mark.parametrize("mode", Q8_MODES)
def test_truncate_evict_born_clear_keep_each_storage_consistent(mode, xr):
    nkv, hd = 2, 40
    c = layer(nkv, hd, mode, xr)
    x, y = rand_rows(80, nkv, hd, seed=9), rand_rows(80, nkv, hd, seed=10)
    for p in range(80):
        c.append(x[p], y[p])
    q = rand_rows(1, 1, hd, seed=11)[0, 0]

    def check(n, rows_before=None, idx=None, xlen=0):
        for h in range(nkv):
            assert c.head_len(h) == n
            o, pr = c.attend(q, h)
            assert np.isfinite(o).all() and pr.shape == (n,)
            if rows_before is not None:
                now = stored(c, h)
                assert set(now) == set(rows_before[h][0])
                for name in now:
                    assert np.array_equal(now[name], rows_before[h][0][name][idx]), (name, h)
                # the exact rows kept are the old exact rows the op kept, still a prefix
                now_x, old_x = exact_rows(c, h), rows_before[h][1]
                for name in now_x:
                    assert np.array_equal(now_x[name], old_x[name][idx[idx < old_x[name].shape[0]]]), (name, h)
            assert int(c.storage.xlen[h]) == xlen
        assert c.seq_len == n
        assert c.memory_bytes() == expected_bytes(mode, [n] * nkv, hd, nkv if n else 0, [xlen] * nkv)

    def rows_now():
        return [(stored(c, h), exact_rows(c, h)) for h in range(nkv)]

    check(80, xlen=xr)
    before = rows_now()
    c.truncate_last(10)
    check(70, before, np.arange(70), xlen=xr)

    before = rows_now()
    c.truncate_last(68)
    check(2, before, np.arange(2), xlen=min(xr, 2))
    for p in range(2, 70):
        c.append(x[p], y[p])
    check(70, xlen=xr)
    for h in range(nkv):   # re-appended exact rows enter field space: x / col
        for name, src, col in (("xk", x, c.storage.kcol), ("xv", y, c.storage.vcol)):
            if name in exact_rows(c, h):
                assert np.array_equal(exact_rows(c, h)[name], src[:xr, h] / col[h]), name

    before = rows_now()
    c.evict(68)
    check(68, before, np.arange(2, 70), xlen=max(xr - 2, 0))

    before = rows_now()
    c.evict(50)
    check(50, before, np.arange(18, 68))

    before = rows_now()
    mass = np.zeros(50, np.float32)
    mass[[7, 13, 21]] = [5.0, 4.0, 3.0]
    c.accumulate_imp(mass)
    c.evict_born(8, 2, 3)
    kept = np.array([0, 1, 7, 13, 21, 47, 48, 49])
    check(8, before, kept)
    assert np.array_equal(c.imp, mass[kept] + 0)

    # Born eviction of a cache whose exact rows are all there: the sink and
    # one exact row of high mass stay exact (a prefix), the others go.
    c.clear()
    for p in range(80):
        c.append(x[p], y[p])
    before = rows_now()
    c.accumulate_imp(np.where(np.arange(80) == 3, 9.0, 0.0).astype(np.float32))
    c.evict_born(6, 1, 4)
    check(6, before, np.array([0, 3, 76, 77, 78, 79]), xlen=min(xr, 2))

    c.clear()
    check(0)
    assert not c.storage.field_frozen(), "clear unfreezes the field"
    for p in range(64):
        c.append(x[p], y[p])
    assert not c.storage.field_frozen()
    c.append(x[64], y[64])
    assert c.storage.field_frozen(), "the next conversation freezes its own field"


# ── selection, memory, refusals ──

@pytest.mark.parametrize("value, mode", [("q8", KvMode.Q8), ("q8_2f", KvMode.Q8_2F), ("q8k", KvMode.Q8K),
                                          ("q8v", KvMode.Q8V), ("q8k_2f", KvMode.Q8K_2F), ("q8v_2f", KvMode.Q8V_2F),
                                          ("f32", KvMode.F32), (None, KvMode.F32), ("", KvMode.F32)])
def test_kv_mode_from_env(monkeypatch, value, mode):
    if value is None:
        monkeypatch.delenv("KVREG_KV", raising=False)
    else:
        monkeypatch.setenv("KVREG_KV", value)
    assert KvMode.from_env() is mode
    assert LayerKvCache(1, 4, backend="reference").mode is mode


def test_kv_mode_from_env_refuses_an_unknown_value(monkeypatch):
    monkeypatch.setenv("KVREG_KV", "int4")
    with pytest.raises(ConfigError) as err:
        KvMode.from_env()
    for accepted in ("f32", "f16", "bf16", "q4", "q8", "q8_2f", "q8k", "q8v", "q8k_2f", "q8v_2f"):
        assert accepted in str(err.value)
    assert "int4" in str(err.value)
    assert isinstance(err.value, ValueError)


def test_q8_memory_is_at_most_028_of_f32_at_hd128():
    nkv, hd = 2, 128
    x = rand_rows(256, nkv, hd, seed=12)
    f, c = layer(nkv, hd, KvMode.F32), layer(nkv, hd, KvMode.Q8_2F)
    for p in range(256):
        f.append(x[p], x[p])
        c.append(x[p], x[p])
    ratio = c.memory_bytes() / f.memory_bytes()
    assert ratio <= 0.28, ratio
    assert c.memory_bytes() == expected_bytes(KvMode.Q8_2F, [256, 256], hd, nkv, [Q8_EXACT_ROWS] * nkv)
    seed = layer(nkv, hd, KvMode.Q8_2F, 0)
    for p in range(256):
        seed.append(x[p], x[p])
    assert seed.memory_bytes() == expected_bytes(KvMode.Q8_2F, [256, 256], hd, nkv), "q8_exact_rows=0: the seed's count"


@pytest.mark.parametrize("mode", Q8_MODES)
def test_q8_exports_wire_v3_and_refuses_f16_payloads(mode):
    c = layer(1, 4, mode)
    c.append(f32([1, 2, 3, 4]), f32([1, 2, 3, 4]))
    blob = c.export_wire()
    assert blob[4] == 3  # v3: the int8 rows and scales as stored
    d = layer(1, 4, mode)
    d.import_wire(blob)
    assert d.export_wire() == blob
    with pytest.raises(WireError, match="f16=False"):
        c.export_wire(True)


@pytest.mark.parametrize("mode", Q8_MODES)
@pytest.mark.parametrize("rows_before", [10, 64])
@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_non_finite_rows_are_refused_and_change_nothing(mode, rows_before, bad):
    nkv, hd = 2, 8
    c = layer(nkv, hd, mode)
    x = rand_rows(rows_before, nkv, hd, seed=13)
    for p in range(rows_before):
        c.append(x[p], x[p])
    good = x[0].copy()
    bad_row = good.copy()
    bad_row[1, 5] = bad
    before = snapshot(c)
    k, v = (bad_row, good) if mode.quant_k else (good, bad_row)
    with pytest.raises(ShapeError, match="inf/NaN"):
        c.append(k, v)
    assert_same_state(snapshot(c), before)   # at 64 rows: not even the field froze
    # a dead head's row is not stored, so it is not refused
    c.append(k, v, alive=[True, False])
    assert c.seq_len == rows_before + 1 and c.head_len(1) == rows_before


def test_kv_abs_max_reports_inf_for_an_inf_row_under_f32():
    c = layer(1, 4, KvMode.F32)
    c.append(f32([1, -2, 0.5, 0]), f32([0.25, 0, 0, 0]))
    assert c.kv_abs_max() == (2.0, 0.25)
    c.append(f32([0, np.inf, 0, 0]), f32([0, 0, -np.inf, 0]))
    assert c.kv_abs_max() == (np.inf, np.inf)


# ── prefill chunk on a q8 layer ──

@pytest.mark.parametrize("mode", Q8_MODES)
@pytest.mark.parametrize("window", [None, 16])
def test_attend_chunk_dequantizes_once_and_matches_f64_over_dequantized_rows(mode, window, monkeypatch):
    nkv, hd, hpk, s0, b = 2, 40, 2, 70, 6
    c = layer(nkv, hd, mode)
    x, y = rand_rows(s0 + b, nkv, hd, seed=14), rand_rows(s0 + b, nkv, hd, seed=15)
    for p in range(s0 + b):
        c.append(x[p], y[p])
    st = c.storage
    kd, vd = np.empty_like(x), np.empty_like(y)
    xl = Q8_EXACT_ROWS
    for g in range(nkv):
        kd[:, g] = (ref_dequant(st.kq[g, :s0 + b], st.ks[g, :s0 + b], 32) * st.kcol[g]
                    if mode.quant_k else x[:, g])
        vd[:, g] = (ref_dequant(st.vq[g, :s0 + b], st.vs[g, :s0 + b, None], hd) * st.vcol[g]
                    if mode.quant_v else y[:, g])
        # the exact rows are attended as appended (up to x / col * col rounding)
        kd[:xl, g], vd[:xl, g] = x[:xl, g], y[:xl, g]
    calls = []
    import kvreg.attention

    real = kvreg.attention.widened_rows
    monkeypatch.setattr(kvreg.attention, "widened_rows", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    q = rand_rows(b, nkv * hpk, hd, seed=16) * np.float32(0.3)
    out = c.attend_chunk(q, b, s0, hpk, window=window)
    assert len(calls) == 1, "the key range is dequantized once per call"
    ref = attention_oracle(q, kd, vd, 1.0 / np.sqrt(hd), positions=s0 + np.arange(b), window=window)
    err = np.abs(out - ref).max() / max(np.abs(ref).max(), 1.0)
    assert err <= 1e-4, err


@pytest.mark.parametrize("bad", [-1, 1.5, "4", None])
def test_q8_exact_rows_must_be_a_nonnegative_int(bad):
    from kvreg import KvCache, KvregError
    with pytest.raises(KvregError, match="q8_exact_rows"):
        LayerKvCache(2, 8, KvMode.Q8_2F, "reference", q8_exact_rows=bad)
    with pytest.raises(KvregError, match="q8_exact_rows"):
        KvCache(2, 2, 8, 64, mode=KvMode.Q8_2F, backend="reference", q8_exact_rows=bad)


def test_exact_rows_hold_the_first_rows_as_appended_in_field_space():
    nkv, hd = 2, 40
    c = layer(nkv, hd, KvMode.Q8_2F, 3)
    x, y = rand_rows(70, nkv, hd, seed=30), rand_rows(70, nkv, hd, seed=31)
    c.extend(x[:10], y[:10])
    st = c.storage
    assert st.xlen.tolist() == [3, 3]
    assert np.array_equal(st.xk[:, :3], x[:3].transpose(1, 0, 2)), "before the freeze: the rows as appended"
    c.extend(x[10:], y[10:])
    assert st.field_frozen()
    for h in range(nkv):
        assert np.array_equal(st.xk[h, :3], x[:3, h] / st.kcol[h]), "after it: divided by the field"
        assert np.array_equal(st.xv[h, :3], y[:3, h] / st.vcol[h])
        # what attention reads: the exact rows back at their scale, the rest int8
        np.testing.assert_allclose(st.attended_rows("k", h, 0, 3), x[:3, h], rtol=1e-6)
        assert np.abs(st.attended_rows("k", h, 3, 70) - x[3:, h]).max() > 1e-4


@pytest.mark.parametrize("mode", [KvMode.Q8, KvMode.Q8K, KvMode.Q8V])
def test_field_free_modes_never_freeze_and_store_the_rotated_window_rows(mode):
    """q8/q8k/q8v quantize every row against its own scales only (no field,
    past 64 rows either): the newest Q8_WINDOW rows of a quantized side are
    float16, every older row the quantizer's int8 of its float16 value, rows
    Walsh-Hadamard rotated first."""
    from kvreg.modes import Q8_WINDOW
    from kvreg.quant import fwht, quantize_rows

    rng = np.random.default_rng(3)
    nkv, hd, n = 2, 64, 130
    x = (rng.standard_normal((n, nkv, hd)) * (1 + 9 * (np.arange(hd) % 7 == 0))).astype(np.float32)
    y = rng.standard_normal((n, nkv, hd)).astype(np.float32)
    free = layer(nkv, hd, mode)
    for p in range(n):
        free.append(x[p], y[p])
    st = free.storage
    assert not st.kcol_set.any() and not st.vcol_set.any() and not st.field_frozen()
    assert st.b8.tolist() == [n - Q8_WINDOW] * nkv
    for side, rows, rot, group, quantized in (("k", x, True, KV_K_GROUP, mode.quant_k),
                                              ("v", y, True, hd, mode.quant_v)):
        if not quantized:
            assert getattr(st, "th" + side) is None
            continue
        for h in range(nkv):
            r = fwht(rows[:, h]) if rot else rows[:, h]
            half = r.astype(np.float16)
            np.testing.assert_array_equal(getattr(st, "th" + side)[h], half[n - Q8_WINDOW:])
            q, sc = quantize_rows(half[: n - Q8_WINDOW].astype(np.float32), None, group)
            np.testing.assert_array_equal(getattr(st, side + "q")[h, : n - Q8_WINDOW], q)
            np.testing.assert_array_equal(getattr(st, side + "s")[h, : n - Q8_WINDOW].reshape(sc.shape), sc)
    assert free.trim_window(16, 0, 1) > 0, "no field to wait for: the trim runs"
