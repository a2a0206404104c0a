"""Accuracy of the O(1) Nyström seal against exact attention and baselines.

On :func:`kvreg.testing.realistic.realistic_qkv` data (GQA 4, two KV groups),
each configuration seals at ``t - ndec`` rows and decodes the last ``ndec``
positions. Every method is compared with the float64 exact attention:

* ``nystrom``: :class:`kvreg.nystrom.NystromState` (sinks + window + m landmarks);
* ``stream``: StreamingLLM, sinks + the most recent rows, far field dropped;
* ``pool_m``: the far field as ``m`` segment super-rows (mean key with logit
  bias ``log(count)``, mean value), sinks + window exact;
* ``pool_B``, ``born``, ``stream``: at the SAME MEMORY as the Nyström state,
  i.e. ``B = memory_bytes / (2·hd·4)`` float32 rows per group: pooling with
  ``B - sink - w`` super-rows; Born eviction keeping sinks + window + the
  ``B - sink - w`` far rows of largest accumulated attention mass (mass summed
  over up to 256 evenly spaced prompt queries: sampled for cost); stream with
  ``B - sink`` recent rows.

Columns: output relative error ``‖o−ô‖/‖o‖`` median / p99 over (position,
head); ``far`` the exact attention mass on the far rows (outside sinks and
the last ``w``); ``needle``: one far key planted to take ~half of the final
query's exact mass in group 0, and the ratio (method's far mass) / (exact far
mass) for that query, averaged over the group's heads (1.0 = the far mass is
kept; for Nyström the far mass is the clamped far denominator's share).
"""

from __future__ import annotations

import numpy as np

from kvreg import nystrom as ny
from kvreg.testing.realistic import exact_attention_f64, realistic_qkv

__all__ = ["o1_accuracy_table", "format_table"]

METHODS = ("nystrom", "stream", "pool_m", "pool_B", "born")


def _softmax_rows(q, keys, vals, bias, scale):
    """q [hpk, hd], keys/vals [n, hd], bias [n] -> (out [hpk, hd], probs [hpk, n]) f64."""
    s = scale * (q @ keys.T) + bias[None, :]
    e = np.exp(s - s.max(axis=1, keepdims=True))
    p = e / e.sum(axis=1, keepdims=True)
    return p @ vals, p


def _pool(k, v, lo, hi, nseg):
    """Segment super-rows over rows [lo, hi): (keys, vals, bias=log count)."""
    n = hi - lo
    nseg = min(nseg, n)
    b = lo + ny.segment_bounds(n, nseg)
    cnt = np.diff(b).astype(np.float64)
    ks = np.add.reduceat(k[lo:hi], b[:-1] - lo, axis=0) / cnt[:, None]
    vs = np.add.reduceat(v[lo:hi], b[:-1] - lo, axis=0) / cnt[:, None]
    return ks, vs, np.log(cnt)


def _born_keep(q, k, lo, hi, budget, scale, hs):
    """Far rows [lo, hi) of largest accumulated mass (prompt queries sampled)."""
    if budget <= 0:
        return np.zeros(0, dtype=np.int64)
    stride = max(1, hi // 256)
    mass = np.zeros(hi)
    for p in range(stride - 1, hi, stride):
        s = scale * (q[p, hs] @ k[:p + 1].T)
        e = np.exp(s - s.max(axis=1, keepdims=True))
        mass[:p + 1] += (e / e.sum(axis=1, keepdims=True)).sum(axis=0)
    far = mass[lo:hi]
    return lo + np.sort(np.argsort(-far, kind="stable")[:budget])


def _decode_group(q, k, v, g, hpk, t0, t_end, w, m, sink, scale, born_mass=True, rcond=1e-3):
    """Every method's outputs [ndec, hpk, hd] and far-mass shares [ndec, hpk]
    for KV group g over decode positions [t0, t_end)."""
    hs = slice(g * hpk, (g + 1) * hpk)
    kg = k[:, g].astype(np.float64)
    vg = v[:, g].astype(np.float64)
    st = ny.NystromState.new_group(m, w, sink, hpk, scale=scale, rcond=rcond)
    st.prefill_group(np.ascontiguousarray(q[:t0, hs].transpose(1, 0, 2)), k[:t0, g], v[:t0, g])
    budget = st.memory_bytes() // (2 * k.shape[2] * 4)
    extra = max(0, budget - sink - w)
    keep = _born_keep(q.astype(np.float64), kg, sink, t0 - w, extra, scale, hs) if born_mass else None
    res = {name: ([], []) for name in METHODS}
    for p in range(t0, t_end):
        qp = q[p, hs].astype(np.float64)
        out = st.step_group(q[p, hs], k[p, g], v[p, g])
        ne, de, nf, df = ny.nystrom_parts(q[p, hs], *st.exact_rows(), st.far, scale)
        res["nystrom"][0].append(out)
        res["nystrom"][1].append(df / (de + df))
        win_lo = p + 1 - w
        exact_idx = np.r_[np.arange(sink), np.arange(win_lo, p + 1)]
        # stream at the same memory: sinks + (budget - sink) recent rows
        idx = np.r_[np.arange(sink), np.arange(max(sink, p + 1 - (budget - sink)), p + 1)]
        o, pr = _softmax_rows(qp, kg[idx], vg[idx], np.zeros(idx.size), scale)
        res["stream"][0].append(o)
        res["stream"][1].append(pr[:, idx < win_lo].sum(axis=1) - pr[:, :sink].sum(axis=1))
        for name, nseg in (("pool_m", m), ("pool_B", max(extra, m))):
            ks, vs, bias = _pool(kg, vg, sink, win_lo, nseg)
            keys = np.r_[kg[exact_idx], ks]
            o, pr = _softmax_rows(qp, keys, np.r_[vg[exact_idx], vs],
                                  np.r_[np.zeros(exact_idx.size), bias], scale)
            res[name][0].append(o)
            res[name][1].append(pr[:, exact_idx.size:].sum(axis=1))
        if keep is not None:
            kept = keep[keep < win_lo]
            idx = np.r_[np.arange(sink), kept, np.arange(win_lo, p + 1)]
            o, pr = _softmax_rows(qp, kg[idx], vg[idx], np.zeros(idx.size), scale)
            res["born"][0].append(o)
            res["born"][1].append(pr[:, sink:sink + kept.size].sum(axis=1))
    return {n: (np.array(a), np.array(b)) for n, (a, b) in res.items() if a}, budget


def _plant_needle(q, k, v, sink, w, scale, hpk):
    """Copy k, v with one far key in group 0 taking ~half of the last query's
    exact mass (averaged over the group's heads). Returns (k, v, pos)."""
    t = k.shape[0]
    pos = sink + (t - w - sink) // 3
    k, v = k.copy(), v.copy()
    qbar = q[-1, :hpk].astype(np.float64).mean(axis=0)
    # only the probe may align with the needle: remove the direction every
    # query shares (the sink's), or the needle becomes a second sink
    common = q[:-1, :hpk].astype(np.float64).mean(axis=(0, 1))
    common /= np.linalg.norm(common)
    u = qbar - (qbar @ common) * common
    u /= np.linalg.norm(u)
    rng = np.random.default_rng(7)
    v[pos, 0] = 3.0 * rng.standard_normal(k.shape[2])
    lo, hi = 0.0, 200.0
    for _ in range(40):  # bisection on the key's norm
        beta = 0.5 * (lo + hi)
        k[pos, 0] = beta * u
        s = scale * (q[-1, :hpk].astype(np.float64) @ k[:, 0].astype(np.float64).T)
        p = np.exp(s - s.max(axis=1, keepdims=True))
        share = (p[:, pos] / p.sum(axis=1)).mean()
        lo, hi = (beta, hi) if share < 0.5 else (lo, beta)
    return k, v, pos


def o1_accuracy_table(contexts=(2048, 8192, 32768), windows=(256, 1024), ms=(16, 64), sink=4,
                      *, quick=False, ndec=32, num_heads=8, num_kv_heads=2, head_dim=64,
                      seed=0, rcond=1e-3) -> list[dict]:
    """One row (dict) per (context, window, m, method); see the module doc.
    ``quick`` shrinks to contexts (2048, 8192), window 256, ndec 16 (< 20 s)."""
    if quick:
        contexts, windows, ndec = tuple(c for c in contexts if c <= 8192) or (2048,), windows[:1], 16
    hpk = num_heads // num_kv_heads
    rows = []
    for t in contexts:
        d = realistic_qkv(t, num_heads, num_kv_heads, head_dim, seed=seed)
        q, k, v, scale = d.q, d.k, d.v, d.scale
        ref, probs = exact_attention_f64(q[t - ndec:], k, v, scale, return_probs=True)
        for w in windows:
            if t - ndec <= ny.o1_deferred_boundary(w, sink, max(ms)):
                continue
            kn, vn, npos = _plant_needle(q, k, v, sink, w, scale, hpk)
            nref, nprobs = exact_attention_f64(q[-1:, :hpk], kn[:, :1], vn[:, :1], scale,
                                               return_probs=True)
            nfar = nprobs[0, :, sink:t - w].sum(axis=1)
            for m in ms:
                outs = {}
                fars = {}
                budget = 0
                for g in range(num_kv_heads):
                    res, budget = _decode_group(q, k, v, g, hpk, t - ndec, t, w, m, sink, scale,
                                                 rcond=rcond)
                    for name, (o, f) in res.items():
                        outs.setdefault(name, []).append(o)
                        fars.setdefault(name, []).append(f)
                # far mass under exact attention, per decode position
                pos = np.arange(t - ndec, t)
                far_exact = np.array([probs[i, :, sink:p + 1 - w].sum(axis=1)
                                      for i, p in enumerate(pos)])
                nres, _ = _decode_group(q, kn, vn, 0, hpk, t - 1, t, w, m, sink, scale,
                                         rcond=rcond)
                for name in outs:
                    o = np.concatenate(outs[name], axis=1)
                    err = np.linalg.norm(o - ref, axis=-1) / np.linalg.norm(ref, axis=-1)
                    f = np.concatenate(fars[name], axis=1)
                    needle_o = nres[name][0][0]
                    rows.append(dict(
                        context=t, window=w, m=m, method=name, budget_rows=int(budget),
                        rel_median=float(np.median(err)), rel_p99=float(np.percentile(err, 99)),
                        far_exact=float(far_exact.mean()), far_est=float(f.mean()),
                        needle_share=float(nprobs[0, :, npos].mean()),
                        needle_kept=float((nres[name][1][0] / nfar).mean()),
                        needle_rel=float(np.median(np.linalg.norm(needle_o - nref[0], axis=-1)
                                                   / np.linalg.norm(nref[0], axis=-1))),
                    ))
    return rows


def format_table(rows: list[dict]) -> str:
    """A fixed-width text table of :func:`o1_accuracy_table` rows."""
    head = (f"{'ctx':>6} {'w':>5} {'m':>3} {'method':<8} {'rows':>5} {'rel_med':>8} "
            f"{'rel_p99':>8} {'far_ex':>7} {'far_est':>7} {'ndl_kept':>8} {'ndl_rel':>8}")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            f"{r['context']:>6} {r['window']:>5} {r['m']:>3} {r['method']:<8} {r['budget_rows']:>5} "
            f"{r['rel_median']:>8.4f} {r['rel_p99']:>8.4f} {r['far_exact']:>7.3f} "
            f"{r['far_est']:>7.3f} {r['needle_kept']:>8.3f} {r['needle_rel']:>8.4f}")
    return "\n".join(lines)


if __name__ == "__main__":  # python -m kvreg.o1_report [--quick]
    import sys

    print(format_table(o1_accuracy_table(quick="--quick" in sys.argv)))
