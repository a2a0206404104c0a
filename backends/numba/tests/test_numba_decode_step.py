"""``LayerKvCache.decode_step`` on numba: the step prepares the launch once
(``NumbaBackend.prepare_append_attend``) and takes it on every call until
something else changes the layer; it then goes through ``append_attend``
once and prepares again. The conformance suite checks its bits against
``append_attend`` on every backend; this checks that the prepared launch is
the one taken (a step that silently fell back to ``append_attend`` on every
call would still give the right bits, at the unprepared cost)."""

import numpy as np
import pytest

from kvreg import LayerKvCache
from kvreg_numba.backend import NumbaBackend


@pytest.mark.parametrize("mode", ["f32", "f16", "bf16", "q8"])
def test_a_decode_step_takes_its_prepared_launch_until_the_layer_changes(mode, monkeypatch):
    monkeypatch.setenv("KVREG_THREADS", "1")     # a q8 step is prepared where the decode runs on one thread
    nkv, hd, nh = 2, 64, 6
    rng = np.random.default_rng(5)
    lay = LayerKvCache(nkv, hd, mode, "numba")
    lay.extend(rng.standard_normal((100, nkv, hd)).astype(np.float32),
               rng.standard_normal((100, nkv, hd)).astype(np.float32))
    lay.append(*rng.standard_normal((2, nkv, hd)).astype(np.float32))   # capacity grown past the 147 rows below
    calls = {"append_attend": 0, "prepare": 0}

    def counted(name, fn):
        def wrapper(*a, **kw):
            calls[name] += 1
            return fn(*a, **kw)
        return wrapper

    monkeypatch.setattr(LayerKvCache, "append_attend", counted("append_attend", LayerKvCache.append_attend))
    monkeypatch.setattr(NumbaBackend, "prepare_append_attend",
                        counted("prepare", NumbaBackend.prepare_append_attend))
    step = lay.decode_step(nh, window=64, importance=False)
    q = rng.standard_normal((nh, hd)).astype(np.float32)
    for _ in range(40):
        step(*rng.standard_normal((2, nkv, hd)).astype(np.float32), q)
    # the first call goes through append_attend (which prepares its own
    # launch, once), then the step prepares its own
    assert calls == {"append_attend": 1, "prepare": 2}, (mode, calls)
    assert step.prepared
    lay.append(*rng.standard_normal((2, nkv, hd)).astype(np.float32))   # a change the step did not make
    assert not step.prepared
    for _ in range(5):
        step(*rng.standard_normal((2, nkv, hd)).astype(np.float32), q)
    assert calls == {"append_attend": 2, "prepare": 4}, (mode, calls)
    assert lay.seq_len == 101 + 46
    lay.backend = NumbaBackend()          # another backend object: its own launch
    assert not step.prepared
    step(*rng.standard_normal((2, nkv, hd)).astype(np.float32), q)
    assert step.prepared and calls == {"append_attend": 3, "prepare": 6}, (mode, calls)
