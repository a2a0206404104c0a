"""`extend` (a prefill chunk at once) equals the same rows appended one by one."""

import numpy as np
import pytest

from kvreg import KvMode, LayerKvCache, ShapeError


@pytest.mark.parametrize("mode", list(KvMode))
@pytest.mark.parametrize("chunks", [(150,), (10, 54, 1, 85), (63, 1, 1, 85), (64, 86)])
def test_extend_equals_appends_bit_for_bit_across_the_freeze(mode, chunks):
    rng = np.random.default_rng(3)
    n = sum(chunks)
    k = rng.standard_normal((n, 3, 40)).astype(np.float32)
    v = rng.standard_normal((n, 3, 40)).astype(np.float32)
    alive = np.array([True, False, True])
    a = LayerKvCache(3, 40, mode, "reference")
    b = LayerKvCache(3, 40, mode, "reference")
    for p in range(n):
        a.append(k[p], v[p], alive)
    at = 0
    for c in chunks:
        b.extend(k[at:at + c], v[at:at + c].reshape(c, -1), alive)
        at += c
    sa, sb = a.storage, b.storage
    assert a.seq_len == b.seq_len == n and np.array_equal(sa.lens, sb.lens)
    for name in sa.block_names():
        for h in range(3):
            m = sa.lens[h]
            assert np.array_equal(getattr(sa, name)[h, :m], getattr(sb, name)[h, :m]), (name, h)
    assert np.array_equal(sa.kcol_set, sb.kcol_set) and np.array_equal(sa.kcol, sb.kcol)
    assert np.array_equal(sa.vcol, sb.vcol)


def test_extend_refuses_mismatched_rows_and_changes_nothing():
    c = LayerKvCache(2, 4, "f32", "reference")
    with pytest.raises(ShapeError, match="same count"):
        c.extend(np.ones((3, 2, 4), np.float32), np.ones((2, 2, 4), np.float32))
    with pytest.raises(ShapeError, match=r"\[n, 2, 4\]"):
        c.extend(np.ones((3, 4, 2), np.float32), np.ones((3, 4, 2), np.float32))
    assert c.seq_len == 0


def test_extend_under_q8_refuses_a_non_finite_row_anywhere_in_the_chunk():
    c = LayerKvCache(1, 32, "q8", "reference")
    k = np.ones((100, 1, 32), np.float32)
    k[97, 0, 3] = np.nan
    with pytest.raises(ShapeError, match="inf/NaN"):
        c.extend(k, np.ones((100, 1, 32), np.float32))
    assert c.seq_len == 0 and c.head_len(0) == 0
