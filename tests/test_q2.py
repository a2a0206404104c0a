"""q2: KIVI's 2-bit storage (kvreg.storage.kivi): a float16 window, then
2-bit blocks of 32 rows, K per channel and V per row."""

import struct
import zlib

import numpy as np
import pytest

from kvreg import KvMode, LayerKvCache, ShapeError, WireError
from kvreg.eviction import born_keep
from kvreg.modes import Q2_GROUP, Q2_SINK_ROWS, Q2_V_GROUP, Q2_WINDOW
from kvreg.quant import quantize_int2
from kvreg.views import KiviRows, TierRows

G, W = Q2_GROUP, Q2_WINDOW


def rows(n, nkv, hd, seed=0, scale=1.0):
    r = np.random.default_rng(seed)
    return (r.standard_normal((n, nkv, hd)) * scale).astype(np.float32)


def q2(nkv=2, hd=64, backend="reference"):
    return LayerKvCache(nkv, hd, "q2", backend)


def blocks_for(n):
    """The 2-bit rows a head of ``n`` rows holds when no removal intervened."""
    return max(n - W, 0) // G * G


def same_storage(a, b):
    """Every stored row, block and window of two q2 layers, bit for bit."""
    sa, sb = a.storage, b.storage
    assert sa.lens.tolist() == sb.lens.tolist() and sa.b8.tolist() == sb.b8.tolist()
    assert sa.xlen.tolist() == sb.xlen.tolist()
    for name in sa.block_names():
        for h in range(sa.num_kv_heads):
            n = int(sa.lens[h])
            assert np.array_equal(getattr(sa, name)[h, :n], getattr(sb, name)[h, :n]), (name, h)
    for name in sa.head_block_names() + ("xk", "xv"):
        assert np.array_equal(getattr(sa, name), getattr(sb, name)), name
    assert a.export_wire() == b.export_wire()


def test_the_mode_parses_and_reads_from_the_environment(monkeypatch):
    assert KvMode.parse("q2") is KvMode.Q2 and KvMode.parse(" Q2 ") is KvMode.Q2
    monkeypatch.setenv("KVREG_KV", "q2")
    assert KvMode.from_env() is KvMode.Q2
    m = KvMode.Q2
    assert m.quant_k and m.quant_v and m.quantized and m.tiered and not m.half and not m.field
    assert not m.rotates_k and not m.rotates_v and m.window == W + G - 1


@pytest.mark.parametrize("hd", [64, 40, 5])
@pytest.mark.parametrize("chunks", [[300], [1, 62, 1, 100, 7, 129], [95, 33, 64, 108]])
def test_appends_and_extends_store_the_same_bits(hd, chunks):
    n = sum(chunks)
    k, v = rows(n, 2, hd), rows(n, 2, hd, 1)
    one, many = q2(2, hd), q2(2, hd)
    at = 0
    for c in chunks:
        one.extend(k[at:at + c], v[at:at + c])
        at += c
    for i in range(n):
        many.append(k[i], v[i])
    same_storage(one, many)
    assert one.storage.b8.tolist() == [blocks_for(n)] * 2


def test_rows_leave_the_window_in_whole_blocks():
    c = q2(1, 64)
    st = c.storage
    k = rows(200, 1, 64)
    for i in range(200):
        c.append(k[i], k[i])
        n = i + 1
        assert st.b8[0] % G == 0 and st.b8[0] == blocks_for(n)
        held = n - int(st.b8[0])
        assert held == n if n < W + G else W <= held <= W + G - 1
    # the window is the rows' float16 values, the sinks their float32 values
    assert np.array_equal(st.thk[0, :200 - st.b8[0]], k[st.b8[0]:, 0].astype(np.float16))
    assert np.array_equal(st.xk[0, :Q2_SINK_ROWS], k[:Q2_SINK_ROWS, 0])


def test_k_is_quantized_per_channel_over_its_block():
    # keys with fixed outlier channels (as real keys carry): each channel's
    # range is its own, so the outliers cost the other channels nothing
    hd = 64
    k = rows(G + W, 1, hd)
    k[:, 0, 5] += 40.0
    k[:, 0, 17] -= 25.0
    c = q2(1, hd)
    c.extend(k, k)
    st = c.storage
    assert st.b8[0] == G
    x = k[:G, 0].astype(np.float16).astype(np.float32)       # the block's rows as the window held them
    got = st.attended_rows("k", 0, Q2_SINK_ROWS, G)
    # every channel within half its own step (range / 3) of the float16 value,
    # plus the float16 rounding of the stored scale and zero
    step = (x.max(axis=0) - x.min(axis=0)) / 3
    bound = 0.5 * step * (1 + 2 ** -8) + 2 ** -10 * np.abs(x).max(axis=0)
    assert (np.abs(got - x[Q2_SINK_ROWS:]) <= bound).all()
    # the stripes: row r of the block holds channels [r*c, (r+1)*c)
    c_ = st.kc
    assert c_ == 2 and st.k2s.shape[2] == c_
    scales = st.k2s[0, :G].reshape(-1)[:hd].astype(np.float32)
    assert np.allclose(scales, step, rtol=2 ** -10)
    # the ordinary channels lose far less than a per-token 2-bit key would
    codes, s, z = quantize_int2(x, Q2_V_GROUP)
    per_token = np.abs(z.astype(np.float32)[:, [0]] + codes[:, :32] * s.astype(np.float32)[:, [0]] - x[:, :32])
    ordinary = [ch for ch in range(32) if ch not in (5, 17)]
    assert np.abs(got - x[Q2_SINK_ROWS:])[:, ordinary].max() < 0.2 * per_token[:, ordinary].max()


def test_v_is_quantized_per_row_in_groups_of_32_channels():
    hd = 64
    v = rows(G + W, 1, hd, 3)
    c = q2(1, hd)
    c.extend(v, v)
    st = c.storage
    x = v[:G, 0].astype(np.float16).astype(np.float32)
    got = st.attended_rows("v", 0, Q2_SINK_ROWS, G)
    xg = x.reshape(G, hd // Q2_V_GROUP, Q2_V_GROUP)
    step = np.repeat((xg.max(axis=2) - xg.min(axis=2)) / 3, Q2_V_GROUP, axis=1)
    bound = 0.5 * step * (1 + 2 ** -8) + 2 ** -10 * np.abs(x).max(axis=1, keepdims=True)
    assert (np.abs(got - x[Q2_SINK_ROWS:]) <= bound[Q2_SINK_ROWS:]).all()
    # the sinks are read exactly
    assert np.array_equal(st.attended_rows("v", 0, 0, Q2_SINK_ROWS), v[:Q2_SINK_ROWS, 0])


def test_the_view_reads_its_blocks_by_name():
    c = q2(1, 8)
    c.extend(rows(100, 1, 8), rows(100, 1, 8, 1))
    view = c.storage.view()
    assert type(view.tiers) is KiviRows and view.q8 is None
    assert view.array("k2") is view.tiers.k2 and view.array("b8") is view.window.b8
    assert view.array("k4") is None and view.array("t8k") is None and view.array("kq") is None
    q4 = LayerKvCache(1, 8, "q4", "reference")
    q4.extend(rows(200, 1, 8), rows(200, 1, 8, 1))
    v4 = q4.storage.view()
    assert type(v4.tiers) is TierRows and v4.array("k2") is None and v4.array("k4") is v4.tiers.k4


def attention(k, v, q):
    """float64 attention of every query head over one KV head's rows ``k``, ``v [n, hd]``."""
    s = (q.astype(np.float64) @ k.astype(np.float64).T) / np.sqrt(k.shape[1])
    p = np.exp(s - s.max(axis=1, keepdims=True))
    return (p / p.sum(axis=1, keepdims=True)) @ v.astype(np.float64)


def held(c, h=0):
    st = c.storage
    n = int(st.lens[h])
    return st.attended_rows("k", h, 0, n), st.attended_rows("v", h, 0, n)


def smooth(n, nkv, hd, seed):
    """Keys with a shared direction (as real keys), random values."""
    return rows(1, nkv, hd, seed + 100) + 0.3 * rows(n, nkv, hd, seed), rows(n, nkv, hd, seed + 1)


def check_reblocked(c, kept_k, kept_v, q, exact_k, exact_v):
    """After a removal: whole blocks, the window the rule says, and the
    attention close to the kept rows' attention as held before (``kept_*``;
    ``exact_*`` the same rows as they were handed over)."""
    st = c.storage
    n = int(st.lens[0])
    assert st.b8[0] == blocks_for(n) and n - st.b8[0] < W + G
    assert c.storage.tiers_consistent() is None
    k, v = held(c)
    got, want, f32 = attention(k, v, q), attention(kept_k, kept_v, q), attention(exact_k, exact_v, q)
    # Requantizing a key block whose rows came from several blocks adds
    # another 2-bit error to its keys (values keep their bits): measured,
    # a quarter to a third of what 2-bit storage itself costs against f32
    # (a misplaced or misread row costs more than that cost itself).
    cost = np.abs(want - f32).max()
    assert np.abs(got - want).max() <= 0.5 * cost
    assert np.abs(got - f32).max() <= 1.25 * cost
    return k, v


def test_eviction_reblocks_and_keeps_attention_close():
    k, v = smooth(400, 1, 64, 1)
    c = q2(1, 64)
    c.extend(k, v)
    for seed in range(3):     # a mass to evict by
        c.attend_layer(rows(1, 4, 64, 20 + seed)[0], importance=True)
    hk, hv = held(c)
    kept = born_keep(c.storage.imp.copy(), 250, Q2_SINK_ROWS, 50)
    c.evict_born(250, Q2_SINK_ROWS, 50)
    assert c.storage.lens[0] == kept.size == 250
    q = rows(1, 4, 64, 5)[0]
    check_reblocked(c, hk[kept], hv[kept], q, k[kept, 0], v[kept, 0])
    # the kept sinks stay exact
    assert c.storage.xlen[0] == Q2_SINK_ROWS
    assert np.array_equal(held(c)[0][:Q2_SINK_ROWS], k[:Q2_SINK_ROWS, 0])


@pytest.mark.parametrize("d", [5, G, 3 * G + 7])
def test_a_sliding_trim_reblocks_and_keeps_attention_close(d):
    k, v = smooth(300, 1, 64, 2)
    c = q2(1, 64)
    c.extend(k, v)
    hk, hv = held(c)
    blocks = {name: getattr(c.storage, name)[0, :c.storage.b8[0]].copy() for name in c.storage.block_names()}
    c.evict(300 - d)           # the oldest rows go: drop_front, as a sliding trim
    assert c.seq_len == 300 - d
    q = rows(1, 4, 64, 6)[0]
    check_reblocked(c, hk[d:], hv[d:], q, k[d:, 0], v[d:, 0])
    if d % G == 0:
        # whole blocks went: the others keep their bits, shifted
        b8 = int(c.storage.b8[0])
        for name, old in blocks.items():
            assert np.array_equal(getattr(c.storage, name)[0, :b8], old[d:d + b8]), name


def test_a_sliding_trim_aligned_to_the_blocks_changes_no_bits():
    c = q2(1, 64)
    k, v = smooth(300, 1, 64, 8)
    c.extend(k, v)
    st = c.storage
    old = {name: getattr(st, name)[0, :256].copy() for name in st.block_names()}
    hk, hv = held(c)
    assert c.trim_window(100, 0, G) == 192
    assert st.lens[0] == 108 and st.b8[0] == 64
    for name in st.block_names():
        assert np.array_equal(getattr(st, name)[0, :64], old[name][192:256]), name
    k2, v2 = held(c)
    assert np.array_equal(k2, hk[192:]) and np.array_equal(v2, hv[192:])    # every row as it was


def test_a_rollback_into_the_2bit_rows_reblocks_the_cut_block_only():
    k, v = smooth(300, 2, 64, 3)
    c = q2(2, 64)
    c.extend(k, v)
    st = c.storage
    assert st.b8.tolist() == [256, 256]
    hk, hv = held(c)
    old = {name: getattr(st, name)[:, :256].copy() for name in st.block_names()}
    c.truncate_last(60)       # 240 rows: blocks [0, 192) stay, [192, 240) back to float16
    assert st.lens.tolist() == [240, 240] and st.b8.tolist() == [192, 192]
    for name in st.block_names():
        assert np.array_equal(getattr(st, name)[:, :192], old[name][:, :192]), name
        assert not getattr(st, name)[:, 192:300].any()          # unwritten slots stay zero
    k2, _ = check_reblocked(c, hk[:240], hv[:240], rows(1, 4, 64, 7)[0], k[:240, 0], v[:240, 0])
    # the rows that went back to the window are their 2-bit values in float16
    assert np.array_equal(k2[192:], hk[192:240].astype(np.float16).astype(np.float32))
    # the rows after a rewrite are logged from the first rebuilt row on
    view = st.view()
    assert view.unchanged_rows(view.version - 1).tolist() == [192, 192]
    # and appends go on as on a layer that held these rows: blocks whole
    c.extend(*smooth(70, 2, 64, 4))
    assert st.b8.tolist() == [blocks_for(310)] * 2


def test_a_rollback_inside_the_window_changes_nothing_else():
    c = q2(1, 64)
    c.extend(rows(300, 1, 64), rows(300, 1, 64, 1))
    st = c.storage
    assert st.b8[0] == 256
    before = {name: getattr(st, name)[0, :256].copy() for name in st.block_names()}
    win = st.thk[0, :30].copy()
    c.truncate_last(14)
    assert st.lens[0] == 286 and st.b8[0] == 256
    for name, old in before.items():
        assert np.array_equal(getattr(st, name)[0, :256], old)
    assert np.array_equal(st.thk[0, :30], win) and not st.thk[0, 30:].any()


def test_a_fork_keeps_its_bits_when_the_other_reblocks():
    c = q2(1, 64)
    c.extend(*smooth(300, 1, 64, 5))
    f = c.fork()
    before = f.export_wire()
    c.evict(293)
    c.truncate_last(100)
    assert f.export_wire() == before


@pytest.mark.parametrize("nkv, hd", [(3, 64), (1, 256)])
def test_bytes_per_element_at_1k_rows_stay_well_under_q4(nkv, hd):
    n = 1024
    k = rows(n, nkv, hd)
    c, four = q2(nkv, hd), LayerKvCache(nkv, hd, "q4", "reference")
    c.extend(k, k)
    four.extend(k, k)
    per = c.memory_bytes() / (2 * nkv * hd * n)
    # 992 2-bit rows (codes 2x hd/4, K stripes 2x 2x hd/32, V stats 2x 2x hd/32
    # bytes), 32 float16 rows, 4 float32 sink rows per head
    assert c.memory_bytes() == nkv * (992 * (hd // 2 + 4 * hd // 32 + 4 * hd // 32) + 32 * hd * 4 + 4 * hd * 8)
    assert per < 0.45 and per < 0.7 * four.memory_bytes() / (2 * nkv * hd * n)


def test_a_wire_round_trip_stores_the_same_bits():
    c = q2(2, 64)
    k, v = smooth(333, 2, 64, 6)
    c.extend(k, v)
    c.truncate_last(50)            # a shorter window, then a reblocked head
    c.extend(k[:9], v[:9])
    blob = c.export_wire()
    d = q2(2, 64)
    d.import_wire(blob)
    same_storage(c, d)
    q = rows(1, 8, 64, 8)[0]
    assert np.array_equal(c.attend_layer(q), d.attend_layer(q))


def test_a_record_whose_blocks_are_not_whole_is_refused():
    c = q2(1, 64)
    c.extend(rows(200, 1, 64), rows(200, 1, 64, 1))
    blob = bytearray(c.export_wire())
    at = blob.index(b"\x02b8")
    pos = blob.index(struct.pack("<q", 160), at)
    blob[pos:pos + 8] = struct.pack("<q", 150)      # within the window's reach, not a block boundary
    blob[-4:] = struct.pack("<I", zlib.crc32(blob[:-4]))   # an exporter's own fault: its CRC-32 matches
    d = q2(1, 64)
    with pytest.raises(WireError, match="blocks"):
        d.import_wire(bytes(blob))
    assert d.seq_len == 0 and d.mode is KvMode.Q2


@pytest.mark.parametrize("bad", [np.nan, np.inf, 1e5])
def test_bad_rows_are_refused_before_anything_changes(bad):
    c = q2(1, 64)
    c.extend(rows(90, 1, 64), rows(90, 1, 64, 1))
    before = c.export_wire()
    k = rows(40, 1, 64, 2)
    k[30, 0, 3] = bad
    with pytest.raises(ShapeError, match="float16"):
        c.extend(k, k)
    with pytest.raises(ShapeError):
        c.append(k[30], k[30])
    assert c.export_wire() == before


def test_attention_follows_f32_within_the_stated_tolerance():
    nkv, hd, n = 2, 64, 600
    k, v = smooth(n, nkv, hd, 9)
    a, f = q2(nkv, hd), LayerKvCache(nkv, hd, "f32", "reference")
    a.extend(k, v)
    f.extend(k, v)
    q = rows(1, 8, hd, 3)[0]
    got, want = a.attend_layer(q), f.attend_layer(q)
    # the kernel reads the stored rows: f64 attention over them agrees to float32 rounding
    for h in range(nkv):
        kk, vv = held(a, h)
        ref = attention(kk, vv, q[4 * h:4 * h + 4])
        assert np.abs(got[4 * h:4 * h + 4] - ref).max() < 1e-5 * np.abs(ref).max() + 1e-6
    # 2-bit random values cost about 40% of the output's peak here (a third
    # of a group's range per step); rows misread (a wrong block's
    # statistics, a stripe off by one) are ~100% and uncorrelated
    assert np.abs(got - want).max() < 0.6 * np.abs(want).max()
    assert np.corrcoef(got.ravel(), want.ravel())[0, 1] > 0.85
    # attention that picks a row out (a query along one key) reads that
    # row's value: the 2-bit error of one value row, a fraction of its size
    kk = k[:, 0] - k[:, 0].mean(axis=0)
    a2, f2 = q2(1, hd), LayerKvCache(1, hd, "f32", "reference")
    a2.extend(kk[:, None], v[:, :1])
    f2.extend(kk[:, None], v[:, :1])
    qq = (40.0 * kk[100] / np.linalg.norm(kk[100]))[None]
    got, want = a2.attend_layer(qq), f2.attend_layer(qq)
    assert np.abs(got - want).max() < 0.5 * np.abs(want).max()


def test_every_backend_runs_the_reference_kernels():
    backend = pytest.importorskip("kvreg_numba.backend")
    assert KvMode.Q2 not in backend.NumbaBackend.native_modes
    k, v = smooth(200, 2, 64, 10)
    a, b = q2(2, 64), q2(2, 64, "numba")
    a.extend(k, v)
    b.extend(k, v)
    q = rows(1, 8, 64, 11)[0]
    assert np.array_equal(a.attend_layer(q), b.attend_layer(q))
