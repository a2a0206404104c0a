"""NVIDIA kvpress's presses on the same tokens as ``kvreg eval`` (a peer, benchmark only).

    python tools/peers/kvpress_eval.py --ids ids.json --prefix 1024 [--keep 0.06,0.125,0.25,0.5]

kvpress pins an older transformers than kvreg's, so it lives in its own
environment and is never a kvreg dependency (tools/peers/README.md). Each
press compresses the prefix as kvpress does, in forward hooks during the
one prefill forward; the scored tokens then decode one at a time through
that cache with their true positions, as kvpress's pipeline feeds them.
``DecodingPress`` also compresses while decoding: the prefill by its
scorer, then back to ``keep * prefix`` rows every ``--interval`` steps.
Everything is scored against kvpress's own uncompressed ``DynamicCache``
(``protocol.py``). A press that cannot run a model is listed under
``skipped`` with kvpress's reason.

Gemma-3-270M is a ``Gemma3ForCausalLM``, which kvpress does not list: as
shipped, every press also compresses the sliding-window layers and the next
forward fails on the mask. kvpress's own rule for Gemma-3 (its
``Gemma3ForConditionalGeneration`` path: compress the global layers only)
is applied to it, and the rotary embedding kvpress calls without a layer
type is given the global one; the report's ``notes`` say so.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import logging
import sys
import tempfile

from protocol import Load, Scorer, add_arguments, load, write_report

PRESSES = ("KVzipPress", "SnapKVPress", "ObservedAttentionPress", "TOVAPress", "StreamingLLMPress",
           "ExpectedAttentionPress", "KnormPress", "DecodingPress")


def _press(kvpress, name, keep, model, args):
    """``(label, Scorer.score contexts)`` of one press keeping ``keep`` of the prefix."""
    ratio = round(1 - keep, 6)
    if name == "DecodingPress":
        press = kvpress.PrefillDecodingPress(
            prefilling_press=kvpress.KnormPress(compression_ratio=ratio),
            decoding_press=kvpress.DecodingPress(base_press=kvpress.KnormPress(), compression_interval=args.interval,
                                                 target_size=int(args.prefix * keep), hidden_states_buffer_size=0))
        return f"DecodingPress(KnormPress, every {args.interval}) keep {keep:g}", {"whole": lambda: press(model)}
    press = getattr(kvpress, name)(compression_ratio=ratio)
    if name != "ObservedAttentionPress":
        return f"{name} keep {keep:g}", {"prefill": lambda: press(model)}

    @contextlib.contextmanager
    def prefill():
        # It scores the attention weights the layer returns, which only the eager kernel materializes.
        model.set_attn_implementation("eager")
        try:
            with press(model):
                yield
        finally:
            model.set_attn_implementation("sdpa")

    return f"{name} keep {keep:g}", {"prefill": prefill}


def _masked_bytes(model) -> int:
    """Rows KVzipPress masks but keeps: kvpress evicts them by overwriting
    their keys at attention time, so the tensors still hold them."""
    total = 0
    for layer in model.model.layers:
        masked = getattr(layer.self_attn, "masked_key_indices", None)
        if masked is not None:
            total += len(masked[0]) * layer.self_attn.head_dim * 2 * model.dtype.itemsize
    return total


def _clear_masks(model) -> None:
    for layer in model.model.layers:
        layer.self_attn.masked_key_indices = None


def _gemma3_rule(model) -> list[str]:
    """kvpress's Gemma-3 handling for the text-only class (module docstring)."""
    from kvpress.presses import base_press
    from transformers import Gemma3ForCausalLM, Gemma3ForConditionalGeneration

    if not isinstance(model, Gemma3ForCausalLM):
        return []
    base_press.Gemma3ForConditionalGeneration = (Gemma3ForConditionalGeneration, Gemma3ForCausalLM)
    rotary = model.model.rotary_emb
    forward = rotary.forward
    rotary.forward = lambda x, position_ids, layer_type=None: forward(x, position_ids, layer_type or "full_attention")
    return ["Gemma3ForCausalLM run under kvpress's Gemma3ForConditionalGeneration rule: presses compress the "
            "global-attention layers only (as shipped, compressing the sliding-window layers fails on the next "
            "forward's mask)",
            "the rotary embedding kvpress calls without a layer type (ExpectedAttentionPress) is given "
            "'full_attention', the type of every layer a press touches"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_arguments(ap)
    ap.add_argument("--keep", default="0.06,0.125,0.25,0.5", help="fractions of the prefix kept")
    ap.add_argument("--presses", default=",".join(PRESSES))
    ap.add_argument("--interval", type=int, default=16, help="DecodingPress: decode steps between compressions")
    args = ap.parse_args(argv)
    import kvpress
    from transformers import AutoTokenizer, DynamicCache

    logging.getLogger("kvpress").setLevel(logging.ERROR)   # per-press "not tested" / "KVzip is slow" warnings
    model, ids, rec = load(args)
    busy = Load()
    notes = _gemma3_rule(model)
    scorer = Scorer(model, ids, args.prefix)
    keeps = [float(k) for k in args.keep.split(",")]
    with tempfile.TemporaryDirectory() as tokdir:
        # KVzipPress reloads the tokenizer from config.name_or_path for its
        # "repeat the context" prompt; a GGUF folder holds no tokenizer files.
        gguf = rec["gguf"].rsplit("/", 1)
        AutoTokenizer.from_pretrained(gguf[0], gguf_file=gguf[1]).save_pretrained(tokdir)
        model.config.name_or_path = tokdir
        for name in args.presses.split(","):
            for keep in keeps:
                label, contexts = _press(kvpress, name, keep, model, args)
                r = scorer.score(label, DynamicCache(config=model.config), **contexts)
                if r is not None and name == "KVzipPress":
                    r["masked_bytes"] = _masked_bytes(model)
                    r["note"] = ("kvpress's KVzipPress masks evicted keys at attention time and keeps every row; "
                                 "peak/avg bytes are what it holds, masked_bytes what a real eviction frees")
                _clear_masks(model)
    write_report(args, f"kvpress {importlib.metadata.version('kvpress')}", "kvpress", rec, scorer, busy, notes)
    return 0


if __name__ == "__main__":
    sys.exit(main())
