"""The tiered far field of a sealed layer (``o1_begin(..., far="tiered")``).

The seed's Nyström seal (:mod:`kvreg.nystrom`) fixes its exact rows at the
seal and estimates every other row from landmark keys fit to prompt queries.
On real pretrained models that loses to plain eviction at equal bytes
(``kvreg eval``): decode queries drift from the prompt's, and a row that was
not heavy in the prompt is never read exactly again. Summaries that merge
rows (mean-key slots read as one row of logit ``s·q·k̄ + log n``) lose too.
What wins per byte on these models is precision, not summaries: kvreg's
``q4`` storage of a whole context costs what a few Born rows in float32 cost
and is far closer to exact. So this seal keeps the lifecycle and the
constant memory of the seed's, and holds rows in two tiers, per KV group:

* **exact** (the layer's precision: float32, float16 or bfloat16 rows for
  ``f32``/``f16``/``bf16`` layers; int8 with a float16 scale per 32 channels,
  rotated, for the q8 modes and ``q4``): the first ``sink`` rows, the newest ``w`` and
  ``heavy`` rows of largest accumulated attention mass, ``R = sink + w +
  heavy`` in all. The mass is the layer's importance at the seal (every
  prompt query's probabilities: what Born eviction reads) and then every
  decode step's probabilities of the group's heads;
* **far** (``far_format``: 4 bits by default, or 2 or 8): up to ``F`` more
  rows, in the memory of ``m`` float32 rows (``F = ⌊m · float32 row bytes /
  far row bytes⌋``: 6.4x ``m`` at hd 64 in 4 bits), in every mode. Keys and
  values are Walsh-Hadamard rotated (when ``hd`` is a power of two) and
  stored as integer codes with float16 scales (4 bits: per 32 key / 64 value
  channels, kvreg's ``q4`` format; 2 bits: four levels between each 32
  channels' minimum and maximum, float16 scale and zero; 8 bits: per 32).

The mass at the seal is the layer's importance (every prompt query's
probabilities summed over all heads) or, with an observation window
(``Seal.begin(..., observe=n)``), each group's own: the probabilities its
heads' last ``n`` prompt queries give each row, pooled over neighbouring
rows (SnapKV's scoring; :func:`kvreg.eviction.observed_mass`). With ``m =
0`` there is no far tier: a fixed-budget eviction per group
(``EvictionPolicy.Snap``).

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

import sys
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from .errors import ConfigError, ShapeError
from .modes import Q4_INT8_GROUP, Q4_K_GROUP, Q4_V_GROUP, KvMode
from .quant import (
    dequantize_half_scaled,
    dequantize_int2,
    from_bf16,
    fwht,
    num_groups,
    pack_int2,
    pack_int4,
    quantize_half_scaled,
    quantize_int2,
    rotates,
    to_bf16,
    unpack_int2,
    unpack_int4,
)

__all__ = ["TieredSeal", "Tier", "exact_format", "far_rows", "seal_bytes", "equal_rows", "tiered_attend"]

#: How a tier stores its rows.
FORMATS = ("f32", "f16", "bf16", "int8", "int4", "int2")
#: The formats a far tier may take (``far_format``).
FAR_FORMATS = ("int8", "int4", "int2")

# (K group, V group, qmax) of the integer formats; int2 is asymmetric (four
# levels from each group's minimum: a symmetric 2-bit code would waste one)
_INT = {"int8": (Q4_INT8_GROUP, Q4_INT8_GROUP, 127), "int4": (Q4_K_GROUP, Q4_V_GROUP, 7),
        "int2": (Q4_INT8_GROUP, Q4_INT8_GROUP, 3)}


def exact_format(mode: KvMode) -> str:
    """The exact tier's format for a layer of ``mode``: its own precision for
    the float modes, int8 for the quantized ones."""
    return {KvMode.F32: "f32", KvMode.F16: "f16", KvMode.BF16: "bf16"}.get(mode, "int8")


class Tier:
    """Rows of every KV group in one format (:data:`FORMATS`), each with its
    position and accumulated mass: ``[nkv, cap]`` slots, ``n`` of them held
    (the same count in every group). The integer formats hold Walsh-Hadamard
    rotated rows when ``hd`` is a power of two (``rotated``): scores take the
    rotated query, outputs rotate back."""

    # The scales (and int2's zeros): an ndarray where the format has them,
    # else None. The format says which, so they are typed Any.
    ks: Any
    vs: Any
    kz: Any
    vz: Any

    def __init__(self, fmt: str, nkv: int, cap: int, hd: int):
        if fmt not in FORMATS:
            raise ConfigError(f"Tier: format must be one of {', '.join(FORMATS)}, got {fmt!r}")
        self.fmt, self.nkv, self.hd, self.n = fmt, nkv, hd, 0
        self.rotated = fmt in _INT and rotates(hd)
        shape = (nkv, cap, hd)
        self.ks = self.vs = self.kz = self.vz = None
        if fmt in _INT:
            kg, vg, _ = _INT[fmt]
            width = {"int8": hd, "int4": (hd + 1) // 2, "int2": (hd + 3) // 4}[fmt]
            dt: DTypeLike = np.int8 if fmt == "int8" else np.uint8
            self.k, self.v = np.zeros((nkv, cap, width), dt), np.zeros((nkv, cap, width), dt)
            self.ks = np.zeros((nkv, cap, num_groups(hd, kg)), np.float16)
            self.vs = np.zeros((nkv, cap, num_groups(hd, vg)), np.float16)
            if fmt == "int2":
                self.kz, self.vz = np.zeros_like(self.ks), np.zeros_like(self.vs)
        else:
            dt = {"f32": np.float32, "f16": np.float16, "bf16": np.uint16}[fmt]
            self.k, self.v = np.zeros(shape, dt), np.zeros(shape, dt)
        self.pos = np.zeros((nkv, cap), np.int64)
        self.mass = np.zeros((nkv, cap), np.float32)

    @staticmethod
    def row_bytes(fmt: str, hd: int) -> int:
        """Bytes of one row of one KV group in ``fmt``, position and mass included."""
        return Tier(fmt, 1, 1, hd).nbytes()

    def arrays(self) -> list:
        return [a for a in (self.k, self.v, self.ks, self.vs, self.kz, self.vz, self.pos, self.mass) if a is not None]

    def nbytes(self) -> int:
        return sum(a.nbytes for a in self.arrays())

    def put(self, at: slice, k: np.ndarray, v: np.ndarray) -> None:
        """Rows ``k, v [nkv, n, hd]`` float32 into slots ``at`` (a slice of ``n``) of every group."""
        nkv, n, hd = k.shape
        if n == 0:
            return
        if self.fmt == "int2":
            for rows, codes, scales, zeros, group in ((k, self.k, self.ks, self.kz, _INT["int2"][0]),
                                                      (v, self.v, self.vs, self.vz, _INT["int2"][1])):
                flat = rows.reshape(nkv * n, hd)
                c, sc, z = quantize_int2(fwht(flat) if self.rotated else flat, group)
                codes[:, at] = pack_int2(c).reshape(nkv, n, -1)
                scales[:, at], zeros[:, at] = sc.reshape(nkv, n, -1), z.reshape(nkv, n, -1)
        elif self.fmt in _INT:
            kg, vg, qmax = _INT[self.fmt]
            for rows, codes, scales, group in ((k, self.k, self.ks, kg), (v, self.v, self.vs, vg)):
                flat = rows.reshape(nkv * n, hd)
                c, sc = quantize_half_scaled(fwht(flat) if self.rotated else flat, group, qmax)
                codes[:, at] = (pack_int4(c) if self.fmt == "int4" else c).reshape(nkv, n, -1)
                scales[:, at] = sc.reshape(nkv, n, -1)
        elif self.fmt == "bf16":
            self.k[:, at], self.v[:, at] = to_bf16(k), to_bf16(v)
        else:
            self.k[:, at], self.v[:, at] = k, v

    def read(self) -> tuple[np.ndarray, np.ndarray]:
        """The held rows, float32 ``[nkv, n, hd]`` K and V (rotated when ``rotated``)."""
        n, nkv, hd = self.n, self.nkv, self.hd
        if n == 0:
            return np.zeros((nkv, 0, hd), np.float32), np.zeros((nkv, 0, hd), np.float32)
        if self.fmt == "int2":
            out = []
            for codes, scales, zeros, group in ((self.k, self.ks, self.kz, _INT["int2"][0]),
                                                (self.v, self.vs, self.vz, _INT["int2"][1])):
                c = unpack_int2(codes[:, :n].reshape(nkv * n, -1), hd)
                out.append(dequantize_int2(c, scales[:, :n].reshape(nkv * n, -1), zeros[:, :n].reshape(nkv * n, -1),
                                           group).reshape(nkv, n, hd))
            return out[0], out[1]
        if self.fmt in _INT:
            kg, vg, _ = _INT[self.fmt]
            out = []
            for codes, scales, group in ((self.k, self.ks, kg), (self.v, self.vs, vg)):
                c = codes[:, :n].reshape(nkv * n, -1)
                c = unpack_int4(c, hd) if self.fmt == "int4" else c
                out.append(dequantize_half_scaled(c, scales[:, :n].reshape(nkv * n, -1), group).reshape(nkv, n, hd))
            return out[0], out[1]
        if self.fmt == "bf16":
            return from_bf16(self.k[:, :n]), from_bf16(self.v[:, :n])
        return self.k[:, :n].astype(np.float32), self.v[:, :n].astype(np.float32)

    def move(self, g: np.ndarray, dst: np.ndarray, src: int) -> None:
        """Slot ``src`` of each group ``g`` over slot ``dst[g]``."""
        for a in self.arrays():
            a[g, dst] = a[g, src]


def far_rows(m: int, hd: int, far_format: str = "int4", window: int | None = None, exact: int = 0) -> int:
    """``F``: the far rows (``far_format``) held in the memory of ``m``
    float32 rows of ``hd`` channels (whatever the exact tier's format: ``m``
    sizes the far tier alike in every KV mode); under a sliding ``window``
    no more than the window leaves beside ``exact`` exact rows."""
    f = (int(m) * Tier.row_bytes("f32", hd)) // Tier.row_bytes(far_format, hd)
    return f if window is None else min(f, max(int(window) - 1 - int(exact), 0))


def seal_bytes(m: int, w: int, sink: int, hd: int, num_kv_heads: int, heavy: int | None = None,
               fmt: str = "f32", far_format: str = "int4", window: int | None = None) -> int:
    """Bytes one sealed layer holds (:meth:`TieredSeal.memory_bytes`), from its geometry."""
    heavy = m if heavy is None else heavy
    r = sink + w + heavy
    return int(num_kv_heads) * ((r + 1) * Tier.row_bytes(fmt, hd)
                                + (far_rows(m, hd, far_format, window, r) + 1) * Tier.row_bytes(far_format, hd))


def equal_rows(m: int, w: int, sink: int, hd: int, num_kv_heads: int, heavy: int | None = None,
               fmt: str = "f32", bytes_per_element: float = 4.0, far_format: str = "int4") -> int:
    """The fewest rows per layer a plain cache (float32 by default) needs to
    hold at least the bytes of this seal: the Born / sinks + window budget
    to compare it with at equal memory."""
    row = 2 * hd * num_kv_heads * bytes_per_element
    return int(-(-seal_bytes(m, w, sink, hd, num_kv_heads, heavy, fmt, far_format) // row))


class TieredSeal:
    """Every KV group of one sealed layer (module docstring): ``exact`` and
    ``far`` are its two :class:`Tier` objects.

    :meth:`seal` once, from the prompt's rows and their mass; then
    :meth:`step` per decode token.
    """

    def __init__(self, m: int, w: int, sink: int, heavy: int, *, num_kv_heads: int, hpk: int, head_dim: int,
                 scale: float, fmt: str = "f32", far_format: str = "int4", window: int | None = None,
                 kernels=None):
        for name, val, lo in (("m", m, 0), ("w", w, 1), ("sink", sink, 0), ("heavy", heavy, 0),
                              ("num_kv_heads", num_kv_heads, 1), ("hpk", hpk, 1), ("head_dim", head_dim, 1)):
            if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < lo:
                raise ConfigError(f"TieredSeal: {name} must be an int >= {lo}, got {val!r}")
        if fmt not in FORMATS[:4]:
            raise ConfigError(f"TieredSeal: the exact tier's format must be one of {', '.join(FORMATS[:4])}, "
                              f"got {fmt!r}")
        if window is not None and (isinstance(window, bool) or not isinstance(window, (int, np.integer))
                                   or window < 1):
            raise ConfigError(f"TieredSeal: window must be None or an int >= 1, got {window!r}")
        if far_format not in FAR_FORMATS:
            raise ConfigError(f"TieredSeal: the far tier's format must be one of {', '.join(FAR_FORMATS)}, "
                              f"got {far_format!r}")
        self.m, self.w, self.sink, self.heavy = int(m), int(w), int(sink), int(heavy)
        self.nkv, self.hpk, self.hd = int(num_kv_heads), int(hpk), int(head_dim)
        self.scale = np.float32(scale)
        self.budget = self.sink + self.w + self.heavy       # exact rows at rest, per group
        #: a sliding layer's window: only rows of the newest ``window`` positions are read
        self.window = None if window is None else int(window)
        self.far_budget = far_rows(self.m, self.hd, far_format, self.window, self.budget)  # at rest, per group
        self.exact = Tier(fmt, self.nkv, self.budget + 1, self.hd)
        self.far = Tier(far_format, self.nkv, self.far_budget + 1, self.hd)
        #: the backend whose ``tiered_attend`` reads the tiers (this module's own when None)
        self.kernels = kernels if kernels is not None else sys.modules[__name__]
        self.seen = 0          # positions ever held: the context depth
        self.dropped = 0       # rows ever dropped per group

    def memory_bytes(self) -> int:
        return self.exact.nbytes() + self.far.nbytes()

    # ── seal ──

    def seal(self, k: np.ndarray, v: np.ndarray, mass: np.ndarray) -> None:
        """Take the prompt: ``k, v [nkv, t, hd]`` float32 (as attention reads
        them), ``mass`` each row's attention mass: ``[t]`` shared by the
        groups (the layer's importance) or ``[nkv, t]`` per group (an
        observation window's, :func:`kvreg.eviction.observed_mass`)."""
        nkv, t, hd = k.shape
        if (nkv, hd) != (self.nkv, self.hd) or v.shape != k.shape or mass.shape not in ((t,), (nkv, t)) or t < 1:
            raise ShapeError(f"TieredSeal.seal: expected k, v [{self.nkv}, t >= 1, {self.hd}] and mass [t] or "
                             f"[{self.nkv}, t], got k {k.shape}, v {v.shape}, mass {mass.shape}")
        mass = np.nan_to_num(np.broadcast_to(np.asarray(mass, dtype=np.float32), (nkv, t)), nan=-np.inf)
        # Under a window the first decode query reads the prompt's last window - 1 rows only.
        t0 = 0 if self.window is None else max(t - (self.window - 1), 0)
        g = np.arange(nkv)[:, None]
        for tier, rows in zip((self.exact, self.far), self._split(mass[:, t0:], t - t0)):
            n, rows = rows.shape[1], rows + t0
            tier.put(slice(0, n), k[g, rows], v[g, rows])
            tier.pos[:, :n], tier.mass[:, :n], tier.n = rows, mass[g, rows], n
        self.seen = t
        self.dropped = t - self.exact.n - self.far.n

    def _split(self, mass: np.ndarray, t: int) -> tuple[np.ndarray, np.ndarray]:
        """Per group, the prompt rows kept exact (sinks, the newest ``w``, the
        ``heavy`` of largest mass between them) and the far tier's (the next
        ``F`` by mass), each ``[nkv, n]`` sorted; ties: the earlier row."""
        if t <= self.budget:
            return np.broadcast_to(np.arange(t), (self.nkv, t)), np.zeros((self.nkv, 0), dtype=np.int64)
        mid = np.arange(self.sink, t - self.w)
        order = mid[np.argsort(-mass[:, mid], axis=1, kind="stable")]
        fixed = np.broadcast_to(np.concatenate([np.arange(self.sink), np.arange(t - self.w, t)]),
                                (self.nkv, self.sink + self.w))
        keep = np.concatenate([fixed, order[:, :self.heavy]], axis=1)
        return np.sort(keep, axis=1), np.sort(order[:, self.heavy:self.heavy + self.far_budget], axis=1)

    # ── decode ──

    def step(self, q: np.ndarray, k: np.ndarray, v: np.ndarray) -> np.ndarray:
        """One decode token: ``q [nkv*hpk, hd]``, the token's ``k, v [nkv,
        hd]`` (checked finite by the caller). Returns ``[nkv*hpk, hd]``."""
        e = self.exact
        n = e.n
        e.put(slice(n, n + 1), k[:, None], v[:, None])
        e.pos[:, n], e.mass[:, n], e.n = self.seen, 0.0, n + 1
        if self.window is not None:
            for t in (e, self.far):
                self._expire(t, self.window)
        rows = [t.read() for t in (e, self.far)]
        out, mass = self.kernels.tiered_attend(q.reshape(self.nkv, self.hpk, self.hd),
                                               [(kk, vv, t.rotated) for t, (kk, vv) in zip((e, self.far), rows)],
                                               scale=self.scale)
        for t, dm in zip((e, self.far), mass):
            t.mass[:, :t.n] += dm
        self.seen += 1
        if e.n > self.budget:
            self._demote(*rows[0])
        return out.reshape(self.nkv * self.hpk, self.hd)

    def _expire(self, t: Tier, window: int) -> None:
        """Drop the rows of positions the ``window`` has passed. Every group
        holds as many rows: a group with fewer such rows drops as many in
        all: its rows of least mass outside the newest ``w`` next."""
        pos = t.pos[:, :t.n]
        old = pos <= self.seen - window
        d = int(old.sum(axis=1).max()) if t.n else 0
        if not d:
            return
        g = np.arange(self.nkv)
        # expired rows first, then least mass; the newest w last, the oldest of them first
        key = np.where(old, -np.inf,
                       np.where(pos >= self.seen - self.w, 1e12 + pos, t.mass[:, :t.n].astype(np.float64)))
        for _ in range(d):
            out = self._least(key, t.pos[:, :t.n], None)
            t.move(g, out, t.n - 1)
            key[g, out] = key[:, t.n - 1]
            t.n -= 1
            key = key[:, :t.n]
        self.dropped += d

    @staticmethod
    def _least(mass: np.ndarray, pos: np.ndarray, allowed: np.ndarray | None) -> np.ndarray:
        """Per group, the index of least mass (among ``allowed``); ties: the
        later position (Born keeps the earlier)."""
        key = mass if allowed is None else np.where(allowed, mass, np.inf)
        lo = key.min(axis=1, keepdims=True)
        return np.argmax(np.where(key == lo, pos, -1), axis=1)

    def _demote(self, kk: np.ndarray, vv: np.ndarray) -> None:
        """Each group's exact row of least mass outside the sinks and the
        window moves to the far tier (the last exact row fills its place);
        a far tier over its budget drops its row of least mass. ``kk, vv``:
        the exact tier's rows as the step read them."""
        e, f, g = self.exact, self.far, np.arange(self.nkv)
        pos = e.pos[:, :e.n]
        out = self._least(e.mass[:, :e.n], pos, (pos >= self.sink) & (pos < self.seen - self.w))
        held = f.n
        if self.far_budget:
            kx, vx = kk[g, out][:, None], vv[g, out][:, None]
            if e.rotated:
                kx, vx = fwht(kx), fwht(vx)
            f.put(slice(f.n, f.n + 1), kx, vx)
            f.pos[:, f.n], f.mass[:, f.n] = e.pos[g, out], e.mass[g, out]
            f.n += 1
        e.move(g, out, e.n - 1)
        e.n -= 1
        if f.n > self.far_budget:
            f.move(g, self._least(f.mass[:, :f.n], f.pos[:, :f.n], None), f.n - 1)
            f.n -= 1
        if f.n == held:
            self.dropped += 1


def tiered_attend(q: np.ndarray, tiers, *, scale: float) -> tuple[np.ndarray, list[np.ndarray]]:
    """The attention of a tiered seal's decode step (the reference of the
    ``tiered_attend`` kernel): ``q [nkv, hpk, hd]`` float32 over the rows of
    every tier under one softmax, scores times ``scale``. ``tiers``: per tier
    ``(k, v, rotated)``, ``k, v [nkv, n, hd]`` float32 as :meth:`Tier.read`
    gives them (``n`` may be 0; ``rotated``: the rows are in the
    Walsh-Hadamard basis, so they meet the rotated query and their share of
    the output rotates back). Returns ``(out [nkv, hpk, hd], mass)``,
    ``mass[i] [nkv, n_i]`` the probabilities of tier ``i``'s rows summed
    over each group's heads. NumPy in a fixed order."""
    qg = q * np.float32(scale)
    turn = any(rotated for _, _, rotated in tiers)
    qr = fwht(qg) if turn else qg   # read by rotated tiers only
    held = [(k, v, rotated) for k, v, rotated in tiers if k.shape[1]]
    scores = [np.matmul(qr if rotated else qg, k.transpose(0, 2, 1)) for k, _, rotated in held]
    top = np.max([s.max(axis=2) for s in scores], axis=0)[:, :, None]
    probs = [np.exp(s - top) for s in scores]
    inv = 1.0 / np.sum([p.sum(axis=2) for p in probs], axis=0)[:, :, None]
    plain, turned = np.zeros_like(qg), np.zeros_like(qg)
    got = []
    for (_, v, rotated), p in zip(held, probs):
        p *= inv
        got.append(p.sum(axis=1))
        acc = turned if rotated else plain
        acc += np.matmul(p, v)
    out = plain + fwht(turned) if turn else plain
    it = iter(got)
    mass = [next(it) if k.shape[1] else np.zeros((k.shape[0], 0), np.float32) for k, _, _ in tiers]
    return out, mass
