"""The v3 storage record's body: a Full/FullTail layer of any storage mode
as that storage holds it (its mode, its counts, then every array block with
its name, dtype and per-row shape), so a mode whose storage declares its
blocks travels with no change here (docs/wire.md)."""

from __future__ import annotations

import math
import struct

import numpy as np

from kvreg.errors import ShapeError, WireError
from kvreg.modes import KvMode

from ._format import (
    DTYPE_CODES,
    MAX_BLOCKS,
    MAX_NAME,
    MAX_NDIM,
    MAX_ROW_BYTES,
    U8,
    U32,
    U32_MAX,
    V3_ENTRY,
    V3_HEAD,
    BlockRecord,
    BlockSpec,
    Expect,
    LayerState,
    Reader,
    RowClass,
    StorageRecord,
    check_rows,
    dtype_code,
    dtype_name,
    empty_rows,
    f32_array,
    geometry,
    payload,
    row_bytes,
    uint,
)

MODE_NAMES = tuple(m.value for m in KvMode)


def _counts(a, name: str, heads: int) -> np.ndarray:
    a = np.asarray(a)
    if a.shape != (heads,) or a.dtype.kind not in "iu":
        raise ShapeError(f"kv export: {name} must be {heads} integers, got {a.dtype} {a.shape}")
    if heads and (int(a.min()) < 0 or int(a.max()) > U32_MAX):
        raise WireError(f"kv export: a {name} count does not fit its 32-bit field")
    return a.astype("<u4")


def _block_name(name, what: str, err) -> str:
    if not isinstance(name, str) or not name.isascii() or not name.isidentifier() or not 1 <= len(name) <= MAX_NAME:
        raise err(f"{what} {name!r} is not an ASCII identifier of 1..{MAX_NAME} characters")
    return name


def _same_dtype(a, b) -> bool:
    a, b = np.dtype(a), np.dtype(b)
    return (a.kind, a.itemsize) == (b.kind, b.itemsize)


def v3_chunks(st: LayerState) -> list:
    """The v3 storage body (docs/wire.md): refuses whatever decode would."""
    s = st.storage
    assert s is not None   # encode writes v3 for a state with a storage only
    heads, hd = int(st.num_kv_heads), int(st.head_dim)
    if s.mode not in MODE_NAMES:
        raise WireError(f"kv export: unknown KV mode {s.mode!r} (this runtime stores {', '.join(MODE_NAMES)})")
    lens, xlen = _counts(s.lens, "lens", heads), _counts(s.xlen, "xlen", heads)
    exact_cap = uint(s.exact_cap, "exact_cap", U32_MAX)
    if heads and (xlen > np.minimum(lens, exact_cap)).any():
        h = int(np.flatnonzero(xlen > np.minimum(lens, exact_cap))[0])
        raise WireError(f"kv export: head {h} has {xlen[h]} exact rows, more than its {lens[h]} rows "
                        f"or the exact-row capacity {exact_cap}")
    lin = f32_array(st.linear_state, "linear_state", 1)
    imp = f32_array(st.imp, "imp", 1)
    seq_len = uint(st.seq_len, "seq_len", U32_MAX)
    check_rows(seq_len, int(lens.max(initial=0)), imp.size, WireError, "kv export: ")
    if len(s.blocks) > MAX_BLOCKS:
        raise WireError(f"kv export: {len(s.blocks)} blocks, the format takes at most {MAX_BLOCKS}")
    table: list = []
    data: list = []
    seen = set()
    for b in s.blocks:
        sp = b.spec
        name = _block_name(sp.name, "kv export: block name", WireError)
        if name in seen:
            raise WireError(f"kv export: block {name!r} listed twice")
        seen.add(name)
        code = dtype_code(sp.dtype)
        if code is None:
            raise ShapeError(f"kv export: block {name!r} has dtype {np.dtype(sp.dtype)}, "
                             "which the wire has no code for")
        shape = tuple(int(d) for d in sp.shape)
        if len(shape) > MAX_NDIM or any(not 1 <= d <= U32_MAX for d in shape):
            raise ShapeError(f"kv export: block {name!r} per-row shape {list(shape)} (at most {MAX_NDIM} dims >= 1)")
        if row_bytes(shape, sp.dtype) > MAX_ROW_BYTES:
            raise ShapeError(f"kv export: block {name!r} rows of {row_bytes(shape, sp.dtype)} bytes, past the "
                             f"format's {MAX_ROW_BYTES}")
        rc = RowClass(sp.rows)
        nb = name.encode("ascii")
        table += [U8.pack(len(nb)), nb, V3_ENTRY.pack(code, int(rc), len(shape)),
                  struct.pack(f"<{len(shape)}I", *shape)]
        le = DTYPE_CODES[code]
        if rc is RowClass.HEAD:
            parts, want = [b.data], [(heads,) + shape]
        else:
            if len(b.data) != heads:
                raise ShapeError(f"kv export: block {name!r} has {len(b.data)} heads, want {heads}")
            counts = lens if rc is RowClass.ROWS else xlen
            parts, want = list(b.data), [(int(counts[h]),) + shape for h in range(heads)]
        for h, (a, w) in enumerate(zip(parts, want)):
            if not isinstance(a, np.ndarray) or not _same_dtype(a.dtype, sp.dtype) or a.shape != w:
                got = f"{a.dtype} {a.shape}" if isinstance(a, np.ndarray) else type(a).__name__
                raise ShapeError(f"kv export: block {name!r} (head {h}) is {got}, want "
                                 f"{dtype_name(sp.dtype)} {w}")
            if a.size:
                data.append(np.ascontiguousarray(a, dtype=le))
    nm = s.mode.encode("ascii")
    head = V3_HEAD.pack(seq_len, uint(heads, "num_kv_heads", U32_MAX), uint(hd, "head_dim", U32_MAX),
                         exact_cap, uint(lin.size, "linear state length", U32_MAX), imp.size, len(s.blocks))
    return ([U32.pack(len(nm)), nm, head, payload(lin, False), payload(imp, False), lens.tobytes(),
             xlen.tobytes()] + table + data)


# ----------------------------------------------------------------- import


def v3_body(r: Reader, expect: Expect | None) -> dict:
    start = r.o
    (m,) = r.unpack(U32, "mode name length")
    if not 1 <= m <= MAX_NAME:
        raise r.fail(f"mode name length {m} is not in 1..{MAX_NAME}", start)
    r.need(m, f"mode name ({m} bytes)", "record")
    at_name = r.o
    name = bytes(r.mv[at_name:at_name + m]).decode("ascii", "replace")
    r.o += m
    r.note(f"v3 storage body at byte {start}: mode {name!r}")
    if name not in MODE_NAMES:
        raise r.fail(f"unknown KV mode {name!r}: this runtime stores {', '.join(MODE_NAMES)}", at_name)
    schema = expect.storage if expect is not None else None
    if schema is not None and name != schema.mode:
        raise r.fail(f"the record stores {name} rows, this layer stores {schema.mode}: a v3 record imports only "
                     f"into a layer of its own mode (set layer.mode = {name!r} on an empty layer, clear() it "
                     f"first if it holds rows, then import)", at_name)
    at = r.o
    seq_len, heads, hd, exact_cap, lin, nimp, nblocks = r.unpack(V3_HEAD, "v3 storage fields")
    r.note(f"  seq_len {seq_len}, heads×hd {heads}×{hd}, exact rows per head {exact_cap}, linear state {lin} "
           f"f32 ({4 * lin} bytes), importance {nimp} f32 ({4 * nimp} bytes), {nblocks} block(s)")
    geometry(r, heads, hd, expect, at + 4)
    if schema is not None and exact_cap != schema.exact_cap:
        raise r.fail(f"the record keeps {exact_cap} exact rows per head, this layer's {name} storage keeps "
                     f"{schema.exact_cap}: build the importing layer with q8_exact_rows={exact_cap}", at + 12)
    if nblocks > MAX_BLOCKS:
        raise r.fail(f"{nblocks} blocks, the format takes at most {MAX_BLOCKS}", at + 24)
    lin_a = r.floats(lin, False, "linear state")
    imp_a = r.floats(nimp, False, "importance")
    r.need(8 * heads, f"{heads} lens and {heads} xlen counts", "record")
    lens_at = r.o
    lens = np.frombuffer(r.mv, "<u4", heads, lens_at).astype(np.int64)
    xlen = np.frombuffer(r.mv, "<u4", heads, lens_at + 4 * heads).astype(np.int64)
    r.o += 8 * heads
    if heads:
        bad = np.flatnonzero(lens > seq_len)
        if bad.size:
            h = int(bad[0])
            raise r.fail(f"a head holds {lens[h]} rows but seq_len is {seq_len} (head {h})", lens_at + 4 * h)
        bad = np.flatnonzero(xlen > np.minimum(lens, exact_cap))
        if bad.size:
            h = int(bad[0])
            raise r.fail(f"head {h} has {xlen[h]} exact rows, more than its {lens[h]} rows or the "
                         f"exact-row capacity {exact_cap}", lens_at + 4 * heads + 4 * h)
        if r.notes is not None and heads <= 64:
            r.note(f"  rows per head {lens.tolist()}, exact rows per head {xlen.tolist()}")
    check_rows(seq_len, int(lens.max(initial=0)), nimp, WireError, "kv import: ", at=at + 20)
    specs = []
    seen = set()
    want = {b.name: b for b in schema.blocks} if schema is not None else None
    for i in range(nblocks):
        e_at = r.o
        (nl,) = r.unpack(U8, f"name length of block {i}")
        if not 1 <= nl <= MAX_NAME:
            raise r.fail(f"block {i}: name length {nl} is not in 1..{MAX_NAME}", e_at)
        r.need(nl, f"name of block {i} ({nl} bytes)", "record")
        bname = bytes(r.mv[r.o:r.o + nl]).decode("ascii", "replace")
        r.o += nl
        if not (bname.isascii() and bname.isidentifier()):
            raise r.fail(f"block {i}: name {bname!r} is not an ASCII identifier", e_at + 1)
        if bname in seen:
            raise r.fail(f"block {bname!r} listed twice", e_at)
        seen.add(bname)
        code_at = r.o
        code, rc, ndim = r.unpack(V3_ENTRY, f"entry of block {bname!r}")
        if code not in DTYPE_CODES:
            raise r.fail(f"block {bname!r}: unknown dtype code {code} (known: 1..{max(DTYPE_CODES)})", code_at)
        if rc not in RowClass._value2member_map_:
            raise r.fail(f"block {bname!r}: row class {rc} is not 0 (rows), 1 (exact) or 2 (head)", code_at + 1)
        if ndim > MAX_NDIM:
            raise r.fail(f"block {bname!r}: {ndim} per-row dims, at most {MAX_NDIM}", code_at + 2)
        dims = r.unpack(struct.Struct(f"<{ndim}I"), f"per-row shape of block {bname!r}")
        if 0 in dims:
            raise r.fail(f"block {bname!r}: per-row shape {list(dims)} has a zero dim", code_at + 3)
        if row_bytes(dims, DTYPE_CODES[code]) > MAX_ROW_BYTES:
            raise r.fail(f"block {bname!r}: per-row shape {list(dims)} makes rows of "
                         f"{row_bytes(dims, DTYPE_CODES[code])} bytes, past the format's {MAX_ROW_BYTES}", code_at + 3)
        sp = BlockSpec(bname, RowClass(rc), DTYPE_CODES[code], tuple(dims))
        if want is not None:
            w = want.get(bname)
            if w is None:
                raise r.fail(f"block {bname!r} is not part of this runtime's {name} storage (it holds "
                             f"{', '.join(want)})", e_at)
            if w.rows is not sp.rows or not _same_dtype(w.dtype, sp.dtype) or tuple(w.shape) != sp.shape:
                raise r.fail(f"block {sp.describe()}, but this runtime's {name} storage holds {w.describe()}", e_at)
        specs.append(sp)
    if want is not None and len(seen) != len(want):
        missing = [n for n in want if n not in seen]
        raise r.fail(f"the record lacks block(s) {', '.join(missing)} of this runtime's {name} storage", r.o)
    blocks = []
    for sp in specs:
        per_row = math.prod(sp.shape)
        counts = lens if sp.rows is RowClass.ROWS else xlen if sp.rows is RowClass.EXACT else None
        nrows = heads if counts is None else int(counts.sum())
        count = nrows * per_row
        r.need(count * sp.dtype.itemsize, f"block {sp.name!r} ({nrows} rows × {per_row} {dtype_name(sp.dtype)})",
               "payload")
        at_b = r.o
        raw = np.frombuffer(r.mv, "u1" if sp.dtype.kind == "b" else sp.dtype, count, at_b)
        r.o += count * sp.dtype.itemsize
        r.note(f"  block {sp.describe()}: {nrows} rows, {count * sp.dtype.itemsize} bytes at byte {at_b}")
        if sp.dtype.kind == "b" and count and int(raw.max()) > 1:
            i = int(np.flatnonzero(raw > 1)[0])
            raise r.fail(f"block {sp.name!r} (bool) holds byte {raw[i]}, not 0 or 1", at_b + i)
        if not r.materialize:
            continue
        # astype always copies: fresh memory, native byte order.
        arr = raw.astype(sp.dtype.newbyteorder("="))
        data: np.ndarray | list[np.ndarray]
        if counts is None:
            data = arr.reshape((heads,) + sp.shape)
        else:
            ends = np.cumsum(counts) * per_row
            data = [arr[e - int(n) * per_row:e].reshape((int(n),) + sp.shape) for n, e in zip(counts, ends)]
        blocks.append(BlockRecord(sp, data))
    storage = StorageRecord(name, exact_cap, lens, xlen, blocks) if r.materialize else None
    return dict(seq_len=seq_len, num_kv_heads=heads, head_dim=hd, linear_state=lin_a, imp=imp_a,
                k=empty_rows(heads, hd, r.materialize), v=empty_rows(heads, hd, r.materialize),
                storage=storage, mode=name)

