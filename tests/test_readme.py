"""The README's usage snippet runs as written."""

import pathlib
import re

import numpy as np


def test_readme_snippet_runs():
    text = (pathlib.Path(__file__).parent.parent / "README.md").read_text()
    code = next(c for c in re.findall(r"```python\n(.*?)```", text, re.S) if "kvreg.KvCache(" in c)
    rng = np.random.default_rng(0)
    n = 8
    env = {
        "k_chunk": rng.standard_normal((n, 8, 128), dtype=np.float32),
        "v_chunk": rng.standard_normal((n, 8, 128), dtype=np.float32),
        "q_chunk": rng.standard_normal((n, 32, 128), dtype=np.float32),
        "n": n,
        "k": rng.standard_normal((8, 128), dtype=np.float32),
        "v": rng.standard_normal((8, 128), dtype=np.float32),
        "q": rng.standard_normal((32, 128), dtype=np.float32),
    }
    exec(compile(code, "README.md", "exec"), env)
    assert env["out"].shape == (32, 128)
    assert env["blob"][:4] == b"KVRC"
