"""``kvreg generate``: text from a real model through kvreg, beside ``DynamicCache``.

Greedy generation of the same prompt twice, once through
:class:`~kvreg.integrations.transformers.KvregCache` and once through
transformers' ``DynamicCache`` (SDPA), printing the text, tokens/s and the
cache bytes of each, and whether the tokens agree. A generation's tokens/s
is the whole model's (prompt included), so it differs from the per-token
times of ``kvreg eval``, which scores many caches in lockstep; both say when
other processes kept the machine busy (:class:`kvreg_tools.report.Load`).
"""

from __future__ import annotations

import sys
import time

DEFAULT_PROMPT = "Write a Python function that checks whether a string is a palindrome."


def _chat_inputs(tok, prompt: str):
    if getattr(tok, "chat_template", None):
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                      return_tensors="pt", return_dict=True)
        return {"input_ids": ids["input_ids"], "attention_mask": ids["attention_mask"]}
    return dict(tok(prompt, return_tensors="pt"))


def main(args) -> int:
    import torch
    from transformers import DynamicCache

    from kvreg import models
    from kvreg.integrations.transformers import KvregCache

    from .evaluation import cache_bytes, cache_keyword
    from .report import Load

    print(f"kvreg generate: loading {args.model} (the first load converts its weights: ~1 min; cached after)",
          file=sys.stderr, flush=True)
    model, tok = models.load(args.model)
    inputs = _chat_inputs(tok, args.prompt)
    n_in = inputs["input_ids"].shape[1]
    kw = cache_keyword(model)
    rows = []
    outputs = {}
    kv = KvregCache(model, mode=args.kv, backend=args.backend)
    # Compiled kernels load (or, on a machine that never ran them, compile) at
    # their first call: outside the timings.
    print(f"kvreg generate: preparing the {kv.backend_name} backend's kernels (minutes on a machine that never "
          "compiled them; loaded from disk after) ...", end="", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    with torch.no_grad():
        model.generate(**inputs, max_new_tokens=2, do_sample=False, **{kw: KvregCache(model, mode=args.kv,
                                                                                        backend=args.backend)})
    print(f" {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    load = Load()
    for label, cache in ((f"kvreg {kv.mode.value} ({kv.backend_name})", kv),
                         ("DynamicCache + SDPA", DynamicCache(config=model.config))):
        t0 = time.perf_counter()
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=args.tokens, do_sample=False, **{kw: cache})
        dt = time.perf_counter() - t0
        new = out[0, n_in:]
        outputs[label] = new
        nbytes = cache_bytes(cache)[0]
        rows.append((label, len(new) / dt, nbytes))
    first = next(iter(outputs))
    print(f"model: {args.model}  prompt: {args.prompt!r}  ({n_in} prompt tokens)")
    print()
    print(tok.decode(outputs[first], skip_special_tokens=True).strip())
    print()
    print(f"{'cache':<32} {'tokens/s':>9} {'KV cache':>12}")
    for label, tps, nbytes in rows:
        print(f"{label:<32} {tps:>9.1f} {nbytes / 2**20:>9.2f} MiB")
    a, b = outputs.values()
    same = a.shape == b.shape and bool(torch.equal(a, b))
    print(f"tokens identical to DynamicCache's: {'yes' if same else 'no'}")
    print("tokens/s: the whole greedy generation, model included; KV cache: the cache's bytes at the end")
    warning = load.warning()
    if warning:
        print(f"kvreg generate: {warning}")
    return 0
