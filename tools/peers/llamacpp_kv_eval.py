"""llama.cpp's KV cache types on the same tokens as ``kvreg eval`` (a peer, benchmark only).

    python tools/peers/llamacpp_kv_eval.py --model smollm2-135m --text FILE --tokens 2048 --prefix 256

Needs ``llama-cpp-python`` (not a kvreg dependency; build it with
``CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_AVX512=OFF"``). The
protocol is kvreg eval's: the text is tokenized by transformers' tokenizer of
the same GGUF file, the first ``prefix`` tokens are evaluated in one batch,
then every following token one at a time; each KV type is scored by mean and
p99 KL of its next-token distributions against llama.cpp's own f16 cache, by
top-1 agreement with it and by perplexity. llama.cpp runs the GGUF's own
quantized weights, so its figures compare with kvreg's as "each system
against its own full-precision cache".
"""

from __future__ import annotations

import argparse
import json
import math
import sys

import numpy as np

# ggml type ids (ggml.h) and bytes per element of each KV type.
TYPES = {"f16": (1, 2.0), "q8_0": (8, 34 / 32), "q4_0": (2, 18 / 32)}


def _logprobs(llm, ids, prefix):
    llm.reset()
    llm.eval(ids[:prefix])
    rows = [np.array(llm.scores[prefix - 1], dtype=np.float64)]
    for t in range(prefix, len(ids) - 1):
        llm.eval([ids[t]])
        rows.append(np.array(llm.scores[t], dtype=np.float64))
    x = np.stack(rows)
    x -= x.max(axis=1, keepdims=True)
    return x - np.log(np.exp(x).sum(axis=1, keepdims=True))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--text", required=True)
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--prefix", type=int, default=256)
    ap.add_argument("--types", default="q8_0,q4_0")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    try:
        from llama_cpp import Llama
    except ImportError:
        print("llama-cpp-python is not installed (a benchmark peer, not a kvreg dependency)", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer

    from kvreg.models import gguf_path

    path = gguf_path(args.model)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ids = tok(open(args.text, encoding="utf-8", errors="replace").read()).input_ids[: args.tokens]
    targets = np.array(ids[args.prefix:])
    results, ref = [], None
    for name in ["f16"] + [t for t in args.types.split(",") if t]:
        gtype, per_el = TYPES[name]
        llm = Llama(model_path=str(path), n_ctx=len(ids) + 8, n_batch=512, logits_all=True, flash_attn=True,
                    type_k=gtype, type_v=gtype, n_threads=2, verbose=False)
        lp = _logprobs(llm, ids, args.prefix)
        if ref is None:
            ref = lp
        kl = (np.exp(ref) * (ref - lp)).sum(axis=1)
        results.append({"config": f"llama.cpp {name}", "ppl": math.exp(-lp[np.arange(len(targets)), targets].mean()),
                        "kl_mean": float(kl.mean()), "kl_p99": float(np.percentile(kl, 99)),
                        "top1": float((lp.argmax(1) == ref.argmax(1)).mean()), "bytes_per_element": per_el})
        print(f"{results[-1]['config']:<18} PPL {results[-1]['ppl']:.4f}  KL {kl.mean():.2e} (p99 "
              f"{results[-1]['kl_p99']:.2e})  top-1 {100 * results[-1]['top1']:.1f}%", flush=True)
        del llm
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"model": args.model, "text": args.text, "tokens": len(ids), "prefix": args.prefix,
                       "results": results}, fh, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
