"""``kvreg eval --budget``: the best cache configuration for a memory budget.

A budget is a fraction of the float32 cache's peak bytes on the text (the
reference's ``peak_bytes``: every row of the context in float32). For each
budget kvreg proposes configurations whose peak bytes, computed from the
model's geometry, fit it (:func:`candidates`): whole-context storage modes
(``f16``, ``q8``, ``q4``, ``q2``), the tiered seal with int8 exact rows and 4-bit
far rows filling the budget (on a model with sliding-window layers, also
with those sealed), and ``Snap`` eviction alone. All of them
are scored in one ``kvreg eval`` pass; for each budget the configuration of
least mean KL whose *measured* peak bytes fit is chosen (:func:`pick`).
Every configuration's row, peak bytes included, is reported too.
"""

from __future__ import annotations

import numpy as np

from kvreg.errors import ConfigError
from kvreg.tiered_seal import far_rows

__all__ = ["candidates", "estimate_peak", "parse_budgets", "pick"]

#: The seal's fixed rows in every proposal: attention sinks, the recent
#: window, and the prompt's last queries that score the rows at the seal.
SINK, RECENT, OBSERVE = 4, 32, 32
#: Rows chosen by mass kept exact (int8) beside the far tier, at most.
HEAVY = 64
#: Storage modes that hold every row, cheapest last.
WHOLE_MODES = ("f16", "q8", "q4", "q2")


def parse_budgets(spec: str) -> list[float]:
    """``"0.06,0.125,0.25"`` -> fractions in (0, 1], ascending."""
    try:
        out = sorted({float(x) for x in spec.split(",") if x.strip()})
    except ValueError:
        raise ConfigError(f"--budget {spec!r}: expected comma-separated fractions of the f32 cache, "
                          "e.g. 0.06,0.125,0.25") from None
    if not out or not all(0 < f <= 1 for f in out):
        raise ConfigError(f"--budget {spec!r}: each budget must be a fraction in (0, 1]")
    return out


def _plain_bytes(mode: str, nkv: int, hd: int, rows: int) -> int:
    """Bytes a plain layer of ``mode`` holds at ``rows`` rows (its own count)."""
    from kvreg import LayerKvCache

    if rows == 0:
        return 0
    layer = LayerKvCache(nkv, hd, mode, "reference")
    x = np.random.default_rng(0).standard_normal((rows, nkv, hd)).astype(np.float32)
    layer.extend(x, x)
    return int(layer.memory_bytes())


class Geometry:
    """The layers a model's cache holds: per layer ``(kv heads, head_dim,
    window or None)``; ``tokens``, the most rows a global layer holds, and
    ``prefix``, the rows of the prompt (a seal is made at its end)."""

    def __init__(self, model, tokens: int, prefix: int):
        from kvreg.integrations.transformers import KvregCache

        cache = KvregCache(model, mode="f32", backend="reference")
        self.tokens, self.prefix = int(tokens), int(prefix)
        self.layers = [(nkv, hd, w) for (nkv, hd), w in zip(cache.geometry, cache.windows)]
        #: the global layers' head_dim (the far tier's row size)
        self.head_dim = max((hd for _, hd, w in self.layers if w is None), default=self.layers[0][1])
        self._memo: dict = {}

    def _sliding_rows(self, w: int, align: int = 1) -> list[int]:
        """A sliding layer's rows after the prefill and after each decode
        step, trimmed by the drop-in's rule (:func:`kvreg.eviction.sliding_trim`)."""
        from kvreg.eviction import sliding_trim

        rows, held = [], self.prefix
        for step in range(self.tokens - self.prefix + 1):
            held += step > 0
            held -= sliding_trim(held, w, align)
            rows.append(held)
        return rows

    def _sliding_peak(self, w: int, mode: str) -> int:
        """The most rows a sliding layer of ``mode`` holds (its trims drop
        whole blocks of the mode's ``drop_align`` rows); computed once."""
        key = ("sliding", w, mode)
        if key not in self._memo:
            from kvreg.modes import KvMode
            from kvreg.storage import make_storage

            align = make_storage(1, 1, KvMode.parse(mode)).drop_align
            self._memo[key] = max(self._sliding_rows(w, align))
        return self._memo[key]

    def f32_peak(self) -> int:
        """The float32 cache's peak bytes, exactly (what budgets are fractions of)."""
        steps = self.tokens - self.prefix + 1
        total = np.zeros(steps, np.int64)
        for nkv, hd, w in self.layers:
            rows = np.arange(self.prefix, self.tokens + 1) if w is None else np.array(self._sliding_rows(w))
            total += rows * (2 * nkv * hd * 4)
        return int(total.max())

    def plain(self, mode: str, rows: int | None = None) -> int:
        """Peak bytes of every layer in ``mode``, at most: global layers at
        ``rows`` (None: the whole text), sliding ones at their own peak."""
        total = 0
        for nkv, hd, w in self.layers:
            n = (self.tokens if rows is None else rows) if w is None else self._sliding_peak(w, mode)
            key = (mode, nkv, hd, n)
            if key not in self._memo:
                self._memo[key] = _plain_bytes(mode, nkv, hd, n)
            total += self._memo[key]
        return total

    @property
    def sliding(self) -> bool:
        return any(w is not None for _, _, w in self.layers)

    def sealed(self, mode: str, m: int, heavy: int, far_format: str, local: bool = False) -> int:
        """Peak bytes with the tiered seal on the global layers (int8 exact
        rows in a quantized ``mode``) and on the sliding ones too when
        ``local`` (no sinks, within the window), ``mode`` on the others."""
        from kvreg.modes import KvMode
        from kvreg.tiered_seal import exact_format, seal_bytes

        fmt = exact_format(KvMode.parse(mode))
        total = 0
        for nkv, hd, w in self.layers:
            if w is None:
                total += seal_bytes(m, RECENT, SINK, hd, nkv, heavy, fmt, far_format)
            elif local:
                total += seal_bytes(m, RECENT, 0, hd, nkv, heavy, fmt, far_format, window=w)
        return total + (0 if local else self.plain(mode, rows=0))


def estimate_peak(geo: Geometry, spec: str) -> int:
    """Peak bytes of a proposal (:func:`candidates`' spellings) on ``geo``:
    exact on models without sliding layers, at most that with them (each
    sliding layer counted at its own peak)."""
    body, _, mode = spec.partition("@")
    mode = mode or "f32"
    head, *rest = body.split("+")
    name, *nums = head.split(":")
    if name == "snap":
        return geo.sealed(mode, 0, int(nums[0]) - SINK - RECENT, "int4")
    if name == "o1":
        far = next((o for o in rest if o.startswith("far")), "far4")
        return geo.sealed(mode, int(nums[0]), int(nums[3]), "int" + far[3:], local="local" in rest)
    return geo.plain(name)


def _largest(fits, lo: int, hi: int) -> int | None:
    """The largest ``x`` in ``[lo, hi]`` with ``fits(x)`` (monotone), or None."""
    if not fits(lo):
        return None
    while lo < hi:
        mid = (lo + hi + 1) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid - 1)
    return lo


def candidates(geo: Geometry, budgets: list[float]) -> list[str]:
    """Configurations (``kvreg eval`` spellings) whose computed peak fits at
    least one of ``budgets`` (fractions of the f32 peak), for each budget the
    largest of each family that fits."""
    full = geo.f32_peak()
    out: list[str] = []

    def add(spec: str | None) -> None:
        if spec is not None and spec not in out:
            out.append(spec)

    for frac in budgets:
        cap = frac * full
        for mode in WHOLE_MODES:
            if geo.plain(mode) <= cap:
                add(mode)
        for local in (False, True) if geo.sliding else (False,):
            for spec in _seals_for(geo, cap, local):
                add(spec)
        n = _largest(lambda x, cap=cap: geo.sealed("q8", 0, x - SINK - RECENT, "int4") <= cap, SINK + RECENT,
                     geo.prefix - 1)
        add(None if n is None else f"snap:{n}@q8")
    return out


def _seals_for(geo: Geometry, cap: float, local: bool) -> list[str]:
    """The tiered seal with 4-bit far rows filling ``cap`` bytes (on the
    sliding layers too when ``local``), once with ``HEAVY`` rows chosen by
    mass kept exact and once with a quarter of them and more far rows: which
    split wins depends on the model and the budget, so both are measured. Its far tier
    never holds more rows than the text leaves it. 2-bit far rows are not
    proposed: at equal bytes they measured far worse than fewer 4-bit ones
    (per-token 2-bit keys misplace attention)."""
    opt = "+local" if local else ""
    out = []
    # a seal is made at the prompt's end when the prompt outgrows its exact rows
    for heavy in (h for h in (HEAVY, HEAVY // 4) if SINK + RECENT + h < geo.prefix):
        whole = _smallest(lambda x, h=heavy: far_rows(x, geo.head_dim) >= geo.tokens - SINK - RECENT - h)
        m = _largest(lambda x, h=heavy: geo.sealed("q8", x, h, "int4", local) <= cap, 0, whole)
        if m:
            out.append(f"o1:{m}:{RECENT}:{SINK}:{heavy}+obs{OBSERVE}{opt}@q8")
    return out


def _smallest(fits) -> int:
    """The smallest ``x >= 0`` with ``fits(x)`` (monotone, true somewhere)."""
    hi = 1
    while not fits(hi):
        hi *= 2
    lo = 0
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(mid) else (mid + 1, hi)
    return lo


def pick(report: dict, budgets: list[float]) -> list[dict]:
    """Per budget, the scored configuration of least mean KL whose measured
    peak bytes fit it (None when none does): ``{"fraction", "bytes",
    "config", "kl_mean", "top1", "ppl", "peak_bytes", "avg_bytes"}``."""
    full = report["reference"]["peak_bytes"]
    chosen = []
    for frac in budgets:
        cap = frac * full
        fits = [r for r in report["results"] if r["kind"] == "kvreg" and r["peak_bytes"] <= cap]
        best = min(fits, key=lambda r: r["kl_mean"], default=None)
        row = {"fraction": frac, "bytes": int(cap), "config": None}
        if best is not None:
            row.update({k: best[k] for k in ("config", "kl_mean", "top1", "ppl", "peak_bytes", "avg_bytes")})
        chosen.append(row)
    return chosen


def markdown(chosen: list[dict], reference_peak: int) -> str:
    lines = ["| budget (of f32 peak) | budget MiB | chosen | mean KL | top-1 | PPL | peak MiB | avg MiB |",
             "|---:|---:|---|---:|---:|---:|---:|---:|"]
    for c in chosen:
        head = f"| {100 * c['fraction']:g}% | {c['bytes'] / 2**20:.2f} |"
        if c["config"] is None:
            lines.append(head + " nothing fits | | | | | |")
            continue
        lines.append(head + f" {c['config']} | {c['kl_mean']:.2e} | {100 * c['top1']:.1f}% | {c['ppl']:.4f} | "
                     f"{c['peak_bytes'] / 2**20:.2f} ({100 * c['peak_bytes'] / reference_peak:.1f}%) | "
                     f"{c['avg_bytes'] / 2**20:.2f} |")
    return "\n".join(lines)
