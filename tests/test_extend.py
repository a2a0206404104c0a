"""`extend` (a prefill chunk at once) equals the same rows appended one by one."""

import numpy as np
import pytest
from pairwise import params

from kvreg import KvMode, LayerKvCache, ShapeError
from kvreg_conformance import startable_backends

ALIVE = {None: "alive-none", (True, False, True): "dead-head", (True, True, True): "all-alive"}


@pytest.mark.parametrize("mode,chunks,alive,hd,exact_rows", params(
    list(KvMode), [(150,), (10, 54, 1, 85), (63, 1, 1, 85), (64, 86)], list(ALIVE),
    [40, 32], [1, 20],   # 32: a rotated head size; 20 sink rows: past the float16 window
    ids=[lambda m: m.value, lambda c: "+".join(map(str, c)), ALIVE.get, lambda h: f"hd{h}",
         lambda x: f"sinks{x}"]))
def test_extend_equals_appends_bit_for_bit_across_the_freeze(mode, chunks, alive, hd, exact_rows):
    # all-alive: one-row appends past a full float16 window take the general
    # path's one-row window shift; alive None: append's decode hot paths
    # (the storage's append_row)
    rng = np.random.default_rng(3)
    n = sum(chunks)
    k = rng.standard_normal((n, 3, hd)).astype(np.float32)
    v = rng.standard_normal((n, 3, hd)).astype(np.float32)
    if alive is not None:
        alive = np.array(alive)
    a = LayerKvCache(3, hd, mode, "reference", q8_exact_rows=exact_rows)
    b = LayerKvCache(3, hd, mode, "reference", q8_exact_rows=exact_rows)
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
    assert np.array_equal(sa.xlen, sb.xlen) and np.array_equal(sa.imp, sb.imp)
    for x in ("xk", "xv"):      # the exact (sink) rows
        if getattr(sa, x) is not None:
            for h in range(3):
                assert np.array_equal(getattr(sa, x)[h, :sa.xlen[h]], getattr(sb, x)[h, :sb.xlen[h]]), (x, h)
    if sa.window:   # q8's float16 windows: the newest rows, bit for bit
        assert np.array_equal(sa.b8, sb.b8)
        for t in ("thk", "thv"):
            if getattr(sa, t) is not None:
                for h in range(3):
                    w = sa.lens[h] - sa.b8[h]
                    assert getattr(sa, t)[h, :w].tobytes() == getattr(sb, t)[h, :w].tobytes(), (t, h)


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


# ── layouts and torch tensors ──

def _bits(c):
    st = c.storage
    return [getattr(st, n)[h, : st.lens[h]].tobytes() for n in st.block_names() for h in range(st.num_kv_heads)]


@pytest.mark.parametrize("mode", ["f32", "q8", "q4"])
def test_head_major_blocks_store_the_same_bits_as_token_major(mode):
    rng = np.random.default_rng(3)
    k, v = rng.standard_normal((2, 5, 3, 8)).astype(np.float32)
    ref = LayerKvCache(3, 8, mode, "reference")
    ref.extend(k, v)
    for layout, kk, vv in (("hnd", k.transpose(1, 0, 2).copy(), v.transpose(1, 0, 2).copy()),
                           ("bhnd", k.transpose(1, 0, 2)[None].copy(), v.transpose(1, 0, 2)[None].copy()),
                           (None, k.transpose(1, 0, 2).copy(), v.transpose(1, 0, 2).copy())):
        c = LayerKvCache(3, 8, mode, "reference")
        c.extend(kk, vv, layout=layout)
        assert _bits(c) == _bits(ref), layout


def test_a_contiguous_head_major_block_is_read_in_place():
    from kvreg import _validate as V

    k = np.ones((3, 5, 8), np.float32)
    view = V.float_block("k", k, 3, 8, "hnd")
    assert view.shape == (5, 3, 8) and np.shares_memory(view, k)


def test_an_ambiguous_shape_is_refused_rather_than_guessed():
    c = LayerKvCache(3, 8, "f32", "reference")
    k = np.ones((3, 3, 8), np.float32)
    with pytest.raises(ShapeError, match="layout='nhd' or layout='hnd'"):
        c.extend(k, k)
    assert c.seq_len == 0
    c.extend(k, k, layout="hnd")
    assert c.seq_len == 3
    with pytest.raises(ShapeError, match="layout must be one of"):
        c.extend(k, k, layout="thd")
    with pytest.raises(ShapeError, match="one sequence per layer"):
        c.extend(np.ones((2, 3, 1, 8), np.float32), np.ones((2, 3, 1, 8), np.float32))
    assert c.seq_len == 3


def test_torch_tensors_are_taken_without_a_copy_where_they_can_be():
    torch = pytest.importorskip("torch")
    from kvreg import _validate as V

    t = torch.randn(1, 3, 4, 8)
    view = V.float_block("k", t, 3, 8)
    assert np.shares_memory(view, t.numpy()), "a contiguous CPU float32 tensor is read in place"
    a, b = LayerKvCache(3, 8, "f32", "reference"), LayerKvCache(3, 8, "f32", "reference")
    a.extend(t, t)
    b.extend(t[0].numpy().transpose(1, 0, 2), t[0].numpy().transpose(1, 0, 2), layout="nhd")
    assert _bits(a) == _bits(b)
    h = t.to(torch.bfloat16)
    c = LayerKvCache(3, 8, "bf16", "reference")
    c.extend(h, h, layout="bhnd")  # widened once (numpy has no bfloat16); bf16 storage holds it exactly
    assert np.array_equal(c.head_keys(0), h[0, 0].float().numpy())


@pytest.mark.parametrize("mode", ["f32", "q8"])
@pytest.mark.parametrize("backend", startable_backends(("reference", "numba")))
def test_attend_chunk_without_importance_answers_the_same_and_leaves_importance_alone(mode, backend):
    rng = np.random.default_rng(5)
    k = rng.standard_normal((40, 2, 16), dtype=np.float32)
    v = rng.standard_normal((40, 2, 16), dtype=np.float32)
    q = rng.standard_normal((24, 4, 16), dtype=np.float32)
    with_imp, without = (LayerKvCache(2, 16, mode, backend) for _ in range(2))
    for lay in (with_imp, without):
        lay.extend(k[:16], v[:16])
        lay.attend_chunk(q[:16], b=16, s0=0, heads_per_kv=2)   # both hold some importance
        lay.extend(k[16:], v[16:])
    before = without.imp.copy()
    a = with_imp.attend_chunk(q, b=24, s0=16, heads_per_kv=2, window=20)
    b = without.attend_chunk(q, b=24, s0=16, heads_per_kv=2, window=20, importance=False)
    assert a.tobytes() == b.tobytes()
    assert without.imp.tobytes() == before.tobytes() and not np.array_equal(with_imp.imp, before)
    with pytest.raises(ShapeError, match="importance must be True or False"):
        without.attend_chunk(q, b=24, s0=16, heads_per_kv=2, importance="no")


@pytest.mark.parametrize("backend", startable_backends(("reference", "numba")))
def test_a_q8_chunk_attends_its_own_rows_as_handed_over_and_older_rows_widened(backend):
    # Under q8's float16 window, attend_chunk after the extend that stored the
    # chunk reads the chunk's rows as the extend received them (float32) and
    # only the older rows from storage: the first chunk answers what an F32
    # layer answers, bit for bit; the second what the kernel answers on the
    # older rows widened followed by the new rows exactly.
    from kvreg import get_backend
    from kvreg.attention import widened_rows
    from kvreg.storage import DenseStorage

    rng = np.random.default_rng(11)
    k = rng.standard_normal((70, 2, 32), dtype=np.float32)
    v = rng.standard_normal((70, 2, 32), dtype=np.float32)
    q = rng.standard_normal((70, 4, 32), dtype=np.float32)
    q8, f32 = LayerKvCache(2, 32, "q8", backend), LayerKvCache(2, 32, "f32", backend)
    for lay in (q8, f32):
        lay.extend(k[:40], v[:40])
    first = q8.attend_chunk(q[:40], b=40, s0=0, heads_per_kv=2, importance=False)
    assert first.tobytes() == f32.attend_chunk(q[:40], b=40, s0=0, heads_per_kv=2, importance=False).tobytes()
    q8.extend(k[40:], v[40:])
    old_k, old_v = widened_rows(q8.storage, q8.backend, 0, 40)   # rows [0, 40) as storage now holds them
    second = q8.attend_chunk(q[40:], b=30, s0=40, heads_per_kv=2, importance=False)
    rows = DenseStorage.of_rows(np.concatenate([old_k, k[40:].transpose(1, 0, 2)], axis=1),
                                np.concatenate([old_v, v[40:].transpose(1, 0, 2)], axis=1))
    want = get_backend(backend).attend_chunk(q[40:], rows.view(), s0=40, b=30, hpk=2, scale=q8.default_scale)
    assert second.tobytes() == want.tobytes()
    assert not np.array_equal(old_k, k[:40].transpose(1, 0, 2))   # the older rows really are q8's
