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
- ``kv_bytes``: the cache's KV state at the end (kvreg: ``memory_bytes``;
  transformers' caches: their tensors' bytes); ``bytes_per_element``: that
  over the K and V elements held, where every layer holds plain rows.

Configurations (``parse_config``): a KV mode name (``f32``, ``q8``, ...);
``born:N`` (Born eviction at ``N`` rows, sink 4), ``sinkwin:N`` (4 sinks +
the newest rows, ``N`` in all), ``recent:N``; ``o1:M:W:SINK[:HEAVY]`` (the
O(1) seal, its tiered far field), ``nystrom:M:W:SINK[:HEAVY]`` (the seal with
the seed's Nyström far field);
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

__all__ = ["CacheConfig", "default_texts", "evaluate", "markdown_table", "parse_config", "parse_configs"]

DEFAULT_CONFIGS = "dynamic,q8,q8k,q8v,born:512,sinkwin:512,o1:64:128:4"


@dataclass(frozen=True)
class CacheConfig:
    label: str
    kind: str                       # "kvreg", "dynamic" or "static"
    kwargs: dict = field(default_factory=dict)


def parse_config(spec: str) -> CacheConfig:
    """One configuration from its command-line spelling (module docstring)."""
    from kvreg.cache import Born, Recent
    from kvreg.modes import KvMode

    raw = spec.strip()
    if raw in ("dynamic", "static"):
        return CacheConfig(raw, raw)
    body, _, mode = raw.partition("@")
    kwargs: dict = {}
    if mode:
        kwargs["mode"] = KvMode.parse(mode).value
    head, *args = body.split(":")
    try:
        nums = [int(a) for a in args]
    except ValueError:
        raise ConfigError(f"config {spec!r}: arguments must be integers") from None
    if head in ("born", "sinkwin", "recent"):
        if len(nums) != 1 or nums[0] <= 0:
            raise ConfigError(f"config {spec!r}: expected {head}:N with N > 0 rows")
        kwargs["budget"] = nums[0]
        kwargs["policy"] = Born(4) if head == "born" else Recent()
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
        raise ConfigError(f"config {spec!r}: expected a KV mode, born:N, sinkwin:N, recent:N, o1:M:W:SINK, "
                          "nystrom:M:W:SINK, dynamic or static")
    kwargs.setdefault("mode", "f32")
    return CacheConfig(raw, "kvreg", kwargs)


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


def _make_cache(cfg: CacheConfig, model, tokens: int, backend):
    if cfg.kind == "dynamic":
        from transformers import DynamicCache

        return DynamicCache(config=model.config)
    if cfg.kind == "static":
        from transformers import StaticCache

        return StaticCache(config=model.config, max_cache_len=tokens)
    from kvreg.integrations.transformers import KvregCache

    return KvregCache(model, backend=backend, **cfg.kwargs)


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


def evaluate(model, tokenizer, text: str, configs: list[CacheConfig], *, tokens: int = 2048, prefix: int = 256,
             backend=None, progress: bool = True) -> dict:
    """Score ``configs`` on ``text`` against the kvreg F32 reference (module
    docstring). Returns ``{"tokens", "prefix", "scored", "results": [...]}``."""
    import torch

    ids = tokenizer(text, return_tensors="pt").input_ids[:, :tokens]
    n = int(ids.shape[1])
    if prefix < 1 or n <= prefix + 1:
        raise ConfigError(f"the text has {n} tokens; need more than prefix+1 = {prefix + 1}")
    runs = [CacheConfig("f32 (reference)", "kvreg", {"mode": "f32"})] + list(configs)
    caches = [_make_cache(c, model, n, backend) for c in runs]
    kw = cache_keyword(model)
    scored = n - prefix
    kl = np.zeros((len(runs), scored))
    agree = np.zeros((len(runs), scored), dtype=bool)
    nll = np.zeros((len(runs), scored))
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
                logits = model(input_ids=feed, use_cache=True, **{kw: cache}).logits[0, -1]
                if step:
                    seconds[i] += time.perf_counter() - t0
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
    results = []
    for i, (cfg, cache) in enumerate(zip(runs, caches)):
        kv_bytes, per_el = cache_bytes(cache)
        results.append({
            "config": cfg.label, "kind": cfg.kind,
            "ppl": math.exp(float(nll[i].mean())),
            "kl_mean": float(kl[i].mean()), "kl_p99": float(np.percentile(kl[i], 99)),
            "top1": float(agree[i].mean()),
            "kv_bytes": int(kv_bytes), "bytes_per_element": per_el,
            "ms_per_token": 1e3 * seconds[i] / max(scored - 1, 1),
        })
    return {"tokens": n, "prefix": prefix, "scored": scored, "results": results}


def markdown_table(report: dict) -> str:
    lines = [f"{report['model']}, {report['text']}: {report['tokens']} tokens, prefix {report['prefix']}, "
             f"{report['scored']} scored, backend {report['backend']}", "",
             "| cache | PPL | mean KL | p99 KL | top-1 agree | KV MiB | bytes/elem | ms/token |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in report["results"]:
        per = "—" if r["bytes_per_element"] is None else f"{r['bytes_per_element']:.3f}"
        lines.append(f"| {r['config']} | {r['ppl']:.4f} | {r['kl_mean']:.2e} | {r['kl_p99']:.2e} | "
                     f"{100 * r['top1']:.1f}% | {r['kv_bytes'] / 2**20:.2f} | {per} | {r['ms_per_token']:.1f} |")
    return "\n".join(lines)


def plot(reports: list[dict], path: str) -> None:
    """KL against cache bytes, one panel per (model, text)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(reports), figsize=(6 * len(reports), 4.5), squeeze=False)
    for ax, rep in zip(axes[0], reports):
        for r in rep["results"][1:]:
            kl = max(r["kl_mean"], 1e-9)
            ax.scatter(r["kv_bytes"] / 2**20, kl)
            ax.annotate(r["config"], (r["kv_bytes"] / 2**20, kl), fontsize=7, xytext=(3, 3),
                        textcoords="offset points")
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("KV cache MiB at the end")
        ax.set_ylabel("mean KL vs F32 (nats)")
        ax.set_title(f"{rep['model']} · {Path(rep['text']).name}", fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(args) -> int:
    from kvreg import models
    from kvreg.registry import get_backend

    configs = parse_configs(args.configs)
    if args.plot:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            raise ConfigError("--plot needs matplotlib: pip install 'kvreg-tools[bench]'")
    texts = [Path(t) for t in args.text] if args.text else default_texts()[:1]
    names = list(models.MODELS) if args.model == "all" else [args.model]
    reports = []
    for name in names:
        model, tok = models.load(name)
        for text in texts:
            rep = evaluate(model, tok, text.read_text(encoding="utf-8", errors="replace"), configs,
                           tokens=args.tokens, prefix=args.prefix, backend=args.backend,
                           progress=not args.no_progress)
            rep.update(model=name, text=str(text), backend=get_backend(args.backend).name)
            reports.append(rep)
            print(markdown_table(rep))
            print()
    if args.json:
        Path(args.json).write_text(json.dumps(reports, indent=1))
    if args.md:
        Path(args.md).write_text("\n\n".join(markdown_table(r) for r in reports) + "\n")
    if args.plot:
        plot(reports, args.plot)
    return 0
