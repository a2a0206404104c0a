"""q8 exact rows (attention-sink-aware quantization): the first rows of each
head are attended from their float32 field-space copies, not their int8
copies -- in the kernels, in the mirror's sync, and through the layer."""

from __future__ import annotations

import numpy as np
import pytest
from ocl_helpers import Q8_MODES, check_close, filled_storage, mirrored, oracle_group, scramble_int8_copies

from kvreg_opencl import kernels


def filled(nkv, hd, rows, mode, *, exact=4, seed=0):
    return filled_storage(nkv, hd, rows, mode, seed=seed, exact=exact)


@pytest.mark.parametrize("hd", [64, 40, 36], ids=["hd64", "hd40", "hd36"])
@pytest.mark.parametrize("mode", Q8_MODES)
@pytest.mark.parametrize("first", [0, 2, 6])
def test_exact_rows_match_oracle(dev, small_blocks, mode, hd, first):
    nkv, hpk, rows = 2, 3, 21
    st = filled(nkv, hd, rows, mode, seed=hd + first)
    assert (st.xlen == 4).all()
    scramble_int8_copies(st)  # the oracle reads xk/xv for those rows
    rng = np.random.default_rng(first)
    q = rng.standard_normal((nkv * hpk, hd)).astype(np.float32)
    sinks = rng.standard_normal(nkv * hpk).astype(np.float32)
    imp = np.zeros(rows, np.float32)
    out, probs = kernels.attend_layer(mirrored(dev, st), q, lens=st.lens, scale=0.3, first=first,
                                      softcap=3.0, sinks=sinks, imp=imp, want_probs=True)
    for g in range(nkv):
        hs = slice(g * hpk, (g + 1) * hpk)
        o, p = oracle_group(st, q[hs], g, scale=0.3, first=first, softcap=3.0, sinks=sinks[hs])
        check_close(out[hs], o, f"{mode} hd={hd} first={first} out g={g}")
        check_close(probs[hs, : p.shape[1]], p, f"{mode} hd={hd} first={first} probs g={g}")


@pytest.mark.parametrize("mode", Q8_MODES)
def test_chunk_reads_exact_rows(dev, small_blocks, mode):
    nkv, hpk, hd, rows = 2, 2, 32, 12
    st = filled(nkv, hd, rows, mode, seed=4)
    scramble_int8_copies(st)
    q = np.random.default_rng(5).standard_normal((rows, nkv * hpk, hd)).astype(np.float32)
    out = kernels.attend_chunk(mirrored(dev, st), q, lens=st.lens, s0=0, hpk=hpk, scale=0.25, window=3)
    for i in range(rows):
        for g in range(nkv):
            hs = slice(g * hpk, (g + 1) * hpk)
            o, _ = oracle_group(st, q[i, hs], g, scale=0.25, first=max(0, i + 1 - 3), upto=i + 1)
            check_close(out[i, hs], o, f"{mode} token {i} group {g}")


def test_invariants_hold_with_exact_rows(dev, small_blocks):
    st = filled(2, 40, 37, "q8_2f", seed=1)
    m = mirrored(dev, st)
    rng = np.random.default_rng(2)
    q = rng.standard_normal((6, 40)).astype(np.float32)
    # grouped == per head, layer == per group
    layer, _ = kernels.attend_layer(m, q, lens=st.lens, scale=0.2, first=2, softcap=2.0)
    for g in range(2):
        grouped, _ = kernels.attend_layer(m, q[3 * g:3 * g + 3], lens=st.lens, scale=0.2, first=2,
                                          softcap=2.0, g0=g, ng=1)
        np.testing.assert_array_equal(layer[3 * g:3 * g + 3], grouped)
        for h in range(3):
            alone, _ = kernels.attend_layer(m, q[3 * g + h:3 * g + h + 1], lens=st.lens, scale=0.2,
                                            first=2, softcap=2.0, g0=g, ng=1)
            np.testing.assert_array_equal(grouped[h], alone[0])
    # upto == the call made when the storage held that many rows
    short = filled(2, 40, 3, "q8_2f", seed=1)  # only exact rows, part of them
    got, _ = kernels.attend_layer(m, q, lens=st.lens, scale=0.2, upto=3)
    want, _ = kernels.attend_layer(mirrored(dev, short), q, lens=short.lens, scale=0.2)
    np.testing.assert_array_equal(got, want)


def test_trimmed_equals_untrimmed_with_exact_rows(dev, small_blocks):
    full = filled(2, 32, 30, "q8_2f", seed=11)
    trimmed = filled(2, 32, 30, "q8_2f", seed=11)
    trimmed.drop_front(2)  # two exact rows left, shifted to the front
    assert (trimmed.xlen == 2).all()
    q = np.random.default_rng(12).standard_normal((4, 32)).astype(np.float32)
    a, _ = kernels.attend_layer(mirrored(dev, full), q, lens=full.lens, scale=0.4, first=2)
    b, _ = kernels.attend_layer(mirrored(dev, trimmed), q, lens=trimmed.lens, scale=0.4, first=0)
    np.testing.assert_array_equal(a, b)


def test_mirror_uploads_exact_rows_only_when_they_change(dev, small_blocks):
    rng = np.random.default_rng(3)
    nkv, hd = 2, 32
    st = filled(nkv, hd, 2, "q8_2f", seed=3)
    m = mirrored(dev, st)
    q = rng.standard_normal((2, hd)).astype(np.float32)

    def step():
        st.append(rng.standard_normal((nkv, hd)), rng.standard_normal((nkv, hd)))
        m.sync(st.view())

    def agrees():
        np.testing.assert_array_equal(kernels.attend_layer(m, q, lens=st.lens, scale=0.25)[0],
                                      kernels.attend_layer(mirrored(dev, st), q, lens=st.lens, scale=0.25)[0])

    assert m.exact_uploads == 1
    step()
    step()  # rows 2 and 3 land inside the exact range
    assert m.exact_uploads == 3 and (st.xlen == 4).all()
    for _ in range(10):  # past the exact range: no exact upload per step
        step()
    assert m.exact_uploads == 3
    agrees()
    # a truncation that leaves the exact rows alone does not re-upload them
    st.truncate_last(3)
    step()
    assert m.exact_uploads == 3
    agrees()
    # truncate into the exact range and re-append to the same xlen: the
    # exact rows were rewritten in place, no rewrite of the whole storage
    st.truncate_last(int(st.lens[0]) - 1)
    m.sync(st.view())  # xlen dropped: re-upload
    assert m.exact_uploads == 4
    for _ in range(13):
        st.append(rng.standard_normal((nkv, hd)), rng.standard_normal((nkv, hd)))
    assert (st.xlen == 4).all() and st.view().unchanged_rows(m.version) is not None
    m.sync(st.view())
    assert m.exact_uploads == 5
    agrees()
    # the same without a sync in between: xlen back where it was, so only
    # the truncation log (the unchanged-rows floor below xlen) reveals the rewrite
    st.truncate_last(int(st.lens[0]) - 2)
    for _ in range(12):
        st.append(rng.standard_normal((nkv, hd)), rng.standard_normal((nkv, hd)))
    assert np.array_equal(st.xlen, m.xlen)
    floor = st.view().unchanged_rows(m.version)
    assert floor is not None and (floor < st.xlen).all()
    m.sync(st.view())
    assert m.exact_uploads == 6 and m.full_reuploads == 1
    agrees()


# ── through the core's LayerKvCache, against the reference backend ──


@pytest.fixture(scope="module")
def backends(dev):
    pytest.importorskip("kvreg.layer")
    from kvreg.reference import ReferenceBackend
    from kvreg_opencl.backend import OpenCLBackend

    return OpenCLBackend(), ReferenceBackend()


def twin(backends, mode, rows, *, nkv=2, hd=64, exact=4, seed=0):
    from kvreg.layer import LayerKvCache

    rng = np.random.default_rng(seed)
    a = LayerKvCache(nkv, hd, mode, backend=backends[0], q8_exact_rows=exact)
    b = LayerKvCache(nkv, hd, mode, backend=backends[1], q8_exact_rows=exact)
    push(a, b, rng, rows, nkv, hd)
    return a, b, rng


def push(a, b, rng, rows, nkv, hd):
    for _ in range(rows):
        k = rng.standard_normal((nkv, hd), dtype=np.float32)
        v = rng.standard_normal((nkv, hd), dtype=np.float32)
        a.append(k, v)
        b.append(k, v)


def close(got, want, what, rtol=2e-5):
    err = np.abs(got - want).max()
    assert err <= rtol * max(1.0, np.abs(want).max()), f"{what}: {err:.3g}"


@pytest.mark.parametrize("rows", [20, 70], ids=["before-freeze", "after-freeze"])
@pytest.mark.parametrize("mode", ["q8", "q8k", "q8v"])
def test_layer_with_exact_rows_matches_reference(backends, small_blocks, mode, rows):
    a, b, rng = twin(backends, mode, rows, seed=rows)
    assert (a.storage.xlen == 4).all()
    q = rng.standard_normal((6, 64)).astype(np.float32)
    for first in (0, 1, 3, 4, 9):  # inside, at the edge of and outside the exact rows
        for g in range(2):
            qg = q[3 * g:3 * g + 3]
            close(a.attend_group(qg, g, scale=0.2, first=first),
                  b.attend_group(qg, g, scale=0.2, first=first), f"{mode} first={first} g={g}")
    close(a.attend_group(q[:3], 0, scale=0.2, upto=3), b.attend_group(q[:3], 0, scale=0.2, upto=3),
          f"{mode} upto inside the exact rows")
    for kw in ({}, {"window": 17, "softcap": 4.0}):
        close(a.attend_layer(q, **kw), b.attend_layer(q, **kw), f"{mode} layer {kw}")
    close(a.imp, b.imp, f"{mode} importance")


@pytest.mark.parametrize("mode", ["q8", "q8k", "q8v"])
def test_chunk_with_exact_rows_matches_reference(backends, small_blocks, mode):
    a, b, rng = twin(backends, mode, 0, seed=7)
    push(a, b, rng, 10, 2, 64)  # a prefill chunk covering the exact rows
    q = rng.standard_normal((10, 4, 64)).astype(np.float32)
    close(a.attend_chunk(q, 10, 0, 2), b.attend_chunk(q, 10, 0, 2), f"{mode} chunk")
    close(a.attend_chunk(q, 10, 0, 2, window=3), b.attend_chunk(q, 10, 0, 2, window=3), f"{mode} windowed chunk")
    close(a.imp, b.imp, f"{mode} chunk importance")


@pytest.mark.parametrize("rows", [10, 70], ids=["before-freeze", "after-freeze"])
def test_truncate_and_reappend_exact_rows_stays_in_sync(backends, small_blocks, rows):
    a, b, rng = twin(backends, "q8", rows, seed=11)
    q = rng.standard_normal((6, 64)).astype(np.float32)
    close(a.attend_layer(q, importance=False), b.attend_layer(q, importance=False), "before")
    m = backends[0].mirror(a.storage.view())
    ups, full = m.exact_uploads, m.full_reuploads
    for d in (rows - 2, rows - 1):  # the rollback reaches into the exact rows
        for layer in (a, b):
            layer.truncate_last(d)
        push(a, b, rng, d, 2, 64)  # back to the same row count (and xlen)
        # no rewrite of the storage: the mirror follows it by the truncation log
        assert (a.storage.xlen == 4).all() and a.storage.view().unchanged_rows(m.version) is not None
        close(a.attend_layer(q, importance=False), b.attend_layer(q, importance=False), f"rollback {d}")
        for g in range(2):
            close(a.attend_group(q[3 * g:3 * g + 3], g, scale=0.3),
                  b.attend_group(q[3 * g:3 * g + 3], g, scale=0.3), f"rollback {d} group {g}")
    assert m.exact_uploads > ups and m.full_reuploads == full
    # decode steps past the exact range upload no exact rows
    ups = m.exact_uploads
    for _ in range(5):
        push(a, b, rng, 1, 2, 64)
        close(a.attend_layer(q, importance=False), b.attend_layer(q, importance=False), "decode")
    assert backends[0].mirror(a.storage.view()).exact_uploads == ups
