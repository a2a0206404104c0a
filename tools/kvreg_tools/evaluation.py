"""``kvreg eval``: how much a cache configuration costs a real model.

A text is tokenized; the first ``prefix`` tokens are prefilled in one
forward, then every following token is decoded one at a time through the
cache, as a generating host would (teacher forcing: the true token is fed).
Every configuration runs in lockstep with the reference (kvreg F32, which
equals ``DynamicCache``) so no distribution is stored. Per configuration:

- ``ppl``: perplexity of the scored tokens under that cache;
- ``kl_mean`` / ``kl_p99``: KL(reference || config) of the next-token
  distributions, nats, over the scored positions;
- ``top1``: fraction of positions whose argmax equals the reference's;
- ``peak_bytes`` / ``avg_bytes``: the cache's KV bytes (kvreg:
  ``memory_bytes``; transformers' caches: their tensors' bytes) after the
  prefill and after every decode step, largest and mean; ``kv_bytes``: at
  the end, and ``bytes_per_element``: that over the K and V elements held,
  where every layer holds plain rows;
- ``ms_per_token``: the model's forward per decoded token with that cache.

Before the timed run each configuration prefills and decodes two tokens on
a cache of its own, so kernels compile (numba: once per machine, then
loaded from its disk cache) outside the timings. ``--json`` writes one
record per model and text (:mod:`kvreg_tools.report`); ``kvreg report``
makes docs/benchmarks.md of them.

Configurations (``parse_config``): a KV mode name (``f32``, ``q8``, ...);
``born:N`` (Born eviction at ``N`` rows, sink 4), ``sinkwin:N`` (4 sinks +
the newest rows, ``N`` in all), ``recent:N``; ``snap:N``
(``EvictionPolicy.Snap`` at ``N`` rows per KV group); ``o1:M:W:SINK[:HEAVY]``
(the O(1) seal, its tiered far field), with options ``+far2`` / ``+far8``
(far rows in 2 or 8 bits instead of 4), ``+obsN`` (rows chosen at the seal
by the prompt's last ``N`` queries) and ``+local`` (the sliding-window
layers sealed too, each within its window); ``nystrom:M:W:SINK[:HEAVY]``
(the seal with the seed's Nyström far field);
any of these ``@MODE`` for another storage; ``dynamic`` / ``static``
(transformers' ``DynamicCache`` / ``StaticCache`` with SDPA).
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from kvreg.errors import ConfigError

__all__ = ["CacheConfig", "default_texts", "describe", "evaluate", "legend", "markdown_table", "parse_config",
           "parse_configs"]

DEFAULT_CONFIGS = "dynamic,q8,q8k,q8v,born:512,sinkwin:512,o1:64:128:4"


@dataclass(frozen=True)
class CacheConfig:
    label: str
    kind: str                       # "kvreg", "dynamic" or "static"
    kwargs: dict = field(default_factory=dict)


#: What every configuration is scored against: kvreg's float32 rows, which answer as DynamicCache.
REFERENCE = CacheConfig("f32 (reference)", "kvreg", {"mode": "f32"})


def parse_config(spec: str) -> CacheConfig:
    """One configuration from its command-line spelling (module docstring)."""
    from kvreg.cache import Born, Recent, Snap
    from kvreg.modes import KvMode

    raw = spec.strip()
    if raw in ("dynamic", "static"):
        return CacheConfig(raw, raw)
    body, _, mode = raw.partition("@")
    kwargs: dict = {}
    if mode:
        kwargs["mode"] = KvMode.parse(mode).value
    body, *options = body.split("+")
    head, *args = body.split(":")
    if options and head != "o1":
        raise ConfigError(f"config {spec!r}: only o1 takes +far2, +far8, +obsN or +local options")
    for opt in options:
        if opt in ("far2", "far4", "far8"):
            kwargs["o1_far_format"] = "int" + opt[3:]
        elif opt.startswith("obs") and opt[3:].isdigit() and int(opt[3:]) > 0:
            kwargs["o1_observe"] = int(opt[3:])
        elif opt == "local":
            kwargs["o1_sliding"] = True
        else:
            raise ConfigError(f"config {spec!r}: unknown option +{opt} (expected +far2, +far4, +far8, +obsN or "
                              "+local)")
    try:
        nums = [int(a) for a in args]
    except ValueError:
        raise ConfigError(f"config {spec!r}: arguments must be integers") from None
    if head in ("born", "sinkwin", "recent", "snap"):
        if len(nums) != 1 or nums[0] <= 0:
            raise ConfigError(f"config {spec!r}: expected {head}:N with N > 0 rows")
        kwargs["budget"] = nums[0]
        kwargs["policy"] = {"born": Born(4), "snap": Snap()}.get(head, Recent())
        if head == "snap" and nums[0] < Snap().sink + Snap().recent:
            raise ConfigError(f"config {spec!r}: snap keeps {Snap().sink + Snap().recent} rows at least")
        if head == "sinkwin":
            kwargs["sink"] = 4
    elif head in ("o1", "nystrom"):
        if len(nums) not in (3, 4):
            raise ConfigError(f"config {spec!r}: expected {head}:M:W:SINK or {head}:M:W:SINK:HEAVY")
        kwargs["o1"] = tuple(nums)
        kwargs["o1_far"] = "tiered" if head == "o1" else "nystrom"
    elif not args:
        if mode:
            raise ConfigError(f"config {spec!r}: a mode takes no @MODE")
        kwargs["mode"] = KvMode.parse(head).value
    else:
        raise ConfigError(f"config {spec!r}: expected a KV mode, born:N, sinkwin:N, recent:N, snap:N, o1:M:W:SINK, "
                          "nystrom:M:W:SINK, dynamic or static")
    kwargs.setdefault("mode", "f32")
    return CacheConfig(raw, "kvreg", kwargs)


def describe(cfg: CacheConfig) -> str:
    """What a configuration is, in words (the legend under ``kvreg eval``'s table)."""
    from kvreg.cli import KV_MODE_DESCRIPTIONS

    if cfg.kind == "dynamic":
        return "transformers' DynamicCache (SDPA attention): the model's own cache, without kvreg"
    if cfg.kind == "static":
        return "transformers' StaticCache (SDPA attention), preallocated for the whole text"
    kw = cfg.kwargs
    mode = kw.get("mode", "f32")
    rows = KV_MODE_DESCRIPTIONS.get(mode, f"{mode} rows")
    if "o1" in kw:
        m, w, sink, *heavy = kw["o1"]
        heavy = heavy[0] if heavy else m
        bits = kw.get("o1_far_format", "int4")[3:]
        far = (f"older rows in {bits} bits, as many as fit in the bytes of" if kw.get("o1_far") == "tiered"
               else "older rows summarized by the seed's Nystrom estimator over")
        chosen = (f"rows the prompt's last {kw['o1_observe']} queries attend most, then decode's mass"
                  if kw.get("o1_observe") else "highest-attention rows")
        local = "; sliding layers too, within their window" if kw.get("o1_sliding") else ""
        return (f"the O(1) seal, constant memory per layer: {sink} first rows + {w} newest + {heavy} "
                f"{chosen} exact, {far} {m} float32 rows (rows: {mode}){local}")
    if "budget" in kw:
        n = kw["budget"]
        if "sink" in kw:
            return f"{kw['sink']} first rows and the newest rest: {n} rows per layer (rows: {mode})"
        sink = getattr(kw["policy"], "sink", None)
        if hasattr(kw["policy"], "observe"):
            p = kw["policy"]
            return (f"Snap eviction, per KV group: the {p.sink} first rows, the {p.recent} newest and the rows the "
                    f"prompt's last {p.observe} queries attend most, then decode's mass; {n} rows (rows: {mode})")
        if sink is not None:
            return (f"Born eviction: the {sink} first rows, the newest half and the highest-attention rest, "
                    f"{n} rows per layer (rows: {mode})")
        return f"the newest {n} rows per layer (rows: {mode})"
    return rows


def legend(configs: list[CacheConfig]) -> str:
    """One line per configuration, then what the columns mean."""
    width = max(len(c.label) for c in configs)
    lines = ["configs:"] + [f"  {c.label:<{width}}  {describe(c)}" for c in configs]
    lines += ["columns: KL = KL(reference || config) of the next-token distribution, nats; top-1 agree = how often "
              "the most likely token is the reference's; peak / avg MiB = the cache's bytes after the prefill and "
              "each decode step; ms/token = the model's forward per decoded token (the whole model, not only "
              "the cache)"]
    return "\n".join(lines)


def parse_configs(specs: str) -> list[CacheConfig]:
    configs = [parse_config(s) for s in specs.split(",") if s.strip()]
    if not configs:
        raise ConfigError("no cache configurations given")
    return configs


def default_texts() -> list[Path]:
    """Two texts every CPython install has: code (``textwrap.py``) and prose (``LICENSE.txt``)."""
    import sysconfig

    lib = Path(sysconfig.get_paths()["stdlib"])
    return [p for p in (lib / "textwrap.py", lib / "LICENSE.txt") if p.exists()]


def cache_keyword(model) -> str:
    import inspect

    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def forward_kwargs(model, cache) -> dict:
    """A forward's keywords that feed ``cache`` and, where the model takes
    ``logits_to_keep``, compute the last position's logits only: a
    prefill's logits for every position are vocabulary × tokens floats
    (gigabytes for a 262k vocabulary at thousands of tokens), and only the
    last is read."""
    import inspect

    kw = {cache_keyword(model): cache}
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        kw["logits_to_keep"] = 1
    return kw


def _make_cache(cfg: CacheConfig, model, tokens: int, backend):
    if cfg.kind == "dynamic":
        from transformers import DynamicCache

        return DynamicCache(config=model.config)
    if cfg.kind == "static":
        from transformers import StaticCache

        return StaticCache(config=model.config, max_cache_len=tokens)
    from kvreg.integrations.transformers import KvregCache

    return KvregCache(model, backend=backend, **cfg.kwargs)


def held_bytes(cache) -> int:
    """The KV bytes ``cache`` holds now."""
    from kvreg.integrations.transformers import KvregCache

    if isinstance(cache, KvregCache):
        return int(cache.memory_bytes())
    return sum(t.numel() * t.element_size() for layer in cache.layers for t in (layer.keys, layer.values)
               if t is not None)


def cache_bytes(cache) -> tuple[int, float | None]:
    """(KV bytes held, bytes per K/V element held or None)."""
    from kvreg.integrations.transformers import KvregCache

    if isinstance(cache, KvregCache):
        total = cache.memory_bytes()
        elements = 0
        for seq in cache.sequences:
            for layer in seq.layers:
                if layer.o1_sealed():
                    return total, None
                elements += sum(layer.head_len(h) for h in range(layer.num_kv_heads)) * layer.head_dim * 2
        return total, (total / elements if elements else None)
    total = elements = 0
    for layer in cache.layers:
        for t in (layer.keys, layer.values):
            if t is not None:
                total += t.numel() * t.element_size()
                elements += t.numel()
    return total, (total / elements if elements else None)


def _say(msg: str, end: str = "\n") -> None:
    print(msg, end=end, file=sys.stderr, flush=True)


def warm(model, ids, prefix: int, configs: list[CacheConfig], backend) -> float:
    """Prefill and two decode steps per configuration on a cache of its own,
    saying so: a configuration's first decode compiles its kernels (numba,
    once per machine) or loads them from disk. Returns the seconds taken."""
    import torch

    t0 = time.perf_counter()
    _say(f"kvreg eval: preparing {len(configs)} configs: the first decode of each compiles its kernels "
         "(minutes on a machine that never ran them; loaded from numba's disk cache after)")
    with torch.no_grad():
        for cfg in configs:
            _say(f"  compiling / loading the kernels of {cfg.label} ...", end="")
            t = time.perf_counter()
            kw = forward_kwargs(model, _make_cache(cfg, model, int(ids.shape[1]), backend))
            for feed in (ids[:, :prefix], ids[:, prefix:prefix + 1], ids[:, prefix + 1:prefix + 2]):
                model(input_ids=feed, use_cache=True, **kw)
            _say(f" {time.perf_counter() - t:.1f} s")
    return time.perf_counter() - t0


def evaluate(model, tokenizer, text: str, configs: list[CacheConfig], *, tokens: int = 2048, prefix: int = 256,
             backend=None, progress: bool = True) -> dict:
    """Score ``configs`` on ``text`` against the kvreg F32 reference (module
    docstring). Returns ``{"tokens", "prefix", "scored", "reference",
    "results"}``: ``reference`` is the F32 run's row, ``results`` one row per
    configuration, in order."""
    import torch

    ids = tokenizer(text, return_tensors="pt").input_ids[:, :tokens]
    n = int(ids.shape[1])
    if prefix < 1 or n <= prefix + 2:
        raise ConfigError(f"the text has {n} tokens; need more than prefix+2 = {prefix + 2}")
    runs = [REFERENCE] + list(configs)
    warm(model, ids, prefix, runs, backend)
    caches = [_make_cache(c, model, n, backend) for c in runs]
    step_kw = [forward_kwargs(model, cache) for cache in caches]
    scored = n - prefix
    kl = np.zeros((len(runs), scored))
    agree = np.zeros((len(runs), scored), dtype=bool)
    nll = np.zeros((len(runs), scored))
    held = np.zeros((len(runs), scored))
    seconds = np.zeros(len(runs))
    targets = ids[0, prefix:]
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(total=scored, desc="kvreg eval", unit="tok", file=sys.stderr, leave=False)
    with torch.no_grad():
        for step in range(scored):
            feed = ids[:, :prefix] if step == 0 else ids[:, prefix + step - 1:prefix + step]
            ref_logp = None
            for i, cache in enumerate(caches):
                t0 = time.perf_counter()
                logits = model(input_ids=feed, use_cache=True, **step_kw[i]).logits[0, -1]
                if step:
                    seconds[i] += time.perf_counter() - t0
                held[i, step] = held_bytes(cache)
                logp = torch.log_softmax(logits.double(), dim=-1)
                if ref_logp is None:
                    ref_logp, ref_p = logp, logp.exp()
                    ref_top = int(logp.argmax())
                kl[i, step] = float((ref_p * (ref_logp - logp)).sum())
                agree[i, step] = int(logp.argmax()) == ref_top
                nll[i, step] = -float(logp[targets[step]])
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    rows = []
    for i, (cfg, cache) in enumerate(zip(runs, caches)):
        kv_bytes, per_el = cache_bytes(cache)
        rows.append({
            "config": cfg.label, "kind": cfg.kind,
            "ppl": math.exp(float(nll[i].mean())),
            "kl_mean": float(kl[i].mean()), "kl_p99": float(np.percentile(kl[i], 99)),
            "top1": float(agree[i].mean()),
            "peak_bytes": int(held[i].max()), "avg_bytes": float(held[i].mean()),
            "kv_bytes": int(kv_bytes), "bytes_per_element": per_el,
            "ms_per_token": 1e3 * seconds[i] / max(scored - 1, 1),
        })
    reference = {k: rows[0][k] for k in ("config", "ppl", "peak_bytes", "avg_bytes", "kv_bytes", "ms_per_token")}
    reference["config"] = "f32"
    return {"tokens": n, "prefix": prefix, "scored": scored, "reference": reference, "results": rows[1:]}


def markdown_table(report: dict) -> str:
    lines = [f"{report['model']}, {report['text']}: {report['tokens']} tokens, prefix {report['prefix']}, "
             f"{report['scored']} scored, backend {report['backend']}", "",
             "| cache | PPL | mean KL | p99 KL | top-1 agree | peak MiB | avg MiB | bytes/elem | ms/token |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    ref = dict(report["reference"], config="f32 (reference)", kl_mean=0.0, kl_p99=0.0, top1=1.0,
               bytes_per_element=None)
    for r in [ref] + report["results"]:
        per = "—" if r["bytes_per_element"] is None else f"{r['bytes_per_element']:.3f}"
        lines.append(f"| {r['config']} | {r['ppl']:.4f} | {r['kl_mean']:.2e} | {r['kl_p99']:.2e} | "
                     f"{100 * r['top1']:.1f}% | {r['peak_bytes'] / 2**20:.2f} | {r['avg_bytes'] / 2**20:.2f} | "
                     f"{per} | {r['ms_per_token']:.1f} |")
    return "\n".join(lines)


def plot(reports: list[dict], path: str) -> None:
    """KL against cache bytes, one panel per (model, text)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(reports), figsize=(6 * len(reports), 4.5), squeeze=False)
    for ax, rep in zip(axes[0], reports):
        for r in rep["results"]:
            kl = max(r["kl_mean"], 1e-9)
            ax.scatter(r["peak_bytes"] / 2**20, kl)
            ax.annotate(r["config"], (r["peak_bytes"] / 2**20, kl), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("KV cache peak MiB")
        ax.set_ylabel("mean KL vs F32 (nats)")
        ax.set_title(f"{rep['model']} · {Path(rep['text']).name}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _command_words(args, name: str, text: Path | None) -> list[str]:
    words = ["kvreg", "eval", "--model", name]
    if text is not None:
        words += ["--text", str(text)]
    words += ["--tokens", str(args.tokens), "--prefix", str(args.prefix)]
    words += ["--configs", args.configs] if args.configs else []
    words += ["--budget", args.budget] if getattr(args, "budget", None) else []
    return words + (["--backend", args.backend] if args.backend else [])


def main(args) -> int:
    import hashlib

    from kvreg import models
    from kvreg.registry import get_backend
    from kvreg_tools.budget import Geometry, candidates, parse_budgets, pick
    from kvreg_tools.budget import markdown as budget_markdown
    from kvreg_tools.report import Load, header

    budgets = parse_budgets(args.budget) if getattr(args, "budget", None) else None
    # With --budget the proposals are scored, beside any --configs named.
    configs = parse_configs(args.configs) if args.configs else ([] if budgets else parse_configs(DEFAULT_CONFIGS))
    if args.plot:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            raise ConfigError("--plot needs matplotlib: pip install 'kvreg-tools[bench]'")
    texts = [Path(t) for t in args.text] if args.text else default_texts()[:1]
    names = list(models.MODELS) if args.model == "all" else [args.model]
    reports = []
    legend_configs: list[CacheConfig] = []
    load = Load()
    for name in names:
        model, tok = models.load(name)
        for text in texts:
            body = text.read_text(encoding="utf-8", errors="replace")
            rec = header("eval", _command_words(args, name, text if args.text else None))
            rec.update(model=name, text=text.name, text_sha256=hashlib.sha256(text.read_bytes()).hexdigest(),
                       backend=get_backend(args.backend).name)
            run = configs
            if budgets:
                n = min(int(tok(body, return_tensors="pt").input_ids.shape[1]), args.tokens)
                # the last token is scored, never fed: the cache holds n - 1 rows at most
                proposed = parse_configs(",".join(candidates(Geometry(model, n - 1, args.prefix), budgets)))
                run = configs + [c for c in proposed if c.label not in {x.label for x in configs}]
            rec.update(evaluate(model, tok, body, run, tokens=args.tokens, prefix=args.prefix,
                                backend=args.backend, progress=not args.no_progress))
            if budgets:
                rec["budgets"] = pick(rec, budgets)
            reports.append(rec)
            print(markdown_table(rec))
            print()
            if budgets:
                print(budget_markdown(rec["budgets"], rec["reference"]["peak_bytes"]))
                print()
            legend_configs.extend(c for c in run if c not in legend_configs)
    print(legend([REFERENCE] + legend_configs))
    warning = load.warning()
    if warning:
        print(f"\nkvreg eval: {warning}")
    if args.json:
        out = reports[0] if len(reports) == 1 else reports
        Path(args.json).write_text(json.dumps(out, indent=1) + "\n")
    if args.md:
        Path(args.md).write_text("\n\n".join(markdown_table(r) for r in reports) + "\n")
    if args.plot:
        plot(reports, args.plot)
    return 0
