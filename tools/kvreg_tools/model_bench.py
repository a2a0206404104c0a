"""``kvreg bench --model NAME``: decode and prefill in a real model, kvreg's
cache beside transformers' ``DynamicCache`` and ``StaticCache``, in one run.

The model is loaded once (:func:`kvreg.models.load`). Each config gets its
own cache, prefilled with the same ``context`` tokens in one chunk (CPython's
``textwrap.py``, repeated and tokenized), then greedy decode steps are timed
round-robin: ``repeats`` rounds, each running ``steps`` steps of every config
in turn, so every config sees the machine's same conditions. Untimed
warm-up first: every config prefills 128 tokens into a throwaway cache and
decodes two steps (numba's JIT, thread start-up), then one step on its real
cache after the prefill. torch's thread count is held to the one the run
started with (numba's OpenMP layer raises it on its first launch; see
``machine.torch_thread_resets`` in the JSON). Each config keeps growing its own
context (position ``context + 1`` up to ``context + 1 + repeats * steps``,
twice that many steps with ``busy``).
The prefill is timed ``repeats`` times too, round-robin, all but the last on
throwaway caches; its figures are the medians of those rounds. With
``busy``, the same decode rounds run once more beside another process
spinning on a core (``kvreg_tools.bench.busy_process``), each config's
steps going on from where its quiet ones stopped, and are reported in a
table of their own with each config's busy over quiet.

Each step is split by timing the calls that are actually made
(``time.perf_counter_ns`` around each):

- **cache**: the cache's ``update`` call (``DynamicCache.update``,
  ``StaticCache.update``, ``KvregCache.update``) plus, for kvreg, the rows'
  store into kvreg and the sliding layers' trims (``LayerKvCache.append``,
  ``extend``, ``evict``, ...: :data:`_STORE_METHODS`), which the integration
  runs inside its attention function (transformers' sliding layers trim
  inside ``update``). A decode step of one sequence stores its row inside
  ``LayerKvCache.append_attend`` (on numba's F32 rows, in the attention's
  own launch), so there the store counts as **attention**: compare kvreg
  and transformers on cache + attention;
- **attention**: the attention function the model dispatches to through
  ``ALL_ATTENTION_FUNCTIONS`` (``"sdpa"`` for transformers' caches,
  ``"kvreg"`` for ``KvregCache``: conversion to numpy, ``attend_layer`` /
  ``attend_chunk``, conversion back), less kvreg's store calls counted in cache;
- **rest**: the step's wall time (forward plus the argmax) minus both.

The wrappers' own cost (two clock reads and a Python call per wrapped call,
about a microsecond each, 2-3 calls per layer) falls mostly into **rest**.
Table figures are medians over every timed step; the table's rest is the
median step minus the median cache and the median attention, so the three
add up to the median step; ``--json`` keeps every step's raw split (whose
parts add up to that step exactly; ``cache_ns`` is ``update_call_ns`` plus
``kvreg_store_ns``).
"""

from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from contextlib import contextmanager
from dataclasses import dataclass

__all__ = ["DEFAULT_CONFIGS", "ModelConfig", "parse_configs", "context_ids", "run", "format_report", "main"]

DEFAULT_CONFIGS = "kvreg:f32,kvreg:q8,dynamic,static"
QUICK_CONFIGS = "kvreg:f32,dynamic,static"

#: (name, bound, what): kvreg's cache+attention per step over a reference's.
TARGETS = (("dynamic", 0.6, "cache + decode attention vs DynamicCache + SDPA"),
           ("static", 0.8, "cache + decode attention vs StaticCache + SDPA"))
#: kvreg's prefill attention of one chunk over SDPA's (DynamicCache's run).
PREFILL_TARGET = 1.0


@dataclass(frozen=True)
class ModelConfig:
    name: str          # as given: "kvreg:f32", "dynamic", "static"
    kind: str          # "kvreg", "dynamic", "static"
    mode: str | None = None


def parse_configs(text: str) -> list[ModelConfig]:
    from kvreg.errors import ConfigError

    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if part in ("dynamic", "static"):
            out.append(ModelConfig(part, part))
        elif part.startswith("kvreg:") and part[6:]:
            from kvreg.modes import KvMode

            KvMode.parse(part[6:])   # a bad mode fails before the model loads
            out.append(ModelConfig(part, "kvreg", part[6:]))
        elif part == "kvreg":
            out.append(ModelConfig("kvreg:f32", "kvreg", "f32"))
        else:
            raise ConfigError(f"unknown bench config {part!r}; expected kvreg:MODE, dynamic or static")
    if not out:
        raise ConfigError("no bench configs given")
    if len({c.name for c in out}) != len(out):
        raise ConfigError(f"a config is given twice: {text!r}")
    return out


def context_ids(tokenizer, n: int):
    """``[1, n]`` token ids: CPython's ``textwrap.py`` repeated until ``n`` tokens."""
    import sysconfig
    from pathlib import Path

    import torch

    text = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
    ids: list[int] = []
    while len(ids) < n:
        ids.extend(tokenizer(text, add_special_tokens=not ids)["input_ids"])
    return torch.tensor([ids[:n]], dtype=torch.long)


# ── instrumentation ──

class _Clock:
    """Nanoseconds spent in the wrapped calls since the last :meth:`take`."""

    def __init__(self):
        self.cache = self.attn = self.extend = 0
        self.calls = 0
        import torch

        self.torch_threads = torch.get_num_threads()
        self.thread_resets: list[tuple[str, int]] = []

    def take(self) -> tuple[int, int, int]:
        out = (self.cache, self.attn, self.extend)
        self.cache = self.attn = self.extend = 0
        return out


#: The ``LayerKvCache`` calls that store or drop rows: what kvreg's cache
#: does, timed as **cache** although the integration runs them inside its
#: attention function (a call nested in another is counted once).
_STORE_METHODS = ("append", "extend", "evict", "evict_born", "truncate_last")


@contextmanager
def _instrumented(clock: _Clock, cache):
    """Wrap ``cache.update``, the registered ``sdpa``/``kvreg`` attention
    functions and ``LayerKvCache``'s store calls for the duration."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from kvreg.layer import LayerKvCache

    ns = time.perf_counter_ns
    orig_update = cache.update

    def update(*a, **kw):
        t0 = ns()
        try:
            return orig_update(*a, **kw)
        finally:
            clock.cache += ns() - t0

    def wrap_attention(fn):
        def attention(*a, **kw):
            t0 = ns()
            try:
                return fn(*a, **kw)
            finally:
                clock.attn += ns() - t0
                clock.calls += 1
        return attention

    depth = [0]

    def wrap_store(fn):
        def store(self, *a, **kw):
            if depth[0]:
                return fn(self, *a, **kw)
            depth[0] += 1
            t0 = ns()
            try:
                return fn(self, *a, **kw)
            finally:
                clock.extend += ns() - t0
                depth[0] -= 1
        return store

    stores = {n: getattr(LayerKvCache, n) for n in _STORE_METHODS if hasattr(LayerKvCache, n)}
    names = [n for n in ("sdpa", "kvreg") if n in ALL_ATTENTION_FUNCTIONS]
    saved = {n: ALL_ATTENTION_FUNCTIONS._local_mapping.get(n) for n in names}
    cache.update = update
    for n, fn in stores.items():
        setattr(LayerKvCache, n, wrap_store(fn))
    for n in names:
        # The local mapping wins over the global one, which KvregCache's
        # constructor re-registers.
        ALL_ATTENTION_FUNCTIONS[n] = wrap_attention(ALL_ATTENTION_FUNCTIONS[n])
    try:
        yield
    finally:
        del cache.update
        for n, fn in stores.items():
            setattr(LayerKvCache, n, fn)
        for n in names:
            if saved[n] is None:
                del ALL_ATTENTION_FUNCTIONS[n]
            else:
                ALL_ATTENTION_FUNCTIONS[n] = saved[n]


# ── the run ──

class _Runner:
    """One config: its cache, its last token and its raw timings."""

    def __init__(self, cfg: ModelConfig, model, max_len: int, backend):
        from kvreg_tools.evaluation import forward_kwargs

        self.cfg = cfg
        self.model = model
        if cfg.kind == "dynamic":
            from transformers import DynamicCache

            self.cache = DynamicCache(config=model.config)
        elif cfg.kind == "static":
            from transformers import StaticCache

            self.cache = StaticCache(config=model.config, max_cache_len=max_len)
        else:
            from kvreg.integrations.transformers import KvregCache

            self.cache = KvregCache(model, mode=cfg.mode, backend=backend)
        self.kw = forward_kwargs(model, self.cache)   # once: every timed forward feeds the same cache
        self.attn = "kvreg" if cfg.kind == "kvreg" else "sdpa"
        self.steps: list[dict] = []
        self.busy_steps: list[dict] = []   # the rounds beside a busy process
        self.tokens: list[int] = []
        self.prefill: dict = {}
        self.prefills: list[dict] = []   # earlier rounds' prefills, on throwaway caches
        self.next = None

    def _forward(self, clock: _Clock, ids):
        import torch

        self.model.set_attn_implementation(self.attn)
        if torch.get_num_threads() != clock.torch_threads:
            # numba's OpenMP layer, on its first parallel launch, sets the
            # process's OpenMP thread count to NUMBA_NUM_THREADS, which torch
            # then uses: hold torch to the count the run started with.
            clock.thread_resets.append((self.cfg.name, torch.get_num_threads()))
            torch.set_num_threads(clock.torch_threads)
        clock.take()
        clock.calls = 0
        with torch.no_grad(), _instrumented(clock, self.cache):
            t0 = time.perf_counter_ns()
            logits = self.model(input_ids=ids, use_cache=True, **self.kw).logits
            tok = logits[:, -1].argmax(-1, keepdim=True)
            total = time.perf_counter_ns() - t0
        update_ns, fn_ns, store_ns = clock.take()
        # kvreg stores rows inside its attention function: count the store as cache.
        cache_ns, attn_ns = update_ns + store_ns, fn_ns - store_ns
        self.next = tok
        self.tokens.append(int(tok[0, 0]))
        return {"step_ns": total, "cache_ns": cache_ns, "attention_ns": attn_ns,
                "rest_ns": total - cache_ns - attn_ns, "attention_calls": clock.calls,
                "update_call_ns": update_ns, "kvreg_store_ns": store_ns}

    def do_prefill(self, clock: _Clock, ids) -> None:
        self.prefill = self._forward(clock, ids)
        self.prefill["tokens"] = int(ids.shape[1])

    def do_step(self, clock: _Clock, rnd: int | None, *, busy: bool = False) -> None:
        rec = self._forward(clock, self.next)
        if rnd is not None:
            rec["round"] = rnd
            (self.busy_steps if busy else self.steps).append(rec)


def _median(xs):
    return float(statistics.median(xs)) if xs else float("nan")


def summarize_steps(st: list[dict]) -> dict:
    """Medians of decode steps' splits (the rest: the median step less the
    median cache and attention, so the three add up)."""
    step = _median([s["step_ns"] for s in st])
    cache = _median([s["cache_ns"] for s in st])
    attn = _median([s["attention_ns"] for s in st])
    return {"median_step_ms": step / 1e6, "median_cache_ms": cache / 1e6, "median_attention_ms": attn / 1e6,
            "median_rest_ms": (step - cache - attn) / 1e6, "tokens_per_s": 1e9 / step if step else float("nan")}


def summarize(runner: _Runner) -> dict:
    pre = lambda key: _median([p[key] for p in runner.prefills + [runner.prefill]]) / 1e6  # noqa: E731
    return {**summarize_steps(runner.steps), "prefill_ms": pre("step_ns"), "prefill_attention_ms": pre("attention_ns"),
            "prefill_cache_ms": pre("cache_ns"), "prefill_rounds": len(runner.prefills) + 1}


def ratios(summary: dict) -> dict:
    """kvreg configs' cache+attention over each transformers cache's, and
    the prefill attention over SDPA's (DynamicCache's prefill)."""
    out = {}
    refs = {k: v for k, v in summary.items() if k in ("dynamic", "static")}
    for name, s in summary.items():
        if not name.startswith("kvreg"):
            continue
        r = {}
        ca = s["median_cache_ms"] + s["median_attention_ms"]
        for ref, rs in refs.items():
            r[f"cache_attention_vs_{ref}"] = ca / (rs["median_cache_ms"] + rs["median_attention_ms"])
            r[f"step_vs_{ref}"] = s["median_step_ms"] / rs["median_step_ms"]
        sdpa = refs.get("dynamic") or refs.get("static")
        if sdpa and "prefill_attention_ms" in s:
            r["prefill_attention_vs_sdpa"] = s["prefill_attention_ms"] / sdpa["prefill_attention_ms"]
        out[name] = r
    return out


def run(model_name: str, *, context: int = 4096, steps: int = 16, repeats: int = 3,
        configs: str = DEFAULT_CONFIGS, backend=None, progress: bool = True, model=None, tokenizer=None,
        busy: bool = False) -> dict:
    import os

    import torch

    from kvreg import models

    cfgs = parse_configs(configs)
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if progress else (lambda *a: None)
    if model is None:
        t0 = time.perf_counter()
        model, tokenizer = models.load(model_name)
        say(f"loaded {model_name} in {time.perf_counter() - t0:.1f} s")
    ids = context_ids(tokenizer, context)
    max_len = context + 1 + (2 if busy else 1) * repeats * steps + 1
    clock = _Clock()
    # Warm-up on throwaway caches: numba's JIT and thread start-up, torch's
    # first-call allocations, outside every timed figure.
    warm_ids = ids[:, :min(context, 128)]
    for c in cfgs:
        w = _Runner(c, model, warm_ids.shape[1] + 4, backend)
        w.do_prefill(clock, warm_ids)
        w.do_step(clock, None)
        w.do_step(clock, None)
    say(f"warm-up done ({len(cfgs)} configs)")
    # The prefill is one long call: one sample per config would make its
    # verdict a coin toss on a shared machine. Each round prefills every
    # config in turn on a throwaway cache; the kept caches' prefill is the
    # last round's, and the figure is the median of the rounds.
    early: dict[str, list] = {c.name: [] for c in cfgs}
    for rnd in range(repeats - 1):
        for c in cfgs:
            w = _Runner(c, model, context + 1, backend)
            w.do_prefill(clock, ids)
            early[c.name].append(w.prefill)
        say(f"prefill round {rnd + 1}/{repeats} done")
    runners = [_Runner(c, model, max_len, backend) for c in cfgs]
    for r in runners:
        r.prefills = early[r.cfg.name]
        t0 = time.perf_counter()
        r.do_prefill(clock, ids)
        r.do_step(clock, None)       # warm-up, untimed
        say(f"prefill {r.cfg.name}: {time.perf_counter() - t0:.1f} s")

    def rounds(busy_steps: bool, what: str) -> None:
        for rnd in range(repeats):
            for r in runners:
                for _ in range(steps):
                    r.do_step(clock, rnd, busy=busy_steps)
            say(f"round {rnd + 1}/{repeats}{what} done")

    rounds(False, "")
    if busy:
        from kvreg_tools.bench import busy_process

        with busy_process():
            rounds(True, " beside a busy process")
    summary = {r.cfg.name: summarize(r) for r in runners}
    backend_name = next((r.cache.backend_name for r in runners if r.cfg.kind == "kvreg"), None)
    ref = next((r.tokens for r in runners if r.cfg.kind == "dynamic"), None)
    agree = {r.cfg.name: (sum(a == b for a, b in zip(r.tokens, ref)) / len(ref) if ref else None) for r in runners}
    return {
        "model": model_name, "context": context, "steps": steps, "repeats": repeats,
        "configs": [c.name for c in cfgs], "kvreg_backend": backend_name,
        "machine": {"cpu": _cpu_name(), "platform": platform.platform(), "torch_threads": clock.torch_threads,
                    "torch_thread_resets": clock.thread_resets,
                    "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS"),
                    "KVREG_THREADS": os.environ.get("KVREG_THREADS")},
        "versions": {"torch": torch.__version__, "transformers": __import__("transformers").__version__},
        "summary": summary, "ratios": ratios(summary),
        **(_busy_figures(runners, summary) if busy else {}),
        "greedy_agreement_with_dynamic": agree,
        "raw": {r.cfg.name: {"prefill": r.prefill, "earlier_prefills": r.prefills, "steps": r.steps,
                             **({"busy_steps": r.busy_steps} if busy else {}), "tokens": r.tokens}
                for r in runners},
    }


def _busy_figures(runners, quiet: dict) -> dict:
    """The decode beside a busy process: each config's summary, kvreg's
    ratios to transformers' caches there, and each config's busy over its
    quiet step and cache + attention."""
    summary = {r.cfg.name: summarize_steps(r.busy_steps) for r in runners}
    ca = lambda x: x["median_cache_ms"] + x["median_attention_ms"]  # noqa: E731
    over = {n: {"step": x["median_step_ms"] / quiet[n]["median_step_ms"], "cache_attention": ca(x) / ca(quiet[n])}
            for n, x in summary.items()}
    return {"busy": {"summary": summary, "ratios": ratios(summary), "over_quiet": over}}


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _ratio_table(rat: dict) -> list[str]:
    lines = ["| kvreg config | cache+attn / dynamic | cache+attn / static | step / dynamic | step / static "
             "| prefill attn / SDPA |", "|---|---:|---:|---:|---:|---:|"]
    for name, r in rat.items():
        def f(k, r=r):
            return f"{r[k]:.2f}x" if k in r else "-"

        lines.append(f"| {name} | {f('cache_attention_vs_dynamic')} | {f('cache_attention_vs_static')} "
                     f"| {f('step_vs_dynamic')} | {f('step_vs_static')} | {f('prefill_attention_vs_sdpa')} |")
    return lines


def format_report(res: dict) -> str:
    s, rat = res["summary"], res["ratios"]
    lines = [f"kvreg bench --model {res['model']}: context {res['context']}, {res['repeats']} rounds x "
             f"{res['steps']} greedy steps per config, round-robin; kvreg backend {res['kvreg_backend']}; "
             f"{res['machine']['cpu']}, torch threads {res['machine']['torch_threads']}",
             "",
             "| config | tokens/s | step ms | cache ms | attention ms | rest ms | cache+attn ms "
             "| prefill attn ms | greedy = dynamic |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    agree = res.get("greedy_agreement_with_dynamic", {})
    for name in res["configs"]:
        x = s[name]
        a = agree.get(name)
        lines.append(f"| {name} | {x['tokens_per_s']:.1f} | {x['median_step_ms']:.2f} | {x['median_cache_ms']:.3f} "
                     f"| {x['median_attention_ms']:.2f} | {x['median_rest_ms']:.2f} "
                     f"| {x['median_cache_ms'] + x['median_attention_ms']:.2f} | {x['prefill_attention_ms']:.0f} "
                     f"| {'-' if a is None else f'{a:.0%}'} |")
    if rat:
        lines += ["", *_ratio_table(rat), ""]
        for name, r in rat.items():
            for ref, bound, what in TARGETS:
                k = f"cache_attention_vs_{ref}"
                if k in r:
                    lines.append(f"target {name}: {what} <= {bound}x: {r[k]:.2f}x "
                                 f"{'met' if r[k] <= bound else 'MISSED'}")
            if "prefill_attention_vs_sdpa" in r:
                v = r["prefill_attention_vs_sdpa"]
                lines.append(f"target {name}: prefill attention of a {res['context']}-token chunk <= SDPA's: "
                             f"{v:.2f}x {'met' if v <= PREFILL_TARGET else 'MISSED'}")
    busy = res.get("busy")
    if busy:
        lines += ["", "beside a busy process (another process spinning on a core), the same decode rounds after "
                      "the quiet ones:", "",
                  "| config | tokens/s | step ms | cache ms | attention ms | rest ms | cache+attn ms "
                  "| step busy/quiet | cache+attn busy/quiet |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for name in res["configs"]:
            x, o = busy["summary"][name], busy["over_quiet"][name]
            lines.append(f"| {name} | {x['tokens_per_s']:.1f} | {x['median_step_ms']:.2f} "
                         f"| {x['median_cache_ms']:.3f} | {x['median_attention_ms']:.2f} | {x['median_rest_ms']:.2f} "
                         f"| {x['median_cache_ms'] + x['median_attention_ms']:.2f} | {o['step']:.2f}x "
                         f"| {o['cache_attention']:.2f}x |")
        if busy["ratios"]:
            lines += ["", *_ratio_table(busy["ratios"])]
    lines += ["", "cache: the cache's update call (+ kvreg's LayerKvCache append/extend/evict; a decode step's "
              "row is stored inside append_attend, counted as attention); attention: the "
              "registered attention function (sdpa / kvreg), less kvreg's store calls; rest: step - cache - attention. "
              "Medians over every timed step; prefill: one chunk, all layers, median of the rounds."]
    return "\n".join(lines)


def main(args) -> int:
    from kvreg.errors import ConfigError

    quick = bool(getattr(args, "quick", False))
    context = getattr(args, "context", None) or (64 if quick else 4096)
    steps = getattr(args, "steps", None) or (2 if quick else 16)
    repeats = getattr(args, "repeats", None) or (1 if quick else 3)
    configs = getattr(args, "configs", None) or (QUICK_CONFIGS if quick else DEFAULT_CONFIGS)
    backends = getattr(args, "backend", None) or [None]
    if isinstance(backends, str):
        backends = [backends]
    if len(backends) > 1:
        print("kvreg bench --model: give one --backend", file=sys.stderr)
        return 2
    if getattr(args, "what", "all") not in (None, "all"):
        print("kvreg bench --model: no `decode`/`o1` argument with --model", file=sys.stderr)
        return 2
    try:
        res = run(args.model, context=int(context), steps=int(steps), repeats=int(repeats), configs=configs,
                  backend=backends[0], progress=getattr(args, "progress", True),
                  busy=bool(getattr(args, "busy", False)))
    except ConfigError as exc:
        print(f"kvreg bench --model: {exc}", file=sys.stderr)
        return 2
    print(format_report(res))
    if getattr(args, "json", None):
        with open(args.json, "w") as fh:
            json.dump(res, fh, indent=1)
        print(f"\nevery raw timing: {args.json}")
    return 0
