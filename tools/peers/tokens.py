"""The token ids ``kvreg eval`` scores, written for the benchmark peers.

    python tools/peers/tokens.py --model smollm2-135m --text FILE --tokens 1280 --out ids.json

Runs in kvreg's own environment: the text is tokenized by the tokenizer
``kvreg.models.load`` returns, exactly as ``kvreg eval`` does, and the first
``tokens`` ids are written as JSON with the model's GGUF path and the text's
SHA-256. The peers (``kvpress_eval.py``, ``quanto_eval.py``) run in their
own environment, with another transformers, and read these ids instead of
tokenizing again, so every system scores the same tokens.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shlex
import sys
from pathlib import Path


def main(argv=None) -> int:
    from kvreg import models
    from kvreg_tools.evaluation import default_texts

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m", choices=sorted(models.MODELS))
    ap.add_argument("--text", default=None, help="text file (default: kvreg eval's default text)")
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    text = Path(args.text) if args.text else default_texts()[0]
    raw = text.read_bytes()
    _, tok = models.load(args.model)
    # Read as kvreg eval reads it (text mode), hashed as the bytes on disk.
    ids = tok(text.read_text(encoding="utf-8", errors="replace")).input_ids[: args.tokens]
    Path(args.out).write_text(json.dumps({
        "command": shlex.join([sys.executable, *sys.argv]), "model": args.model,
        "gguf": str(models.gguf_path(args.model)), "text": text.name, "text_path": str(text),
        "text_sha256": hashlib.sha256(raw).hexdigest(), "ids": ids,
    }))
    print(f"{len(ids)} ids of {text.name} ({args.model}) -> {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
