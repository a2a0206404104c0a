"""Slow float64 oracle of the Nyström far-field estimator (``kvreg.nystrom``).

It recomputes, from the full history and with plain loops, what a sealed
state should answer at a given decode position: no ring, no online
stabilizers, no chunking, no SVD (the ridge fit is solved from its normal
equations, ``λ`` from the largest eigenvalue of ``ΦᵀΦ``), nothing shared
with the fast path but the estimator's definition (module doc of
``kvreg.nystrom``). Use it on small inputs only (the loops are per row).
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["nystrom_oracle"]


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
