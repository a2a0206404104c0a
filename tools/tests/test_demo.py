"""The host-app demo on a tiny model: every cache path it drives, and the
two-process hand-off giving the same tokens as one process."""

import argparse

import pytest

from kvreg.errors import ConfigError
from kvreg_tools.demo import DemoConfig, main, run_demo

TINY = DemoConfig(layers=2, num_heads=4, num_kv_heads=2, head_dim=16, d_model=64, d_ff=128, vocab=64,
                  o1_m=4, o1_w=8, o1_sink=2)


def quiet(*_):
    pass


def demo(**kw):
    kw.setdefault("tokens", 6)
    kw.setdefault("prompt", 40)
    kw.setdefault("chunk", 16)
    return run_demo(TINY, backend="reference", out=quiet, **kw)


def test_same_seed_gives_same_tokens():
    assert demo()["tokens"] == demo()["tokens"]


def test_handoff_decodes_the_same_tokens_in_another_process():
    res = demo(handoff_=True)
    h = res["handoff"]
    assert res["handoff_same"] and h["tokens"] == res["tokens"]
    assert len({h["prefill_pid"], h["decode_pid"]}) == 2
    assert h["wire_bytes"] > 0


def test_handoff_with_born_budget_carries_the_importance():
    res = demo(handoff_=True, budget=30, tokens=8)
    assert res["evictions"] > 0 and res["handoff_same"]


def test_q8_cache_stores_less_than_f32():
    f32, q8 = demo(), demo(kv="q8")
    assert q8["total_memory_bytes"] < f32["total_memory_bytes"]


def test_budget_keeps_every_layer_under_it():
    res = demo(budget=24, tokens=10)
    assert res["evictions"] > 0
    assert res["seq_len"] <= 24


def test_o1_seals_after_the_prompt_and_decodes():
    res = demo(o1=True, tokens=5)
    assert res["sealed"] and len(res["tokens"]) == 5


def test_o1_waits_for_its_boundary_when_the_prompt_is_short():
    # boundary w + sink + m + 1 = 15 rows: prompt 10 seals during decode
    res = demo(o1=True, prompt=10, chunk=4, tokens=8)
    assert res["sealed"]


@pytest.mark.parametrize("kw", [dict(handoff_=True, kv="q8"), dict(handoff_=True, o1=True),
                                dict(o1=True, kv="q8"), dict(budget=8, chunk=16)])
def test_refused_combinations_say_why(kw):
    with pytest.raises(ConfigError):
        demo(**kw)


def test_main_returns_2_on_a_refused_combination(capsys):
    args = argparse.Namespace(tokens=2, prompt=8, chunk=4, kv="q8", budget=None, o1=False, handoff=True,
                              layers=2, config=TINY)
    assert main(args) == 2
    assert "refuse" in capsys.readouterr().err


def test_prefill_chunks_do_not_change_the_tokens_much():
    # chunked prefill (attend_chunk) and one-row chunks (the same kernel, b=1)
    # differ only in summation order: the greedy tokens agree on this model
    a = demo(chunk=16)["tokens"]
    b = demo(chunk=40)["tokens"]
    assert a[0] == b[0]
