"""The tiered far field of a sealed layer (``o1_begin(..., far="tiered")``).

The seed's Nyström seal (:mod:`kvreg.nystrom`) fixes its exact rows at the
seal and estimates every other row from landmark keys fit to prompt queries.
On real pretrained models that loses to plain Born eviction at equal bytes
(docs/figures.md): decode queries drift from the prompt's, and a row that was
not heavy in the prompt is never read exactly again. Summaries that merge
rows lose too: on SmolLM2, ``m`` mean-key slots (each read as one row of logit
``s·q·k̄ + log n``) in place of ``m`` exact rows raised the mean KL at equal
bytes (4.7e-2 with 4 slots, 5.2e-2 with 32, 6.3e-2 with 64; Born 4.6e-2).
What wins per byte on these models is precision, not summaries: kvreg's
``q4`` storage of a whole 1k context costs what Born's 152 f32 rows cost and
is 10x closer to exact. So this seal keeps the lifecycle and the constant
memory of the seed's, and holds rows in two tiers, per KV group:

* **exact** (float32): the first ``sink`` rows, the newest ``w`` and
  ``heavy`` rows of largest accumulated attention mass, ``R = sink + w +
  heavy`` in all. The mass is the layer's importance at the seal (every
  prompt query's probabilities: what Born eviction reads) and then every
  decode step's probabilities of the group's heads;
* **far** (4 bits): up to ``F`` more rows, in the memory of ``m`` exact rows
  (``F = ⌊m · exact row bytes / far row bytes⌋``, about 6x ``m`` at hd 64).
  Keys and values are Walsh-Hadamard rotated (when ``hd`` is a power of two)
  and stored as 4-bit codes with a float16 scale per 32 key / 64 value
  channels, kvreg's ``q4`` format.

When a step brings the exact tier to ``R + 1`` rows, the row of least mass
outside the sinks and the window moves to the far tier; when the far tier
then holds ``F + 1``, its row of least mass is dropped. Rows keep being chosen
as they leave the window, by the mass decode gives them, in each KV group on
its own. Both tiers go under one softmax; every row keeps gathering mass.

Memory is fixed at the seal: ``R + 1`` exact and ``F + 1`` far rows (the
step's staging rows included), with positions and mass, whatever the context.
Every step is NumPy in a fixed order, whatever the layer's backend.
"""

from __future__ import annotations

import numpy as np

from .errors import ConfigError, ShapeError
from .modes import Q4_K_GROUP, Q4_V_GROUP
from .quant import dequantize_half_scaled, fwht, num_groups, pack_int4, quantize_half_scaled, rotates, unpack_int4

__all__ = ["TieredSeal", "far_rows", "seal_bytes", "equal_rows"]

_QMAX = 7


def _row_bytes(hd: int) -> tuple[int, int]:
    """(exact, far) bytes of one row of one KV group, position and mass included."""
    meta = 8 + 4
    far = 2 * ((hd + 1) // 2) + 2 * (num_groups(hd, Q4_K_GROUP) + num_groups(hd, Q4_V_GROUP))
    return 2 * hd * 4 + meta, far + meta


def far_rows(m: int, hd: int) -> int:
    """``F``: the 4-bit rows held in the memory of ``m`` exact rows of ``hd`` channels."""
    exact, far = _row_bytes(hd)
    return (int(m) * exact) // far


def seal_bytes(m: int, w: int, sink: int, hd: int, num_kv_heads: int, heavy: int | None = None) -> int:
    """Bytes one sealed layer holds (:meth:`TieredSeal.memory_bytes`), from its geometry."""
    exact, far = _row_bytes(hd)
    heavy = m if heavy is None else heavy
    return int(num_kv_heads) * ((sink + w + heavy + 1) * exact + (far_rows(m, hd) + 1) * far)


def equal_rows(m: int, w: int, sink: int, hd: int, num_kv_heads: int, heavy: int | None = None,
               bytes_per_element: float = 4.0) -> int:
    """The fewest rows per layer a plain cache (float32 by default) needs to
    hold at least the bytes of this seal: the Born / sinks + window budget
    to compare it with at equal memory."""
    row = 2 * hd * num_kv_heads * bytes_per_element
    return int(-(-seal_bytes(m, w, sink, hd, num_kv_heads, heavy) // row))


class TieredSeal:
    """Every KV group of one sealed layer (module docstring).

    :meth:`seal` once, from the prompt's rows and their mass; then
    :meth:`step` per decode token.
    """

    def __init__(self, m: int, w: int, sink: int, heavy: int, *, num_kv_heads: int, hpk: int, head_dim: int,
                 scale: float):
        for name, val, lo in (("m", m, 0), ("w", w, 1), ("sink", sink, 0), ("heavy", heavy, 0),
                              ("num_kv_heads", num_kv_heads, 1), ("hpk", hpk, 1), ("head_dim", head_dim, 1)):
            if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < lo:
                raise ConfigError(f"TieredSeal: {name} must be an int >= {lo}, got {val!r}")
        self.m, self.w, self.sink, self.heavy = int(m), int(w), int(sink), int(heavy)
        self.nkv, self.hpk, self.hd = int(num_kv_heads), int(hpk), int(head_dim)
        self.scale = np.float32(scale)
        self.rotate = rotates(self.hd)
        self.budget = self.sink + self.w + self.heavy       # exact rows at rest, per group
        self.far_budget = far_rows(self.m, self.hd)         # far rows at rest, per group
        nkv, hd, cap, fcap = self.nkv, self.hd, self.budget + 1, self.far_budget + 1
        self.k = np.zeros((nkv, cap, hd), dtype=np.float32)
        self.v = np.zeros_like(self.k)
        self.pos = np.zeros((nkv, cap), dtype=np.int64)
        self.mass = np.zeros((nkv, cap), dtype=np.float32)
        half = (hd + 1) // 2
        self.kq = np.zeros((nkv, fcap, half), dtype=np.uint8)
        self.vq = np.zeros_like(self.kq)
        self.ks = np.zeros((nkv, fcap, num_groups(hd, Q4_K_GROUP)), dtype=np.float16)
        self.vs = np.zeros((nkv, fcap, num_groups(hd, Q4_V_GROUP)), dtype=np.float16)
        self.fpos = np.zeros((nkv, fcap), dtype=np.int64)
        self.fmass = np.zeros((nkv, fcap), dtype=np.float32)
        self.rows = 0          # exact rows held per group (the same in every group)
        self.far = 0           # far rows held per group (the same in every group)
        self.seen = 0          # positions ever held: the context depth
        self.dropped = 0       # rows ever dropped per group

    def _arrays(self):
        return (self.k, self.v, self.pos, self.mass, self.kq, self.vq, self.ks, self.vs, self.fpos, self.fmass)

    def memory_bytes(self) -> int:
        return sum(a.nbytes for a in self._arrays())

    # ── the far tier's format ──

    def _put_far(self, at, k: np.ndarray, v: np.ndarray) -> None:
        """Rows ``k, v [nkv, n, hd]`` into far slots ``at`` (a slice of ``n``) of every group."""
        nkv, n, hd = k.shape
        for rows, codes, scales, group in ((k, self.kq, self.ks, Q4_K_GROUP), (v, self.vq, self.vs, Q4_V_GROUP)):
            flat = rows.reshape(nkv * n, hd)
            c, sc = quantize_half_scaled(fwht(flat) if self.rotate else flat, group, _QMAX)
            codes[:, at] = pack_int4(c).reshape(nkv, n, -1)
            scales[:, at] = sc.reshape(nkv, n, -1)

    def _far_rows(self, a: np.ndarray, s: np.ndarray, group: int) -> np.ndarray:
        """The far tier's rows of one side, float32 ``[nkv, far, hd]`` (rotated)."""
        n = self.far
        codes = unpack_int4(a[:, :n].reshape(self.nkv * n, -1), self.hd)
        return dequantize_half_scaled(codes, s[:, :n].reshape(self.nkv * n, -1), group).reshape(
            self.nkv, n, self.hd)

    # ── seal ──

    def seal(self, k: np.ndarray, v: np.ndarray, mass: np.ndarray) -> None:
        """Take the prompt: ``k, v [nkv, t, hd]`` float32 (as attention reads
        them), ``mass [t]`` each row's accumulated attention mass."""
        nkv, t, hd = k.shape
        if (nkv, hd) != (self.nkv, self.hd) or v.shape != k.shape or mass.shape != (t,) or t < 1:
            raise ShapeError(f"TieredSeal.seal: expected k, v [{self.nkv}, t >= 1, {self.hd}] and mass [t], "
                             f"got k {k.shape}, v {v.shape}, mass {mass.shape}")
        mass = np.nan_to_num(np.asarray(mass, dtype=np.float32), nan=-np.inf)
        keep, far = self._split(mass, t)
        n = keep.size
        self.k[:, :n], self.v[:, :n] = k[:, keep], v[:, keep]
        self.pos[:, :n], self.mass[:, :n] = keep, mass[keep]
        self._put_far(slice(0, far.size), k[:, far], v[:, far])
        self.fpos[:, :far.size], self.fmass[:, :far.size] = far, mass[far]
        self.rows, self.far, self.seen = n, int(far.size), t
        self.dropped = t - n - int(far.size)

    def _split(self, mass: np.ndarray, t: int) -> tuple[np.ndarray, np.ndarray]:
        """The prompt rows kept exact (sinks, the newest ``w``, the ``heavy``
        of largest mass between them) and the far tier's (the next ``F`` by
        mass), each sorted; ties: the earlier row."""
        if t <= self.budget:
            return np.arange(t), np.zeros(0, dtype=np.int64)
        mid = np.arange(self.sink, t - self.w)
        order = mid[np.argsort(-mass[mid], kind="stable")]
        keep = np.concatenate([np.arange(self.sink), order[:self.heavy], np.arange(t - self.w, t)])
        return np.sort(keep), np.sort(order[self.heavy:self.heavy + self.far_budget])

    # ── decode ──

    def step(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """One decode token: ``q [nkv*hpk, hd]``, the token's ``k, v [nkv,
        hd]`` (checked finite by the caller). Returns ``[nkv*hpk, hd]``."""
        n, f = self.rows, self.far
        self.k[:, n], self.v[:, n], self.pos[:, n], self.mass[:, n] = k, v, self.seen, 0.0
        n += 1
        qg = q.reshape(self.nkv, self.hpk, self.hd) * self.scale
        se = np.matmul(qg, self.k[:, :n].transpose(0, 2, 1))                     # [nkv, hpk, n]
        top = se.max(axis=2)
        if f:
            kf = self._far_rows(self.kq, self.ks, Q4_K_GROUP)
            sf = np.matmul(fwht(qg) if self.rotate else qg, kf.transpose(0, 2, 1))  # [nkv, hpk, f]
            top = np.maximum(top, sf.max(axis=2))
        pe = np.exp(se - top[:, :, None])
        den = pe.sum(axis=2)
        if f:
            pf = np.exp(sf - top[:, :, None])
            den += pf.sum(axis=2)
        inv = (1.0 / den)[:, :, None]
        pe *= inv
        out = np.matmul(pe, self.v[:, :n])
        self.mass[:, :n] += pe.sum(axis=1)
        if f:
            pf *= inv
            of = np.matmul(pf, self._far_rows(self.vq, self.vs, Q4_V_GROUP))
            out += fwht(of) if self.rotate else of
            self.fmass[:, :f] += pf.sum(axis=1)
        self.rows, self.seen = n, self.seen + 1
        if n > self.budget:
            self._demote()
        return out.reshape(self.nkv * self.hpk, self.hd)

    @staticmethod
    def _least(mass: np.ndarray, pos: np.ndarray, allowed: np.ndarray | None) -> np.ndarray:
        """Per group, the index of least mass (among ``allowed``); ties: the
        later position (Born keeps the earlier)."""
        key = mass if allowed is None else np.where(allowed, mass, np.inf)
        lo = key.min(axis=1, keepdims=True)
        return np.argmax(np.where(key == lo, pos, -1), axis=1)

    def _demote(self) -> None:
        """Each group's exact row of least mass outside the sinks and the
        window moves to the far tier (the last exact row fills its place);
        a far tier over its budget drops its row of least mass."""
        g = np.arange(self.nkv)
        n = self.rows
        pos = self.pos[:, :n]
        out = self._least(self.mass[:, :n], pos, (pos >= self.sink) & (pos < self.seen - self.w))
        f = self.far
        if self.far_budget:
            self._put_far(slice(f, f + 1), self.k[g, out][:, None], self.v[g, out][:, None])
            self.fpos[:, f], self.fmass[:, f] = self.pos[g, out], self.mass[g, out]
            f += 1
        for a in (self.k, self.v, self.pos, self.mass):
            a[g, out] = a[g, n - 1]
        self.rows = n - 1
        if f > self.far_budget:
            gone = self._least(self.fmass[:, :f], self.fpos[:, :f], None)
            for a in (self.kq, self.vq, self.ks, self.vs, self.fpos, self.fmass):
                a[g, gone] = a[g, f - 1]
            f -= 1
        if f == self.far:
            self.dropped += 1
        self.far = f
