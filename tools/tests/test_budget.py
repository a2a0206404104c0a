"""``kvreg eval --budget``: proposals sized from the model's geometry fit
their budget as measured, and the pick is the least KL that fits."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvreg.errors import ConfigError  # noqa: E402
from kvreg_tools.budget import Geometry, candidates, estimate_peak, parse_budgets, pick  # noqa: E402
from kvreg_tools.evaluation import evaluate, parse_configs  # noqa: E402
from tests.test_transformers_families import tiny_model  # noqa: E402


class _Tok:
    """Token ids straight from the text's bytes (a tiny model needs no tokenizer)."""

    def __call__(self, text, return_tensors="pt"):
        class Out:
            input_ids = torch.tensor([[3 + b % 120 for b in text.encode()]])
        return Out()


@pytest.mark.parametrize("family", ["llama", "qwen2"])   # qwen2: two sliding layers beside the global ones
def test_proposals_fit_their_budget_as_measured(family):
    model = tiny_model(family)
    text, tokens, prefix = "the budget decides " * 8, 120, 96
    geo = Geometry(model, tokens - 1, prefix)     # the last token is scored, never fed
    budgets = [0.15, 0.3, 0.6]
    specs = candidates(geo, budgets)
    assert any(s.startswith("o1:") for s in specs) and any(s.startswith("snap:") for s in specs)
    report = evaluate(model, _Tok(), text, parse_configs(",".join(specs)), tokens=tokens, prefix=prefix,
                      backend="reference", progress=False)
    assert report["reference"]["peak_bytes"] == geo.f32_peak()
    for row in report["results"]:
        est = estimate_peak(geo, row["config"])
        # exact without sliding layers; with them, each counted at its own peak
        assert row["peak_bytes"] == est if family == "llama" else row["peak_bytes"] <= est, row["config"]
        assert row["peak_bytes"] <= max(budgets) * geo.f32_peak()
    chosen = pick(report, budgets)
    assert chosen[-1]["config"] is not None
    for c in chosen:
        if c["config"] is None:    # nothing proposed fits (a tiny model's sliding layers alone may not)
            assert all(estimate_peak(geo, s) > c["bytes"] for s in specs)
            continue
        assert c["peak_bytes"] <= c["bytes"]
        fitting = [r["kl_mean"] for r in report["results"] if r["peak_bytes"] <= c["bytes"]]
        assert c["kl_mean"] == min(fitting)


def test_pick_takes_the_least_kl_under_each_budget_and_says_when_nothing_fits():
    rows = [{"config": "a", "kind": "kvreg", "kl_mean": 0.1, "top1": 0.9, "ppl": 2.0, "peak_bytes": 50,
             "avg_bytes": 40},
            {"config": "b", "kind": "kvreg", "kl_mean": 0.01, "top1": 0.99, "ppl": 1.9, "peak_bytes": 200,
             "avg_bytes": 150},
            {"config": "dynamic", "kind": "dynamic", "kl_mean": 0.0, "top1": 1.0, "ppl": 1.8, "peak_bytes": 10,
             "avg_bytes": 10}]
    chosen = pick({"reference": {"peak_bytes": 1000}, "results": rows}, [0.01, 0.06, 0.25])
    assert [c["config"] for c in chosen] == [None, "a", "b"]
    assert chosen[1]["bytes"] == 60 and chosen[2]["kl_mean"] == 0.01


@pytest.mark.parametrize("bad", ["", "x", "0", "1.5", "-0.1,0.2"])
def test_bad_budgets_are_refused(bad):
    with pytest.raises(ConfigError, match="budget"):
        parse_budgets(bad)


def test_budgets_parse_sorted():
    assert parse_budgets("0.25, 0.06,0.125") == [0.06, 0.125, 0.25]
