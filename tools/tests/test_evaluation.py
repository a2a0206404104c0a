"""kvreg eval's configuration grammar (no model needed)."""

import pytest

from kvreg.cache import Born, Recent
from kvreg.errors import ConfigError
from kvreg_tools.evaluation import REFERENCE, describe, legend, parse_config, parse_configs


def test_modes_policies_seal_and_peers_parse():
    assert parse_config("q8").kwargs == {"mode": "q8"}
    born = parse_config("born:512")
    assert born.kwargs["budget"] == 512 and born.kwargs["policy"] == Born(4) and born.kwargs["mode"] == "f32"
    sw = parse_config("sinkwin:176@q8")
    assert sw.kwargs == {"budget": 176, "policy": Recent(), "sink": 4, "mode": "q8"}
    assert parse_config("recent:64").kwargs["policy"] == Recent() and "sink" not in parse_config("recent:64").kwargs
    assert parse_config("o1:64:128:4").kwargs == {"o1": (64, 128, 4), "o1_far": "tiered", "mode": "f32"}
    assert parse_config("o1:16:128:4:32").kwargs["o1"] == (16, 128, 4, 32)
    assert parse_config("nystrom:64:128:4").kwargs == {"o1": (64, 128, 4), "o1_far": "nystrom", "mode": "f32"}
    assert parse_config("dynamic").kind == "dynamic" and parse_config("static").kind == "static"
    assert [c.label for c in parse_configs("f32, q8v ,dynamic")] == ["f32", "q8v", "dynamic"]


@pytest.mark.parametrize("bad", ["born", "born:0", "born:x", "o1:64:128", "o1:1:2:3:4:5", "nystrom:4", "q3", "q8@q8",
                                 "lru:5", ""])
def test_bad_configs_are_refused_with_the_grammar(bad):
    with pytest.raises(ConfigError):
        parse_configs(bad)


def test_the_legend_says_what_each_config_is():
    text = legend([REFERENCE] + parse_configs("dynamic,static,q8,born:104,sinkwin:96,recent:64,o1:16:64:4,"
                                              "o1:16:64:4:8,nystrom:8:32:4,born:50@q4"))
    lines = dict(line.split(None, 1) for line in text.splitlines()[1:-1])
    assert lines["dynamic"].startswith("transformers' DynamicCache")
    assert lines["static"].startswith("transformers' StaticCache")
    assert lines["q8"].startswith("int8 K (rotated")
    assert lines["born:104"] == ("Born eviction: the 4 first rows, the newest half and the highest-attention rest, "
                                 "104 rows per layer (rows: f32)")
    assert lines["sinkwin:96"] == "4 first rows and the newest rest: 96 rows per layer (rows: f32)"
    assert lines["recent:64"] == "the newest 64 rows per layer (rows: f32)"
    assert lines["o1:16:64:4"] == ("the O(1) seal, constant memory per layer: 4 first rows + 64 newest + 16 "
                                   "highest-attention rows exact, older rows in 4 bits, as many as fit in the bytes "
                                   "of 16 float32 rows (rows: f32)")
    assert "+ 8 highest-attention rows" in lines["o1:16:64:4:8"]
    assert "Nystrom" in lines["nystrom:8:32:4"]
    assert lines["born:50@q4"].endswith("50 rows per layer (rows: q4)")
    assert text.splitlines()[1].split(None, 2)[:2] == ["f32", "(reference)"]
    assert text.splitlines()[-1].startswith("columns: KL = KL(reference || config)")


def test_every_kv_mode_has_words():
    from kvreg.modes import KvMode

    for mode in KvMode:
        assert describe(parse_config(mode.value)) != f"{mode.value} rows"
