"""Accuracy of the O(1) Nyström seal against exact attention and baselines.

On :func:`kvreg_conformance.data.realistic_qkv` data (GQA 4, two KV groups),
each configuration seals at ``t - ndec`` rows and decodes the last ``ndec``
positions. Every method is compared with the float64 exact attention:

* ``nystrom``: :class:`kvreg.nystrom.NystromState` (sinks + window + ``m``
  heavy rows kept exact + m landmarks; its far mass counts the heavy rows);
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
kept; for Nyström the far mass is the clamped far denominator's share; on real
data the ratio of the heads' sums, since a real head may have ~no exact far
mass and its own ratio then explodes).

Real data (:func:`o1_real_table`, ``--real``): the same table
on :func:`research.real_attention.real_qkv`, a small trained decoder's
post-RoPE Q/K/V for a held-out text (see ``research/real_attention_capture.py``), pooled
over every captured layer and head (``layer`` "all") and per layer, with one
more baseline, ``sinkwin``: the sinks and the window alone, no far field and
no extra rows (what "sinks + window" alone keeps; ``stream`` is given the
Nyström state's whole byte budget instead).

Run it from the repository root: ``python -m research.o1_report [--quick] [--real]``.
"""

from __future__ import annotations

import numpy as np

from kvreg import nystrom as ny
from kvreg.errors import ConfigError
from kvreg_conformance.data import realistic_qkv
from kvreg_conformance.oracle import attention_oracle

__all__ = ["o1_accuracy_table", "o1_real_table", "format_table"]

METHODS = ("nystrom", "stream", "pool_m", "pool_B", "born")
#: the real-data table's extra baseline: sinks + the window alone (the
#: memory of the exact rows only, without the landmark state's bytes)
SINKWIN = "sinkwin"


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


def _decode_group(q, k, v, g, hpk, t0, t_end, w, m, sink, scale, born_mass=True, rcond=1e-3,
                  sinkwin=False):
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
    res = {name: ([], []) for name in METHODS + ((SINKWIN,) if sinkwin else ())}
    for p in range(t0, t_end):
        qp = q[p, hs].astype(np.float64)
        out = st.step_group(q[p, hs], k[p, g], v[p, g])
        ke, ve = st.exact_rows()
        ne, de, nf, df = ny.nystrom_parts(q[p, hs], ke, ve, st.far, scale)
        # the far share counts the heavy rows (far rows kept exact): their
        # terms under the parts' shared max μ = logsumexp(exact logits) − log de
        se = scale * (qp @ ke.astype(np.float64).T)
        mx = se.max(axis=1)
        mu = mx + np.log(np.exp(se - mx[:, None]).sum(axis=1)) - np.log(de)
        dh = np.exp(se[:, sink:sink + st.n_heavy] - mu[:, None]).sum(axis=1)
        res["nystrom"][0].append(out)
        res["nystrom"][1].append((df + dh) / (de + df))
        win_lo = p + 1 - w
        exact_idx = np.r_[np.arange(sink), np.arange(win_lo, p + 1)]
        # stream at the same memory: sinks + (budget - sink) recent rows
        idx = np.r_[np.arange(sink), np.arange(max(sink, p + 1 - (budget - sink)), p + 1)]
        o, pr = _softmax_rows(qp, kg[idx], vg[idx], np.zeros(idx.size), scale)
        res["stream"][0].append(o)
        res["stream"][1].append(pr[:, idx < win_lo].sum(axis=1) - pr[:, :sink].sum(axis=1))
        if sinkwin:
            o, _ = _softmax_rows(qp, kg[exact_idx], vg[exact_idx], np.zeros(exact_idx.size), scale)
            res[SINKWIN][0].append(o)
            res[SINKWIN][1].append(np.zeros(hpk))
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


def _config_rows(q, k, v, scale, t, windows, ms, sink, ndec, hpk, rcond, head_blocks=None,
                 sinkwin=False, far_heavy=None):
    """Rows for one context ``t`` (the first ``t`` rows of q/k/v) over every
    (window, m, method). ``head_blocks``: optional ``{label: slice of query
    heads}`` for extra rows (``layer`` = label) computed from the same
    errors; the main rows get ``layer`` = "all" when it is given.
    ``far_heavy``: also ``rel_med_far`` / ``rel_p99_far``, the error over the
    reads (position, head) whose exact far mass is at least this, and
    ``far_reads`` (their fraction)."""
    q, k, v = q[:t], k[:t], v[:t]
    num_kv_heads = k.shape[1]
    ref, probs = attention_oracle(q[t - ndec:], k, v, scale, return_probs=True)
    rows = []
    for w in windows:
        if t - ndec <= ny.o1_deferred_boundary(w, sink, max(ms)):
            continue
        kn, vn, npos = _plant_needle(q, k, v, sink, w, scale, hpk)
        nref, nprobs = attention_oracle(q[-1:, :hpk], kn[:, :1], vn[:, :1], scale,
                                           return_probs=True)
        nfar = nprobs[0, :, sink:t - w].sum(axis=1)
        for m in ms:
            outs = {}
            fars = {}
            budget = 0
            for g in range(num_kv_heads):
                res, budget = _decode_group(q, k, v, g, hpk, t - ndec, t, w, m, sink, scale,
                                             rcond=rcond, sinkwin=sinkwin)
                for name, (o, f) in res.items():
                    outs.setdefault(name, []).append(o)
                    fars.setdefault(name, []).append(f)
            # far mass under exact attention, per decode position
            pos = np.arange(t - ndec, t)
            far_exact = np.array([probs[i, :, sink:p + 1 - w].sum(axis=1)
                                  for i, p in enumerate(pos)])
            nres, _ = _decode_group(q, kn, vn, 0, hpk, t - 1, t, w, m, sink, scale,
                                     rcond=rcond, sinkwin=sinkwin)
            blocks = {None: slice(None)} if head_blocks is None else {
                "all": slice(None), **head_blocks}
            for label, hs in blocks.items():
                for name in outs:
                    o = np.concatenate(outs[name], axis=1)[:, hs]
                    r = ref[:, hs]
                    err = np.linalg.norm(o - r, axis=-1) / np.linalg.norm(r, axis=-1)
                    f = np.concatenate(fars[name], axis=1)[:, hs]
                    needle_o = nres[name][0][0]
                    row = dict(
                        context=t, window=w, m=m, method=name,
                        budget_rows=int(sink + w if name == SINKWIN else budget),
                        rel_median=float(np.median(err)), rel_p99=float(np.percentile(err, 99)),
                        far_exact=float(far_exact[:, hs].mean()), far_est=float(f.mean()),
                        needle_share=float(nprobs[0, :, npos].mean()),
                        # real heads often put ~no exact far mass: a per-head
                        # ratio then explodes, so real rows take the ratio of sums
                        needle_kept=float((nres[name][1][0] / nfar).mean() if far_heavy is None
                                          else nres[name][1][0].sum() / nfar.sum()),
                        needle_rel=float(np.median(np.linalg.norm(needle_o - nref[0], axis=-1)
                                                   / np.linalg.norm(nref[0], axis=-1))),
                    )
                    if far_heavy is not None:
                        sel = err[far_exact[:, hs] >= far_heavy]
                        row.update(
                            far_reads=float(sel.size / err.size),
                            rel_med_far=float(np.median(sel)) if sel.size else float("nan"),
                            rel_p99_far=float(np.percentile(sel, 99)) if sel.size else float("nan"))
                    if label is not None:
                        row = {"layer": label, **row}
                    rows.append(row)
    return rows


def o1_accuracy_table(contexts=(2048, 8192, 32768), windows=(256, 1024), ms=(16, 64), sink=4,
                      *, quick=False, ndec=32, num_heads=8, num_kv_heads=2, head_dim=64,
                      seed=0, rcond=1e-3, data="realistic") -> list[dict]:
    """One row (dict) per (context, window, m, method); see the module doc.
    ``quick`` shrinks to contexts (2048, 8192), window 256, ndec 16 (< 20 s).
    ``data="real"``: the captured real-model data instead, through
    :func:`o1_real_table` (``contexts``/``windows`` then default to its own;
    the generator's shape arguments and ``seed`` do not apply)."""
    if data == "real":
        kw = dict(ms=ms, sink=sink, ndec=ndec, rcond=rcond, quick=quick)
        if contexts != (2048, 8192, 32768):
            kw["contexts"] = contexts
        if windows != (256, 1024):
            kw["windows"] = windows
        return o1_real_table(**kw)
    if data != "realistic":
        raise ConfigError(f"o1_accuracy_table: data must be 'realistic' or 'real', got {data!r}")
    if quick:
        contexts, windows, ndec = tuple(c for c in contexts if c <= 8192) or (2048,), windows[:1], 16
    hpk = num_heads // num_kv_heads
    rows = []
    for t in contexts:
        d = realistic_qkv(t, num_heads, num_kv_heads, head_dim, seed=seed)
        rows += _config_rows(d.q, d.k, d.v, d.scale, t, windows, ms, sink, ndec, hpk, rcond)
    return rows


def o1_real_table(contexts=None, windows=(64, 256), ms=(16, 64), sink=4, *, ndec=32,
                  layers=None, per_layer=True, rcond=1e-3, quick=False,
                  path=None, far_heavy=0.2) -> list[dict]:
    """The same comparison on real attention data
    (:func:`research.real_attention.real_qkv`: a trained decoder's
    post-RoPE Q/K/V for a held-out text): every captured layer's every KV
    group is sealed and decoded, and the errors pooled over all layers and
    heads (rows with ``layer="all"``); ``per_layer`` adds one row per layer
    (``layer`` = its index) from the same errors. Methods: those of
    :func:`o1_accuracy_table` plus ``sinkwin`` (sinks + window only).
    Real heads are mostly local (many reads put no mass beyond the window,
    where every method is exact), so each row also has ``rel_med_far`` /
    ``rel_p99_far``: the error over the reads whose exact far mass is at
    least ``far_heavy``, and ``far_reads``, their fraction. ``contexts``: causal
    prefixes of the captured rows (default: half and all of them); the needle
    is planted in the first layer's first KV group. ``quick``: the full
    context and the first window only, ndec 16 (seconds). ``path``: another capture file of the same format
    (default: research/data/real_qkv.npz)."""
    from .real_attention import real_layers, real_meta, real_qkv

    meta = real_meta(path=path)
    total = int(meta["rows"])
    layers = real_layers(path=path) if layers is None else list(layers)
    if contexts is None:
        contexts = (total,) if quick else (total // 2, total)
    if quick:
        windows, ndec = windows[:1], min(ndec, 16)
    for t in contexts:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)) or not ndec < t <= total:
            raise ConfigError(f"o1_real_table: contexts must be ints in ({ndec}, {total}], got {t!r}")
    nh, nkv = int(meta["num_heads"]), int(meta["num_kv_heads"])
    hpk = nh // nkv
    parts = [real_qkv(li, path=path) for li in layers]  # validates the layer indices
    q = np.concatenate([d.q for d in parts], axis=1)
    k = np.concatenate([d.k for d in parts], axis=1)
    v = np.concatenate([d.v for d in parts], axis=1)
    blocks = {li: slice(i * nh, (i + 1) * nh) for i, li in enumerate(layers)} if per_layer else {}
    rows = []
    for t in contexts:
        rows += _config_rows(q, k, v, parts[0].scale, int(t), windows, ms, sink, ndec, hpk, rcond,
                             head_blocks=blocks, sinkwin=True, far_heavy=far_heavy)
    return rows


def format_table(rows: list[dict]) -> str:
    """A fixed-width text table of :func:`o1_accuracy_table` (or
    :func:`o1_real_table`: with a ``layer`` column) rows."""
    lay = bool(rows) and "layer" in rows[0]
    fh = bool(rows) and "rel_med_far" in rows[0]
    head = (f"{'layer':>5} " if lay else "") + (
        f"{'ctx':>6} {'w':>5} {'m':>3} {'method':<8} {'rows':>5} {'rel_med':>8} "
        f"{'rel_p99':>8} {'far_ex':>7} {'far_est':>7} {'ndl_kept':>8} {'ndl_rel':>8}") + (
        f" {'farreads':>8} {'far_med':>8} {'far_p99':>8}" if fh else "")
    lines = [head, "-" * len(head)]
    for r in rows:
        lines.append(
            (f"{r['layer']!s:>5} " if lay else "") +
            f"{r['context']:>6} {r['window']:>5} {r['m']:>3} {r['method']:<8} {r['budget_rows']:>5} "
            f"{r['rel_median']:>8.4f} {r['rel_p99']:>8.4f} {r['far_exact']:>7.3f} "
            f"{r['far_est']:>7.3f} {r['needle_kept']:>8.3f} {r['needle_rel']:>8.4f}" +
            (f" {r['far_reads']:>8.3f} {r['rel_med_far']:>8.4f} {r['rel_p99_far']:>8.4f}"
             if fh else ""))
    return "\n".join(lines)


def main(argv=None) -> int:
    """``python -m research.o1_report [--quick] [--real] [--json FILE]``: the
    table of :func:`o1_accuracy_table` (``--real``: on the captured data)."""
    import argparse
    import json

    ap = argparse.ArgumentParser(prog="python -m research.o1_report", description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer contexts and windows (seconds)")
    ap.add_argument("--real", action="store_true", help="the captured real-model Q/K/V instead of the generator")
    ap.add_argument("--json", default=None, metavar="FILE")
    a = ap.parse_args(argv)
    data = "real" if a.real else "realistic"
    rows = o1_accuracy_table(quick=a.quick, data=data)
    if a.real:
        from .real_attention import real_meta

        meta = real_meta()
        print(f"real attention data: {meta['num_layers']}-layer byte-level decoder, layers "
              f"{meta['layers']}, {meta['num_heads']} q / {meta['num_kv_heads']} kv heads, "
              f"hd {meta['head_dim']}, {meta['rows']} rows of held-out text "
              f"({meta['captured_text']}); held-out {meta['heldout_bits_per_byte']:.2f} bits/byte")
    print(format_table(rows))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump({"what": "o1", "data": data, "rows": rows}, fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
