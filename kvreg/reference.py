"""The NumPy reference backend: every kernel, written to be obviously right.

Bit-exact invariants (docs/kernels.md) hold here by construction:

* every Q head is scored and normalised on its own (a per-head gemv over the
  visible rows), so a group equals its heads one by one;
* only the visible slice ``[first, n)`` is ever handed to a BLAS call, and a
  slice of the same rows gives the same bits wherever it sits in memory, so a
  trimmed tail equals the untrimmed cache and ``upto`` equals the sequential
  call;
* the softmax denominator is summed sequentially (``cumsum``), so zeros in
  front of the window (the ``-inf``-masked full row) change nothing.
"""

from __future__ import annotations

import numpy as np

from . import quant
from .modes import KV_K_GROUP, KvMode
from .plugin import Backend

_SKIP = np.float32(1e-12)


def key_scores(kv, g: int, q: np.ndarray, first: int, n: int) -> np.ndarray:
    """``⟨q[h], k[g, p]⟩`` for p in ``[first, n)``, ``[nh, n-first]`` float32 (unscaled)."""
    nh = q.shape[0]
    span = n - first
    out = np.empty((nh, span), dtype=np.float32)
    if kv.tiers is not None:
        rows = kv.attended_rows("k", g, first, n)
        for h in range(nh):
            out[h] = rows @ q[h]
        return out
    if kv.dense.k is not None:
        rows = quant.from_half(kv.dense.k[g, first:n])
        for h in range(nh):
            out[h] = rows @ q[h]
        return out
    # q8 K: Σ_groups s_k · ⟨q ⊙ col_k, k_q⟩, groups summed in order; the
    # exact rows (field space) are plain dots with q ⊙ col_k.
    # The float16 window rows [w0, n) are plain dots too (widened).
    hd, q8 = kv.head_dim, kv.q8
    x1 = min(max(_exact_rows(kv, g), first), n)
    w0 = max(_window_start(kv, g, n), x1)
    kq = q8.kq[g, x1:w0].astype(np.float32)
    ks = q8.ks[g, x1:w0]
    qc = q * q8.kcol[g] if q8.kcol_set[g] else q
    win = _window_rows("thk", kv, g, w0, n)
    for h in range(nh):
        acc = np.zeros(w0 - x1, dtype=np.float32)
        for j in range(q8.ngk):
            j0, j1 = j * KV_K_GROUP, min((j + 1) * KV_K_GROUP, hd)
            acc += (kq[:, j0:j1] @ qc[h, j0:j1]) * ks[:, j]
        out[h, x1 - first:w0 - first] = acc
        if win is not None:
            out[h, w0 - first:] = win @ qc[h]
        for r in range(first, x1):
            out[h, r - first] = kv.exact.xk[g, r] @ qc[h]
    return out


def _exact_rows(kv, g: int) -> int:
    """Leading rows of head ``g`` read from the exact rows (0: none)."""
    return int(kv.exact.xlen[g]) if kv.exact is not None else 0


def _window_start(kv, g: int, n: int) -> int:
    """First row of head ``g``'s float16 window among ``[0, n)`` (``n``: none)."""
    return min(int(kv.window.b8[g]), n) if kv.window is not None else n


def _window_rows(side: str, kv, g: int, w0: int, n: int):
    """Rows ``[w0, n)`` of a side's float16 window (``"thk"``/``"thv"``),
    widened (None when empty or the side has none)."""
    th = None if kv.window is None else getattr(kv.window, side)
    if th is None or n <= w0:
        return None
    o = w0 - int(kv.window.b8[g])
    return th[g, o:o + n - w0].astype(np.float32)


def softmax_rows(s: np.ndarray, sinks: np.ndarray | None) -> np.ndarray:
    """Per-row softmax with the seed's semantics: max (with the sink), exp, a
    SEQUENTIAL sum (plus the sink's share), divide.

    Non-finite scores follow IEEE (docs/kernels.md): a NaN or +inf score, or
    a row of -inf scores with no sink, makes the max or the sum NaN and so
    every probability of the row NaN; -inf scores under a finite max get
    probability 0. (The sum of a row with a finite max is >= 1: the max's
    own term is exp(0).)

    Rows are independent: every operation is elementwise or along a row
    (``cumsum`` accumulates each row on its own), so a row's bits do not
    depend on how many rows are processed together.
    """
    m = s.max(axis=1)
    if sinks is not None:
        m = np.maximum(m, sinks)
    e = np.exp(s - m[:, None])
    z = np.cumsum(e, axis=1, dtype=np.float32)[:, -1]
    if sinks is not None:
        z = z + np.exp(sinks - m)
    with np.errstate(invalid="ignore", divide="ignore"):
        return e / z[:, None]


def value_pass(kv, g: int, p: np.ndarray, first: int, n: int) -> np.ndarray:
    """``Σ_p prob[h, p] · v[g, p]`` over ``[first, n)`` for each head."""
    nh = p.shape[0]
    hd = kv.head_dim
    out = np.empty((nh, hd), dtype=np.float32)
    if kv.dense.v is not None or kv.tiers is not None:
        rows = kv.attended_rows("v", g, first, n) if kv.tiers is not None else quant.from_half(kv.dense.v[g, first:n])
        for h in range(nh):
            w = np.where(np.abs(p[h]) < _SKIP, np.float32(0), p[h])
            out[h] = w @ rows
        return out
    # q8 V: the int8 rows with their per-row scale folded into the weight,
    # plus the exact rows (field space); the field multiplies the sum.
    q8 = kv.q8
    x1 = min(max(_exact_rows(kv, g), first), n)
    w0 = max(_window_start(kv, g, n), x1)
    vq = q8.vq[g, x1:w0].astype(np.float32)
    vs = q8.vs[g, x1:w0]
    win = _window_rows("thv", kv, g, w0, n)
    for h in range(nh):
        w = p[h, x1 - first:w0 - first] * vs
        w = np.where(np.abs(w) < _SKIP, np.float32(0), w)
        out[h] = w @ vq
        if win is not None:
            ww = np.where(np.abs(p[h, w0 - first:]) < _SKIP, np.float32(0), p[h, w0 - first:])
            out[h] = ww @ win + out[h]
        if x1 > first:
            wx = np.where(np.abs(p[h, : x1 - first]) < _SKIP, np.float32(0), p[h, : x1 - first])
            out[h] = wx @ kv.exact.xv[g, first:x1] + out[h]
    if q8.vcol_set[g]:
        out *= q8.vcol[g]
    return out


def attend_rows(kv, g, q, *, scale, first, n, softcap, sinks):
    """(out [nh, hd], probs [nh, n-first]) of KV head ``g`` over ``[first, n)``."""
    with np.errstate(over="ignore", invalid="ignore"):  # NaN/inf follow IEEE (docs/kernels.md)
        s = key_scores(kv, g, q, first, n) * np.float32(scale)
        if softcap > 0:
            c = np.float32(softcap)
            s = c * np.tanh(s / c)
        p = softmax_rows(s, sinks)
    return value_pass(kv, g, p, first, n), p


def _masked_values(p: np.ndarray, vmat: np.ndarray, mask: np.ndarray) -> np.ndarray:
    """``out[b, h] = Σ_k p[h, b, k] · vmat[k]`` over the keys row ``b`` can
    see (``mask``): one GEMM when every value is finite (a masked key's
    probability is 0, so it adds nothing); otherwise row by row over the
    visible keys, so a NaN/inf value reaches only the rows that see it
    (0 · NaN would reach the others through the GEMM)."""
    if np.isfinite(vmat).all():
        return np.einsum("hbk,kd->bhd", p, vmat, optimize=True)
    nh, b, _ = p.shape
    out = np.empty((b, nh, vmat.shape[1]), dtype=np.float32)
    for r in range(b):
        cols = np.flatnonzero(mask[r])
        out[r] = p[:, r, cols] @ vmat[cols]
    return out


class ReferenceBackend(Backend):
    """NumPy, float32, every kernel. The oracle of the exact class."""

    name = "reference"
    priority = 0
    auto = True
    is_reference = True
    native_modes = frozenset(KvMode)

    def attend_group(self, q, kv, g, *, scale, first=0, upto=None, softcap=0.0, sinks=None, imp=None):
        n = int(kv.lens[g]) if upto is None else min(int(kv.lens[g]), upto)
        if n == 0:
            return np.zeros_like(q)
        first = min(first, n - 1)
        out, p = attend_rows(kv, g, q, scale=scale, first=first, n=n, softcap=softcap, sinks=sinks)
        if imp is not None:
            m = min(imp.shape[0], n)
            for h in range(q.shape[0]):
                if m > first:
                    imp[first:m] += p[h, : m - first]
        return out

    def attend_layer(self, q, kv, *, scale, window=None, softcap=0.0, sinks=None, imp=None):
        nkv = kv.num_kv_heads
        hpk = q.shape[0] // nkv
        out = np.zeros_like(q)
        for g in range(nkv):
            n = int(kv.lens[g])
            first = max(0, n - window) if window else 0
            hs = slice(g * hpk, (g + 1) * hpk)
            out[hs] = self.attend_group(
                q[hs], kv, g, scale=scale, first=first, softcap=softcap,
                sinks=None if sinks is None else sinks[hs], imp=imp,
            )
        return out

    def attend_batch(self, q, kvs, *, scale, window=None, softcap=0.0, sinks=None, imps=None):
        out = np.zeros(q.shape, np.float32)
        for b, kv in enumerate(kvs):
            out[b] = self.attend_layer(q[b], kv, scale=scale, window=window, softcap=softcap,
                                       sinks=None if sinks is None else sinks[b], imp=None if imps is None else imps[b])
        return out

    def attend_chunk(self, q, kv, *, s0, b, hpk, scale, window=None, imp=None):
        n = s0 + b
        nkv = kv.num_kv_heads
        nh = nkv * hpk
        hd = kv.head_dim
        # The window bounds the keys of the whole chunk: O(b·(b+w)), not O(b·n).
        lo0 = min(max(0, s0 + 1 - window), n) if window else 0
        nk = n - lo0
        rows = np.arange(b)
        allowed = s0 + rows + 1 - lo0                        # exclusive end per row
        lo = np.maximum(0, s0 + rows + 1 - window) - lo0 if window else np.zeros(b, dtype=np.int64)
        cols = np.arange(nk)
        mask = (cols[None, :] >= lo[:, None]) & (cols[None, :] < allowed[:, None])
        out = np.empty((b, nh, hd), dtype=np.float32)
        for g in range(nkv):
            kmat = quant.from_half(kv.dense.k[g, lo0:n])
            vmat = quant.from_half(kv.dense.v[g, lo0:n])
            qg = q[:, g * hpk:(g + 1) * hpk, :]               # [b, hpk, hd]
            s = np.einsum("bhd,kd->hbk", qg, kmat, optimize=True) * np.float32(scale)
            s = np.where(mask[None], s, -np.inf)
            with np.errstate(invalid="ignore"):
                s -= s.max(axis=2, keepdims=True)
                np.exp(s, out=s)
                s /= s.sum(axis=2, keepdims=True)
            # A poisoned row (NaN or +inf score) is NaN at its visible keys
            # only: its masked keys get probability 0, not NaN (IEEE would
            # spread the NaN to keys the row cannot see).
            s = np.where(mask[None], s, np.float32(0))
            out[:, g * hpk:(g + 1) * hpk, :] = _masked_values(s, vmat, mask)
            if imp is not None:
                ni = min(imp.shape[0], n)
                if ni > lo0:
                    imp[lo0:ni] += s.sum(axis=(0, 1))[: ni - lo0]
        return out

    def quantize_rows(self, x, col, *, group):
        return quant.quantize_rows(x, col, group)

    def freeze_field(self, q, s, *, group):
        return quant.freeze_field(q, s, group)

    def gather_rows(self, rows, idx):
        return rows[idx]

    def rotate_rows(self, x):
        return quant.fwht(x)
