"""The one float64 oracle every kernel is compared with.

Plain, obvious float64 code, nothing shared with the fast paths (:mod:`kvreg.reference`
or a backend) but the storage layout of docs/kernels.md: the conformance
suite, the core's tests, the backends' own tests and the benchmarks all
compare with these functions.

* :func:`attention_oracle` is causal softmax attention (GQA, a window, soft-cap,
  learned sinks); every attention oracle below is it on other inputs:
  :func:`attend_rows_oracle` (one KV head's rows), :func:`attend_group_oracle`
  and :func:`attend_layer_oracle` (a layer's storage), :func:`attend_chunk_oracle`
  (causal prefill), :func:`bounded_attend_oracle` (the anchor ring, rotated
  with :func:`rope64`).
* Storage readers: :func:`head_keys64` / :func:`head_values64` read a
  :class:`kvreg.storage.LayerStorage` (``layer.storage``) in every KV mode.
  q8 rows are the STORED int8 rows dequantized with their scales and field
  (:func:`dequantize64`), so a comparison checks the kernel's arithmetic, not
  the quantization error (which is the exact class, checked bit for bit
  against :func:`quantize_oracle` and the reference).
* :func:`field_rms_oracle` (the q8 field), :func:`nystrom_oracle` (the O(1)
  seal's far-field estimator, recomputed from the full history).

None mutates its input.
"""

from __future__ import annotations

import math

import numpy as np

from kvreg.errors import ShapeError
from kvreg.modes import KV_K_GROUP

__all__ = [
    "attention_oracle", "attend_rows_oracle", "attend_group_oracle", "attend_layer_oracle",
    "attend_chunk_oracle", "importance_delta", "head_keys64", "head_values64", "dequantize64",
    "field_rms_oracle", "quantize_oracle", "rope64", "bounded_attend_oracle", "nystrom_oracle",
]


# ── attention ──

def attention_oracle(q, k, v, scale: float, *, positions=None, window: int | None = None,
                     softcap: float = 0.0, sinks=None, return_probs: bool = False):
    """Causal softmax attention in float64, GQA.

    ``q [nq, nh, hd]``, ``k``/``v [n, nkv, hd]``. Query ``i`` sits at absolute
    position ``positions[i]`` (default: the last ``nq`` positions, ``n - nq +
    i``; a single query therefore attends over all rows) and sees rows
    ``[lo, pos]`` with ``lo = max(0, pos + 1 - window)`` (all rows up to pos
    when ``window`` is None). ``softcap > 0``: each score ``s`` becomes
    ``softcap * tanh(s / softcap)``. ``sinks [nh]``: a learned sink logit per
    head that joins the max and the denominator and has no value row.

    Returns ``out [nq, nh, hd]`` float64, plus ``probs [nq, nh, n]`` (zeros
    outside the visible range) when ``return_probs``.
    """
    q = np.asarray(q)
    k = np.asarray(k)
    v = np.asarray(v)
    if q.ndim != 3 or k.ndim != 3 or v.shape != k.shape or q.shape[2] != k.shape[2]:
        raise ShapeError(
            "attention_oracle: expected q [nq, nh, hd] and k, v [n, nkv, hd] with equal hd, got "
            f"q {q.shape}, k {k.shape}, v {v.shape}"
        )
    nq, nh, hd = q.shape
    n, nkv, _ = k.shape
    if nkv == 0 or nh % nkv:
        raise ShapeError(f"attention_oracle: nh={nh} is not a multiple of nkv={nkv}")
    pos = np.arange(n - nq, n) if positions is None else np.asarray(positions, dtype=np.int64)
    if pos.shape != (nq,) or (nq and (pos.min() < 0 or pos.max() >= n)):
        raise ShapeError(f"attention_oracle: positions must be {nq} values in [0, {n})")
    if window is not None and window < 1:
        raise ShapeError(f"attention_oracle: window must be >= 1, got {window}")
    hpk = nh // nkv
    k64 = k.astype(np.float64)
    v64 = v.astype(np.float64)
    sink64 = None if sinks is None else np.asarray(sinks, dtype=np.float64)
    out = np.zeros((nq, nh, hd))
    probs = np.zeros((nq, nh, n)) if return_probs else None
    for i, p in enumerate(pos):
        lo = 0 if window is None else max(0, p + 1 - window)
        for g in range(nkv):
            hs = slice(g * hpk, (g + 1) * hpk)
            s = scale * (q[i, hs].astype(np.float64) @ k64[lo:p + 1, g].T)  # [hpk, rows]
            if softcap > 0:
                s = softcap * np.tanh(s / softcap)
            mx = s.max(axis=1)
            if sink64 is not None:
                mx = np.maximum(mx, sink64[hs])
            e = np.exp(s - mx[:, None])
            z = e.sum(axis=1)
            if sink64 is not None:
                z = z + np.exp(sink64[hs] - mx)
            pr = e / z[:, None]
            out[i, hs] = pr @ v64[lo:p + 1, g]
            if probs is not None:
                probs[i, hs, lo:p + 1] = pr
    return (out, probs) if return_probs else out


def attend_rows_oracle(q, keys, values, *, scale: float, first: int = 0, n: int | None = None,
                       softcap: float = 0.0, sinks=None):
    """The heads ``q [nh, hd]`` of one KV group over its rows ``[first, n)``
    (``keys``/``values [>= n, hd]``; ``n`` None: every row), the contract of
    ``attend_group``: ``(out [nh, hd], probs [nh, n - first])``; ``n == 0``
    gives zero output and empty ``probs``."""
    q = np.asarray(q, dtype=np.float64)
    keys = np.asarray(keys)
    n = keys.shape[0] if n is None else int(n)
    if n == 0:
        return np.zeros(q.shape), np.zeros((q.shape[0], 0))
    out, probs = attention_oracle(q[None], keys[:n, None], np.asarray(values)[:n, None], scale,
                                  positions=[n - 1], window=n - first, softcap=softcap, sinks=sinks,
                                  return_probs=True)
    return out[0], probs[0, :, first:n]


def attend_group_oracle(st, g: int, q, *, scale: float, first: int = 0, upto: int | None = None,
                        softcap: float = 0.0, sinks=None):
    """One KV group's attention over storage ``st``, the contract of ``attend_group``.

    Returns ``(out [nh, hd], probs [nh, n - first], first, n)``; ``first`` is
    clamped to ``n - 1`` as the contract does. ``n == 0`` gives zero output and
    an empty ``probs``. Importance is ``probs.sum(0)`` added at ``[first, n)``
    (see :func:`importance_delta`).
    """
    q = np.asarray(q, dtype=np.float64).reshape(-1, st.head_dim)
    n = int(st.lens[g]) if upto is None else min(int(st.lens[g]), int(upto))
    if n == 0:
        return np.zeros(q.shape), np.zeros((q.shape[0], 0)), 0, 0
    first = min(int(first), n - 1)
    out, probs = attend_rows_oracle(q, head_keys64(st, g, n), head_values64(st, g, n), scale=scale,
                                    first=first, n=n, softcap=softcap, sinks=sinks)
    return out, probs, first, n


def importance_delta(probs: np.ndarray, first: int, n: int, length: int) -> np.ndarray:
    """What ``imp`` (``length`` rows) gains from ``attend_group``: ``Σ_h probs``
    at ``[first, min(length, n))``, zero elsewhere."""
    delta = np.zeros(length)
    for p in range(first, min(length, n)):
        delta[p] = math.fsum(probs[:, p - first])
    return delta


def attend_layer_oracle(st, q, *, scale: float, window: int | None = None, softcap: float = 0.0,
                        sinks=None):
    """Every KV group (``attend_layer``): ``(out [nh, hd], imp_delta [seq_len])``."""
    q = np.asarray(q, dtype=np.float64).reshape(-1, st.head_dim)
    nkv = st.num_kv_heads
    hpk = q.shape[0] // nkv
    out = np.zeros(q.shape)
    imp = np.zeros(st.seq_len)
    for g in range(nkv):
        n = int(st.lens[g])
        first = max(0, n - window) if window else 0
        hs = slice(g * hpk, (g + 1) * hpk)
        o, p, f, nn = attend_group_oracle(st, g, q[hs], scale=scale, first=first, softcap=softcap,
                                          sinks=None if sinks is None else np.asarray(sinks)[hs])
        out[hs] = o
        if nn:
            imp += importance_delta(p, f, nn, st.seq_len)
    return out, imp


def attend_chunk_oracle(keys, values, q, *, s0: int, b: int, hpk: int, scale: float,
                        window: int | None = None):
    """Causal prefill over per-head rows ``keys``/``values`` (lists of
    ``[>= s0+b, hd]``, already dequantized): ``q [b, nh, hd]``; row ``i`` sees
    ``[max(0, s0+i+1-window), s0+i+1)``. Returns ``(out [b, nh, hd],
    imp_delta [s0+b])`` (the masked column sums)."""
    n = s0 + b
    k = np.stack([np.asarray(x)[:n] for x in keys], axis=1)
    v = np.stack([np.asarray(x)[:n] for x in values], axis=1)
    q = np.asarray(q, dtype=np.float64)
    if q.shape[1] != hpk * k.shape[1]:
        raise ShapeError(f"attend_chunk_oracle: {q.shape[1]} query heads, expected {hpk} x {k.shape[1]}")
    out, probs = attention_oracle(q, k, v, scale, positions=s0 + np.arange(b), window=window,
                                  return_probs=True)
    return out, probs.sum(axis=(0, 1))


# ── storage ──

def dequantize64(q, s, group: int, col=None) -> np.ndarray:
    """Stored int8 rows ``q [n, hd]`` in float64: ``q * s[group of d] * col``;
    ``s [n, ceil(hd / group)]`` (or ``[n]`` for one group per row), ``col
    [hd]`` the q8 field (None: 1)."""
    q = np.asarray(q)
    sc = np.asarray(s, dtype=np.float64).reshape(q.shape[0], -1)
    out = q.astype(np.float64) * sc[:, np.arange(q.shape[-1]) // group]
    return out if col is None else out * np.asarray(col, dtype=np.float64)


def _rows64(f32, q, s, col, col_set, g: int, n: int, group: int, exact, xlen, window=None) -> np.ndarray:
    """Rows ``[0, n)`` of KV head ``g`` as float64 ``[n, hd]``: the f32 (or
    f16/bf16) block when stored, else ``q * scale(group of d) * field`` in float64 (the oracle
    dequantizes so that it checks the kernel's math, not the quantization),
    the exact rows ``x * field``."""
    if window is not None and window[0] is not None:
        # q8's float16 window: rows [b8, n) are not integer yet. Exact rows win.
        th, b8 = window
        b8 = min(int(b8[g]), n)
        out = _rows64(f32, q, s, col, col_set, g, n, group, exact, xlen)
        out[b8:n] = th[g, : n - b8].astype(np.float64)
        xl = min(int(xlen[g]), n)
        if xl:
            out[:xl] = exact[g, :xl]
        return out
    if f32 is not None:
        rows = f32[g, :n]
        if rows.dtype == np.uint16:  # bfloat16 bit patterns: the top half of a float32
            rows = (rows.astype(np.uint32) << np.uint32(16)).view(np.float32)
        return np.array(rows, dtype=np.float64)
    out = dequantize64(q[g, :n], s[g, :n], group)
    xl = min(int(xlen[g]), n)
    if xl:
        out[:xl] = exact[g, :xl]
    if col_set[g]:
        out *= col[g].astype(np.float64)
    return out


def _hadamard64(hd: int) -> np.ndarray:
    """Sylvester's orthonormal Hadamard matrix in float64 (symmetric, its own inverse)."""
    h = np.ones((1, 1))
    while h.shape[0] < hd:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(hd)


def _tiered64(st, side: str, g: int, n: int) -> np.ndarray:
    """q4 and q2 rows in their tiers' float32 values (``attended_rows``),
    rotated back in float64 where the side is rotated (q4)."""
    rows = np.array(st.attended_rows(side, g, 0, n), dtype=np.float64)
    return rows @ _hadamard64(st.head_dim) if (st.rot_k if side == "k" else st.rot_v) else rows


def _side64(st, side: str, g: int, n: int | None) -> np.ndarray:
    """Rows of side ``side`` (``"k"``/``"v"``) of KV head ``g`` as float64
    ``[n, hd]``, read from a storage (``layer.storage``) or its view."""
    kv = st.view() if hasattr(st, "view") else st
    n = int(kv.lens[g]) if n is None else n
    if kv.tiers is not None:
        return _tiered64(kv, side, g, n)
    nkv = kv.num_kv_heads
    xlen = kv.array("xlen")
    rows = _rows64(kv.array(side), kv.array(side + "q"), kv.array(side + "s"), kv.array(side + "col"),
                   kv.array(side + "col_set"), g, n, KV_K_GROUP if side == "k" else kv.head_dim,
                   kv.array("x" + side), np.zeros(nkv, np.int64) if xlen is None else xlen,
                   (kv.array("th" + side), kv.window.b8) if kv.window is not None else None)
    return rows @ _hadamard64(kv.head_dim) if (kv.rot_k if side == "k" else kv.rot_v) else rows


def head_keys64(st, g: int, n: int | None = None) -> np.ndarray:
    """Keys of KV head ``g`` as float64 ``[n, hd]``, dequantized under q8 K."""
    return _side64(st, "k", g, n)


def head_values64(st, g: int, n: int | None = None) -> np.ndarray:
    """Values of KV head ``g`` as float64 ``[n, hd]``, dequantized under q8 V."""
    return _side64(st, "v", g, n)


def field_rms_oracle(rows) -> np.ndarray:
    """The q8 field over dequantized rows ``[n, hd]``: ``max(sqrt(mean x²), 1e-6)``."""
    rows = np.asarray(rows, dtype=np.float64)
    n, hd = rows.shape
    return np.array([max(math.sqrt(math.fsum(rows[p, d] ** 2 for p in range(n)) / n), 1e-6)
                     for d in range(hd)])


def _round_half_away(x):
    t = np.trunc(x)
    f = x - t
    return (t + np.where(f >= 0.5, 1.0, 0.0) - np.where(f <= -0.5, 1.0, 0.0)).astype(np.float32)


def quantize_oracle(x, col, group: int):
    """``quantize_rows`` row by row in float32 numpy: NaN ignored by the
    group's absmax (Rust's f32::max), NaN -> 0, ties away from zero, clamp
    127. ``col [1 or n, hd]`` (None: 1). Returns ``(q int8 [n, hd], s
    float32 [n, groups])``."""
    x = np.asarray(x, np.float32)
    n, hd = x.shape
    ng = -(-hd // group)
    q = np.zeros((n, hd), np.int8)
    s = np.zeros((n, ng), np.float32)
    with np.errstate(all="ignore"):
        for i in range(n):
            r = x[i] / col[i if col.shape[0] > 1 else 0] if col is not None else x[i].copy()
            for j in range(ng):
                rg = r[j * group:(j + 1) * group]
                a = np.abs(rg)
                amax = np.float32(a[~np.isnan(a)].max()) if (~np.isnan(a)).any() else np.float32(0)
                sc = max(np.float32(amax / np.float32(127)), np.float32(1e-12))
                s[i, j] = sc
                qq = _round_half_away(rg / np.float32(sc))
                qq = np.clip(qq, -127, 127)
                qq[np.isnan(qq)] = 0
                q[i, j * group:(j + 1) * group] = qq.astype(np.int8)
    return q, s


# ── RoPE and the bounded ring ──

def rope64(x, positions, theta: float, rotary_dims: int | None = None) -> np.ndarray:
    """Rotate-half RoPE of ``x [rows, ..., hd]`` at ``positions [rows]``, float64.

    With ``rd = rotary_dims`` (None: ``hd``), channel ``i < rd/2`` pairs with
    ``i + rd/2`` and turns by ``pos * theta**(-2i/rd)``; channels from ``rd``
    on are left as they are.
    """
    x64 = np.asarray(x, dtype=np.float64)
    rd = x64.shape[-1] if rotary_dims is None else int(rotary_dims)
    if rd % 2 or rd > x64.shape[-1]:
        raise ShapeError(f"rope64: rotary dims must be even and <= {x64.shape[-1]}, got {rd}")
    half = rd // 2
    if half == 0:
        return x64.copy()
    inv = theta ** (-np.arange(half, dtype=np.float64) * 2.0 / rd)
    ang = np.asarray(positions, dtype=np.float64)[:, None] * inv[None, :]
    shape = (ang.shape[0],) + (1,) * (x64.ndim - 2) + (half,)
    cos, sin = np.cos(ang).reshape(shape), np.sin(ang).reshape(shape)
    a, b = x64[..., :half], x64[..., half:rd]
    return np.concatenate([a * cos - b * sin, b * cos + a * sin, x64[..., rd:]], axis=-1)


def bounded_attend_oracle(
    q, ring_k, ring_v, seen, sink_k, sink_v, group_windows, rope, scale, num_heads
) -> np.ndarray:
    """Float64 ``[num_heads, hd]`` answer of the bounded (``swa_sink_v1``) attend contract.

    Same arguments as :func:`kvreg.bounded.bounded_attend`, assumed valid.
    Each visible ring row is looked up by its absolute position ``t`` (slot
    ``t % window``) and rotated at ``t``, the query at ``seen - 1``; sinks
    carry no position. It shares nothing with the fast path but
    ``rope.theta`` and ``rope.rotary_dims``, so a slicing or indexing slip
    there shows up as a mismatch instead of being reproduced.
    """
    ring_k = np.asarray(ring_k, dtype=np.float64)
    ring_v = np.asarray(ring_v, dtype=np.float64)
    kvh, window, hd = ring_k.shape
    q = np.asarray(q, dtype=np.float64).reshape(num_heads, hd)
    sk = np.asarray(sink_k, dtype=np.float64).reshape(kvh, -1, hd)
    sv = np.asarray(sink_v, dtype=np.float64).reshape(kvh, -1, hd)
    theta, rd = float(rope.theta), rope.rotary_dims
    hpk = num_heads // kvh
    qr = rope64(q[None], [seen - 1], theta, rd)[0]
    out = np.zeros((num_heads, hd))
    for g in range(kvh):
        t = np.arange(seen - min(seen, window, group_windows[g]), seen)
        keys = np.concatenate([sk[g], rope64(ring_k[g, t % window], t, theta, rd)])
        vals = np.concatenate([sv[g], ring_v[g, t % window]])
        hs = slice(g * hpk, (g + 1) * hpk)
        out[hs] = attend_rows_oracle(qr[hs], keys, vals, scale=scale)[0]
    return out


# ── the O(1) seal ──
#
# The Nyström far-field estimator (kvreg.nystrom) recomputed from the full
# history with plain loops: no ring, no online stabilizers, no chunking, no
# SVD (the ridge fit is solved from its normal equations, λ from the largest
# eigenvalue of ΦᵀΦ), nothing shared with the fast path but the estimator's
# definition (module doc of kvreg.nystrom). Small inputs only.

def _recent_positions(q_trace: np.ndarray, t0: int, n: int) -> list[int]:
    """The last ``n`` positions of the trace that end a run of equal rows
    (all heads of the group compared), newest first."""
    out: list[int] = []
    for p in range(t0 - 1, -1, -1):
        if len(out) == n:
            break
        if p == t0 - 1 or not np.array_equal(q_trace[:, p], q_trace[:, p + 1]):
            out.append(p)
    return out


def _segments(lo: int, n: int, m: int) -> list[tuple[int, int]]:
    return [(lo + j * n // m, lo + (j + 1) * n // m) for j in range(m)]


def _heavy_rows(q_trace, k, t0: int, lo: int, hi: int, n: int, n_queries: int,
                scale: float) -> list[int]:
    """The ``n`` rows of ``[lo, hi)`` of largest attention mass (ties: the
    earlier row) under the queries of the last ``n_queries // hpk`` distinct
    prompt positions, every head, each over rows ``[0, p]``, summed."""
    if n <= 0:
        return []
    hpk = q_trace.shape[0]
    mass = [0.0] * (hi - lo)
    for p in _recent_positions(q_trace, t0, max(1, n_queries // hpk)):
        for h in range(hpk):
            lg = [scale * float(q_trace[h, p] @ k[r]) for r in range(p + 1)]
            mx = max(lg)
            e = [math.exp(x - mx) for x in lg]
            den = sum(e)
            for r in range(lo, min(hi, p + 1)):
                mass[r - lo] += e[r] / den
    order = sorted(range(hi - lo), key=lambda i: (-mass[i], i))
    return sorted(lo + i for i in order[:n])


def nystrom_oracle(q_trace, k, v, t0: int, pos: int, q, *, m: int, w: int, sink: int,
                   scale: float, rcond: float = 1e-3, heavy: int | None = None,
                   heavy_queries: int = 64) -> np.ndarray:
    """What a state sealed at ``t0`` rows answers for query ``q [hpk, hd]``
    once rows ``[0, pos]`` are in it (``pos >= t0 - 1``).

    ``q_trace [hpk, >= t0, hd]``: the group's prompt queries; ``k``, ``v
    [> pos, hd]``: every row of the group; ``heavy``: far rows kept exact
    (``None``: ``m``), picked by the mass of ``heavy_queries`` query vectors
    (``kvreg.nystrom.estimator.HEAVY_QUERIES``; recent positions only, its default
    ``HEAVY_EVEN = 0``). Returns ``out [hpk, hd]`` float64.
    """
    q_trace = np.asarray(q_trace, dtype=np.float64)
    k = np.asarray(k, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    q = np.asarray(q, dtype=np.float64)
    hpk, hd = q.shape
    n = pos + 1
    n_sink = min(sink, n)
    win_lo = max(n_sink, n - w)
    exact_rows = list(range(n_sink)) + list(range(win_lo, n))

    # landmarks, from the rows that were far at the seal, but the heavy ones
    n0 = t0 - min(sink, t0) - min(w, t0 - min(sink, t0))
    has_far = n0 > 0
    heavy_rows = []
    if has_far:
        h_n = min(m if heavy is None else heavy, n0 - 1)
        heavy_rows = _heavy_rows(q_trace, k, t0, sink, sink + n0, h_n, heavy_queries, scale)
        exact_rows = exact_rows[:n_sink] + heavy_rows + exact_rows[n_sink:]
    far_rows = [p for p in range(n_sink, win_lo) if p not in heavy_rows] if has_far else []
    if has_far:
        seal_far = [p for p in range(sink, sink + n0) if p not in heavy_rows]
        n1 = len(seal_far)
        me = min(m, n1)
        n_seg = (me + 1) // 2
        segs = [seal_far[a - sink:b - sink] for a, b in _segments(sink, n1, me)]
        kt = np.array([sum(k[p] for p in seg) / len(seg) for seg in segs])
        # pooled prior: segment sums at the seal, later rows join the last one
        count = np.array([float(len(seg)) for seg in segs])
        vsum = np.array([sum(v[p] for p in seg) for seg in segs])
        for p in range(sink + n0, win_lo):
            count[-1] += 1.0
            vsum[-1] += v[p]
        vlo = np.array([min(v[p, d] for p in far_rows) for d in range(hd)])
        vhi = np.array([max(v[p, d] for p in far_rows) for d in range(hd)])
        recent = _recent_positions(q_trace, t0, me - n_seg)
    out = np.zeros((hpk, hd))
    for h in range(hpk):
        num = np.zeros(hd)
        den = 0.0
        for p in exact_rows:
            e = math.exp(scale * float(q[h] @ k[p]))
            num += e * v[p]
            den += e
        if has_far:
            probes = [sum(q_trace[h, p] for p in range(a, b)) / (b - a)
                      for a, b in _segments(sink, n0, n_seg)]
            probes += [q_trace[h, p] for p in recent]
            # each probe's attention denominator over the whole prompt
            nu = [math.log(sum(math.exp(scale * float(qs @ k[p])) for p in range(t0)))
                  for qs in probes]
            phi = np.array([[math.exp(scale * float(qs @ kt[i]) - nu[s]) for i in range(me)]
                            for s, qs in enumerate(probes)])
            gram = phi.T @ phi
            lam = rcond * float(np.linalg.eigvalsh(gram).max())
            p_mat = np.linalg.solve(gram + lam * np.eye(me), phi.T)  # [me, probes]
            # W = P·F̂ + R·W₀ (the fast path keeps W₀ + P·(F̂ − Φ·W₀): the same map)
            r_mat = np.eye(me) - p_mat @ phi
            # probe far sums over the rows far now, each over its denominator
            f_num = np.array([sum(math.exp(scale * float(qs @ k[p]) - nu[s]) * v[p]
                                  for p in far_rows) for s, qs in enumerate(probes)])
            f_den = np.array([sum(math.exp(scale * float(qs @ k[p]) - nu[s]) for p in far_rows)
                              for s, qs in enumerate(probes)])
            a = np.array([math.exp(scale * float(q[h] @ kt[i])) for i in range(me)])
            den_f = float(a @ p_mat @ f_den + a @ r_mat @ count)
            num_f = a @ p_mat @ f_num + a @ r_mat @ vsum
            den_pool = float(a @ count)  # Jensen: a lower bound on the far denominator
            # the far average lies in the box of the far values
            outside = any(num_f[d] < den_f * vlo[d] or num_f[d] > den_f * vhi[d] for d in range(hd))
            if den_f < den_pool or outside:
                num_f, den_f = a @ vsum, den_pool
            num += num_f
            den += den_f
        out[h] = num / den
    return out
