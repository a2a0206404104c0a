"""kvreg_tools.fork_memory: forks hold the prompt once, deep copies each hold it."""

import sys

import pytest

from kvreg_tools.fork_memory import fork_memory

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")


def test_forks_share_the_prompt_and_copies_do_not():
    kw = dict(prompt=2048, forks=4, steps=4, backend="reference", layers=2, kv_heads=2, head_dim=64)
    forked, copied = fork_memory(**kw), fork_memory(copies=True, **kw)
    assert forked["apart_mib"] == copied["apart_mib"]
    assert forked["resident_mib"] < 1.1 * forked["prompt_mib"]
    assert copied["resident_mib"] > 4.5 * copied["prompt_mib"]
