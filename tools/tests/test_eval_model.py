"""``kvreg eval`` (kvreg_tools.evaluation) on a real pretrained model, end to end."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")


def test_kvreg_eval_scores_against_f32_and_writes_a_record_markdown_plot(tmp_path, capsys, monkeypatch):
    """The harness on a short run: DynamicCache, the same cache in
    transformers, has the reference's perplexity to 1e-4 relative; a q8 cache
    costs some KL and fewer bytes. The JSON is a benchmark record kvreg report
    reads, with peak and average bytes over the run; the output says when
    kernels compile, explains each config and warns of a busy machine."""
    import json

    from kvreg.cli import main
    from kvreg_tools import report

    text = tmp_path / "text.txt"
    text.write_text(open(__file__).read())
    out = tmp_path / "eval.json"
    monkeypatch.setattr(report.Load, "warning", lambda self: "timings are unreliable: the machine was busy (test)")
    assert main(["eval", "--model", "smollm2-135m", "--text", str(text), "--tokens", "96", "--prefix", "64",
                 "--configs", "dynamic,q8,born:32,o1:8:16:4", "--json", str(out), "--md", str(tmp_path / "eval.md"),
                 "--plot", str(tmp_path / "kl.png"), "--no-progress"]) == 0
    rec = json.loads(out.read_text())
    report._check_record(rec, "eval.json")                 # every field kvreg report needs
    ref, (dyn, q8, born, seal) = rec["reference"], rec["results"]
    assert rec["kind"] == "eval" and rec["system"] == "kvreg" and rec["scored"] == 32 and rec["text"] == "text.txt"
    assert rec["command"].endswith(f"kvreg eval --model smollm2-135m --text {text} --tokens 96 --prefix 64 "
                                   "--configs dynamic,q8,born:32,o1:8:16:4")
    import hashlib

    assert rec["text_sha256"] == hashlib.sha256(text.read_bytes()).hexdigest()
    assert abs(dyn["ppl"] / ref["ppl"] - 1) < 1e-4 and dyn["kl_mean"] < 1e-6
    assert 0 < q8["kl_mean"] < 0.05 and q8["peak_bytes"] < 0.4 * ref["peak_bytes"]
    # a growing cache: its peak is its size at the end, its mean below it
    for r in (ref, dyn, q8):
        assert r["peak_bytes"] == r["kv_bytes"] and 0 < r["avg_bytes"] < r["peak_bytes"]
    assert dyn["peak_bytes"] == ref["peak_bytes"]           # DynamicCache holds float32 too
    # Born eviction holds its budget from the prefill on; the drop-in seals a
    # layer at the end of the prompt, so the seal never holds the whole prefix
    assert born["peak_bytes"] == born["kv_bytes"] == born["avg_bytes"] < ref["peak_bytes"]
    assert seal["peak_bytes"] == seal["kv_bytes"] and seal["avg_bytes"] <= seal["peak_bytes"] < ref["peak_bytes"]
    assert "| q8 |" in (tmp_path / "eval.md").read_text()
    assert (tmp_path / "kl.png").stat().st_size > 1000
    printed = capsys.readouterr()
    assert "compiling / loading the kernels of q8" in printed.err
    assert re.search(r"^  dynamic +transformers' DynamicCache", printed.out, re.M)
    assert re.search(r"^  q8 +int8 K", printed.out, re.M)
    assert "kvreg eval: timings are unreliable: the machine was busy (test)" in printed.out


@pytest.mark.real_models
@pytest.mark.parametrize("model", ["smollm2-135m", "gemma3-270m"])
def test_the_seal_beats_born_and_sinks_window_at_equal_bytes(model):
    """The O(1) seal through the transformers integration, against Born and
    sinks + window given at least its bytes (kvreg.tiered_seal.equal_rows),
    on a short code text: lower perplexity and KL than both, in no more bytes."""
    import sysconfig
    from pathlib import Path

    from kvreg.models import load
    from kvreg.tiered_seal import equal_rows
    from kvreg_tools.evaluation import evaluate, parse_configs

    lm, tok = load(model)
    cfg = lm.config.get_text_config(decoder=True)
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    n = equal_rows(8, 32, 4, hd, cfg.num_key_value_heads)
    text = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
    rep = evaluate(lm, tok, text, parse_configs(f"o1:8:32:4,born:{n},sinkwin:{n}"), tokens=160, prefix=64,
                   progress=False)
    ref, (seal, born, sinkwin) = rep["reference"], rep["results"]
    assert seal["kv_bytes"] <= born["kv_bytes"] == sinkwin["kv_bytes"] < ref["kv_bytes"]
    assert seal["ppl"] <= born["ppl"] and seal["ppl"] < sinkwin["ppl"]
    assert seal["kl_mean"] < born["kl_mean"] and seal["kl_mean"] < sinkwin["kl_mean"]
