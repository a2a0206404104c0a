"""Wire v3: every storage mode travels in its own format (docs/wire.md).

Round trips bit for bit for every non-F32 mode this runtime has (the list is
read from ``KvMode``, so a mode added later is covered once its storage
declares its blocks), the freeze state of the 2f modes, the mode policy
(v2 into another mode = extend; v3 into another mode refused), every
refusal before any state changes, v2 compatibility, the cache container,
inspect, and a fuzz run (a long one in the ``long_fuzz`` tier).
"""

from __future__ import annotations

import pathlib
import struct
import subprocess
import sys
import types
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as hs

from kvreg import KvCache, KvMode, LayerKvCache, WireError, WireKind
from kvreg.cli import main
from kvreg.modes import KV_COL_WARMUP, Q2_SINK_ROWS, Q4_SINK_ROWS, Q8_WINDOW
from kvreg.wire import (
    DTYPE_CODES,
    FLAG_CRC32,
    WIRE_VERSION_STORAGE,
    Expect,
    decode_cache,
    decode_layer,
    encode_cache,
    encode_layer,
    inspect,
)
from kvreg.wire.layer import storage_schema

MODES = [m for m in KvMode if m is not KvMode.F32]
IDS = [m.value for m in MODES]
NKV, HD, EXACT = 2, 40, 2   # hd 40: two K scale groups, the last one partial


def rows(seed, n, scale=1.0):
    rng = np.random.default_rng(seed)
    k = (rng.standard_normal((n, NKV, HD)) * scale).astype(np.float32)
    v = (rng.standard_normal((n, NKV, HD)) * scale).astype(np.float32)
    k[:, :, ::2] *= 4.0   # channel structure: the 2f field matters
    return k, v


def make(mode, n=0, seed=0, exact=EXACT, backend="reference", ragged=True):
    c = LayerKvCache(NKV, HD, mode, backend, q8_exact_rows=exact)
    if n:
        k, v = rows(seed, n)
        for p in range(n):   # head 1 dead at every third position
            c.append(k[p], v[p], [True, not ragged or p % 3 != 0])
        c.accumulate_imp(np.random.default_rng(seed + 9).random(n).astype(np.float32))
    c.linear_state = np.array([0.5, -0.25], np.float32)
    return c


def storage_bits(c):
    st = c.storage
    out = {"lens": st.lens.tolist(), "xlen": st.xlen.tolist(), "seq_len": st.seq_len,
           "imp": st.imp.tobytes(), "mode": st.mode, "exact_cap": st.exact_cap}
    for name in st.block_names():
        a = getattr(st, name)
        out[name] = b"" if a is None else b"".join(a[h, : st.lens[h]].tobytes() for h in range(NKV))
    for name in ("xk", "xv"):
        a = getattr(st, name)
        out[name] = None if a is None else b"".join(a[h, : st.xlen[h]].tobytes() for h in range(NKV))
    for name in ("kcol", "vcol", "kcol_set", "vcol_set"):
        out[name] = getattr(st, name).tobytes()
    return out


def answers(c):
    q = np.random.default_rng(77).standard_normal((NKV * 2, HD)).astype(np.float32)
    out = [c.attend_layer(q, importance=False), c.attend_layer(q, window=5, softcap=3.0, importance=False)]
    out += [c.attend(q[g * 2], g)[i] for g in range(NKV) for i in (0, 1)] if min(c.storage.lens) else []
    return out


def same_answers(a, b):
    for x, y in zip(answers(a), answers(b), strict=True):
        assert x.dtype == y.dtype and np.array_equal(x.view(np.uint32), y.view(np.uint32))


def snapshot(c):
    return (c.export_wire(), c.generation, c.seq_len, c.base, c.mode, c.linear_state.tobytes(), storage_bits(c))


# ------------------------------------------------------------ round trips

@pytest.mark.parametrize("mode", MODES, ids=IDS)
@pytest.mark.parametrize("n", [0, 1, 5, 40, 70, 130], ids=lambda n: f"{n}rows")
def test_round_trip_is_bit_for_bit(mode, n):
    a = make(mode, n, seed=n)
    blob = a.export_wire()
    assert struct.unpack_from("<I", blob, 4)[0] == WIRE_VERSION_STORAGE
    b = make(mode)
    b.import_wire(blob)
    assert b.mode is mode and b.seq_len == a.seq_len and b.pos_len == a.pos_len
    assert storage_bits(b) == storage_bits(a)
    assert np.array_equal(b.linear_state, a.linear_state)
    assert b.export_wire() == blob
    if n:
        same_answers(a, b)


@pytest.mark.parametrize("mode", [m for m in MODES if m.field], ids=lambda m: m.value)
@pytest.mark.parametrize("n", [10, KV_COL_WARMUP - 1, KV_COL_WARMUP, KV_COL_WARMUP + 1])
def test_a_2f_layer_not_yet_frozen_freezes_as_the_original_would(mode, n):
    a = make(mode, n, seed=3)
    assert a.storage.field_frozen() == (n > KV_COL_WARMUP)
    b = make(mode)
    b.import_wire(a.export_wire())
    k, v = rows(99, 80)
    for p in range(80):
        for c in (a, b):
            c.append(k[p], v[p], [p % 5 != 1, True])
    assert a.storage.field_frozen() and b.storage.field_frozen()
    assert storage_bits(b) == storage_bits(a)
    assert b.export_wire() == a.export_wire()
    same_answers(a, b)


@pytest.mark.parametrize("mode", MODES, ids=IDS)
def test_a_trimmed_layer_travels_as_a_v3_tail(mode):
    a = make(mode, 150, seed=4, ragged=False)
    assert a.trim_window(30, 2, 8) > 0 and a.base > 0
    blob = a.export_wire()
    assert blob[20] == WireKind.FullTail and struct.unpack_from("<Q", blob, 32)[0] == a.base
    b = make(mode)
    b.import_wire(blob)
    assert (b.base, b.seq_len) == (a.base, a.seq_len) and b.export_wire() == blob
    same_answers(a, b)


@pytest.mark.parametrize("mode", MODES, ids=IDS)
def test_what_follows_an_import_is_what_follows_the_original(mode):
    a = make(mode, 30, seed=5)
    b = make(mode)
    b.import_wire(a.export_wire())
    k, v = rows(6, 20)
    for c in (a, b):
        c.extend(k[:12], v[:12])
        c.truncate_last(3)
        c.accumulate_imp(np.linspace(0, 1, c.seq_len, dtype=np.float32))
        c.evict_born(25, 2, 6)
        c.extend(k[12:], v[12:], [False, True])
    assert b.export_wire() == a.export_wire()
    same_answers(a, b)


def test_an_f32_layer_still_writes_v2_bytes():
    a = make(KvMode.F32, 7)
    blob = a.export_wire()
    assert struct.unpack_from("<I", blob, 4)[0] == 2
    assert a.export_wire(True)[4] == 2 and a.export_wire(True)[21] == 1


@pytest.mark.parametrize("mode", MODES, ids=IDS)
@pytest.mark.parametrize("kind", [WireKind.Linear, WireKind.Bounded], ids=["linear", "bounded"])
def test_linear_and_bounded_kinds_stay_v2_in_every_mode(mode, kind):
    a, b = make(mode), make(mode)
    for c in (a, b):
        c.wire_kind = kind
        if kind is WireKind.Bounded:
            c.install_bounded(4)
    if kind is WireKind.Bounded:
        for p in range(6):
            a.bounded.insert(np.full(NKV * HD, p, np.float32), np.ones(NKV * HD, np.float32))
        a.seq_len = 6
    else:
        a.seq_len = 9
    blob = a.export_wire()
    assert blob[4] == 2
    b.import_wire(blob)
    assert b.mode is mode and b.seq_len == a.seq_len and b.export_wire() == blob


def test_export_f16_is_refused_on_a_storage_record():
    c = make(KvMode.Q8, 3)
    with pytest.raises(WireError, match="f16=False"):
        c.export_wire(True)


# --------------------------------------------------- the mode policy

@pytest.mark.parametrize("mode", MODES, ids=IDS)
@pytest.mark.parametrize("n", [3, 70, 130])
def test_an_f32_record_is_stored_as_extend_stores_its_rows(mode, n):
    k, v = rows(n, n)
    src = LayerKvCache(NKV, HD, KvMode.F32, "reference")
    src.extend(k, v)
    imp = np.random.default_rng(1).random(n).astype(np.float32)
    src.accumulate_imp(imp)
    src.linear_state = np.array([0.5, -0.25], np.float32)
    want = make(mode)
    want.extend(k, v)
    want.accumulate_imp(imp)
    got = make(mode)
    got.import_wire(src.export_wire())
    assert got.mode is mode and storage_bits(got) == storage_bits(want)
    assert got.export_wire() == want.export_wire()
    same_answers(got, want)


@pytest.mark.parametrize("mode", [KvMode.Q8, KvMode.Q8_2F] + [m for m in MODES if m.value in ("f16", "bf16")],
                         ids=lambda m: m.value)
def test_an_f32_record_with_a_dead_head_is_stored_as_its_first_rows(mode):
    # The v2 record keeps each head's rows, not the positions it skipped:
    # head h is taken as alive at the first rows_h positions.
    k, v = rows(8, 90)
    src = LayerKvCache(NKV, HD, KvMode.F32, "reference")
    src.extend(k[:50], v[:50])
    src.extend(k[50:], v[50:], [True, False])
    src.extend(k[:0], v[:0])
    want = make(mode)
    want.extend(k[:50], v[:50])
    want.extend(k[50:], v[50:], [True, False])
    got = make(mode)
    got.import_wire(src.export_wire())
    assert storage_bits(got) == storage_bits(want)


@pytest.mark.parametrize("mode", MODES, ids=IDS)
def test_an_f32_record_of_a_tail_and_a_position_counter(mode):
    src = make(KvMode.F32, 120, seed=2, ragged=False)
    src.trim_window(30, 2, 8)
    got = make(mode)
    got.import_wire(src.export_wire())
    assert (got.base, got.seq_len, got.pos_len) == (src.base, src.seq_len, src.pos_len)
    counter = LayerKvCache(NKV, HD, KvMode.F32, "reference")
    counter.extend(*rows(1, 5), alive=[False, False])
    got = make(mode)
    got.import_wire(counter.export_wire())
    assert got.seq_len == 5 and not got.storage.lens.any()


@pytest.mark.parametrize("mode", [m for m in MODES if m.quant_k], ids=lambda m: m.value)
def test_an_f32_record_a_q8_layer_cannot_store_is_refused_at_its_byte(mode):
    k, v = rows(3, 10)
    k[6, 1, 7] = np.nan
    src = LayerKvCache(NKV, HD, KvMode.F32, "reference")
    src.extend(k, v)
    blob = src.export_wire()
    c = make(mode, 4)
    before = snapshot(c)
    with pytest.raises(WireError, match=f"this {mode.value} layer cannot store") as info:
        c.import_wire(blob)
    assert np.isnan(struct.unpack_from("<f", blob, info.value.offset)[0])
    assert snapshot(c) == before


@pytest.mark.parametrize("src_mode", MODES, ids=IDS)
def test_a_v3_record_into_another_mode_is_refused_naming_both(src_mode):
    blob = make(src_mode, 6).export_wire()
    for dst_mode in KvMode:
        if dst_mode is src_mode:
            continue
        c = make(dst_mode, 4, seed=1)
        before = snapshot(c)
        with pytest.raises(WireError) as info:
            c.import_wire(blob)
        msg = str(info.value)
        assert f"stores {src_mode.value} rows, this layer stores {dst_mode.value}" in msg, msg
        assert f"layer.mode = '{src_mode.value}'" in msg and info.value.offset == 36
        assert snapshot(c) == before
    # ...and the way out the message names works
    c = make(KvMode.F32, 4)
    c.clear()
    c.mode = src_mode
    c.import_wire(blob)
    assert c.export_wire() == blob


def test_an_exact_row_capacity_mismatch_is_refused():
    blob = make(KvMode.Q8, 6, exact=2).export_wire()
    c = make(KvMode.Q8, 3, exact=4)
    before = snapshot(c)
    with pytest.raises(WireError, match="keeps 2 exact rows per head.*keeps 4.*q8_exact_rows=2"):
        c.import_wire(blob)
    assert snapshot(c) == before
    other = make(KvMode.Q8, exact=2)
    other.import_wire(blob)
    assert other.export_wire() == blob


# ----------------------------------------------------------- refusals

def unsealed(blob):
    """A v3 record as a kvreg before the CRC-32 wrote it: flags 0, no CRC
    (still read). The field refusals below patch these, so the structural
    check, not the CRC, speaks."""
    assert struct.unpack_from("<H", blob, 22)[0] == FLAG_CRC32
    b = bytearray(blob[:-4])
    struct.pack_into("<H", b, 22, 0)
    return bytes(b)


def sealed(blob):
    """``blob`` (an unsealed record, patched or not) with a CRC-32 that
    matches: what an exporter writes when its record itself is wrong."""
    b = bytearray(blob)
    struct.pack_into("<H", b, 22, FLAG_CRC32)
    return bytes(b) + struct.pack("<I", zlib.crc32(b))


def v3_blob(mode=KvMode.Q8_2F, n=5):
    return unsealed(make(mode, n, seed=11).export_wire())


def offsets(blob):
    """Byte offsets of the v3 fields of a Full record (docs/wire.md)."""
    m = struct.unpack_from("<I", blob, 32)[0]
    o = 36 + m
    seq_len, heads, hd, cap, lin, nimp, nblocks = struct.unpack_from("<7I", blob, o)
    lens = o + 28 + 4 * lin + 4 * nimp
    table = lens + 8 * heads
    entries, t = [], table
    for _ in range(nblocks):
        nl = blob[t]
        name = blob[t + 1:t + 1 + nl].decode()
        code, rc, ndim = blob[t + 1 + nl:t + 4 + nl]
        entries.append((name, t, code, rc, ndim))
        t += 4 + nl + 4 * ndim
    return dict(name=36, fields=o, lens=lens, xlen=lens + 4 * heads, table=table, entries=entries, payload=t)


def refused(blob, meaning, mode=KvMode.Q8_2F, at=None):
    """``blob`` (unsealed) and its sealed twin are both refused, naming the
    same field at the same byte, and change nothing."""
    c = make(mode, 4, seed=1)
    before = snapshot(c)
    for b in (bytes(blob), sealed(blob)):
        with pytest.raises(WireError) as info:
            c.import_wire(b)
        assert meaning in str(info.value), str(info.value)
        if at is not None:
            assert info.value.offset == at and f"(at byte {at})" in str(info.value)
    assert snapshot(c) == before
    return info.value


@pytest.mark.parametrize("mode", MODES, ids=IDS)
def test_every_truncation_is_refused_and_changes_nothing(mode):
    blob = make(mode, 3, seed=12).export_wire()
    c = make(mode, 4, seed=1)
    before = snapshot(c)
    for cut in range(len(blob)):
        # the CRC-32 is checked first: a cut record fails it (or is too
        # short to hold one)
        with pytest.raises(WireError, match="fails its CRC-32|truncated"):
            c.import_wire(blob[:cut])
    old = unsealed(blob)
    # every cut through the fields and the block table, and through the
    # payloads at a stride (a q4 record is tens of KB)
    table_end = offsets(old)["payload"]
    for cut in sorted(set(range(min(table_end + 64, len(old)))) | set(range(table_end, len(old), 29))):
        with pytest.raises(WireError, match="truncated|mode name length"):
            c.import_wire(old[:cut])
    assert snapshot(c) == before
    refused(old + b"\0", "1 trailing byte(s) after the record", mode, at=len(old))


def test_refuses_an_unknown_mode_naming_the_known_ones():
    blob = bytearray(v3_blob())
    blob[36:41] = b"q4_0x"
    err = refused(blob, "unknown KV mode 'q4_0x'", at=36)
    assert "q8_2f" in str(err) and "f32" in str(err)


def test_refuses_a_bad_mode_name_length():
    blob = bytearray(v3_blob())
    struct.pack_into("<I", blob, 32, 0)
    refused(blob, "mode name length 0", at=32)
    struct.pack_into("<I", blob, 32, 0xFFFF_FFFF)
    refused(blob, "mode name length 4294967295", at=32)


def test_refuses_a_bad_dtype_code_and_a_wrong_dtype():
    blob = v3_blob()
    name, t, code, rc, ndim = offsets(blob)["entries"][0]
    code_at = t + 1 + len(name)
    bad = bytearray(blob)
    bad[code_at] = 0
    refused(bad, f"block '{name}': unknown dtype code 0", at=code_at)
    bad[code_at] = 200
    refused(bad, "unknown dtype code 200", at=code_at)
    bad[code_at] = 4  # uint8 for the int8 block: same width, another dtype
    refused(bad, f"block {name}: uint8 [{HD}] per stored row, but this runtime's q8_2f storage holds "
                 f"{name}: int8 [{HD}] per stored row", at=t)


def test_refuses_a_wrong_row_class_or_shape():
    blob = v3_blob()
    name, t, code, rc, ndim = offsets(blob)["entries"][0]
    bad = bytearray(blob)
    bad[t + 2 + len(name)] = 1
    refused(bad, "per exact row, but", at=t)
    bad[t + 2 + len(name)] = 7
    refused(bad, "row class 7")
    bad = bytearray(blob)
    struct.pack_into("<I", bad, t + 4 + len(name), HD // 2)
    refused(bad, f"[{HD // 2}] per stored row, but", at=t)
    bad = bytearray(blob)
    bad[t + 3 + len(name)] = 9
    refused(bad, "9 per-row dims")


def test_refuses_an_unknown_missing_or_repeated_block():
    blob = v3_blob()
    ent = offsets(blob)["entries"]
    name, t = ent[0][0], ent[0][1]
    bad = bytearray(blob)
    bad[t + 1:t + 1 + len(name)] = b"zz"[: len(name)].ljust(len(name), b"z")
    refused(bad, "is not part of this runtime's q8_2f storage", at=t)
    bad = bytearray(blob)
    second, t2 = ent[1][0], ent[1][1]
    assert len(second) == len(name)
    bad[t2 + 1:t2 + 1 + len(name)] = name.encode()
    refused(bad, f"block '{name}' listed twice", at=t2)
    bad = bytearray(blob)
    struct.pack_into("<I", bad, offsets(blob)["fields"] + 24, len(ent) - 1)
    refused(bad, "lacks block(s) vcol_set")


def test_refuses_inconsistent_lens():
    blob = v3_blob(n=5)
    o = offsets(blob)
    bad = bytearray(blob)
    struct.pack_into("<I", bad, o["lens"] + 4, 6)
    refused(bad, "a head holds 6 rows but seq_len is 5 (head 1)", at=o["lens"] + 4)
    bad = bytearray(blob)
    struct.pack_into("<I", bad, o["xlen"], 3)   # capacity 2
    refused(bad, "head 0 has 3 exact rows", at=o["xlen"])
    q8 = v3_blob(KvMode.Q8, n=5)
    bad = bytearray(q8)
    struct.pack_into("<I", bad, offsets(q8)["lens"], 3)   # fewer rows than sent: the payload ends early
    refused(bad, "trailing byte(s)", mode=KvMode.Q8, at=len(q8) - 2 * (HD + 2 * 4 + HD + 4))
    bad = bytearray(blob[:o["lens"] - 4] + blob[o["lens"]:])   # one importance entry fewer
    struct.pack_into("<I", bad, o["fields"] + 20, 4)
    refused(bad, "4 importance entries for seq_len 5", at=o["fields"] + 20)


def test_refuses_a_bool_byte_other_than_0_or_1():
    blob = v3_blob(n=70)   # frozen: kcol_set is 1s
    at = len(blob) - NKV   # vcol_set, the last block
    bad = bytearray(blob)
    bad[at] = 2
    refused(bad, "block 'vcol_set' (bool) holds byte 2, not 0 or 1", at=at)


def test_refuses_header_fields_v3_does_not_take():
    blob = bytearray(v3_blob())
    bad = bytearray(blob)
    bad[21] = 1
    refused(bad, "f16 flag 1 on a v3 record", at=21)
    lin = make(KvMode.Q8_2F)
    lin.wire_kind = WireKind.Linear
    bad = bytearray(blob)
    bad[20] = WireKind.Linear
    with pytest.raises(WireError, match="carries Full or FullTail storage, not Linear"):
        lin.import_wire(bytes(bad))
    bad = bytearray(blob)
    struct.pack_into("<I", bad, 4, 4)
    refused(bad, "wire version 4, this runtime speaks 2 and 3", at=4)


def test_refuses_other_geometry():
    blob = v3_blob()
    c = LayerKvCache(NKV, HD // 2, KvMode.Q8_2F, "reference", q8_exact_rows=EXACT)
    with pytest.raises(WireError, match=f"peer sent {NKV}×{HD} per position"):
        c.import_wire(blob)


def test_a_v2_only_peer_refuses_a_v3_record_by_its_version():
    # The v2 codec as it was before v3, from git history (the parent of the
    # commit that added v3): a peer that predates v3 refuses the record
    # cleanly instead of misreading it.
    root = pathlib.Path(__file__).resolve().parent.parent

    def git(*args):
        return subprocess.run(["git", "-C", str(root), *args], capture_output=True, check=True,
                              timeout=60).stdout.decode()
    try:
        v3_added = git("log", "--reverse", "--format=%H", "-S", "WIRE_VERSION_STORAGE = 3", "--",
                       "kvreg/wire.py").split()[0]
        src = git("show", f"{v3_added}^:kvreg/wire.py")
    except (OSError, IndexError, subprocess.SubprocessError):
        pytest.skip("no git history to load the v2-only codec from")
    old = types.ModuleType("kvreg_wire_v2_peer")
    sys.modules[old.__name__] = old
    try:
        exec(compile(src, "wire_v2.py", "exec"), old.__dict__)
        with pytest.raises(WireError, match=r"wire version 3, this runtime speaks 2 \(at byte 4\)"):
            old.decode_layer(v3_blob(), old.Expect(NKV, HD))
        report = old.inspect(v3_blob())
        assert report.splitlines()[-1] == "ERROR: kv import: wire version 3, this runtime speaks 2 (at byte 4)"
        # ...and reads an F32 layer's export as before
        assert old.decode_layer(make(KvMode.F32, 4).export_wire(), old.Expect(NKV, HD)).seq_len == 4
    finally:
        del sys.modules[old.__name__]


# ------------------------------------------------------- layout pinned

def test_v3_layout_byte_by_byte():
    # q8v, 1 head × hd 4, 1 exact row, 2 rows: the layout of docs/wire.md,
    # written here from the storage's own arrays.
    c = LayerKvCache(1, 4, KvMode.Q8V, "reference", q8_exact_rows=1)
    c.append(np.float32([1, 2, 3, 4]), np.float32([4, -3, 2, -1]))
    c.append(np.float32([0.5, 0, 0, 1]), np.float32([1, 1, 1, 1]))
    c.accumulate_imp(np.float32([0.25, 0.75]))
    c.wire_identity, c.wire_layer = 0xABC, 7
    st = c.storage
    u32 = lambda *x: struct.pack(f"<{len(x)}I", *x)   # noqa: E731

    def entry(name, code, rc, dims):
        return bytes([len(name)]) + name.encode() + bytes([code, rc, len(dims)]) + u32(*dims)
    want = (b"CMFS" + u32(3) + struct.pack("<Q", 0xABC) + u32(7) + bytes([0, 0]) + b"\1\0" + struct.pack("<Q", 2)
            + u32(3) + b"q8v" + u32(2, 1, 4, 1, 0, 2, 6) + np.float32([0.25, 0.75]).tobytes()
            + u32(2) + u32(1)   # lens, xlen
            + entry("k", 1, 0, [4]) + entry("vq", 3, 0, [4]) + entry("vs", 1, 0, []) + entry("xv", 1, 1, [4])
            + entry("b8", 9, 2, []) + entry("thv", 2, 2, [Q8_WINDOW, 4])
            + st.k[0, :2].tobytes() + st.vq[0, :2].tobytes() + st.vs[0, :2].tobytes() + st.xv[0, :1].tobytes()
            + st.b8.astype("<i8").tobytes() + st.thv[0].tobytes())
    # both rows are still in q8v's float16 window: their int8 slots are zero
    assert not st.vq[0, :2].any() and st.b8.tolist() == [0]
    want += u32(zlib.crc32(want))   # flags bit 0: a CRC-32 of every byte before it ends the record
    assert c.export_wire() == want
    assert [d.str for d in (DTYPE_CODES[1], DTYPE_CODES[2], DTYPE_CODES[3], DTYPE_CODES[6])] == \
        ["<f4", "<f2", "|i1", "<u2"]


@pytest.mark.parametrize("mode", MODES, ids=IDS)
def test_the_block_list_is_read_from_the_storage(mode):
    schema = storage_schema(NKV, HD, mode, EXACT)
    names = [b.name for b in schema.blocks]
    probe = LayerKvCache(NKV, HD, mode, "reference", q8_exact_rows=EXACT).storage
    assert names[:len(probe.block_names())] == list(probe.block_names())
    assert ("xk" in names) == mode.quant_k and ("xv" in names) == mode.quant_v
    assert ("kcol" in names) == mode.field
    own = {KvMode.Q4: Q4_SINK_ROWS, KvMode.Q2: Q2_SINK_ROWS}     # the tiered modes keep their own sink rows
    assert schema.exact_cap == own.get(mode, EXACT if (mode.quant_k or mode.quant_v) else 0)


# --------------------------------------------------- cache container

@pytest.mark.parametrize("mode", [KvMode.Q8, KvMode.Q8_2F] + [m for m in MODES if m.value == "f16"],
                         ids=lambda m: m.value)
def test_a_whole_cache_of_v3_layers_round_trips_and_refuses_atomically(mode):
    def fill(c, seed):
        for i, lay in enumerate(c.layers):
            k, v = rows(seed + i, 20 + 30 * i)
            lay.extend(k, v)
        return c
    a = fill(KvCache(3, NKV, HD, 4096, mode=mode, backend="reference", q8_exact_rows=EXACT), 1)
    blob = a.export_wire()
    parts = decode_cache(blob)
    assert all(p[4] == 3 for p in parts)
    b = KvCache(3, NKV, HD, 4096, mode=mode, backend="reference", q8_exact_rows=EXACT)
    b.import_wire(blob)
    assert b.export_wire() == blob
    for la, lb in zip(a.layers, b.layers):
        same_answers(la, lb)
    dst = fill(KvCache(3, NKV, HD, 4096, mode=mode, backend="reference", q8_exact_rows=EXACT), 5)
    before = [snapshot(x) for x in dst.layers]
    for bad_last in (parts[2][:-1], parts[2][:36] + b"q9" + parts[2][38:]):
        with pytest.raises(WireError):
            dst.import_wire(encode_cache(parts[:2] + [bad_last]))
        assert [snapshot(x) for x in dst.layers] == before
    other = KvCache(3, NKV, HD, 4096, mode=KvMode.F32, backend="reference")
    with pytest.raises(WireError, match=f"stores {mode.value} rows, this layer stores f32"):
        other.import_wire(blob)


# ------------------------------------------------------------- inspect

def test_inspect_reports_a_v3_record():
    report = inspect(v3_blob(n=70))
    for part in ("version 3", "v3 storage body at byte 32: mode 'q8_2f'", "exact rows per head 2",
                 "rows per head [70, 46]", f"block kq: int8 [{HD}] per stored row: 116 rows",
                 "block ks: float32 [2] per stored row", "block xk: float32 [40] per exact row: 4 rows",
                 "block kcol_set: bool [] per head: 2 rows",
                 "\nOK: Full record (v3, mode q8_2f), position 70, seq_len 70, 2×40"):
        assert part in report, (part, report)
    bad = inspect(v3_blob()[:-1]).splitlines()[-1]
    assert bad.startswith("ERROR: kv import: truncated payload: block 'vcol_set'") and "(at byte" in bad


def test_cli_inspects_a_v3_file(tmp_path, capsys):
    f = tmp_path / "q8.bin"
    f.write_bytes(v3_blob())
    assert main(["wire", "inspect", str(f)]) == 0
    assert "OK: Full record (v3, mode q8_2f)" in capsys.readouterr().out


# ---------------------------------------------------------------- fuzz

SEEDS = [make(m, n, seed=n).export_wire() for m in MODES for n in (0, 3)] + [v3_blob(n=70)]
EDGE = [0, 1, 2, 3, 4, 40, 0x7FFFFFFF, 0xFFFFFFFF]


@hs.composite
def mutated(draw):
    blob = bytearray(draw(hs.sampled_from(SEEDS)))
    for _ in range(draw(hs.integers(1, 4))):
        op = draw(hs.sampled_from(["byte", "u32", "truncate", "extend", "table"]))
        if op == "byte" and blob:
            blob[draw(hs.integers(0, len(blob) - 1))] = draw(hs.integers(0, 255))
        elif op == "u32" and len(blob) >= 4:
            struct.pack_into("<I", blob, draw(hs.integers(0, len(blob) - 4)), draw(hs.sampled_from(EDGE)))
        elif op == "truncate":
            del blob[draw(hs.integers(0, len(blob))):]
        elif op == "extend":
            blob += draw(hs.binary(max_size=16))
        elif op == "table" and len(blob) > 40:
            # aim at the fields and the table (the first ~300 bytes)
            blob[draw(hs.integers(32, min(len(blob), 330) - 1))] = draw(hs.sampled_from([0, 1, 2, 3, 9, 255]))
    if len(blob) >= 36 and struct.unpack_from("<H", blob, 22)[0] == FLAG_CRC32 and draw(hs.booleans()):
        # resealed: a CRC-32 that matches, as an exporter's own fault would
        # send, so the change reaches the field checks and the install
        return sealed(unsealed(bytes(blob)))
    return bytes(blob)


@settings(max_examples=300, deadline=None, database=None, derandomize=True, suppress_health_check=list(HealthCheck))
@given(mutated())
def test_fuzzed_v3_blobs_raise_only_wire_error_and_change_nothing(blob):
    fuzzed_v3_blob_raises_only_wire_error_and_changes_nothing(blob)


@pytest.mark.long_fuzz
@settings(max_examples=100_000, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(mutated())
def test_long_fuzzed_v3_blobs_raise_only_wire_error_and_change_nothing(blob):
    fuzzed_v3_blob_raises_only_wire_error_and_changes_nothing(blob)


def fuzzed_v3_blob_raises_only_wire_error_and_changes_nothing(blob):
    assert isinstance(inspect(blob), str)
    mode = blob[36:36 + struct.unpack_from("<I", blob, 32)[0]].decode("ascii", "replace") \
        if len(blob) >= 36 and struct.unpack_from("<I", blob, 32)[0] < 16 else "q8"
    mode = KvMode(mode) if mode in {m.value for m in KvMode} else KvMode.Q8
    c = make(mode, 2, seed=1)
    before = snapshot(c)
    try:
        c.import_wire(blob)
    except WireError:
        assert snapshot(c) == before
        return
    # accepted: the layer re-exports what it took, and still works
    again = c.export_wire()
    if mode is not KvMode.F32 and blob[20] in (0, 3):
        assert again == (blob if blob[22] else sealed(blob))
    c.append(np.ones(NKV * HD, np.float32), np.ones(NKV * HD, np.float32))
    c.attend_layer(np.ones((NKV, HD), np.float32))


def test_decode_with_a_plain_expect_checks_structure_only():
    # A codec user without the layer's storage schema still gets every
    # structural check, and the record re-encodes to the same bytes.
    blob = make(KvMode.Q8_2F, 70, seed=11).export_wire()
    st = decode_layer(blob, Expect(NKV, HD))
    assert st.version == 3 and st.mode == "q8_2f" and st.storage.exact_cap == EXACT
    assert encode_layer(st, f16=False) == blob
