"""``kvreg eval``'s protocol for peers that run on transformers caches.

Shared by ``kvpress_eval.py`` and ``quanto_eval.py``, in the peers' own
environment (no kvreg import). The ids come from ``tokens.py``; the first
``prefix`` are prefilled in one forward, then every following token is fed
one at a time (teacher forcing) with its true position. Each configuration
runs alone, start to end; the reference run (``DynamicCache``, float32)
keeps its next-token logits so every configuration is scored against it:
mean and p99 KL(reference || config) in nats, top-1 agreement, perplexity.
The cache's bytes (its tensors' own storage) are sampled after the prefill
and after every decode step: ``peak_bytes`` and ``avg_bytes`` of those.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import platform
import shlex
import sys
import time
from pathlib import Path

# Before tqdm is first imported: it reads its settings then (the GGUF
# dequantizer's progress bar would fill the logs).
os.environ.setdefault("TQDM_DISABLE", "1")

import numpy as np  # noqa: E402
import torch  # noqa: E402


def add_arguments(ap) -> None:
    ap.add_argument("--ids", required=True, help="JSON written by tools/peers/tokens.py")
    ap.add_argument("--prefix", type=int, default=1024)
    ap.add_argument("--out", default=None, help="report JSON (default: docs/results/peers/<system>-<model>-<n>.json)")
    ap.add_argument("--threads", type=int, default=1)


def load(args):
    """``(model, ids tensor [1, n], ids record)``; the model from the GGUF
    file named in the ids record, float32, SDPA, on the CPU."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.disable_progress_bar()
    logging.set_verbosity_error()
    torch.set_num_threads(args.threads)
    rec = json.loads(Path(args.ids).read_text())
    ids = torch.tensor([rec["ids"]])
    if not 1 <= args.prefix < ids.shape[1] - 1:
        sys.exit(f"{args.ids} holds {ids.shape[1]} ids; need more than prefix+1 = {args.prefix + 1}")
    gguf = Path(rec["gguf"])
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32,
                                                 attn_implementation="sdpa")
    return model.eval(), ids, rec


def tensor_bytes(t) -> int:
    """Storage of a tensor; wrapper subclasses (quanto's packed codes,
    scales and shifts) are summed over their inner tensors."""
    if t is None:
        return 0
    if hasattr(t, "__tensor_flatten__"):
        names, _ = t.__tensor_flatten__()
        return sum(tensor_bytes(getattr(t, n)) for n in names)
    return t.numel() * t.element_size()


def cache_bytes(cache) -> int:
    total = 0
    for layer in cache.layers:
        for name in ("keys", "values", "_quantized_keys", "_quantized_values"):
            total += tensor_bytes(getattr(layer, name, None))
    return total


def run(model, ids, prefix, cache, *, prefill=contextlib.nullcontext, whole=contextlib.nullcontext,
        after_step=None):
    """Prefill then teacher-forced decode through ``cache``; yields per
    scored position ``(logits float32 [vocab], cache bytes)``, then a last
    item ``{"prefill_s", "decode_s"}``. ``prefill`` wraps the prefill forward
    only, ``whole`` the prefill and every decode step."""
    n = ids.shape[1]
    with torch.no_grad(), whole():
        t0 = time.perf_counter()
        with prefill():
            out = model(input_ids=ids[:, :prefix], past_key_values=cache, use_cache=True, logits_to_keep=1)
        prefill_s = time.perf_counter() - t0
        yield out.logits[0, -1].float(), cache_bytes(cache)
        decode_s = 0.0
        for pos in range(prefix, n - 1):
            t0 = time.perf_counter()
            # The true position: a press shortens the cache, so the cache's
            # length no longer says where the token sits.
            out = model(input_ids=ids[:, pos:pos + 1], past_key_values=cache, use_cache=True,
                        position_ids=torch.tensor([[pos]]))
            decode_s += time.perf_counter() - t0
            yield out.logits[0, -1].float(), cache_bytes(cache)
    yield {"prefill_s": prefill_s, "decode_s": decode_s}


class Scorer:
    """Runs the reference first, then scores each configuration against it."""

    def __init__(self, model, ids, prefix):
        from transformers import DynamicCache

        self.model, self.ids, self.prefix = model, ids, prefix
        self.targets = ids[0, prefix:]
        t0 = time.perf_counter()
        steps = list(run(model, ids, prefix, DynamicCache(config=model.config)))
        self.ref_logits = torch.stack([lg for lg, _ in steps[:-1]])
        self.results, self.skipped = [], []
        row = self._row("DynamicCache", steps, time.perf_counter() - t0)
        self.reference = {k: row[k] for k in ("config", "ppl", "peak_bytes", "avg_bytes", "ms_per_token",
                                              "prefill_s", "wall_s")}

    def score(self, label, cache, **contexts):
        t0 = time.perf_counter()
        try:
            steps = list(run(self.model, self.ids, self.prefix, cache, **contexts))
        except Exception as exc:   # a peer that cannot run a configuration is a result too
            self.skipped.append({"config": label, "reason": f"{type(exc).__name__}: {exc}"})
            print(f"{label:<40} cannot run: {self.skipped[-1]['reason']}", flush=True)
            return None
        row = self._row(label, steps, time.perf_counter() - t0)
        self.results.append(row)
        return row

    def _row(self, label, steps, wall):
        timing = steps[-1]
        kl, agree, nll, sizes = [], [], [], []
        for i, (logits, nbytes) in enumerate(steps[:-1]):
            ref = torch.log_softmax(self.ref_logits[i].double(), -1)
            logp = torch.log_softmax(logits.double(), -1)
            kl.append(float((ref.exp() * (ref - logp)).sum()))
            agree.append(int(logp.argmax()) == int(ref.argmax()))
            nll.append(-float(logp[self.targets[i]]))
            sizes.append(nbytes)
        r = {"config": label, "ppl": math.exp(float(np.mean(nll))), "kl_mean": float(np.mean(kl)),
             "kl_p99": float(np.percentile(kl, 99)), "top1": float(np.mean(agree)),
             "peak_bytes": int(max(sizes)), "avg_bytes": float(np.mean(sizes)),
             "ms_per_token": 1e3 * timing["decode_s"] / max(len(sizes) - 1, 1),
             "prefill_s": timing["prefill_s"], "wall_s": wall}
        full = getattr(self, "reference", r)["peak_bytes"]
        print(f"{label:<40} KL {r['kl_mean']:.3e} (p99 {r['kl_p99']:.2e})  top-1 {100 * r['top1']:5.1f}%  "
              f"peak {r['peak_bytes'] / full:.3f}  avg {r['avg_bytes'] / full:.3f}  PPL {r['ppl']:.3f}  "
              f"{r['ms_per_token']:.1f} ms/tok  {wall:.0f} s", flush=True)
        return r


def _busy_seconds() -> float | None:
    """CPU seconds all CPUs spent busy (steal included), from /proc/stat."""
    try:
        ticks = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:9]]
    except (OSError, ValueError):
        return None
    return (sum(ticks) - ticks[3] - ticks[4]) / os.sysconf("SC_CLK_TCK")


class Load:
    """Cores other processes kept busy on average while this one ran: the
    timings (``ms_per_token``) are only as good as that is small."""

    def __init__(self):
        self.wall, self.own, self.busy = time.perf_counter(), time.process_time(), _busy_seconds()

    def others(self) -> float | None:
        busy = _busy_seconds()
        if busy is None or self.busy is None:
            return None
        own = time.process_time() - self.own
        return round(max(0.0, (busy - self.busy - own) / (time.perf_counter() - self.wall)), 2)


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def write_report(args, system: str, short: str, rec: dict, scorer: Scorer, load: Load, notes=()) -> Path:
    n = int(scorer.ids.shape[1])
    out = Path(args.out) if args.out else (Path(__file__).resolve().parents[2] / "docs" / "results" / "peers"
                                           / f"{short}-{rec['model']}-{Path(rec['text']).stem}-{n}.json")
    command = f"{rec['command']} && {shlex.join([sys.executable, *sys.argv])}"
    report = {
        "kind": "eval", "system": system, "command": command,
        "machine": {"cpu": _cpu(), "cores": os.cpu_count(), "platform": platform.platform(),
                    "python": platform.python_version(), "torch_threads": torch.get_num_threads()},
        "date": datetime.date.today().isoformat(),
        "model": rec["model"], "text": rec["text"], "text_sha256": rec["text_sha256"],
        "tokens": n, "prefix": scorer.prefix, "scored": n - scorer.prefix,
        "reference": scorer.reference, "results": scorer.results,
        "other_cores_busy": load.others(),
    }
    if notes:
        report["notes"] = list(notes)
    if scorer.skipped:
        report["skipped"] = scorer.skipped
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=1) + "\n")
    print(f"-> {out}", file=sys.stderr)
    return out
