"""An O(1) seal over NaN/inf rows or queries is a failed seal: ``o1_seal``
returns False and latches, ``o1_seal_checked`` raises SealError and changes
nothing (not a ShapeError raised from inside the fit)."""

import numpy as np
import pytest

from kvreg import LayerKvCache, SealError

NKV, HD, NH, ROWS = 2, 8, 4, 40


def collecting(where, bad=np.nan):
    c = LayerKvCache(NKV, HD, "f32", "reference")
    c.o1_begin(4, 4, 1, far="nystrom")
    rng = np.random.default_rng(0)
    for p in range(ROWS):
        k = rng.standard_normal(NKV * HD).astype(np.float32)
        v = rng.standard_normal(NKV * HD).astype(np.float32)
        q = rng.standard_normal(NH * HD).astype(np.float32)
        if p == 17:
            {"k": k, "v": v, "q": q}[where][HD + 3] = bad
        c.append(k, v)
        c.o1_push_q(q)
    return c


@pytest.mark.parametrize("bad", [np.nan, np.inf])
@pytest.mark.parametrize("where", ["k", "v", "q"])
def test_o1_seal_on_non_finite_input_returns_false_and_latches(where, bad):
    c = collecting(where, bad)
    assert c.o1_seal(NH) is False
    assert "NaN/inf" in c.take_o1_error()
    assert c.seq_len == 0 and not c.o1_sealed()
    with pytest.raises(SealError, match="clear\\(\\) it first"):
        c.append(np.ones(NKV * HD, np.float32), np.ones(NKV * HD, np.float32))
    c.clear()
    c.append(np.ones(NKV * HD, np.float32), np.ones(NKV * HD, np.float32))


@pytest.mark.parametrize("where", ["k", "q"])
def test_o1_seal_checked_on_non_finite_input_raises_and_changes_nothing(where):
    c = collecting(where)
    keys = [c.head_keys(h).copy() for h in range(NKV)]
    with pytest.raises(SealError, match="NaN/inf"):
        c.o1_seal_checked(NH)
    assert c.o1_collecting() and c.seq_len == ROWS and c.take_o1_error() is None
    assert all(np.array_equal(c.head_keys(h), keys[h], equal_nan=True) for h in range(NKV))
