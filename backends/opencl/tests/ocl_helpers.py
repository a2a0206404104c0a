"""Test helpers: a layer's rows in the core's REAL storage (driven through
its public operations, read through the :class:`kvreg.plugin.KvView` a
kernel gets), the careful numpy q8 quantizer and the f64 oracle."""

from __future__ import annotations

import numpy as np

from kvreg.layer import LayerKvCache
from kvreg_conformance.tolerances import tolerance


def quantize_ref(x, col, group):
    """The exact-class contract in numpy float32, step by step."""
    x = np.asarray(x, dtype=np.float32)
    n, hd = x.shape
    r = x / np.asarray(col, dtype=np.float32) if col is not None else x.copy()  # [hd] or [n, hd]
    ng = -(-hd // group)
    q = np.zeros((n, hd), dtype=np.int8)
    s = np.zeros((n, ng), dtype=np.float32)
    with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
        for j in range(ng):
            blk = r[:, j * group:(j + 1) * group]
            # fmax: a NaN channel is ignored, as Rust f32::max does
            am = np.fmax.reduce(np.abs(blk), axis=1, initial=np.float32(0.0)).astype(np.float32)
            sc = np.maximum(am / np.float32(127.0), np.float32(1e-12)).astype(np.float32)
            s[:, j] = sc
            t = (blk / sc[:, None]).astype(np.float32)
            # half away from zero without double rounding: floor(|t|+0.5) is
            # wrong for 0.49999997f, so test the (exact) fractional part.
            fl = np.floor(np.abs(t))
            frac = np.abs(t) - fl
            a = np.where(frac >= np.float32(0.5), fl + 1, fl)
            rt = np.copysign(a, t)
            rt = np.where(np.isnan(rt), 0, np.clip(rt, -127, 127))
            q[:, j * group:(j + 1) * group] = rt.astype(np.int8)
    return q, s


#: The storage modes the mirror tests drive directly: unquantized float32,
#: and the q8 layouts without a float16 window or rotation (the seed's 2f
#: storage: int8 rows, their field frozen at KV_COL_WARMUP = 64 rows).
#: The windowed q8 modes are tested through the layer (test_opencl_window).
MODES = ("f32", "q8_2f", "q8k_2f", "q8v_2f")
Q8_MODES = MODES[1:]
#: float32 scores/exp/sums against the f64 oracle over <= 64 rows.
RTOL = tolerance("decode_small_scaled")[0]


class Rows:
    """One layer's rows in the core's own :class:`kvreg.storage.Storage`.

    A thin handle on a reference-backend :class:`kvreg.LayerKvCache`: every
    mutation is the core's (``append`` with dead heads, ``truncate_last``,
    ``drop_front`` = eviction of the oldest rows, ``clear``; the q8 field
    freezes at the append that finds 64 rows stored), so each one moves the
    storage's ``version`` and change log exactly as in production. A kernel
    or mirror reads :meth:`view`; the oracle reads :meth:`keys`/:meth:`values`,
    the rows as the view says the kernels answer with them.

    ``exact``: the q8 exact rows per head (``q8_exact_rows``; 0: none)."""

    def __init__(self, nkv, hd, mode="f32", *, exact=0):
        if mode not in MODES:
            raise ValueError(f"Rows: mode {mode!r} is not one of {MODES}")
        self.nkv, self.hd = nkv, hd
        self.layer = LayerKvCache(nkv, hd, mode, backend="reference", q8_exact_rows=exact)

    @property
    def storage(self):
        """The real storage (for writing behind its back on purpose only:
        :func:`scramble_int8_copies` -- everything else goes through the layer)."""
        return self.layer.storage

    def view(self):
        """The frozen :class:`kvreg.plugin.KvView` of the current version."""
        return self.layer.storage.view()

    @property
    def lens(self):
        return self.view().lens

    @property
    def xlen(self):
        x = self.view().exact
        return np.zeros(self.nkv, np.int64) if x is None else x.xlen

    @property
    def version(self):
        return self.view().version

    def append(self, k, v, alive=None):
        self.layer.append(np.asarray(k, np.float32), np.asarray(v, np.float32), alive=alive)

    def truncate_last(self, n):
        self.layer.truncate_last(n)

    def drop_front(self, n):
        """Drop the ``n`` oldest rows of every head (an eviction: a rewrite)."""
        self.layer.evict(self.layer.seq_len - n)

    def clear(self):
        self.layer.clear()

    # the rows the kernels answer with, widened to float64 for the oracle
    def keys(self, h):
        return self.view().attended_rows("k", h, 0, int(self.lens[h])).astype(np.float64)

    def values(self, h):
        return self.view().attended_rows("v", h, 0, int(self.lens[h])).astype(np.float64)


def scramble_int8_copies(st):
    """Garbage in the int8 copies of the exact rows (written into the real
    storage's arrays behind its back, like kvreg_conformance.fill's
    poison_window_slots; call it before any mirror syncs): a kernel that
    reads them instead of xk/xv gives a different answer, the oracle (which
    reads the view's attended rows) does not."""
    s = st.storage
    for h in range(st.nkv):
        xl = int(s.xlen[h])
        for name in ("kq", "vq"):
            a = getattr(s, name)
            if a is not None:
                a[h, :xl] = 127 - a[h, :xl] // 2
        for name in ("ks", "vs"):
            a = getattr(s, name)
            if a is not None:
                a[h, :xl] *= 3.0


def oracle_group(st, q, g, *, scale, first=0, softcap=0.0, upto=None, sinks=None):
    """f64 loops: out [hpk, hd], probs [hpk, span] for KV group g."""
    q = np.asarray(q, np.float64)
    n = int(st.lens[g]) if upto is None else min(int(st.lens[g]), upto)
    hpk, hd = q.shape
    if n == 0:
        return np.zeros((hpk, hd)), np.zeros((hpk, 0))
    first = min(first, n - 1)
    K, V = st.keys(g)[first:n], st.values(g)[first:n]
    out = np.zeros((hpk, hd))
    probs = np.zeros((hpk, n - first))
    for h in range(hpk):
        s = np.array([scale * sum(q[h, d] * K[p, d] for d in range(hd)) for p in range(len(K))])
        if softcap > 0:
            s = softcap * np.tanh(s / softcap)
        m = s.max() if sinks is None else max(s.max(), float(sinks[h]))
        e = np.exp(s - m)
        z = e.sum() + (0.0 if sinks is None else np.exp(float(sinks[h]) - m))
        probs[h] = e / z
        out[h] = probs[h] @ V
    return out, probs


def filled_storage(nkv, hd, rows, mode="f32", *, seed=0, alive=None, exact=0):
    """Real storage of ``mode`` holding ``rows`` seeded random rows, appended
    one by one (``exact``: its q8 exact rows per head)."""
    st = Rows(nkv, hd, mode, exact=exact)
    rng = np.random.default_rng(seed)
    for _ in range(rows):
        st.append(rng.standard_normal((nkv, hd)), rng.standard_normal((nkv, hd)), alive)
    return st


def mirrored(dev, st):
    """A device mirror of ``st``'s current view, synced once."""
    from kvreg_opencl.mirror import DeviceMirror

    m = DeviceMirror(dev)
    m.sync(st.view())
    return m


def check_close(got, want, what):
    """``got`` within :data:`RTOL` (relative to the largest |want|, at least 1) of ``want``."""
    want = np.asarray(want)
    err = np.abs(got - want).max() if want.size else 0.0
    bound = RTOL * max(1.0, np.abs(want).max() if want.size else 0.0)
    assert err <= bound, f"{what}: max abs err {err:.3g} > {bound:.3g}"
