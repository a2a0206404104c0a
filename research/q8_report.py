"""Accuracy of the q8_2f cache against exact attention, with and without its field.

On :func:`kvreg_conformance.data.realistic_qkv` data (RoPE, outlier K
channels, a sink, log-normal values) every row is appended to one layer per
configuration: an ``f32`` baseline and each q8 mode (``q8`` = K and V,
``q8k``, ``q8v``), with the per-channel 2f field (the seed's ``_2f`` storage)
and without it (the field-free modes: every row quantized against its own
scales only), and with the leading rows held
exact (``q8_exact_rows``, the default) or not (0: the seed's storage). Then the last ``queries``
positions are decoded: Q head ``h`` of position ``i`` attends the rows
``[0, i]`` of its group through the public ``attend_group(..., upto=i+1)``
(bit-identical to the call made when the layer held exactly ``i+1`` rows), its
probabilities read back through ``imp_acc``. Each output and probability row
is compared with :func:`kvreg_conformance.oracle.attention_oracle` on the
original float32 data:

* output relative error ``‖o−ô‖/‖o‖``, median and p99 over (position, head);
* probability L1 ``Σ_p |p−p̂|``, median and p99;
* bytes per stored K/V element (``memory_bytes`` over ``2·rows·nkv·hd``).

Run it from the repository root: ``python -m research.q8_report [--real]``.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from kvreg.errors import ShapeError
from kvreg.layer import LayerKvCache
from kvreg.modes import Q8_EXACT_ROWS, KvMode
from kvreg_conformance.data import realistic_qkv
from kvreg_conformance.oracle import attention_oracle

__all__ = ["q8_accuracy", "format_q8_table", "error_report"]


def _storage(mode: str, field: bool | None) -> KvMode:
    """The layer mode of a configuration: the seed's ``_2f`` storage when the
    field is on, the field-free mode of the same sides when it is off."""
    base = KvMode.parse(mode)
    return KvMode.parse(f"{base.value}_2f") if field else base


def _decode(layer: LayerKvCache, q: np.ndarray, first_pos: int, hpk: int, scale: float):
    """Outputs ``[nq, nh, hd]`` and probabilities ``[nq, nh, rows]`` of the
    queries ``q [nq, nh, hd]`` at positions ``first_pos + i``, head by head."""
    nq, nh, hd = q.shape
    rows = layer.seq_len
    out = np.zeros((nq, nh, hd), dtype=np.float32)
    probs = np.zeros((nq, nh, rows), dtype=np.float32)
    for i in range(nq):
        upto = first_pos + i + 1
        for h in range(nh):
            acc = probs[i, h]
            out[i, h] = layer.attend_group(q[i, h][None, :], h // hpk, scale=scale, upto=upto, imp_acc=acc)[0]
    return out, probs


def _dequantized(layer: LayerKvCache, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """The K and V rows the layer answers with, ``[rows, nkv, hd]`` float64
    (``q · s · col``; f32 storage as stored)."""
    st = layer.storage
    k = np.stack([st.attended_rows("k", g, 0, rows) for g in range(layer.num_kv_heads)], axis=1)
    v = np.stack([st.attended_rows("v", g, 0, rows) for g in range(layer.num_kv_heads)], axis=1)
    return k.astype(np.float64), v.astype(np.float64)


def _choices(x, kind):
    """A single value or an iterable of them, as a tuple."""
    return (kind(x),) if isinstance(x, (bool, int, np.bool_, np.integer)) else tuple(kind(v) for v in x)


def q8_accuracy(modes=("q8", "q8k", "q8v"), rows: int = 2048, *, field=True, exact_rows=Q8_EXACT_ROWS,
                seed: int = 0, num_heads: int = 32, num_kv_heads: int = 8, head_dim: int = 128,
                queries: int = 32, backend="reference", baseline: bool = True, data=None,
                **data_options) -> list[dict]:
    """Measure each q8 mode against the f64 exact attention.

    ``field``: True (the real cache), False (no field) or an iterable of both,
    e.g. ``(True, False)``; ``exact_rows``: the layer's ``q8_exact_rows`` (0 is
    the seed's storage) or an iterable of counts. ``baseline`` adds the F32 row first;
    ``data_options`` go to :func:`realistic_qkv` (``outlier_channels``,
    ``outlier_scale``, ``rope_theta``, ``sink_strength``); ``data`` (a
    :class:`~kvreg_conformance.data.RealisticQKV`, e.g.
    :func:`research.real_attention.real_qkv`) replaces the generator,
    its shapes replacing ``rows`` and the head counts. Returns one
    dict per configuration: ``mode``, ``field`` (None for f32), ``exact_rows``,
    ``bytes_per_element``, ``rel_median``, ``rel_p99``, ``rel_max``,
    ``prob_l1_median``, ``prob_l1_p99``, ``n`` (the (position, head) pairs),
    ``key_rel_err`` / ``value_rel_err`` (``‖x̂−x‖/‖x‖`` over every stored
    row), ``logit_err_rms`` (RMS of ``scale·⟨q, k̂−k⟩`` over the decoded
    queries and all their rows) and ``sink_logit_err_rms`` (the same on row 0,
    the attention sink).
    """
    fields = _choices(field, bool)
    exacts = _choices(exact_rows, int)
    queries = min(int(queries), int(rows))
    if data is None:
        data = realistic_qkv(rows, num_heads, num_kv_heads, head_dim, seed=seed, **data_options)
    else:
        (rows, num_heads, head_dim), num_kv_heads = data.q.shape, data.k.shape[1]
        queries = min(queries, rows)
    hpk = num_heads // num_kv_heads
    first_pos = rows - queries
    qs = data.q[first_pos:]
    ref_out, ref_probs = attention_oracle(qs, data.k, data.v, data.scale, return_probs=True)

    configs = [(KvMode.F32, None, 0)] if baseline else []
    configs += [(KvMode.parse(m), f, x) for m in modes for x in exacts for f in fields]
    results = []
    for mode, f, x in configs:
        layer = LayerKvCache(num_kv_heads, head_dim, _storage(mode.value, f), backend, q8_exact_rows=x)
        for p in range(rows):
            layer.append(data.k[p], data.v[p])
        out, probs = _decode(layer, qs, first_pos, hpk, data.scale)
        rep = error_report(out, ref_out, probs, ref_probs)
        kd, vd = _dequantized(layer, rows)
        k64, v64 = data.k.astype(np.float64), data.v.astype(np.float64)
        logit_err = np.einsum("qhd,nhd->qhn", qs.astype(np.float64), np.repeat(kd - k64, hpk, axis=1)) * data.scale
        results.append({
            "mode": mode.value,
            "field": f,
            "exact_rows": x,
            "bytes_per_element": layer.memory_bytes() / (2 * rows * num_kv_heads * head_dim),
            "rel_median": rep["rel_median"],
            "rel_p99": rep["rel_p99"],
            "rel_max": rep["rel_max"],
            "prob_l1_median": rep["prob_l1_median"],
            "prob_l1_p99": rep["prob_l1_p99"],
            "n": int(rep["rel"].size),
            "key_rel_err": float(np.linalg.norm(kd - k64) / np.linalg.norm(k64)),
            "value_rel_err": float(np.linalg.norm(vd - v64) / np.linalg.norm(v64)),
            "logit_err_rms": float(np.sqrt(np.mean(logit_err ** 2))),
            "sink_logit_err_rms": float(np.sqrt(np.mean(logit_err[..., 0] ** 2))),
        })
    return results


def _pct(x: float) -> str:
    return f"{100 * x:.3f}%" if x < 0.01 else f"{100 * x:.2f}%"


def format_q8_table(rows: list[dict]) -> str:
    """A markdown table of :func:`q8_accuracy`'s rows."""
    lines = [
        "| mode | bytes/element | field | exact rows | output err median | output err p99 | prob L1 median |",
        "|---|---:|:---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        fld = "—" if r["field"] is None else ("on" if r["field"] else "off")
        xr = "—" if r["field"] is None else r["exact_rows"]
        lines.append(f"| {r['mode']} | {r['bytes_per_element']:.3f} | {fld} | {xr} | {_pct(r['rel_median'])} | "
                     f"{_pct(r['rel_p99'])} | {r['prob_l1_median']:.2e} |")
    return "\n".join(lines)


def error_report(out, ref, probs=None, probs_ref=None) -> dict:
    """Compare an attention output with its oracle.

    ``out``/``ref [..., hd]``: the relative error ``||o - ô|| / ||o||`` per
    leading index (per (query, head)); ``probs``/``probs_ref [..., n]``: the
    L1 distance of the probability rows. Returns a dict with ``rel`` (the
    array) and ``rel_median``, ``rel_p99``, ``rel_max``; with probabilities
    also ``prob_l1`` and its ``prob_l1_median``, ``prob_l1_p99``.
    """
    o = np.asarray(out, dtype=np.float64)
    r = np.asarray(ref, dtype=np.float64)
    if o.shape != r.shape:
        raise ShapeError(f"error_report: out {o.shape} and ref {r.shape} differ in shape")
    # a zero reference row would divide by zero; its error is then absolute
    denom = np.maximum(np.linalg.norm(r, axis=-1), np.finfo(np.float64).tiny)
    rel = np.linalg.norm(o - r, axis=-1) / denom
    rep = {
        "rel": rel,
        "rel_median": float(np.median(rel)),
        "rel_p99": float(np.percentile(rel, 99)),
        "rel_max": float(rel.max()),
    }
    if (probs is None) != (probs_ref is None):
        raise ShapeError("error_report: give both probs and probs_ref, or neither")
    if probs is not None:
        p = np.asarray(probs, dtype=np.float64)
        pr = np.asarray(probs_ref, dtype=np.float64)
        if p.shape != pr.shape:
            raise ShapeError(f"error_report: probs {p.shape} and probs_ref {pr.shape} differ")
        l1 = np.abs(p - pr).sum(axis=-1)
        rep.update(prob_l1=l1, prob_l1_median=float(np.median(l1)),
                   prob_l1_p99=float(np.percentile(l1, 99)))
    return rep


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m research.q8_report", description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--queries", type=int, default=32)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--backend", default="reference")
    ap.add_argument("--outlier-scale", type=float, default=10.0, help="realistic_qkv's outlier_scale")
    ap.add_argument("--real", action="store_true",
                    help="the captured real-model Q/K/V (research.real_attention) instead of the generator")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    if a.real:
        from .real_attention import real_qkv

        data = real_qkv()
        what = f"real_qkv (all captured layers) rows={data.q.shape[0]} heads={data.q.shape[1]}/{data.k.shape[1]} " \
               f"hd={data.q.shape[2]}"
    else:
        data = None
        what = (f"realistic_qkv rows={a.rows} heads={a.heads}/{a.kv_heads} hd={a.head_dim} seed={a.seed} "
                f"outlier_scale={a.outlier_scale}")
    res = q8_accuracy(rows=a.rows, field=(True, False), exact_rows=(Q8_EXACT_ROWS, 0), seed=a.seed,
                      num_heads=a.heads, num_kv_heads=a.kv_heads, head_dim=a.head_dim, queries=a.queries,
                      backend=a.backend, data=data, outlier_scale=a.outlier_scale)
    print(f"{what}, last {a.queries} positions, backend {a.backend} ({time.perf_counter() - t0:.1f} s)\n")
    print(format_q8_table(res))


if __name__ == "__main__":
    main()
