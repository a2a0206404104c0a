"""Slow float64 oracle of the Nyström far-field estimator (``kvreg.nystrom``).

It recomputes, from the full history and with plain loops, what a sealed
state should answer at a given decode position: no ring, no online
stabilizers, no chunking, nothing shared with the fast path except
``np.linalg.pinv`` (the definition of the pseudo-inverse, same ``rcond``).
Use it on small inputs only (the loops are per row).
"""

from __future__ import annotations

import math

import numpy as np

__all__ = ["nystrom_oracle"]


def nystrom_oracle(q_trace, k, v, t0: int, pos: int, q, *, m: int, w: int, sink: int,
                   scale: float, rcond: float = 1e-6) -> np.ndarray:
    """What a state sealed at ``t0`` rows answers for query ``q [hpk, hd]``
    once rows ``[0, pos]`` are in it (``pos >= t0 - 1``).

    ``q_trace [hpk, >= t0, hd]``: the group's prompt queries; ``k``, ``v
    [> pos, hd]``: every row of the group. Returns ``out [hpk, hd]`` float64.
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

    # landmarks, from the rows that were far at the seal
    n0 = t0 - min(sink, t0) - min(w, t0 - min(sink, t0))
    has_far = n0 > 0
    far_rows = list(range(n_sink, win_lo)) if has_far else []
    out = np.zeros((hpk, hd))
    for h in range(hpk):
        num = np.zeros(hd)
        den = 0.0
        for p in exact_rows:
            e = math.exp(scale * float(q[h] @ k[p]))
            num += e * v[p]
            den += e
        if has_far:
            me = min(m, n0)
            kt = np.zeros((me, hd))
            qt = np.zeros((me, hd))
            for j in range(me):
                lo = sink + j * n0 // me
                hi = sink + (j + 1) * n0 // me
                kt[j] = sum(k[p] for p in range(lo, hi)) / (hi - lo)
                qt[j] = sum(q_trace[h, p] for p in range(lo, hi)) / (hi - lo)
            lg = np.array([[scale * float(qt[j] @ kt[i]) for i in range(me)] for j in range(me)])
            r = lg.max(axis=1)
            m_hat = np.linalg.pinv(np.exp(lg - r[:, None]), rcond=rcond)
            # far sums with the exact max of each landmark's logits
            fl = np.array([[scale * float(qt[j] @ k[p]) for p in far_rows] for j in range(me)])
            c = fl.max(axis=1)
            z = np.array([sum(math.exp(fl[j, i] - c[j]) for i in range(len(far_rows)))
                          for j in range(me)])
            th = np.array([sum(math.exp(fl[j, i] - c[j]) * v[p] for i, p in enumerate(far_rows))
                           for j in range(me)])
            a = np.array([math.exp(scale * float(q[h] @ kt[i])) for i in range(me)])
            coef = (a @ m_hat) * np.exp(c - r)
            den_f = float(coef @ z)
            if den_f > 0:
                num += coef @ th
                den += den_f
        out[h] = num / den
    return out
