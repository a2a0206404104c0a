"""kvreg inside a real model (SmolLM2-135M, Gemma-3-270M through
transformers, 4k context): ``kvreg bench --model``'s ratios, kvreg's cache
update + decode attention over ``DynamicCache`` + SDPA's and ``StaticCache``
+ SDPA's, and kvreg's prefill attention of the 4k chunk over SDPA's, all
measured in one run (:func:`kvreg_tools.model_bench.run`). Skipped where
the models or transformers are not installed."""

from __future__ import annotations

import functools


@functools.lru_cache(maxsize=2)
def _run(model: str) -> dict:
    try:
        from kvreg_tools import model_bench
    except ImportError as exc:
        raise NotImplementedError(f"kvreg-tools[bench] not installed: {exc}") from None
    from kvreg.errors import ConfigError

    try:
        return model_bench.run(model, context=4096, steps=8, repeats=2,
                               configs="kvreg:f32,dynamic,static", progress=False)
    except (ImportError, ConfigError) as exc:  # torch, transformers or the model missing
        raise NotImplementedError(f"{model}: {exc}") from None


class InModel:
    params = [["smollm2-135m", "gemma3-270m"]]
    param_names = ["model"]
    timeout = 1800

    def setup(self, model):
        self.r = _run(model)["ratios"]["kvreg:f32"]

    def track_cache_attention_vs_dynamic(self, model):
        return self.r["cache_attention_vs_dynamic"]

    track_cache_attention_vs_dynamic.unit = "x DynamicCache + SDPA (target <= 0.6)"

    def track_cache_attention_vs_static(self, model):
        return self.r["cache_attention_vs_static"]

    track_cache_attention_vs_static.unit = "x StaticCache + SDPA (target <= 0.8)"

    def track_prefill_attention_vs_sdpa(self, model):
        return self.r["prefill_attention_vs_sdpa"]

    track_prefill_attention_vs_sdpa.unit = "x SDPA (target <= 1)"
