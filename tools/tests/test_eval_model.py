"""``kvreg eval`` (kvreg_tools.evaluation) on a real pretrained model, end to end.

Moved from tests/test_transformers_integration.py with the harness.
"""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")


def test_kvreg_eval_scores_against_f32_and_writes_json_markdown_plot(tmp_path):
    """The harness on a short run: the reference scores itself at KL 0;
    DynamicCache, the same cache in transformers, has the reference's
    perplexity to 1e-4 relative; a q8 cache costs some KL and fewer bytes."""
    import json

    from kvreg.cli import main

    text = tmp_path / "text.txt"
    text.write_text(open(__file__).read())
    out = tmp_path / "eval.json"
    assert main(["eval", "--model", "smollm2-135m", "--text", str(text), "--tokens", "96", "--prefix", "64",
                 "--configs", "dynamic,q8", "--json", str(out), "--md", str(tmp_path / "eval.md"),
                 "--plot", str(tmp_path / "kl.png"), "--no-progress"]) == 0
    (rep,) = json.loads(out.read_text())
    ref, dyn, q8 = rep["results"]
    assert rep["scored"] == 32 and ref["kl_mean"] == 0 and ref["top1"] == 1
    assert abs(dyn["ppl"] / ref["ppl"] - 1) < 1e-4 and dyn["kl_mean"] < 1e-6
    assert 0 < q8["kl_mean"] < 0.05 and q8["kv_bytes"] < 0.4 * ref["kv_bytes"]
    assert "| q8 |" in (tmp_path / "eval.md").read_text()
    assert (tmp_path / "kl.png").stat().st_size > 1000


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
    ref, seal, born, sinkwin = rep["results"]
    assert seal["kv_bytes"] <= born["kv_bytes"] == sinkwin["kv_bytes"] < ref["kv_bytes"]
    assert seal["ppl"] <= born["ppl"] and seal["ppl"] < sinkwin["ppl"]
    assert seal["kl_mean"] < born["kl_mean"] and seal["kl_mean"] < sinkwin["kl_mean"]
