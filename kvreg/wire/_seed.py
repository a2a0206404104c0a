"""The seed's record bodies (v2): Full (also the unversioned legacy blob),
Linear and Bounded, written and read byte for byte as kv_cache.rs does."""

from __future__ import annotations

import numpy as np

from kvreg.errors import ShapeError, WireError

from ._format import (
    BOUNDED_HEAD,
    FULL_HEAD,
    LINEAR_HEAD,
    U32,
    U32_MAX,
    BoundedRecord,
    Expect,
    LayerState,
    Reader,
    check_rows,
    empty_rows,
    f32_array,
    geometry,
    payload,
    uint,
)


def check_exportable(mode_is_f32: bool, has_o1: bool, has_frozen_cols: bool) -> None:
    """Refuse, in the seed's order, a layer holding state this format does
    not describe; shipping the rest would land a plausible cache that
    answers differently."""
    if not mode_is_f32:
        raise WireError("kv export: only the F32 cache is described by this format "
                        "(q8 stores int8 rows and per-row scales)")
    if has_o1:
        raise WireError("kv export: an O(1) Nyström overlay is not part of this format — "
                        "the skeletons are irreversible and would have to travel with it")
    if has_frozen_cols:
        raise WireError("kv export: frozen columns under an F32 cache — refusing to ship "
                        "a state this format does not describe")


# ----------------------------------------------------------------- export


def full_chunks(st: LayerState, f16: bool) -> list:
    heads, hd = st.num_kv_heads, st.head_dim
    if len(st.k) != heads or len(st.v) != heads:
        raise ShapeError(f"kv export: {len(st.k)} K / {len(st.v)} V heads for a {heads}-head layer")
    lin = f32_array(st.linear_state, "linear_state", 1)
    imp = f32_array(st.imp, "imp", 1)
    chunks: list = []
    rows_max = 0
    for h in range(heads):
        k = f32_array(st.k[h], f"k[{h}]", 2)
        v = f32_array(st.v[h], f"v[{h}]", 2)
        if k.shape[1] != hd or v.shape != k.shape:
            raise ShapeError(f"kv export: head {h} K {k.shape} / V {v.shape}, want [rows, {hd}] each")
        n = uint(k.size, f"element count of head {h}", U32_MAX)
        rows_max = max(rows_max, k.shape[0])
        chunks += [U32.pack(n), payload(k, f16), U32.pack(n), payload(v, f16)]
    seq_len = uint(st.seq_len, "seq_len", U32_MAX)
    check_rows(seq_len, rows_max, imp.size, WireError, "kv export: ")
    head = FULL_HEAD.pack(int(f16), seq_len, uint(heads, "num_kv_heads", U32_MAX), uint(hd, "head_dim", U32_MAX),
                          uint(lin.size, "linear state length", U32_MAX), imp.size)
    return [head, payload(lin, False), payload(imp, False)] + chunks


def encode_full_body(state: LayerState, *, f16: bool) -> bytes:
    """The per-position record alone: the seed's legacy (unversioned) blob."""
    return b"".join(full_chunks(state, bool(f16)))


def linear_chunks(st: LayerState) -> list:
    lin = f32_array(st.linear_state, "linear_state", 1)
    return [LINEAR_HEAD.pack(uint(st.num_kv_heads, "num_kv_heads", U32_MAX), uint(st.head_dim, "head_dim", U32_MAX),
                             uint(lin.size, "linear state length", U32_MAX)),
            payload(lin, False)]


def bounded_chunks(st: LayerState, position: int, f16: bool) -> list:
    b = st.bounded
    if b is None:
        raise WireError("kv export: bounded wire kind without an installed ring")
    shape = (st.num_kv_heads, b.window, st.head_dim)
    for name in ("ring_k", "ring_v"):
        if f32_array(getattr(b, name), name, 3).shape != shape:
            raise ShapeError(f"kv export: {name} {getattr(b, name).shape}, want {shape}")
    if b.window < 1 or b.len != min(position, b.window) or b.head != position % b.window:
        raise WireError(f"kv export: ring len/head {b.len}/{b.head} inconsistent with "
                        f"position {position} (window {b.window})")
    fields = [uint(x, n, U32_MAX) for x, n in ((st.num_kv_heads, "num_kv_heads"), (st.head_dim, "head_dim"),
                                                (b.window, "window"), (b.len, "len"), (b.head, "head"))]
    return [BOUNDED_HEAD.pack(*fields), payload(b.ring_k, f16), payload(b.ring_v, f16)]


# ----------------------------------------------------------------- import


def full_body(r: Reader, expect: Expect | None, header_f16: bool | None) -> dict:
    start = r.o
    f16w, seq_len, heads, hd, lin, nimp = r.unpack(FULL_HEAD, "Full body fields")
    r.note(f"Full body at byte {start}: f16 flag {f16w}, seq_len {seq_len}, heads×hd {heads}×{hd}, "
           f"linear state {lin} f32 ({4 * lin} bytes), importance {nimp} f32 ({4 * nimp} bytes)")
    geometry(r, heads, hd, expect, start + 8)
    if f16w > 1:
        raise r.fail(f"Full body f16 flag {f16w} is neither 0 nor 1", start)
    f16 = f16w == 1
    if header_f16 is not None and header_f16 != f16:
        raise r.fail(f"header f16 flag {int(header_f16)} disagrees with the Full body's {f16w}", start)
    lin_a = r.floats(lin, False, "linear state")
    imp_a = r.floats(nimp, False, "importance")
    # Each head is at least two u32 counts: bound the loop by the bytes left.
    r.need(8 * heads, f"{heads} K/V count pairs", "record")
    ks, vs, rows_max, payload_at = [], [], 0, []
    for h in range(heads):
        pair: list[tuple[int, np.ndarray | None]] = []
        offs: list[int] = []
        for which in "KV":
            at = r.o
            (n,) = r.unpack(U32, f"{which} count of head {h}")
            if n % hd:
                raise r.fail(f"{which} of head {h} holds {n} elements, not a multiple of head_dim {hd}", at)
            if which == "V" and n != pair[0][0]:
                raise r.fail(f"head {h} holds {pair[0][0] // hd} K rows but {n // hd} V rows", at)
            offs.append(r.o)
            a = r.floats(n, f16, f"{which} of head {h}")
            pair.append((n, None if a is None else a.reshape(n // hd, hd)))
        rows_max = max(rows_max, pair[0][0] // hd)
        r.note(f"  head {h}: K and V {pair[0][0] // hd} rows each, "
               f"{2 * pair[0][0] * (2 if f16 else 4)} bytes ({'f16' if f16 else 'f32'})")
        ks.append(pair[0][1])
        vs.append(pair[1][1])
        payload_at.append(tuple(offs))
    check_rows(seq_len, rows_max, nimp, WireError, "kv import: ", at=start + 4)
    return dict(seq_len=seq_len, num_kv_heads=heads, head_dim=hd, linear_state=lin_a,
                imp=imp_a, k=ks, v=vs, payload_at=payload_at, payload_width=2 if f16 else 4)


def linear_record(r: Reader, expect: Expect | None, head: tuple) -> LayerState:
    kind, identity, layer, position = head
    at = r.o
    heads, hd, lin = r.unpack(LINEAR_HEAD, "Linear record fields")
    r.note(f"Linear record at byte {at}: heads×hd {heads}×{hd}, state {lin} f32 ({4 * lin} bytes)")
    geometry(r, heads, hd, expect, at)
    lin_a = r.floats(lin, False, "linear state")
    r.trailing()
    m = r.materialize
    return LayerState(kind, identity, layer, position, 0, position, heads, hd,
                      linear_state=lin_a, imp=np.zeros(0, np.float32),
                      k=empty_rows(heads, hd, m), v=empty_rows(heads, hd, m))


def bounded_record(r: Reader, expect: Expect | None, head: tuple, f16: bool) -> LayerState:
    kind, identity, layer, position = head
    at = r.o
    heads, hd, window, blen, bhead = r.unpack(BOUNDED_HEAD, "Bounded record fields")
    r.note(f"Bounded record at byte {at}: heads×window×hd {heads}×{window}×{hd}, len {blen}, "
           f"head {bhead}, ring K and V {2 * heads * window * hd * (2 if f16 else 4)} bytes "
           f"({'f16' if f16 else 'f32'})")
    if expect is not None:
        if expect.bounded_window is None:
            raise r.fail("bounded record for a layer without a ring", at)
        if (heads, hd, window) != (expect.num_kv_heads, expect.head_dim, expect.bounded_window):
            raise r.fail(f"bounded record {heads}×{window}×{hd} does not fit this layer's ring "
                         f"{expect.num_kv_heads}×{expect.bounded_window}×{expect.head_dim}", at)
    if window == 0:
        raise r.fail("bounded record with window 0", at + 8)
    if blen != min(position, window) or bhead != position % window:
        raise r.fail(f"bounded record len/head {blen}/{bhead} inconsistent with position "
                     f"{position} (window {window})", at + 12)
    n = heads * window * hd
    r.need(2 * n * (2 if f16 else 4), f"ring K and V ({2 * n} × {'f16' if f16 else 'f32'})", "payload")
    rk = r.floats(n, f16, "ring K")
    rv = r.floats(n, f16, "ring V")
    r.trailing()
    m = r.materialize
    if m:
        rk, rv = rk.reshape(heads, window, hd), rv.reshape(heads, window, hd)
    return LayerState(kind, identity, layer, position, 0, position, heads, hd,
                      linear_state=np.zeros(0, np.float32), imp=np.zeros(0, np.float32),
                      k=empty_rows(heads, hd, m), v=empty_rows(heads, hd, m),
                      bounded=BoundedRecord(window, blen, bhead, rk, rv))
