"""Two spellings of one attend kernel give the same bits.

- ``config.INLINE_VEC``: the vector loads, stores and widenings as
  dereferences and ``__builtin_convertvector`` (the CPU default: on PoCL the
  OpenCL builtins can be calls LLVM will not inline) or as vloadn /
  vload_halfn / convert_floatn (everywhere else). Loads are loads and the
  widenings exact (cl/common.h's binary16 widening included), so the answers
  must not move by a bit.
- ``LOCAL_SIZE`` 1 (the CPU default: one work-item a work-group, rows outer in
  the value pass, sums in the partial state, ``merge`` one work-item a
  head) against 4 (one 8-channel slice a work-item, rows inner, ``merge``
  one work-item a channel): the same additions in the same row order, so
  the same outputs. Not the same probabilities: with one work-item
  ``probs`` takes eight rows an ``exp`` call, and PoCL's vector ``exp``
  differs from its scalar one in the last bit now and then; so importance
  is compared between spellings of one ``LOCAL_SIZE``.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvreg.layer import LayerKvCache
from kvreg_opencl import config

SPELLINGS = [(True, 1), (False, 1), (True, 4), (False, 4)]


def layer(mode, hd, nkv=3, n=45, seed=0):
    """A layer on the OpenCL backend with ragged heads (the last one dead
    for the last row), binary16 edge values (subnormals, the largest finite,
    -0) and, where the mode stores them (not q8's), an inf key and a NaN
    value."""
    rng = np.random.default_rng(seed)
    k = rng.standard_normal((n, nkv, hd)).astype(np.float32)
    v = rng.standard_normal((n, nkv, hd)).astype(np.float32)
    if not mode.startswith("q8"):
        k[7, 1, 3] = np.inf
        v[11, 2, hd - 1] = np.nan
    v[3, 0, :4] = [6e-8, 3e-6, -0.0, 6.1e-5]   # binary16 subnormals, -0, the smallest normal
    v[4, 1, :2] = [65504.0, -65504.0]            # the largest finite binary16
    c = LayerKvCache(nkv, hd, mode, backend="opencl")
    c.extend(k, v)
    alive = np.ones(nkv, bool)
    alive[-1] = False
    c.append(k[0], v[0], alive=alive)
    return c


def answers(c, hd, hpk):
    rng = np.random.default_rng(1)
    nh = 3 * hpk
    q = rng.standard_normal((nh, hd)).astype(np.float32)
    sinks = rng.standard_normal(nh).astype(np.float32)
    out, imps = [], []
    for kw in (dict(), dict(window=9), dict(softcap=5.0), dict(sinks=sinks),
               dict(window=20, softcap=3.0, sinks=sinks)):
        imp = np.zeros(c.storage.cap, np.float32)
        out.append(c.backend.attend_layer(q, c.storage.view(), scale=0.3, imp=imp, **kw).tobytes())
        imps.append(imp.tobytes())
    out.append(c.backend.attend_group(q[:3], c.storage.view(), 1, scale=0.3, first=5, upto=40,
                                      softcap=2.0).tobytes())
    qc = rng.standard_normal((6, nh, hd)).astype(np.float32)
    out.append(c.backend.attend_chunk(qc, c.storage.view(), s0=30, b=6, hpk=hpk, scale=0.3).tobytes())
    return out, imps


@pytest.mark.parametrize("mode", ["f32", "f16", "bf16", "q8", "q8k", "q8v"])
@pytest.mark.parametrize("hd", [64, 40])
@pytest.mark.parametrize("hpk", [3, 4])
def test_inline_and_builtin_spellings_and_one_or_four_work_items_give_the_same_bits(
        dev, small_blocks, monkeypatch, mode, hd, hpk):
    """hpk 3 and 4: the one-work-item value pass takes 8 and 4 slices of a
    row a pass (cl/attend.cl, KVREG_VW), so 4 heads at hd 40 / 64 / 96 take
    a short last pass, two and three passes."""
    if mode.startswith("q8") and hd % 32:
        hd = 96  # q8 K groups are 32 channels: a multiple of 32 that is not 64
    c = layer(mode, hd)
    got = {}
    for inline, local in SPELLINGS:
        monkeypatch.setattr(config, "INLINE_VEC", inline)
        monkeypatch.setattr(config, "LOCAL_SIZE", local)
        got[inline, local] = answers(c, hd, hpk)
    want = got[SPELLINGS[0]][0]
    for (inline, local), (out, imps) in got.items():
        for i, (x, y) in enumerate(zip(out, want)):
            assert x == y, ((inline, local), "output", i)
        assert imps == got[SPELLINGS[0] if local == 1 else SPELLINGS[2]][1], ((inline, local), "importance")


@pytest.mark.parametrize("mode", ["f32", "q8"])
def test_the_row_prefetch_changes_no_bit(dev, small_blocks, monkeypatch, mode):
    """``config.PREFETCH_BYTES`` (cl/common.h, KVREG_PREFETCH) is a hint:
    the kernels built without it and with another distance than the
    default answer the same."""
    c = layer(mode, 64)
    got = []
    for ahead in (0, 64):
        monkeypatch.setattr(config, "PREFETCH_BYTES", ahead)
        got.append(answers(c, 64, 4))
    assert got[1] == got[0]
