"""Deliberately broken backends: the conformance suite must fail each one.

Each is a :class:`~kvreg.reference.ReferenceBackend` with one realistic bug.
Loaded as a pytest plugin (``-p broken_backends``, with this folder on the
path) it registers them with kvreg for that pytest session only, through the
same pluggy hook a real plugin uses.
"""

from __future__ import annotations

import numpy as np

from kvreg import registry
from kvreg.hookspecs import hookimpl
from kvreg.quant import num_groups
from kvreg.reference import ReferenceBackend


class HalfEvenRounding(ReferenceBackend):
    """quantize_rows with np.round: ties to even, not away from zero."""

    name = "broken_round"
    auto = False

    def quantize_rows(self, x, col, *, group):
        x = np.asarray(x, dtype=np.float32)
        n, hd = x.shape
        r = x / col if col is not None else x
        ng = num_groups(hd, group)
        q = np.empty((n, hd), np.int8)
        s = np.empty((n, ng), np.float32)
        for j in range(ng):
            blk = r[:, j * group:(j + 1) * group]
            sj = np.maximum(np.nanmax(np.abs(blk), axis=1) / np.float32(127), np.float32(1e-12))
            s[:, j] = sj
            with np.errstate(invalid="ignore"):
                q[:, j * group:(j + 1) * group] = np.nan_to_num(np.clip(np.round(blk / sj[:, None]), -127, 127))
        return q, s


class NoImportance(ReferenceBackend):
    """attend_group that never adds the probabilities to imp."""

    name = "broken_imp"
    auto = False

    def attend_group(self, q, kv, g, *, imp=None, **kw):
        return super().attend_group(q, kv, g, imp=None, **kw)


class WindowOffByOne(ReferenceBackend):
    """attend_layer whose window holds one row too few."""

    name = "broken_window"
    auto = False

    def attend_layer(self, q, kv, *, scale, window=None, softcap=0.0, sinks=None, imp=None):
        hpk = q.shape[0] // kv.num_kv_heads
        out = np.zeros_like(q)
        for g in range(kv.num_kv_heads):
            n = int(kv.lens[g])
            first = min(max(0, n - window + 1), max(n - 1, 0)) if window else 0
            hs = slice(g * hpk, (g + 1) * hpk)
            out[hs] = self.attend_group(q[hs], kv, g, scale=scale, first=first, softcap=softcap,
                                        sinks=None if sinks is None else sinks[hs], imp=imp)
        return out


class DroppingGather(ReferenceBackend):
    """gather_rows that skips the second kept row (and repeats the last)."""

    name = "broken_gather"
    auto = False

    def gather_rows(self, rows, idx):
        if idx.size >= 2:
            idx = np.concatenate([idx[:1], idx[2:], idx[-1:]])
        return rows[idx]


class StaleMirror(ReferenceBackend):
    """A device copy of the keys keyed on (storage, head) that uploads only
    rows past what it holds, ignoring the view's version: after
    truncate-then-append (same row count) it answers from the dropped rows."""

    name = "broken_mirror"
    auto = False

    def __init__(self, device=None):
        super().__init__(device)
        self._mirror: dict[tuple[int, int], np.ndarray] = {}

    def attend_group(self, q, kv, g, **kw):
        if kv.dense.k is None:
            return super().attend_group(q, kv, g, **kw)
        n = int(kv.lens[g])
        key = (id(kv.owner), g)
        rows = self._mirror.get(key, np.zeros((0, kv.head_dim), np.float32))
        if rows.shape[0] < n:
            rows = np.concatenate([rows, kv.dense.k[g, rows.shape[0]:n]])
            self._mirror[key] = rows
        k = kv.dense.k.copy()
        k[g, :n] = rows[:n]
        return super().attend_group(q, kv._replace(dense=kv.dense._replace(k=k)), g, **kw)


class IgnoresExactRows(ReferenceBackend):
    """q8 attention that reads every row from the int8 blocks, the exact
    (float32) copies of the sink rows ignored."""

    name = "broken_exact"
    auto = False

    def attend_group(self, q, kv, g, **kw):
        if kv.exact is None:
            return super().attend_group(q, kv, g, **kw)
        return super().attend_group(q, kv._replace(exact=kv.exact._replace(xlen=np.zeros_like(kv.exact.xlen))), g,
                                    **kw)


class DropsNanRows(ReferenceBackend):
    """A softmax whose max and exp skip NaN scores (a ``x > m`` max, a NaN
    exp flushed to 0): a NaN key row is dropped silently instead of
    poisoning its head (what kvreg-numba did before the NaN policy)."""

    name = "broken_nan"
    auto = False

    def attend_group(self, q, kv, g, *, scale, first=0, upto=None, softcap=0.0, sinks=None, imp=None):
        from kvreg.reference import key_scores, softmax_rows, value_pass

        n = int(kv.lens[g]) if upto is None else min(int(kv.lens[g]), upto)
        if n == 0:
            return np.zeros_like(q)
        first = min(first, n - 1)
        s = key_scores(kv, g, q, first, n) * np.float32(scale)
        p = softmax_rows(np.where(np.isnan(s), np.float32(-np.inf), s), sinks)
        if imp is not None:
            m = min(imp.shape[0], n)
            for h in range(q.shape[0]):
                if m > first:
                    imp[first:m] += p[h, : m - first]
        return value_pass(kv, g, p, first, n)


BROKEN = (HalfEvenRounding, NoImportance, WindowOffByOne, DroppingGather, StaleMirror, IgnoresExactRows,
          DropsNanRows)



class NarrowRowCount(ReferenceBackend):
    """attend_group that keeps the row bound ``upto`` in a uint8 (it wraps
    past 255 rows): the integer-width bug class."""

    name = "broken_narrow"
    auto = False

    def attend_group(self, q, kv, g, *, upto=None, **kw):
        return super().attend_group(q, kv, g, upto=None if upto is None else upto % 256, **kw)


class ShortestHeadLayer(ReferenceBackend):
    """attend_layer that takes every group's length from the shortest head
    (a kernel written for dense heads): ragged heads read too few rows."""

    name = "broken_ragged"
    auto = False

    def attend_layer(self, q, kv, **kw):
        return super().attend_layer(q, kv._replace(lens=np.full_like(kv.lens, int(kv.lens.min()))), **kw)


class PositionKeyedRing(ReferenceBackend):
    """bounded_attend from a copy of the ring refreshed only at the newly
    inserted slot whenever the position advances by one, ignoring the view's
    version: a ring replaced in place by an import at the same position keeps
    being read stale."""

    name = "broken_ring"
    auto = False

    provides = frozenset({"bounded_ring"})

    def __init__(self, device=None):
        super().__init__(device)
        self._copies: dict[int, list] = {}

    def bounded_attend(self, q, ring, **kw):
        seen = ring.seen
        c = self._copies.get(id(ring.owner))
        if c is None or seen != c[0] + 1:
            c = self._copies[id(ring.owner)] = [seen, ring.k.copy(), ring.v.copy()]
        else:
            s = (seen - 1) % ring.k.shape[1]
            c[1][:, s], c[2][:, s] = ring.k[:, s], ring.v[:, s]
            c[0] = seen
        return super().bounded_attend(q, ring._replace(k=c[1], v=c[2]), **kw)


class MatmulRotation(ReferenceBackend):
    """rotate_rows as a product with the Hadamard matrix (one BLAS call
    instead of the butterflies): the same transform, other roundings."""

    name = "broken_rotate"
    auto = False

    def rotate_rows(self, x):
        hd = x.shape[-1]
        h = np.ones((1, 1), np.float32)
        while h.shape[0] < hd:
            h = np.block([[h, h], [h, -h]])
        return (np.asarray(x, np.float32) @ h) * np.float32(1.0 / np.sqrt(hd))


BROKEN = BROKEN + (NarrowRowCount, ShortestHeadLayer, PositionKeyedRing, MatmulRotation)

class _KvregPlugin:
    @hookimpl
    def kvreg_register_backends(self, register):
        for cls in BROKEN:
            register(cls)


PLUGIN = _KvregPlugin()


def pytest_configure(config):
    registry.register_plugin(PLUGIN)


def pytest_unconfigure(config):
    # A run inside the process of another (pytester) leaves the registry as it found it.
    registry.unregister_plugin(PLUGIN)
