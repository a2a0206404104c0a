"""Int8 rows: ``Q8``, ``Q8K``, ``Q8V`` and the seed's ``Q8_2F``,
``Q8K_2F``, ``Q8V_2F`` (docs/kernels.md, docs/formats.md).

A quantized side holds ``kq [nkv, cap, hd]`` int8 with ``ks [nkv, cap,
ngk]`` float32 scales (K: one per 32 channels) or ``vq`` with ``vs [nkv,
cap]`` (V: one per row); the other side of ``Q8K``/``Q8V`` stays float32
(``k`` or ``v``).

* The ``_2F`` modes divide each row by a per-channel field (``kcol``/``vcol
  [nkv, hd]``) that freezes at the start of the append that finds 64 rows
  stored (the seed's rule), requantizing every stored row against it.
* ``Q8``, ``Q8K``, ``Q8V`` keep each head's newest :data:`~kvreg.modes.Q8_WINDOW`
  rows of a quantized side in float16 (``thk``/``thv [nkv, window, hd]``,
  oldest first): rows ``[0, b8)`` are int8, ``[b8, lens)`` the window; a
  row is quantized when it leaves the window. Their rows are Walsh-Hadamard
  rotated where ``hd`` is a power of two.

Exact rows: the first ``exact_cap`` rows of each head are also held in
float32, ``xk``/``xv [nkv, exact_cap, hd]``, for the quantized side(s).
They are stored in FIELD SPACE (divided by the head's 2f field, like the
quantizer's input), so a kernel treats an exact row as an already
dequantized row: scores use ``q ⊙ kcol``, values are multiplied by ``vcol``
at the end, as for int8 rows. ``xlen[h]`` is how many leading rows of head
``h`` are exact: rows ``[0, xlen[h])`` are read from ``xk``/``xv``, the rest
from the int8 blocks. Their int8 copies stay stored (the seed's layout, the
freeze and the exact-class kernels are unchanged). This is attention-sink
aware quantization (KVQuant keeps the first token in full precision): the
sink takes a large share of most queries' mass, so its quantization error
dominates the output error of a q8 cache.
"""

from __future__ import annotations

import numpy as np

from ..errors import ShapeError
from ..modes import KV_COL_WARMUP, KV_K_GROUP, Q8_ABS_MAX, KvMode
from ..views import DenseRows, ExactRows, Q8Rows, WindowRows
from .base import Groups, Storage, writes


def _field_rows(col: np.ndarray, col_set: np.ndarray, heads: np.ndarray, n: int) -> np.ndarray | None:
    """The 2f field of each row to quantize (``n`` rows per head, head-major),
    1 for a head whose field is not frozen; None before any freeze."""
    if not col_set[heads].any():
        return None
    return np.repeat(np.where(col_set[heads, None], col[heads], np.float32(1)), n, axis=0)


def _field_space(x: np.ndarray, col: np.ndarray, col_set: np.ndarray, heads: np.ndarray) -> np.ndarray:
    """Head-major rows ``[len(heads), t, hd]`` divided by their head's frozen
    field (as the quantizer divides them); unchanged for a head without one."""
    x = np.array(x, dtype=np.float32)
    for i, h in enumerate(heads):
        if col_set[h]:
            x[i] /= col[h]
    return x


class Int8Storage(Storage):
    """The q8 family (module docstring)."""

    def __init__(self, num_kv_heads: int, head_dim: int, mode: KvMode, exact_rows: int = 0):
        super().__init__(num_kv_heads, head_dim, mode)
        self.exact_cap = self._exact_rows(exact_rows)
        xshape = (num_kv_heads, self.exact_cap, head_dim)
        self.xk = np.zeros(xshape, np.float32) if self.exact_cap and mode.quant_k else None
        self.xv = np.zeros(xshape, np.float32) if self.exact_cap and mode.quant_v else None
        #: The float16 window: each head's newest ``window`` rows of a quantized
        #: side are ``thk``/``thv`` [nkv, window, hd] (oldest first), not yet
        #: integer; rows ``[0, b8)`` are. The window rows' slots in the
        #: integer blocks are allocated but unwritten.
        self.window = mode.window
        if self.window:
            self.b8 = np.zeros(num_kv_heads, np.int64)
            wshape = (num_kv_heads, self.window, head_dim)
            self.thk = np.zeros(wshape, np.float16) if mode.quant_k else None
            self.thv = np.zeros(wshape, np.float16) if mode.quant_v else None

    def _exact_rows(self, asked: int) -> int:
        return int(asked)

    # ── layout ──

    def block_names(self) -> tuple[str, ...]:
        names = ("kq", "ks") if self.mode.quant_k else ("k",)
        return names + (("vq", "vs") if self.mode.quant_v else ("v",))

    def _block_specs(self, cap: int) -> dict:
        nkv, hd = self.num_kv_heads, self.head_dim
        specs = {"k": ((nkv, cap, hd), np.dtype(np.float32)), "v": ((nkv, cap, hd), np.dtype(np.float32)),
                 "kq": ((nkv, cap, hd), np.dtype(np.int8)), "ks": ((nkv, cap, self.ngk), np.dtype(np.float32)),
                 "vq": ((nkv, cap, hd), np.dtype(np.int8)), "vs": ((nkv, cap), np.dtype(np.float32))}
        return {n: specs[n] for n in self.block_names()}

    def head_block_names(self) -> tuple[str, ...]:
        """The float16 window and its bound."""
        if not self.window:
            return ()
        return ("b8",) + tuple(n for n in ("thk", "thv") if getattr(self, n) is not None)

    def written_rows(self, block: str) -> np.ndarray:
        """A quantized side's integer rows stop at the window (its rows' slots stay zero)."""
        th = self.thk if block in ("kq", "ks") else self.thv if block in ("vq", "vs") else None
        return self.b8 if self.window and th is not None else self.lens

    def _groups(self, array, count) -> Groups:
        q8 = Q8Rows(array("kq"), array("ks"), array("vq"), array("vs"), array("kcol"), array("vcol"),
                    count(self.kcol_set), count(self.vcol_set), self.ngk)
        exact = ExactRows(array("xk"), array("xv"), count(self.xlen), self.exact_cap) if self.exact_cap else None
        window = WindowRows(array("thk"), array("thv"), count(self.b8), self.window) if self.window else None
        return DenseRows(array("k"), array("v")), q8, exact, window, None

    def field_frozen(self) -> bool:
        """Whether the q8 field froze (the seed: any head's column is set)."""
        return bool(self.kcol_set.any() or self.vcol_set.any())

    def stored_bytes(self) -> int:
        rows = int(self.lens.sum())
        hd = self.head_dim
        # A window row is held in float16 only (its integer slot is unwritten).
        win = int((self.lens - self.b8).sum()) if self.window else 0
        irows = rows - win
        total = irows * self.ngk * 4 + irows * hd + win * hd * 2 if self.mode.quant_k else rows * hd * 4
        total += irows * 4 + irows * hd + win * hd * 2 if self.mode.quant_v else rows * hd * 4
        total += int(self.kcol_set.sum() + self.vcol_set.sum()) * hd * 4
        sides = (self.xk is not None) + (self.xv is not None)
        total += int(self.xlen.sum()) * hd * 4 * sides
        return total

    def tiers_consistent(self) -> str | None:
        if not self.window:
            return None
        b8, lens = self.b8, self.lens
        if (b8 < 0).any() or (b8 > lens).any() or ((lens - b8) > self.window).any():
            return (f"window bound b8 {b8.tolist()} must lie within {self.window} rows below the rows held "
                    f"{lens.tolist()}")
        return None

    # ── rows in ──

    def check_rows(self, k: np.ndarray, v: np.ndarray) -> None:
        """Refuse rows a quantized side cannot store: one comparison refuses
        NaN (it compares false) as well as inf and values so large that the
        field's float32 RMS would overflow (one inf would make its group's
        scale inf and every dequantized value of the row NaN)."""
        mode = self.mode
        for name, x, q in (("k", k, mode.quant_k), ("v", v, mode.quant_v)):
            if q and not (np.abs(x) <= Q8_ABS_MAX).all():
                what = "inf/NaN values" if not np.isfinite(x).all() else f"values beyond ±{Q8_ABS_MAX:.0e}"
                raise ShapeError(f"{name} has {what}: a {mode.value} layer stores finite rows with |x| <= "
                                 f"{Q8_ABS_MAX:.0e} only (its 2f field, a float32 RMS over the first "
                                 f"{KV_COL_WARMUP} rows, would overflow to inf)")

    def basis(self, k: np.ndarray, v: np.ndarray, kernels) -> tuple[np.ndarray, np.ndarray]:
        """K and V rows in the basis this storage keeps them in: rotated
        (the backend's ``rotate_rows``) on a rotated side, else float32 as
        they are; one transform of both when both rotate (row by row, the
        same bits)."""
        if self.rot_k and self.rot_v:
            k, v = kernels.rotate_rows(np.stack((k, v)))
            return k, v
        return (kernels.rotate_rows(k) if self.rot_k else np.asarray(k, dtype=np.float32),
                kernels.rotate_rows(v) if self.rot_v else np.asarray(v, dtype=np.float32))

    def store(self, k: np.ndarray, v: np.ndarray, heads: np.ndarray, kernels) -> None:
        """The seed's field rule: the field freezes at the START of the
        append that finds ``seq_len >= 64`` and no field yet, so rows up to
        that point go in field-free and the append that reaches it freezes
        first."""
        n, done = k.shape[0], 0
        while done < n:
            seg = n - done
            if self.mode.field and not self.field_frozen():
                if self.seq_len >= KV_COL_WARMUP:
                    self.freeze(kernels.freeze_field)
                if not self.field_frozen():
                    seg = min(seg, max(KV_COL_WARMUP - self.seq_len, 1))
            self._store(k[done:done + seg], v[done:done + seg], heads, kernels)
            done += seg

    def _store(self, k: np.ndarray, v: np.ndarray, heads: np.ndarray, kernels) -> None:
        mode, hd, n = self.mode, self.head_dim, k.shape[0]
        rows, exact = {}, {}
        t = self.exact_rows_wanted(heads, n)
        if heads.size:
            every = heads.size == self.num_kv_heads
            kh = (k if every else k[:, heads]).transpose(1, 0, 2)
            vh = (v if every else v[:, heads]).transpose(1, 0, 2)
            if self.window:
                # The rows join the float16 window; those it pushes out are
                # quantized from their float16 value (one call per side, every head).
                kh, vh = self.basis(kh, vh, kernels)
                if t:
                    exact = {n_: x[:, :t] for n_, x, q in (("xk", kh, mode.quant_k), ("xv", vh, mode.quant_v)) if q}
                self.reserve(int(self.lens[heads].max()) + n)
                for side, x, group in (("k", kh, KV_K_GROUP), ("v", vh, hd)):
                    if getattr(self, "th" + side) is None:
                        rows[side] = x
                        continue
                    where, leaving = self.push_window(side, heads, x)
                    if leaving.shape[0]:
                        q, sc = kernels.quantize_rows(leaving, None, group=group)
                        self.write_quantized(side, where, q, sc)
                self.advance_window(heads, n)
                self.append(rows, heads, n, exact)
                return
            for side, x, quantized, group, col, col_set in (
                    ("k", kh, mode.quant_k, KV_K_GROUP, self.kcol, self.kcol_set),
                    ("v", vh, mode.quant_v, hd, self.vcol, self.vcol_set)):
                if not quantized:
                    rows[side] = x
                    continue
                field = _field_rows(col, col_set, heads, n)
                q, sc = kernels.quantize_rows(np.ascontiguousarray(x).reshape(-1, hd), field, group=group)
                rows[side + "q"] = q.reshape(heads.size, n, hd)
                rows[side + "s"] = sc.reshape(heads.size, n, -1) if side == "k" else sc.reshape(heads.size, n)
                if t:
                    exact["x" + side] = _field_space(x[:, :t], col, col_set, heads)
        self.append(rows, heads, n, exact)

    def exact_rows_wanted(self, heads: np.ndarray, n: int) -> int:
        """How many of the next ``n`` rows of ``heads`` become exact rows (the
        most over those heads): a row is exact when it lands at index
        ``< exact_cap`` right after the head's exact rows."""
        # past the exact rows on every head (every append after the first
        # few): one reduction, no fancy indexing, on the append hot path
        if not self.exact_cap or not heads.size or int(self.lens.min()) >= self.exact_cap:
            return 0
        at = self.lens[heads]
        open_ = (self.xlen[heads] == at) & (at < self.exact_cap)
        return int(min(n, (self.exact_cap - at[open_]).max())) if open_.any() else 0

    @writes
    def freeze(self, freeze_field) -> None:
        """The 2f freeze: per head and quantized side, ``freeze_field(q, s,
        group=...) -> (col, q2, s2)`` (a backend kernel) gives the field and the
        requantized rows, which replace the stored ones; the exact rows move
        into field space (divided by it). Every stored row is rewritten."""
        hd = self.head_dim
        for h in range(self.num_kv_heads):
            n = int(self.lens[h])
            if n == 0:
                continue
            for quantized, qb, sb, colb, setb, group, x in (
                (self.mode.quant_k, "kq", "ks", self.kcol, self.kcol_set, KV_K_GROUP, self.xk),
                (self.mode.quant_v, "vq", "vs", self.vcol, self.vcol_set, hd, self.xv),
            ):
                if not quantized:
                    continue
                q, s = getattr(self, qb), getattr(self, sb)
                sc = s[h, :n] if s.ndim == 3 else s[h, :n, None]
                col, nq, ns = freeze_field(q[h, :n], np.ascontiguousarray(sc), group=group)
                q[h, :n] = nq
                s[h, :n] = ns if s.ndim == 3 else ns[:, 0]
                colb[h] = col
                setb[h] = True
                if x is not None:
                    x[h, : self.xlen[h]] /= col
        self._rewritten()

    # ── the decode step's row ──

    def window_rows(self) -> bool:
        """Whether a row appends through :meth:`append_window_row`: a q8
        (``Q8``, ``Q8K``, ``Q8V``) storage whose heads all hold the same
        count, a full float16 window and every exact row they keep."""
        if not self.window:
            return False
        lens = self.lens.tolist()
        at = lens[0]
        return lens.count(at) == len(lens) and at >= self.exact_cap and \
            self.b8.tolist().count(at - self.window) == len(lens)

    def append_row(self, k: np.ndarray, v: np.ndarray, kernels) -> bool:
        """Past the window's first fill: the backend's one call (it checks
        that state itself), else the window path in NumPy."""
        if not self.window:
            return False
        if self.append_window_row_by(k, v, kernels.store_window_row):
            return True
        if not self.window_rows():
            return False
        self.check_rows(k, v)
        self.append_window_row(*self.basis(k, v, kernels), kernels.quantize_rows)
        return True

    @writes
    def append_window_row(self, k: np.ndarray, v: np.ndarray, quantize) -> None:
        """One row ``[nkv, hd]`` float32 (in the basis it is stored in) on
        every head of a :meth:`window_rows` storage, the decode step of a q8
        layer: on each quantized side the window's oldest row leaves, is
        quantized by ``quantize(rows, None, group=...)`` (the backend's
        ``quantize_rows``) into its integer slot, and the new row joins the
        window. The bits :meth:`push_window`, :meth:`write_quantized`,
        :meth:`advance_window` and :meth:`append` store for it, in a handful
        of slice stores; the quantizing comes first, so nothing is written
        if it fails."""
        at, p = int(self.lens[0]), int(self.b8[0])
        sides = (("k", k, self.thk, KV_K_GROUP), ("v", v, self.thv, self.head_dim))
        codes = {side: quantize(th[:, 0].astype(np.float32), None, group=group)
                 for side, _, th, group in sides if th is not None}
        if at >= self.cap or self.seq_len >= self._imp.shape[0]:
            self.reserve(max(at, self.seq_len) + 1)
        for side, x, th, _ in sides:
            if th is None:
                getattr(self, side)[:, at] = x
                continue
            th[:, :-1] = th[:, 1:]
            th[:, -1] = x
            q, sc = codes[side]
            getattr(self, side + "q")[:, p] = q
            getattr(self, side + "s")[:, p] = sc if side == "k" else sc[:, 0]
        self.b8 += 1
        self.lens += 1
        self._imp[self.seq_len] = 0.0
        self.seq_len += 1
        self._touch()

    @writes
    def append_window_row_by(self, k: np.ndarray, v: np.ndarray, kernel) -> bool:
        """:meth:`append_window_row` in one backend call: ``kernel`` is the
        backend's :meth:`~kvreg.plugin.Backend.store_window_row`, which checks
        that this is a :meth:`window_rows` storage, writes the rows, counts
        and importance slot given here and returns False, having written
        nothing, to leave the row to the layer's other paths (not that state,
        a value it refuses, or no fused kernel). False too when the row needs
        more capacity."""
        if self.lens.item(0) >= self.cap or self.seq_len >= self._imp.shape[0]:
            return False
        if not kernel(k, v, rot_k=self.rot_k, rot_v=self.rot_v, thk=self.thk, thv=self.thv, kq=self.kq,
                      ks=self.ks, vq=self.vq, vs=self.vs, kf=self.k, vf=self.v, lens=self.lens, b8=self.b8,
                      imp=self._imp, seq=self.seq_len, exact_cap=self.exact_cap):
            return False
        self.seq_len += 1
        self._touch()
        return True

    def _row_steps(self) -> bool:
        return bool(self.window)

    def _row_step_room(self) -> bool:
        """The row's importance, and the window's integer slot (an F32, f16 or
        bf16 step checks its row's slot itself)."""
        return self.seq_len < self._imp.shape[0] and not (self.window and self.lens.item(0) >= self.cap)

    # ── the window ──

    @writes
    def push_window(self, side: str, heads: np.ndarray, x: np.ndarray) -> tuple[tuple, np.ndarray]:
        """``n`` new float32 rows per head (``[len(heads), n, hd]``) join
        side ``side``'s float16 window; returns ``((head, position) index
        arrays, float32 rows [m, hd])`` of the rows pushed out, oldest first,
        for the caller to quantize into the integer blocks. Call
        :meth:`advance_window` once both sides are pushed."""
        th, w, n = getattr(self, "th" + side), self.window, x.shape[1]
        fh = self.lens[heads] - self.b8[heads]
        if n == 1 and heads.size == th.shape[0] and (fh == w).all():
            # A decode step past the window (every head): its oldest row
            # leaves, the rest move down one, the new row goes last. The
            # same rows and float16 roundings as the general case below.
            leaving = th[:, 0].astype(np.float32)
            th[:, :-1] = th[:, 1:]
            th[:, -1] = x[:, 0]
            return (heads, self.b8[heads]), leaving
        if heads.size and (fh == fh[0]).all():
            f = np.concatenate([th[heads, : fh[0]], x.astype(np.float16)], axis=1)
            out = max(int(fh[0]) + n - w, 0)
            th[heads, : f.shape[1] - out] = f[:, out:]
            pos = self.b8[heads][:, None] + np.arange(out)
            return (np.repeat(heads, out), pos.ravel()), f[:, :out].reshape(-1, x.shape[2]).astype(np.float32)
        hs, ps, rows = [], [], []
        for i, h in enumerate(heads):
            f = np.concatenate([th[h, : fh[i]], x[i].astype(np.float16)])
            out = max(int(fh[i]) + n - w, 0)
            th[h, : f.shape[0] - out] = f[out:]
            hs.append(np.full(out, h))
            ps.append(self.b8[h] + np.arange(out))
            rows.append(f[:out].astype(np.float32))
        return (np.concatenate(hs), np.concatenate(ps)), np.concatenate(rows)

    @writes
    def write_quantized(self, side: str, where: tuple, q: np.ndarray, s: np.ndarray) -> None:
        """Integer rows (and their scales) of side ``side`` at ``where``, a
        ``(head, position)`` index pair (:meth:`push_window`)."""
        names = ("kq", "ks") if side == "k" else ("vq", "vs")
        getattr(self, names[0])[where] = q
        getattr(self, names[1])[where] = s if side == "k" else s[:, 0]

    @writes
    def advance_window(self, heads: np.ndarray, n: int) -> None:
        """The window bound after ``n`` rows joined ``heads`` (before the append counts them)."""
        fh = self.lens[heads] - self.b8[heads]
        self.b8[heads] += np.maximum(fh + n - self.window, 0)
        self._touch()

    # ── rows out ──

    def _cut(self, new_lens: np.ndarray) -> None:
        """Under a float16 window, zero the row slots ``[new_lens[h], lens[h])``
        a shrink leaves behind: a later row's integer slot stays zero until
        the row leaves the window (so equal layers export equal bytes)."""
        if not (self.window and self.cap):
            return
        for h in range(self.num_kv_heads):
            for name in self.block_names():
                getattr(self, name)[h, int(new_lens[h]):int(self.lens[h])] = 0

    def _after_cut(self) -> None:
        if not self.window:
            return
        # The newest rows go; older rows keep the form they reached.
        np.minimum(self.b8, self.lens, out=self.b8)
        self._zero_window_tails()

    def _zero_window_tails(self) -> None:
        """Zero the window's slots past their rows after a shrink, for the
        same reason."""
        for h in range(self.num_kv_heads):
            for t in (self.thk, self.thv):
                if t is not None:
                    t[h, int(self.lens[h] - self.b8[h]):] = 0

    def _drop_front_extra(self, d: int) -> None:
        for h in range(self.num_kv_heads):
            dh, xl = min(d, int(self.lens[h])), int(self.xlen[h])
            left = max(xl - dh, 0)
            for x in (self.xk, self.xv):
                if x is not None and left:
                    x[h, :left] = x[h, dh:xl].copy()
            self.xlen[h] = left
        if self.window:
            for h in range(self.num_kv_heads):
                self._drop_front_window(h, min(d, int(self.lens[h])))

    def _drop_front_window(self, h: int, d: int) -> None:
        """Head ``h`` loses its first ``d`` rows (the caller shifts the blocks)."""
        b8 = int(self.b8[h])
        d16 = min(max(d - b8, 0), int(self.lens[h]) - b8)  # float16 rows dropped
        if d16:
            for t in (self.thk, self.thv):
                if t is not None:
                    t[h, : int(self.lens[h]) - b8 - d16] = t[h, d16:int(self.lens[h]) - b8].copy()
        self.b8[h] = max(b8 - d, 0)

    def _gather_extra(self, kept: np.ndarray) -> None:
        for h in range(self.num_kv_heads):
            # kept is ascending, so the exact rows kept stay a prefix
            idx = kept[kept < int(self.xlen[h])]
            for x in (self.xk, self.xv):
                if x is not None and idx.size:
                    x[h, : idx.size] = x[h, idx]
            self.xlen[h] = idx.size
        if self.window:
            for h in range(self.num_kv_heads):
                self._gather_window(h, kept[kept < int(self.lens[h])])

    def _gather_window(self, h: int, kept: np.ndarray) -> None:
        """Head ``h`` keeps rows ``kept`` (ascending, below its length); the
        caller gathers the integer blocks by position."""
        b8 = int(self.b8[h])
        k16 = kept[kept >= b8] - b8
        for t in (self.thk, self.thv):
            if t is not None:
                t[h, : k16.size] = t[h, k16]
        self.b8[h] = int(np.count_nonzero(kept < b8))

    def _clear_extra(self) -> None:
        if self.window:
            self.b8[:] = 0
        self.kcol_set[:] = False
        self.vcol_set[:] = False
        self.kcol[:] = 1.0
        self.vcol[:] = 1.0
