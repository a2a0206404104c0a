"""transformers' ``QuantizedCache`` (optimum-quanto backend) on the same tokens as ``kvreg eval``.

    python tools/peers/quanto_eval.py --ids ids.json --prefix 1024 [--configs 4:128,4:0,2:128,2:0]

A benchmark peer in its own environment with kvpress's transformers (never
a kvreg dependency; tools/peers/README.md). Each configuration is
``NBITS:RESIDUAL``: quanto's int4 or int2 codes, per-channel groups of 64
(transformers' default) with a scale and a shift each, and up to
``RESIDUAL`` newest rows kept in full precision before they are quantized
(128 is transformers' default; 0 quantizes every row at the next step).
The prefill is quantized whole; the bytes counted are the packed codes,
scales, shifts and the residual rows. Scored against transformers' own
``DynamicCache`` (``protocol.py``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys

from protocol import Load, Scorer, add_arguments, load, write_report


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    ap.add_argument("--configs", default="4:128,4:0,2:128,2:0", help="NBITS:RESIDUAL, comma-separated")
    args = ap.parse_args(argv)
    import torch
    from transformers import QuantizedCache

    model, ids, rec = load(args)
    busy = Load()
    # quanto compiles its C++ unpacking kernel on first use; build it before anything is timed.
    QuantizedCache(backend="quanto", config=model.config).layers[0]._quantize(torch.zeros(1, 1, 64, 64), 0).dequantize()
    scorer = Scorer(model, ids, args.prefix)
    for spec in args.configs.split(","):
        nbits, residual = (int(x) for x in spec.split(":"))
        cache = QuantizedCache(backend="quanto", config=model.config, nbits=nbits, residual_length=residual)
        scorer.score(f"quanto int{nbits} residual {residual}", cache)
    notes = []
    if "sliding_attention" in (getattr(model.config, "layer_types", None) or ()):
        notes.append("QuantizedCache has no sliding-window layers: it keeps every row of the sliding-window "
                     "layers too, where the reference DynamicCache keeps the window")
    system = (f"transformers {importlib.metadata.version('transformers')} QuantizedCache "
              f"(optimum-quanto {importlib.metadata.version('optimum-quanto')})")
    write_report(args, system, "quanto", rec, scorer, busy, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
