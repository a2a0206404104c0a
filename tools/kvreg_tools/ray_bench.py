"""Prefill -> decode hand-off on Ray: bytes shipped per token and latency per MiB.

``python -m kvreg_tools.ray_bench [--model smollm2-135m] [--contexts 512,2048]
[--modes f32,f16,q8] [--repeats 3]`` (needs ``kvreg[ray,hf]``).

For each mode and context the driver prefills that many tokens (CPython's
``textwrap.py``, repeated and tokenized) into a ``KvregCache`` and exports
it (:meth:`KvregCache.export_wire`, the blob the prefill worker ships):

- **bytes shipped**: the blob's size, per token of context, and the marginal
  bytes per token between the two smallest contexts (what one more token
  costs; the fixed part is each layer's header, q8's exact rows and f16
  window). ``f32 K+V`` is ``2 * layers * kv_heads * head_dim * 4`` per token.
- **latency** (medians over ``--repeats``, after one untimed warm-up round): ``export``: ``export_wire`` in the
  driver; ``put``/``get``: actor A ``ray.put``-s the blob it holds, actor B
  ``ray.get``-s it and touches every page (a sum of every 4096th byte), timed
  inside each actor; ``put+get RPC``: the same two calls timed from the
  driver, as the ``numpy.uint8`` array the workers ship (zero-copy on get)
  and as ``bytes`` (pickled in band: copied on get); ``import``: ``import_wire`` in the driver;
  ``hand-off``: a real ``DecodeWorker.load`` RPC from the driver, the blob
  already in the object store (Ray's dispatch + mapping the object +
  ``import_wire`` + the model-free checks), per MiB of blob.

The object store is sized to hold a few of the largest blobs (``--store-mib``).
"""

from __future__ import annotations

import argparse
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path


def _text_ids(tok, n: int) -> list:
    import textwrap

    text = Path(textwrap.__file__).read_text()
    ids = tok(text)["input_ids"]
    while len(ids) < n:
        ids = ids + ids
    return ids[:n]


def _med(xs) -> float:
    return statistics.median(xs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvreg_tools.ray_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--contexts", default="512,2048", help="prompt lengths (tokens), comma-separated")
    ap.add_argument("--modes", default="f32,f16,q8")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--store-mib", type=int, default=1024, help="Ray object store size")
    ap.add_argument("--backend", default=None)
    args = ap.parse_args(argv)
    contexts = sorted(int(c) for c in args.contexts.split(","))
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]

    import numpy as np
    import ray
    import torch

    from kvreg.integrations.ray import DecodeWorker, SequenceMeta, wire_array
    from kvreg.integrations.transformers import KvregCache
    from kvreg.models import load

    print("$ " + " ".join(["python -m kvreg_tools.ray_bench"] + [shlex.quote(a) for a in (argv or sys.argv[1:])]))
    tmp = tempfile.mkdtemp(prefix="kvreg-raybench-")
    ray.init(address="local", num_cpus=2, include_dashboard=False, _temp_dir=tmp,
             object_store_memory=args.store_mib * 2**20, log_to_driver=False, configure_logging=False)

    @ray.remote
    class Src:
        def hold(self, payload):
            self.payload = bytes(payload) if isinstance(payload, bytes) else np.array(payload)  # its own copy

        def put(self):
            t = time.perf_counter()
            ref = ray.put(self.payload)
            return [ref], time.perf_counter() - t

    @ray.remote
    class Dst:
        def get(self, refs):
            t = time.perf_counter()
            obj = ray.get(refs[0])
            view = np.frombuffer(obj, dtype=np.uint8) if isinstance(obj, bytes) else obj
            int(view[::4096].sum())   # touch every page
            return time.perf_counter() - t, type(obj).__name__

    decoder = DecodeWorker.remote(args.model, backend=args.backend)
    src, dst = Src.remote(), Dst.remote()
    model, tok = load(args.model)
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    f32_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * 4
    ray.get(decoder.ready.remote())
    torch_threads = torch.get_num_threads()

    sizes, rows = {}, []
    for mode in modes:
        for n in contexts:
            ids = _text_ids(tok, n)
            cache = KvregCache(model, mode=mode, backend=args.backend)
            with torch.inference_mode():
                logits = model(input_ids=torch.tensor([ids]), cache=cache, use_cache=True).logits
            exp, imp, pg_np, pg_b, put_np, get_np, hand = [], [], [], [], [], [], []
            for rep in range(args.repeats + 1):   # round 0: warm-up (first calls, numba), not kept
                if rep == 1:
                    for xs in (exp, imp, pg_np, pg_b, put_np, get_np, hand):
                        xs.clear()
                t = time.perf_counter()
                blob = cache.export_wire()
                exp.append(time.perf_counter() - t)
                t = time.perf_counter()
                KvregCache(model, mode=mode, backend=args.backend).import_wire(blob)
                imp.append(time.perf_counter() - t)
                for payload, sink in ((wire_array(blob), pg_np), (blob, pg_b)):
                    ray.get(src.hold.remote(payload))
                    t = time.perf_counter()
                    refs, put_s = ray.get(src.put.remote())
                    get_s, _ = ray.get(dst.get.remote(refs))
                    sink.append(time.perf_counter() - t)
                    if sink is pg_np:
                        put_np.append(put_s)
                        get_np.append(get_s)
                    del refs
                meta = SequenceMeta("bench", n, (int(logits[0, -1].argmax()),), n + 2, (),
                                    {"mode": mode, "q8_exact_rows": cache.q8_exact_rows, "policy": None,
                                     "budget": None, "sink": 0}, len(blob))
                wire_ref = ray.put(wire_array(blob))
                t = time.perf_counter()
                ray.get(decoder.load.remote(meta, wire_ref))
                hand.append(time.perf_counter() - t)
                ray.get(decoder.release.remote("bench"))
                del wire_ref
            sizes[(mode, n)] = len(blob)
            rows.append((mode, n, len(blob), _med(exp), _med(put_np), _med(get_np), _med(pg_np), _med(pg_b),
                         _med(imp), _med(hand)))
            del cache, blob
    ray.shutdown()
    shutil.rmtree(tmp, ignore_errors=True)

    print(f"\nmodel {args.model}: {cfg.num_hidden_layers} layers x {cfg.num_key_value_heads} KV heads x "
          f"head_dim {head_dim}; f32 K+V = {f32_per_token} bytes/token; repeats {args.repeats}; "
          f"driver torch threads {torch_threads}, workers 1\n")
    print("| mode | context | blob | bytes/token | marginal bytes/token | vs f32 K+V |")
    print("|---|---:|---:|---:|---:|---:|")
    lo, hi = contexts[0], contexts[-1]
    for mode in modes:
        marg = (sizes[(mode, hi)] - sizes[(mode, lo)]) / (hi - lo) if hi > lo else float("nan")
        for n in contexts:
            b = sizes[(mode, n)]
            print(f"| {mode} | {n} | {b / 2**20:.2f} MiB | {b / n:,.0f} | {marg:,.0f} | {marg / f32_per_token:.3f} |")
    print("\nLatency, medians (ms; ms/MiB in brackets):\n")
    print("| mode | context | MiB | export | put (A) | get (B) | put+get RPC, uint8 | put+get RPC, bytes "
          "| import | DecodeWorker.load RPC |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for mode, n, b, e, pn, gn, rn, rb, im, h in rows:
        mib = b / 2**20

        def f(s, mib=mib):
            return f"{s * 1e3:.1f} ({s * 1e3 / mib:.2f})"

        print(f"| {mode} | {n} | {mib:.2f} | {f(e)} | {f(pn)} | {f(gn)} | {f(rn)} | {f(rb)} | {f(im)} | {f(h)} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
