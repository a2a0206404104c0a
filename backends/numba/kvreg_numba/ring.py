"""Bounded (``swa_sink_v1``) ring attention: one parallel Numba kernel.

Same contract as :func:`kvreg.bounded.bounded_attend` (tolerance class). The
reference rotates the group's whole visible window into a fresh array on
every step; here each task rotates ``SUB_ROWS`` ring rows at a time into an
L1 buffer, scores every head of the group against them (each key rotated
once, read once), and the tasks' partial softmax states are merged in block
order with the sinks, as the decode kernel does.

RoPE tables follow the reference: the query's ``cos/sin`` at ``seen - 1``
come from :meth:`BoundedRope.cos_sin`; the ring rows' come from the angle
addition of :meth:`BoundedRope.cos_sin_range` (``cos(start·f)``,
``sin(start·f)`` on the host, a cached float64 table of offsets), evaluated
in float64 and rounded once to float32 inside the kernel, so no per-step
``n·rd/2`` table is built on the host.
"""

from __future__ import annotations

import numpy as np
from numba import njit, prange

from kvreg.bounded import offset_table

from . import config
from .blocks import SUB_ROWS, accumulate, partial_slabs, scores, task_grid
from .intrinsics import fexp, lane_dot, lane_sum, max_nan
from .threads import thread_budget, thread_scratch

_FM = set(config.FASTMATH)
_CACHE = config.CACHE
_NEG_INF = np.float32(-np.inf)
_ZERO = np.float32(0.0)


@njit(parallel=True, nogil=True, cache=_CACHE)
def _ring_tables(start_cos, start_sin, c0, s0, n, tcos, tsin):
    """``tcos[j] = f32(cos(start) c0[j] - sin(start) s0[j])`` (and ``tsin``):
    cos_sin_range's arithmetic, without fast-math so it stays the same."""
    half = c0.shape[1]
    for j in prange(n):
        for i in range(half):
            tcos[j, i] = np.float32(start_cos[i] * c0[j, i] - start_sin[i] * s0[j, i])
            tsin[j, i] = np.float32(start_sin[i] * c0[j, i] + start_cos[i] * s0[j, i])


@njit(nogil=True, cache=_CACHE, fastmath=_FM)
def _rotate_rows(ring_k, g, slot0, nr, tcos, tsin, j0, kbuf):
    """Rotate ring rows ``slot0 .. slot0+nr`` (table rows ``j0 ..``) into kbuf."""
    hd = ring_k.shape[2]
    half = tcos.shape[1]
    for r in range(nr):
        x = ring_k[g, slot0 + r]
        c = tcos[j0 + r]
        s = tsin[j0 + r]
        y = kbuf[r]
        for i in range(half):
            a = x[i]
            b = x[half + i]
            y[i] = a * c[i] - b * s[i]
            y[half + i] = b * c[i] + a * s[i]
        for d in range(2 * half, hd):
            y[d] = x[d]


@njit(parallel=True, nogil=True, cache=_CACHE, fastmath=_FM)
def bounded_kernel(q, qcos, qsin, ring_k, ring_v, start, n_max, firsts, tcos, tsin,
                   sink_k, sink_v, scale, block, out, scratch):
    """``q [nh, hd]`` (raw); group ``g`` scores its sinks and table rows
    ``[firsts[g], n_max)`` (position ``start + j``, slot ``% window``)."""
    kvh, window, hd = ring_k.shape
    nh = q.shape[0]
    hpk = nh // kvh
    half = qcos.shape[0]
    nsink = sink_k.shape[1]

    qr = np.empty((nh, hd), np.float32)
    for row in range(nh):
        for i in range(half):
            a = q[row, i]
            b = q[row, half + i]
            qr[row, i] = a * qcos[i] - b * qsin[i]
            qr[row, half + i] = b * qcos[i] + a * qsin[i]
        for d in range(2 * half, hd):
            qr[row, d] = q[row, d]

    tstart, tgroup = task_grid(n_max - firsts, block)
    ntask = tstart[kvh]

    E, pm, pl, pacc, _ = partial_slabs(scratch, ntask, hpk, block, hd)

    for t in prange(ntask):
        g = tgroup[t]
        j0 = firsts[g] + (t - tstart[g]) * block
        nr = min(block, n_max - j0)
        Et = E[t]
        kbuf = np.empty((SUB_ROWS, hd), np.float32)
        # Scores, SUB_ROWS rotated rows at a time; a run never crosses the
        # ring's wrap (its slots stay contiguous).
        r = 0
        while r < nr:
            slot = (start + j0 + r) % window
            m = min(SUB_ROWS, nr - r, window - slot)
            _rotate_rows(ring_k, g, slot, m, tcos, tsin, j0 + r, kbuf)
            scores(qr, g * hpk, hpk, kbuf, m, scale, Et, r)  # rows in L1
            r += m
        for h in range(hpk):
            e = Et[h, :nr]
            mx = max_nan(e)  # lanes; the ring holds finite rows only
            for i in range(nr):  # elementwise: vectorizes without fast-math
                e[i] = fexp(e[i] - mx)
            pm[t, h] = mx
            pl[t, h] = lane_sum(e)
            for d in range(hd):
                pacc[t, h, d] = _ZERO
        r = 0
        while r < nr:
            slot = (start + j0 + r) % window
            m = min(nr - r, window - slot)
            accumulate(Et, hpk, r, ring_v[g, slot:slot + m], m, pacc[t])
            r += m

    for row in prange(nh):
        g = row // hpk
        h = row - g * hpk
        qh = qr[row]
        ss = np.empty(nsink, np.float32)
        for j in range(nsink):
            ss[j] = lane_dot(qh, sink_k[g, j]) * scale
        t0 = tstart[g]
        t1 = tstart[g + 1]
        mx = _NEG_INF
        for t in range(t0, t1):
            mx = max(mx, pm[t, h])
        for j in range(nsink):
            mx = max(mx, ss[j])
        o = out[row]
        for d in range(hd):
            o[d] = _ZERO
        z = _ZERO
        for t in range(t0, t1):
            w = fexp(pm[t, h] - mx)
            z += w * pl[t, h]
            a = pacc[t, h]
            for d in range(hd):
                o[d] += w * a[d]
        for j in range(nsink):
            w = fexp(ss[j] - mx)
            z += w
            sv = sink_v[g, j]
            for d in range(hd):
                o[d] += w * sv[d]
        for d in range(hd):
            o[d] = o[d] / z


# ---------------------------------------------------------------------------
# host side
# ---------------------------------------------------------------------------

def bounded_attend(q32, ring_k, ring_v, seen, sk, sv, gws, rope, scale, *, block=None):
    """Validated arguments (``check_bounded_attend_args``'s results) ->
    ``out [nh, hd]`` float32."""
    kvh, window, hd = ring_k.shape
    nh = q32.shape[0]
    hpk = nh // kvh
    n_max = min(seen, window, max(gws))
    start = seen - n_max
    inv = rope.inv_freq(hd)
    half = inv.shape[0]
    qcos, qsin = rope.cos_sin([seen - 1], hd)
    c0, s0 = offset_table(float(rope.theta), inv, n_max)
    a = start * inv
    block = int(block or config.BOUNDED_BLOCK)
    firsts = n_max - np.minimum(n_max, np.asarray(gws, dtype=np.int64))
    ntask = int(((n_max - firsts + block - 1) // block).sum())
    table = n_max * half
    buf = thread_scratch(2 * table + ntask * hpk * (block + 2 + hd))
    tcos = buf[:table].reshape(n_max, half)
    tsin = buf[table:2 * table].reshape(n_max, half)
    out = np.empty((nh, hd), np.float32)
    with thread_budget(int((n_max - firsts).sum()) * hd * 8, "ring"):  # K and V ring rows read
        _ring_tables(np.cos(a), np.sin(a), c0, s0, n_max, tcos, tsin)
        bounded_kernel(q32, np.ascontiguousarray(qcos[0]), np.ascontiguousarray(qsin[0]),
                       np.ascontiguousarray(ring_k), np.ascontiguousarray(ring_v), start, n_max,
                       firsts, tcos, tsin, np.ascontiguousarray(sk), np.ascontiguousarray(sv),
                       np.float32(scale), block, out, buf[2 * table:])
    return out
