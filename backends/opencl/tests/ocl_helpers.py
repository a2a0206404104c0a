"""Test helpers: a minimal fake of the core's layer storage (the attributes
docs/kernels.md lists), the careful numpy q8 quantizer and the f64 oracle."""

from __future__ import annotations

import itertools

import numpy as np

_GEN = itertools.count(1)


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


class FakeStorage:
    """Head-major layer storage with the attributes the mirror reads.

    ``exact``: q8 exact rows (the core's ``exact_cap``): the first ``exact``
    rows of each head are also kept in float32 field space (``xk``/``xv`` for
    the quantized sides, ``xlen`` per head) and attended instead of their
    int8 copies."""

    def __init__(self, nkv, hd, *, kq=False, vq=False, cap=4, exact=0):
        self.nkv, self.hd, self.cap = nkv, hd, cap
        self.k_quant, self.v_quant = kq, vq
        ngk = -(-hd // 32)
        z = lambda *s, dt=np.float32: np.zeros((nkv, cap) + s, dtype=dt)
        self.k = None if kq else z(hd)
        self.kq = z(hd, dt=np.int8) if kq else None
        self.ks = z(ngk) if kq else None
        self.kcol = np.ones((nkv, hd), np.float32) if kq else None
        self.kcol_set = np.zeros(nkv, bool) if kq else None
        self.v = None if vq else z(hd)
        self.vq = z(hd, dt=np.int8) if vq else None
        self.vs = z() if vq else None
        self.vcol = np.ones((nkv, hd), np.float32) if vq else None
        self.vcol_set = np.zeros(nkv, bool) if vq else None
        self.lens = np.zeros(nkv, np.int64)
        self.exact_cap = int(exact) if (kq or vq) else 0
        xz = lambda on: np.zeros((nkv, self.exact_cap, hd), np.float32) if on and self.exact_cap else None
        self.xk, self.xv = xz(kq), xz(vq)
        self.xlen = np.zeros(nkv, np.int64)
        self.generation = next(_GEN)
        self.edits = 0
        self._hist = []  # (edit number, lens after that truncation)

    def _grow(self, need):
        if need <= self.cap:
            return
        cap = self.cap
        while cap < need:
            cap *= 2
        for name in ("k", "kq", "ks", "v", "vq", "vs"):
            a = getattr(self, name)
            if a is not None:
                b = np.zeros((a.shape[0], cap) + a.shape[2:], a.dtype)
                b[:, : a.shape[1]] = a
                setattr(self, name, b)
        self.cap = cap

    def append(self, k, v, alive=None):
        k = np.asarray(k, np.float32).reshape(self.nkv, self.hd)
        v = np.asarray(v, np.float32).reshape(self.nkv, self.hd)
        self._grow(int(self.lens.max()) + 1)
        for h in range(self.nkv):
            if alive is not None and not alive[h]:
                continue
            p = self.lens[h]
            if self.exact_cap and self.xlen[h] == p < self.exact_cap:
                for x, row, col, isset in ((self.xk, k[h], self.kcol, self.kcol_set),
                                           (self.xv, v[h], self.vcol, self.vcol_set)):
                    if x is not None:
                        x[h, p] = row / col[h] if isset[h] else row
                self.xlen[h] = p + 1
            if self.k_quant:
                col = self.kcol[h] if self.kcol_set[h] else None
                q, s = quantize_ref(k[h][None], col, 32)
                self.kq[h, p], self.ks[h, p] = q[0], s[0]
            else:
                self.k[h, p] = k[h]
            if self.v_quant:
                col = self.vcol[h] if self.vcol_set[h] else None
                q, s = quantize_ref(v[h][None], col, self.hd)
                self.vq[h, p], self.vs[h, p] = q[0], s[0, 0]
            else:
                self.v[h, p] = v[h]
            self.lens[h] += 1

    def truncate_last(self, n):
        self.lens = np.maximum(self.lens - n, 0)
        np.minimum(self.xlen, self.lens, out=self.xlen)
        self.edits += 1
        self._hist.append((self.edits, self.lens.copy()))

    def edit_floor(self, since):
        if since is None or (self._hist and since < self._hist[0][0] - 1):
            return None
        fl = None
        for num, lens in self._hist:
            if num > since:
                fl = lens.copy() if fl is None else np.minimum(fl, lens)
        return fl if fl is not None else self.lens.copy()

    def forget_history(self):
        self._hist.clear()

    def drop_front(self, n):
        """A trim: rows shift, so the generation changes."""
        for name in ("k", "kq", "ks", "v", "vq", "vs"):
            a = getattr(self, name)
            if a is not None:
                a[:, : a.shape[1] - n] = a[:, n:].copy()
        for x in (self.xk, self.xv):
            if x is not None and n < self.exact_cap:
                x[:, : self.exact_cap - n] = x[:, n:].copy()
        self.xlen = np.maximum(self.xlen - n, 0)
        self.lens = np.maximum(self.lens - n, 0)
        self.generation = next(_GEN)

    # dequantized views for the oracle
    def keys(self, h):
        n = self.lens[h]
        if not self.k_quant:
            return self.k[h, :n].astype(np.float64)
        ng = self.ks.shape[2]
        s = np.repeat(self.ks[h, :n].astype(np.float64), 32, axis=1)[:, : self.hd]
        del ng
        rows = self.kq[h, :n].astype(np.float64) * s
        if self.xk is not None:
            rows[: self.xlen[h]] = self.xk[h, : self.xlen[h]]
        return rows * self.kcol[h].astype(np.float64)

    def values(self, h):
        n = self.lens[h]
        if not self.v_quant:
            return self.v[h, :n].astype(np.float64)
        rows = self.vq[h, :n].astype(np.float64) * self.vs[h, :n, None].astype(np.float64)
        if self.xv is not None:
            rows[: self.xlen[h]] = self.xv[h, : self.xlen[h]]
        return rows * self.vcol[h].astype(np.float64)


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


#: (K quantized, V quantized) per mode name.
MODES = {"f32": (False, False), "q8": (True, True), "q8k": (True, False), "q8v": (False, True)}
#: float32 scores/exp/sums against the f64 oracle over <= 64 rows.
RTOL = 2e-5


def filled_storage(nkv, hd, rows, mode="f32", *, seed=0, alive=None, exact=0):
    """A fake storage of ``mode`` holding ``rows`` seeded random rows
    (``exact``: its q8 exact rows per head)."""
    kq, vq = MODES[mode]
    st = FakeStorage(nkv, hd, kq=kq, vq=vq, exact=exact)
    rng = np.random.default_rng(seed)
    for _ in range(rows):
        st.append(rng.standard_normal((nkv, hd)), rng.standard_normal((nkv, hd)), alive)
    return st


def mirrored(dev, st):
    """A device mirror of ``st``, synced once."""
    from kvreg_opencl.mirror import DeviceMirror

    m = DeviceMirror(dev)
    m.sync(st)
    return m


def check_close(got, want, what):
    """``got`` within :data:`RTOL` (relative to the largest |want|, at least 1) of ``want``."""
    want = np.asarray(want)
    err = np.abs(got - want).max() if want.size else 0.0
    bound = RTOL * max(1.0, np.abs(want).max() if want.size else 0.0)
    assert err <= bound, f"{what}: max abs err {err:.3g} > {bound:.3g}"
