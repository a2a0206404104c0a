"""kvreg eval's configuration grammar (no model needed)."""

import pytest

from kvreg.cache import Born, Recent
from kvreg.errors import ConfigError
from kvreg_tools.evaluation import parse_config, parse_configs


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


@pytest.mark.parametrize("bad", ["born", "born:0", "born:x", "o1:64:128", "o1:1:2:3:4:5", "nystrom:4", "q3", "q8@q8", "lru:5", ""])
def test_bad_configs_are_refused_with_the_grammar(bad):
    with pytest.raises(ConfigError):
        parse_configs(bad)
