"""`LayerKvCache`: one layer's KV cache with the seed's full surface.

Storage is head-major (:mod:`kvreg.storage`), attention runs on the layer's
backend (:mod:`kvreg.plugin`). Every public method validates its arguments
first and mutates only after: a refused call leaves the layer as it was.
"""

from __future__ import annotations

import copy
import functools
import inspect
import threading
import warnings

import numpy as np

from . import _validate as V
from .decode_step import DecodeStep
from .errors import SealError, ShapeError, StateError
from .lifecycle import Lifecycle
from .modes import KV_COL_WARMUP, KV_K_GROUP, Q8_EXACT_ROWS, KvMode
from .plugin import Backend
from .quant import HALF_OVERFLOW, from_half, to_half
from .registry import get_backend
from ._bounded_layer import BoundedMixin
from ._o1_layer import O1Mixin
from ._wire_layer import WireMixin
from .storage import LayerStorage
from .wire import WireKind


#: Channels per position (num_kv_heads × head_dim) a layer takes: far past
#: any model (8×128, 128×256), and small enough that its per-channel fields
#: allocate at once and every element count fits the wire's u32.
MAX_ROW = 2**24

#: The largest |value| a q8 layer stores: the 2f field is a float32 RMS over
#: the first KV_COL_WARMUP (64) rows, Σ x² of which stays finite (64·1e36 <
#: 3.4e38), and a row divided by the smallest field (1e-6) stays finite too.
Q8_ABS_MAX = 1e18


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


class LayerKvCache(WireMixin, BoundedMixin, O1Mixin):
    """KV cache of a single layer, head-major.

    ``num_kv_heads`` heads of ``head_dim`` channels. ``mode`` None reads
    ``KVREG_KV``; ``backend`` None reads ``KVREG_BACKEND``/``KVREG_DEVICE``
    (a name or a :class:`~kvreg.plugin.Backend` instance also work).
    ``q8_exact_rows``: under q8, the first rows of each head (the attention
    sinks) are also kept in float32 and attended exactly (see
    :mod:`kvreg.storage`); 0 gives the seed's storage exactly.
    """

    def __init__(self, num_kv_heads: int, head_dim: int, mode: KvMode | str | None = None,
                 backend=None, *, layer: int = 0, q8_exact_rows: int = Q8_EXACT_ROWS):
        # Serializes every public method and setter (docs/reliability.md).
        self._lock = threading.RLock()
        self.num_kv_heads = V.positive_int("num_kv_heads", num_kv_heads)
        self.head_dim = V.positive_int("head_dim", head_dim)
        self._default_scale = np.float32(1.0) / np.sqrt(np.float32(self.head_dim))
        if self.num_kv_heads * self.head_dim > MAX_ROW:
            raise ShapeError(f"num_kv_heads×head_dim = {self.num_kv_heads}×{self.head_dim} is past {MAX_ROW} "
                             "channels per position (2**24)")
        # A few sink rows per head, allocated up front: bounded like a row.
        self.q8_exact_rows = V.nonneg_int("q8_exact_rows", q8_exact_rows, hi=MAX_ROW)
        layer = V.integer("layer", layer, 0, 0xFFFF_FFFF)   # the wire header's u32
        mode = KvMode.from_env() if mode is None else KvMode.parse(mode)
        self.backend = get_backend(backend)
        self._st = self._new_storage(mode)
        self._seq_len = 0
        self._base = 0
        self._tail: int | None = None
        self._sinks: np.ndarray | None = None
        self._decode_memo: tuple | None = None   # _decode_args' last plain answer
        self._linear_state = np.zeros(0, dtype=np.float32)
        self._linear_scratch = np.zeros(0, dtype=np.float32)
        self._linear_wire_allowed = True
        self._kv_amax = [0.0, 0.0]
        self._kv_amax_rows = 0
        #: The rows of the last extend under a float16 window, float32 head-
        #: major, with the storage state they belong to: attend_chunk reads
        #: them instead of their stored form (see attend_chunk).
        self._fresh = None
        # Rows scanned per head: a head that was dead for earlier appends
        # lags behind the longest, and its new rows sit below that mark.
        self._kv_amax_head = np.zeros(self.num_kv_heads, dtype=np.int64)
        # The wire record this layer exchanges (v2 header fields).
        self.wire_kind = WireKind.Full
        self.wire_layer = layer
        self.wire_identity = 0
        self.bounded = None   # the bounded ring, once install_bounded ran
        self._init_o1()

    # ── plain state ──

    @property
    def lock(self):
        """The layer's re-entrant lock, which every public method and setter
        holds: hold it too to read several getters as one state from a
        thread that does not drive the layer (docs/reliability.md)."""
        return self._lock

    @property
    def lifecycle(self) -> Lifecycle:
        """Where this layer is in its life (:class:`kvreg.Lifecycle`): plain,
        collecting, sealed, bounded, or failed."""
        return self._lifecycle

    @property
    def storage(self) -> LayerStorage:
        """The row storage kernels read (treat as read-only)."""
        return self._st

    @property
    def mode(self) -> KvMode:
        return self._st.mode

    @mode.setter
    def mode(self, mode) -> None:
        mode = KvMode.parse(mode)
        if mode is self._st.mode:
            return
        if self._st.seq_len or self._st.lens.any():
            raise StateError(f"cannot change the KV mode of a layer holding {self._seq_len} rows; clear() it first")
        self._st = self._new_storage(mode)

    def _new_storage(self, mode: KvMode) -> LayerStorage:
        return LayerStorage(self.num_kv_heads, self.head_dim, mode, self.q8_exact_rows)

    @property
    def seq_len(self) -> int:
        """Rows stored (dead heads included). Row 0 is absolute position ``base``."""
        return self._seq_len

    @seq_len.setter
    def seq_len(self, value: int) -> None:
        # The seed's record-only layers (linear, bounded) set the depth directly.
        self._seq_len = V.position("seq_len", value)

    @property
    def base(self) -> int:
        """Absolute position of stored row 0 (only ``trim_window`` moves it)."""
        return self._base

    @property
    def pos_len(self) -> int:
        """Absolute context depth: the position the next append will hold."""
        return self._base + self._seq_len

    @property
    def generation(self) -> int:
        """Storage generation; with the row count, the key of a device copy."""
        return self._st.generation

    @property
    def tail_window(self) -> int | None:
        """The window this layer trims to, once ``trim_window`` ran on it."""
        return self._tail

    @property
    def default_scale(self) -> np.float32:
        """``1/√hd`` in float32 arithmetic (the seed's ``attend``): the score
        scale of every call given none."""
        return self._default_scale

    @property
    def imp(self) -> np.ndarray:
        """Accumulated attention mass per stored row (read-only view)."""
        v = self._st.imp
        v = v.view()
        v.flags.writeable = False
        return v

    @property
    def linear_state(self) -> np.ndarray:
        """Linear-core recurrent state (float32; empty on full layers). It
        travels on the wire always as f32."""
        return self._linear_state

    @linear_state.setter
    def linear_state(self, value) -> None:
        self._linear_state = V.float_vector("linear_state", value)

    @property
    def linear_scratch(self) -> np.ndarray:
        """Tentative recurrent state during speculative verify (float32)."""
        return self._linear_scratch

    @linear_scratch.setter
    def linear_scratch(self, value) -> None:
        self._linear_scratch = V.float_vector("linear_scratch", value)

    @property
    def sinks(self) -> np.ndarray | None:
        """Learned per-Q-head sink logits (weights: ``clear`` and imports keep them)."""
        return self._sinks

    @sinks.setter
    def sinks(self, value) -> None:
        self._sinks = None if value is None else V.float_vector("sinks", value)

    def head_len(self, kv_head: int) -> int:
        """Rows actually stored for a head (0 for a dead head)."""
        return int(self._st.lens[V.index("kv_head", kv_head, self.num_kv_heads)])

    def head_keys(self, kv_head: int) -> np.ndarray:
        """f32 keys of a head, ``[rows, hd]`` read-only (empty when K is int8).

        Under f32 a view, not a copy: valid until the next mutation of the
        layer; under f16/bf16 the rows widened to float32 (a copy).
        """
        return self._head_view(self._st.k, kv_head)

    def head_values(self, kv_head: int) -> np.ndarray:
        """f32 values of a head, ``[rows, hd]`` read-only (empty when V is int8; as :meth:`head_keys`)."""
        return self._head_view(self._st.v, kv_head)

    def _head_view(self, block, kv_head):
        kv_head = V.index("kv_head", kv_head, self.num_kv_heads)
        if block is None:
            return np.zeros((0, self.head_dim), dtype=np.float32)
        v = from_half(block[kv_head, : self._st.lens[kv_head]]).view()
        v.flags.writeable = False
        return v

    def memory_bytes(self) -> int:
        """Bytes of stored state, counted as the seed counts (elements held)."""
        return (self._st.stored_bytes() + self.linear_state.size * 4
                + self.o1_memory_bytes() + self.bounded_state_bytes())

    def shared_bytes(self) -> int:
        """Of :meth:`memory_bytes`, the stored rows this layer shares with a
        live fork (held once for all of them; 0 when it holds its own)."""
        return self._st.shared_block_bytes()

    def reserved_bytes(self) -> int:
        """Bytes of capacity the row storage holds (stored rows + room to grow)."""
        return self._st.reserved_bytes()

    # ── copies ──

    def fork(self) -> "LayerKvCache":
        """A new sequence holding this one's rows, copy-on-write: rows are
        held once, and a write of either side (append, truncate, a trim,
        eviction, the seal, clear, an import) copies only what it touches
        (the pages of a large layer's snapshot, a small layer's arrays), so
        the other keeps its bits (:meth:`LayerStorage.fork
        <kvreg.storage.LayerStorage.fork>`, docs/serving.md). Everything else
        (lengths, importance, sinks, the seal's state, a bounded ring) is the
        fork's own. It answers as a deep copy does, bit for bit."""
        return self._copy({}, share=True)

    def __deepcopy__(self, memo) -> "LayerKvCache":
        # The backend (compiled programs, device contexts) is shared, the lock is new.
        return self._copy(memo, share=False)

    def _copy(self, memo: dict, *, share: bool) -> "LayerKvCache":
        with self._lock:
            st = self._st.fork() if share else self._st.copy()
            new = object.__new__(type(self))
            memo.update({id(self): new, id(self.backend): self.backend, id(self._st): st,
                         id(self._lock): threading.RLock()})
            for name, val in vars(self).items():
                setattr(new, name, copy.deepcopy(val, memo))
            return new

    def set_linear_wire_allowed(self, allowed: bool) -> None:
        """Bind this layer to the legacy-wire policy (delta layers refuse it)."""
        self._linear_wire_allowed = V.flag("allowed", allowed)

    def discard_linear_scratch(self) -> None:
        self.linear_scratch = np.zeros(0, dtype=np.float32)

    # ── append ──

    def append(self, k, v, alive=None) -> None:
        """Append one position: ``k``, ``v`` are ``num_kv_heads*head_dim`` floats
        (flat or ``[nkv, hd]``); heads with ``alive[h] == False`` store nothing.

        Under q8 the 2f field freezes at the START of the append that finds
        ``seq_len >= 64`` and no field yet (the seed's rule: only rows that
        survived a rollback are in it). A q8 layer refuses non-finite rows:
        one inf would make its group's scale inf and every dequantized value
        of the row NaN, poisoning the head silently; and rows with |x| > 1e18
        (``Q8_ABS_MAX``), whose squares would make the field inf.
        """
        nkv, hd = self.num_kv_heads, self.head_dim
        self._append(V.rows("k", k, nkv, hd), V.rows("v", v, nkv, hd), alive)

    def _append(self, k: np.ndarray, v: np.ndarray, alive) -> None:
        nkv = self.num_kv_heads
        st = self._st
        if alive is None and self._lifecycle is Lifecycle.PLAIN and self._base + self._seq_len < V.MAX_POSITION:
            # The decode hot paths (every head alive and level): what _extend
            # does for one such row, without its general machinery.
            if st.plain_rows():     # F32/f16/bf16
                if st._half:
                    self._check_half(k, v)
                self._fresh = None
                st.append_row(k, v)
                self._seq_len += 1
                return
            # q8/q8k/q8v past the window's first fill: the backend's one call
            # (it checks that state itself), else the general window path
            stored = bool(st.window) and st.append_window_row_by(k, v, self.backend.store_window_row)
            if not stored and st.window_rows():
                self._check_quantized(k, v)
                st.append_window_row(*self._stored_basis(k, v), self.backend.quantize_rows)
                stored = True
            if stored:
                self._fresh = None
                self._seq_len += 1
                return
        alive = V.alive_mask(alive, nkv)
        if alive.all() and self._o1_auto_append(k, v):
            return
        self._extend(k[None], v[None], alive)

    def extend(self, k, v, alive=None, *, layout: str | None = None) -> None:
        """Append ``n`` positions at once (a prefill chunk). ``k``, ``v``: numpy
        arrays or torch tensors (a contiguous CPU float32 tensor is read in
        place), token-major ``[n, num_kv_heads, head_dim]`` (or ``[n,
        nkv*hd]``; ``layout="nhd"``) or head-major ``[nkv, n, hd]``
        (``"hnd"``, the storage's own layout: no copy before the store) or
        ``[1, nkv, n, hd]`` (``"bhnd"``, transformers' key/value states).
        ``layout`` None reads the shape and refuses one that fits both
        (``n == nkv``). The storage ends bit for bit as after ``n`` calls of
        :meth:`append` (the q8 field freezes at the same row), in one copy
        per head."""
        nkv, hd = self.num_kv_heads, self.head_dim
        layout = V.kv_layout(k, v, nkv, layout)
        k = V.float_block("k", k, nkv, hd, layout)
        v = V.float_block("v", v, nkv, hd, layout)
        if k.shape[0] != v.shape[0]:
            raise ShapeError(f"k has {k.shape[0]} rows and v {v.shape[0]}; expected the same count")
        self._extend(k, v, V.alive_mask(alive, nkv))

    def _extend(self, k: np.ndarray, v: np.ndarray, alive: np.ndarray) -> None:
        state = self._lifecycle
        if state is Lifecycle.FAILED:
            raise SealError(f"append refused: the O(1) seal of this layer failed ({self._o1.error}); clear() it first")
        if state is Lifecycle.BOUNDED:
            raise StateError("append on a bounded-anchor layer: use bounded_step (it stores nothing per position)")
        if state is Lifecycle.SEALED:
            raise StateError("extend on a sealed O(1) layer: it takes one position at a time, through o1_step "
                             "(or append + attend_layer when it seals itself: o1_begin(..., auto=True))")
        if self.pos_len + k.shape[0] > V.MAX_POSITION:
            raise ShapeError(f"append past absolute position 2**53 (the layer is at {self.pos_len}): "
                             "float64 does not resolve positions beyond it")
        st = self._st
        mode = st.mode
        heads = np.flatnonzero(alive)
        if mode.quantized:
            every = heads.size == self.num_kv_heads
            self._check_quantized(k if every else k[:, heads], v if every else v[:, heads])
        self._fresh = None
        if mode.tiered:
            self._store_tiered(k, v, heads)
            self._remember_fresh(k, v, heads)
            return
        if mode.half:
            self._check_half(k[:, heads], v[:, heads])
        n, done = k.shape[0], 0
        while done < n:
            seg = n - done
            if mode.field and not st.field_frozen():
                if self._seq_len >= KV_COL_WARMUP:
                    self._freeze_field()
                if not st.field_frozen():
                    # Rows up to the freeze point go in unquantized-field; the
                    # append that reaches it freezes first.
                    seg = min(seg, max(KV_COL_WARMUP - self._seq_len, 1))
            self._store(k[done:done + seg], v[done:done + seg], heads)
            done += seg
        self._remember_fresh(k, v, heads)

    def _check_quantized(self, k: np.ndarray, v: np.ndarray) -> None:
        """Refuse rows a quantized side cannot store: one comparison refuses
        NaN (it compares false) as well as inf and values so large that the
        field's float32 RMS would overflow."""
        mode = self._st.mode
        for name, x, q in (("k", k, mode.quant_k), ("v", v, mode.quant_v)):
            if q and not (np.abs(x) <= Q8_ABS_MAX).all():
                what = "inf/NaN values" if not np.isfinite(x).all() else f"values beyond ±{Q8_ABS_MAX:.0e}"
                raise ShapeError(f"{name} has {what}: a {mode.value} layer stores finite rows with |x| <= "
                                 f"{Q8_ABS_MAX:.0e} only (its 2f field, a float32 RMS over the first "
                                 f"{KV_COL_WARMUP} rows, would overflow to inf)")

    def _check_half(self, k: np.ndarray, v: np.ndarray) -> None:
        """Refuse finite values an f16/bf16 store would round to inf (inf and
        NaN are stored as they are: IEEE, as under f32)."""
        mode = self._st.mode
        lim = HALF_OVERFLOW[mode.value]
        for name, x in (("k", k), ("v", v)):
            xa = np.abs(x)
            if ((xa >= lim) & np.isfinite(xa)).any():
                raise ShapeError(f"{name} has finite values of magnitude >= {float(lim):.6g}, which "
                                 f"{mode.value} storage would round to inf: use f32 (or bf16) storage")

    def _remember_fresh(self, k: np.ndarray, v: np.ndarray, heads: np.ndarray) -> None:
        """Keep a chunk's float32 rows for the attend_chunk that follows it
        (windowed modes, every head alive and level; a copy, dropped at the
        next append)."""
        st = self._st
        if st.window and k.shape[0] > 1 and heads.size == self.num_kv_heads and (st.lens == st.lens[0]).all():
            self._fresh = (st.version, int(st.lens[0]),
                           np.ascontiguousarray(k.transpose(1, 0, 2)), np.ascontiguousarray(v.transpose(1, 0, 2)))

    def _store(self, k: np.ndarray, v: np.ndarray, heads: np.ndarray) -> None:
        """Write rows ``[n, nkv, hd]`` of the alive ``heads`` (quantized per mode)."""
        st = self._st
        mode, hd, n = st.mode, self.head_dim, k.shape[0]
        rows = {}
        exact = {}
        t = st.exact_rows_wanted(heads, n)
        if heads.size:
            # Head-major [n_alive, n, hd] (a view when every head is alive).
            every = heads.size == self.num_kv_heads
            kh = (k if every else k[:, heads]).transpose(1, 0, 2)
            vh = (v if every else v[:, heads]).transpose(1, 0, 2)
            if st.window:
                # q8: the rows join the float16 window; those it pushes out are
                # quantized from their float16 value (one call per side, every head).
                kh, vh = self._stored_basis(kh, vh)
                if t:
                    exact = {n_: x[:, :t] for n_, x, q in (("xk", kh, mode.quant_k), ("xv", vh, mode.quant_v)) if q}
                st.reserve(int(st.lens[heads].max()) + n)
                for side, x, group in (("k", kh, KV_K_GROUP), ("v", vh, hd)):
                    if getattr(st, "th" + side) is None:
                        rows[side] = x
                        continue
                    where, leaving = st.push_window(side, heads, x)
                    if leaving.shape[0]:
                        q, sc = self.backend.quantize_rows(leaving, None, group=group)
                        st.write_quantized(side, where, q, sc)
                st.advance_window(heads, n)
                st.append(rows, heads, n, exact)
                self._seq_len += n
                return
            if mode.quant_k:
                col = _field_rows(st.kcol, st.kcol_set, heads, n)
                kq, ks = self.backend.quantize_rows(np.ascontiguousarray(kh).reshape(-1, hd), col, group=KV_K_GROUP)
                rows["kq"], rows["ks"] = kq.reshape(heads.size, n, hd), ks.reshape(heads.size, n, -1)
                if t:
                    exact["xk"] = _field_space(kh[:, :t], st.kcol, st.kcol_set, heads)
            elif mode.half:
                rows["k"] = to_half(kh, mode.float_dtype)
            else:
                rows["k"] = kh
            if mode.quant_v:
                col = _field_rows(st.vcol, st.vcol_set, heads, n)
                vq, vs = self.backend.quantize_rows(np.ascontiguousarray(vh).reshape(-1, hd), col, group=hd)
                rows["vq"], rows["vs"] = vq.reshape(heads.size, n, hd), vs.reshape(heads.size, n)
                if t:
                    exact["xv"] = _field_space(vh[:, :t], st.vcol, st.vcol_set, heads)
            elif mode.half:
                rows["v"] = to_half(vh, mode.float_dtype)
            else:
                rows["v"] = vh
        st.append(rows, heads, n, exact)
        self._seq_len += n

    def _store_tiered(self, k: np.ndarray, v: np.ndarray, heads: np.ndarray) -> None:
        """q4: rotate the rows of the alive ``heads``, check them, tier them in."""
        st, n = self._st, k.shape[0]
        every = heads.size == self.num_kv_heads
        rk = self._basis(st.rot_k, (k if every else k[:, heads]).transpose(1, 0, 2))
        rv = self._basis(st.rot_v, (v if every else v[:, heads]).transpose(1, 0, 2))
        for name, r in (("k", rk), ("v", rv)):
            # The newest rows are float16 (the scales too): a rotated value
            # past its range would be stored as inf.
            if not (np.abs(r) < HALF_OVERFLOW["f16"]).all():
                raise ShapeError(f"{name} has values whose Walsh-Hadamard rotation exceeds float16's range "
                                 f"(|x| >= {float(HALF_OVERFLOW['f16']):.6g}), which q4 stores in float16: "
                                 "use f32 or bf16 storage")
        t = st.exact_rows_wanted(heads, n)
        st.append_tiered(rk, rv, heads, n)
        st.append({}, heads, n, {"xk": rk[:, :t], "xv": rv[:, :t]} if t else None)
        self._seq_len += n

    def _freeze_field(self) -> None:
        """Freeze the 2f field: col = RMS per channel over the stored
        (dequantized) rows; every stored row is requantized against it, and
        the exact rows move into field space (divided by it)."""
        self._st.freeze(self.backend.freeze_field)

    # ── attention ──

    def attend(self, q, kv_head: int):
        """Per-head attention over the whole stored row with scale 1/√hd.

        Returns ``(out [hd], probs [rows])``; bit-for-bit the grouped kernel.
        """
        kv_head = V.index("kv_head", kv_head, self.num_kv_heads)
        qv = V.rows("q", q, 1, self.head_dim)
        n = int(self._st.lens[kv_head])
        probs = np.zeros(n, dtype=np.float32)
        out = self._rotated_attend(self.backend.attend_group, qv, self._st, kv_head, scale=self.default_scale,
                                   first=0, upto=None, softcap=0.0, sinks=None, imp=probs)
        return out[0], probs

    def _stored_basis(self, k: np.ndarray, v: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """K and V rows in the basis the storage keeps them in (:meth:`_basis`
        per side; one transform of both when both rotate: row by row, the
        same bits)."""
        st = self._st
        if st.rot_k and st.rot_v:
            k, v = self.backend.rotate_rows(np.stack((k, v)))
            return k, v
        return self._basis(st.rot_k, k), self._basis(st.rot_v, v)

    def _basis(self, rotated: bool, x: np.ndarray) -> np.ndarray:
        """Rows into (or, the transform being its own inverse, out of) the
        Walsh-Hadamard basis when ``rotated`` (the backend's ``rotate_rows``);
        else float32 as they are."""
        return self.backend.rotate_rows(x) if rotated else np.asarray(x, dtype=np.float32)

    def _rotated_attend(self, kernel, q, st, *args, **kwargs) -> np.ndarray:
        """``kernel(q, st, ...)``, in the rotated basis where the rows are (the
        quantized sides of q8, q8k, q8v and q4): ``⟨Hq, Hk⟩ = ⟨q, k⟩`` and
        ``H Σ p Hv = Σ p v`` (H is its own inverse)."""
        rotate = self.backend.rotate_rows
        out = kernel(rotate(q) if st.rot_k else q, st.view(), *args, **kwargs)
        return rotate(out) if st.rot_v else out

    def attend_group(self, q_group, kv_head: int, *, scale: float, first: int = 0, softcap: float = 0.0,
                     sinks=None, upto: int | None = None, imp_acc: np.ndarray | None = None) -> np.ndarray:
        """All Q heads of one KV group in one pass (``[nheads, hd]`` or flat).

        Scores rows ``[first, stored)`` only (``stored = min(head_len, upto)``);
        ``softcap > 0`` applies ``c·tanh(s/c)``; ``sinks`` (one logit per head
        of this group) join the max and the denominator; ``imp_acc`` (float32,
        writable) accumulates ``Σ_h probs``. Returns ``[nheads, hd]``.
        """
        kv_head = V.index("kv_head", kv_head, self.num_kv_heads)
        q = V.heads("q_group", q_group, self.head_dim)
        stored = int(self._st.lens[kv_head])
        if upto is not None:
            # Past the stored rows `upto` means them all: clamped here, so no
            # kernel sees a count its integer type cannot hold.
            upto = min(V.nonneg_int("upto", upto), stored)
        n = stored if upto is None else upto
        first = V.nonneg_int("first", first)
        if n and first >= n:
            raise ShapeError(f"first={first} must be < the {n} visible rows of kv_head {kv_head}")
        sinks = V.sinks(sinks, q.shape[0])
        imp = V.imp_acc(imp_acc)
        return self._rotated_attend(self.backend.attend_group, q, self._st, kv_head, scale=V.scale(scale),
                                    first=first, upto=upto, softcap=V.softcap(softcap), sinks=sinks, imp=imp)

    def attend_group_upto(self, q_group, kv_head: int, *, upto: int, **kwargs) -> np.ndarray:
        """``attend_group`` over the first ``upto`` rows only: bit-identical to the
        call made when the layer held exactly ``upto`` rows."""
        return self.attend_group(q_group, kv_head, upto=upto, **kwargs)

    def attend_layer(self, q_all, *, scale: float | None = None, window: int | None = None, softcap: float = 0.0,
                     sinks="layer", importance: bool = True) -> np.ndarray:
        """Decode attention of every KV group in one call: ``q_all`` is
        ``[num_heads, hd]`` (or flat), Q head ``h`` reads group ``h // hpk``.

        ``window`` bounds each group to its newest rows; ``sinks`` defaults to
        the layer's learned sinks (None disables); ``importance`` accumulates
        the probabilities into the layer's importance (what Born eviction
        reads). Returns ``[num_heads, hd]``; equals ``attend_group`` per group.
        :func:`kvreg.attend_batch` is this call for many sequences at once.
        """
        q = V.heads("q_all", q_all, self.head_dim)
        return self._attend_layer(q, self._decode_args(q.shape[0], scale, window, softcap, sinks, importance))

    def _attend_layer(self, q: np.ndarray, args: dict) -> np.ndarray:
        life = self._lifecycle
        if life is Lifecycle.SEALED:
            return self._o1_auto_attend(q)
        st = self._st
        if st.rot_k or st.rot_v:
            out = self._rotated_attend(self.backend.attend_layer, q, st, **args)
        else:
            out = self.backend.attend_layer(q, st.view(), **args)
        if life is Lifecycle.COLLECTING:
            self._o1_record(q)
        return out

    def append_attend(self, k, v, q_all, *, scale: float | None = None, window: int | None = None,
                      softcap: float = 0.0, sinks="layer", importance: bool = True,
                      out: np.ndarray | None = None) -> np.ndarray:
        """A decode step: :meth:`append` of one position (``k``, ``v``), then
        :meth:`attend_layer` of ``q_all`` over the rows with it; the same
        answer and the same state as those two calls, bit for bit. The
        query, the rows and the attention's arguments are all checked before
        the row is stored: a refused call stores nothing.

        Where the backend has a fused kernel
        (:meth:`~kvreg.plugin.Backend.append_attend_layer`; numba: F32, f16
        and bf16 rows, and q8 rows where the decode runs on one thread) the
        row is written and attended in one launch, which saves the two
        calls' Python and NumPy work (each call costs µs inside a model,
        whose matmuls evict the interpreter's working set between layers).
        ``out``: a C-contiguous float32 ``[num_heads, hd]`` array the answer
        is written to and returned (a host's own buffer: no allocation)."""
        nkv, hd = self.num_kv_heads, self.head_dim
        q = V.heads("q_all", q_all, hd)
        k = V.rows("k", k, nkv, hd)
        v = V.rows("v", v, nkv, hd)
        args = self._decode_args(q.shape[0], scale, window, softcap, sinks, importance)
        if out is not None:
            V.out_block("out", out, q.shape)
        # a backend without the fused hook (the reference, OpenCL) goes straight to the two calls
        if self._lifecycle is Lifecycle.PLAIN and self._base + self._seq_len < V.MAX_POSITION and \
                type(self.backend).append_attend_layer is not Backend.append_attend_layer:
            got = self._st.append_row_attend_by(k, v, self.backend, q=q, scale=args["scale"], window=args["window"],
                                                softcap=args["softcap"], sinks=args["sinks"],
                                                importance=args["imp"] is not None, out=out)
            if got is not None:
                self._fresh = None
                self._seq_len += 1
                return got
        self._append(k, v, None)
        # asked again: the append may have grown the capacity a window is
        # clamped to, or sealed the layer
        got = self._attend_layer(q, self._decode_args(q.shape[0], scale, window, softcap, sinks, importance))
        if out is None:
            return got
        out[...] = got
        return out

    def decode_step(self, num_heads: int, *, scale: float | None = None, window: int | None = None,
                    softcap: float = 0.0, sinks="layer", importance: bool = True,
                    out: np.ndarray | None = None) -> DecodeStep:
        """:meth:`append_attend` with these arguments, prepared for a run of
        decode steps: a :class:`~kvreg.DecodeStep`, ``step(k, v, q)`` with
        ``q`` ``[num_heads, hd]``, the answer in ``step.out`` (``out``, or a
        buffer of its own). Bit for bit the calls it stands for; it saves
        their per-call checks and launch set-up while nothing else changes
        the layer (a model's decode loop: one step per layer). The arguments
        are checked here (and again where the layer changed)."""
        nh = V.positive_int("num_heads", num_heads)
        self._decode_args(nh, scale, window, softcap, sinks, importance)
        shape = (nh, self.head_dim)
        out = np.empty(shape, np.float32) if out is None else V.out_block("out", out, shape)
        return DecodeStep(self, nh, dict(scale=scale, window=window, softcap=softcap, sinks=sinks,
                                         importance=importance), out)

    def _decode_args(self, nh: int, scale, window, softcap, sinks, importance) -> dict:
        """``attend_layer``'s arguments checked and resolved for the kernel
        (``scale``, ``window``, ``softcap``, ``sinks``, ``imp``); refuses what
        a sealed layer cannot take. Changes nothing.

        A decode step asks the same as the last one (inside a model each
        validation call is paid with the caches cold: ~19 µs for these, ~2
        for the lookup): answered from a memo of the last plain answer,
        keyed on everything it reads (the sinks by identity)."""
        # plain: Python scalars and flags (an array would make the key's
        # comparison ambiguous before the validation could name it)
        plain = (importance is False or importance is True) and (sinks is None or type(sinks) is str) \
            and (scale is None or type(scale) is float) and (window is None or type(window) is int) \
            and type(softcap) is float
        if plain:
            key = (nh, scale, window, softcap, sinks, importance, self._st.cap, self._lifecycle)
            memo = self._decode_memo
            if memo is not None and memo[1] is self._sinks and memo[0] == key:
                # importance: the rows' current view (it grows with them)
                return dict(memo[2], imp=self._st.imp) if importance else memo[2]
        if nh % self.num_kv_heads:
            raise ShapeError(f"q_all has {nh} heads, not a multiple of num_kv_heads={self.num_kv_heads}")
        if window is not None:
            # A window past every stored row reads them all, as None does:
            # clamped so no kernel sees a count its integer type cannot hold
            # (to the capacity, which bounds every head's rows: no reduction
            # over the counts on every decode call).
            window = min(V.positive_int("window", window), max(self._st.cap, 1))
        sinks = V.sinks(self._sinks if isinstance(sinks, str) and sinks == "layer" else sinks, nh)
        scale = self.default_scale if scale is None else V.scale(scale)
        imp = self._st.imp if V.flag("importance", importance) else None
        softcap = V.softcap(softcap)
        if self._lifecycle is Lifecycle.SEALED and (window is not None or sinks is not None or softcap):
            raise StateError("attend_layer on a sealed layer reads its sinks, window and far field: "
                             "window, learned sinks and softcap do not apply (importance has no rows)")
        args = dict(scale=scale, window=window, softcap=softcap, sinks=sinks, imp=None)
        if plain:
            self._decode_memo = (key, self._sinks, args)
        return dict(args, imp=imp) if imp is not None else args

    def attend_chunk(self, q_all, b: int, s0: int, heads_per_kv: int, *, scale: float | None = None,
                     window: int | None = None, importance: bool = True) -> np.ndarray:
        """Batched causal attention for a prefill chunk already appended.

        ``q_all``: ``[b, num_heads, hd]`` (or flat); the layer holds ``s0 + b``
        rows; row ``i`` sees rows ``[s0+i+1-window, s0+i+1)``. Importance gets
        the masked column sums (``importance=False``: left as it is, and the
        sums are not computed). Summation order differs from the per-row path
        (tolerance class). On a q8 layer the key/value range the chunk reads
        is dequantized once per call (the field and scales applied) and the
        same kernel runs on it. Under a float16 window (q8, q8k, q8v, q4), the
        rows of the extend that appended the chunk, when nothing changed the
        layer since, are read as that extend received them (float32): the
        chunk's rows are all the newest, which the window keeps near-exact.
        Returns ``[b, num_heads, hd]``.
        """
        b = V.positive_int("b", b)
        s0 = V.nonneg_int("s0", s0)
        heads_per_kv = V.positive_int("heads_per_kv", heads_per_kv)
        n = s0 + b
        lens = self._st.lens
        if not (lens == n).all():
            raise ShapeError(f"attend_chunk needs every KV head to hold s0+b={n} rows; heads hold {lens.tolist()}")
        nh = self.num_kv_heads * heads_per_kv
        q = V.array("q_all", q_all, (b, nh, self.head_dim))
        if window is not None:
            # A window past every row reads them all: clamped (as attend_layer).
            window = min(V.positive_int("window", window), n)
        scale = self.default_scale if scale is None else V.scale(scale)
        imp = self._st.imp if V.flag("importance", importance) else None
        native_q8 = self.mode.quantized and not self._st.window and self.backend.native_q8_chunk
        if self.mode is KvMode.F32 or native_q8:
            out = self.backend.attend_chunk(q, self._st.view(), s0=s0, b=b, hpk=heads_per_kv, scale=scale,
                                            window=window, imp=imp)
            self._o1_record(q)
            return out
        # q8, q4, f16, bf16: widen only the key range the chunk reads, once per call; the
        # kernel's masks are relative to its first row, so it sees the same rows.
        lo = min(max(0, s0 + 1 - window), n) if window else 0
        f = self._fresh
        # The chunk's own rows as it handed them over (vLLM's prefill, too,
        # attends the fresh K/V and quantizes them for the cache): under a
        # float16 window the newest rows are near-exact, and a prefill
        # chunk's rows are all the newest. Rows [a, n) are those; only the
        # older rows [lo, a) are widened.
        fresh = f is not None and (f[0], f[1]) == (self._st.version, n)
        a = max(lo, n - f[2].shape[1]) if fresh else n
        off = a - (n - f[2].shape[1]) if fresh else 0   # row a in the fresh block
        if fresh and a == lo:
            k = np.ascontiguousarray(f[2][:, off:])   # no copy when it is all of them
            v = np.ascontiguousarray(f[3][:, off:])
        else:
            k, v = self._widened_rows(lo, n, a)
            if fresh:
                k[:, a - lo:] = f[2][:, off:]
                v[:, a - lo:] = f[3][:, off:]
        view = LayerStorage.of_rows(k, v).view()
        out = self.backend.attend_chunk(q, view, s0=s0 - lo, b=b, hpk=heads_per_kv, scale=scale, window=window,
                                        imp=None if imp is None else imp[lo:])
        self._o1_record(q)
        return out

    def _widened_rows(self, lo: int, n: int, upto: int | None = None) -> tuple[np.ndarray, np.ndarray]:
        """Float32 ``[nkv, n-lo, hd]`` K and V blocks for this layer's rows
        ``[lo, n)``, rows ``[lo, upto)`` filled (dequantized, widened,
        un-rotated; ``upto`` None = ``n``), the rest left to the caller."""
        upto = n if upto is None else upto
        src = self._st.view()
        shape = (self.num_kv_heads, n - lo, self.head_dim)
        k, v = np.empty(shape, np.float32), np.empty(shape, np.float32)
        for h in range(self.num_kv_heads):
            k[h, :upto - lo] = self._basis(src.rot_k, src.attended_rows("k", h, lo, upto))
            v[h, :upto - lo] = self._basis(src.rot_v, src.attended_rows("v", h, lo, upto))
        return k, v

    def accumulate_imp(self, probs) -> None:
        """Add attention mass per stored row (the shorter length wins, as a zip)."""
        p = V.float_vector("probs", probs)
        imp = self._st.imp
        m = min(imp.shape[0], p.shape[0])
        imp[:m] += p[:m]

    # ── rollback, trims, eviction ──

    def truncate_last(self, n_drop: int) -> None:
        """Roll back the last ``n_drop`` positions (speculative-decode reject)."""
        n_drop = V.nonneg_int("n_drop", n_drop)
        self.discard_linear_scratch()
        d = min(n_drop, self._seq_len)
        if self.bounded is not None:
            rolled = self.bounded.rollback(d)
            if rolled < d:
                warnings.warn(f"bounded anchor: rollback of {d} exceeds the undo depth ({rolled} restored)",
                              stacklevel=2)
            self._seq_len = self.bounded.seen
            return
        if self._tail is not None and self._base > 0 and self._seq_len - d < self._tail - 1:
            warnings.warn(f"sliding tail: rollback of {d} leaves {self._seq_len - d} rows under the "
                          f"{self._tail}-row window", stacklevel=2)
        st = self._st
        live = st.lens > 0
        if live.any():
            self._kv_rows_changed(int((st.lens[live] - d).clip(min=0).min()))
        st.truncate(d)
        self._seq_len -= d

    def trim_window(self, w: int, slack: int, align: int) -> int:
        """Drop the rows a sliding-window layer can never read again (see
        ``trim_window_anchored``). Returns the rows dropped."""
        return self.trim_window_anchored(w, slack, align, None)

    def trim_window_anchored(self, w: int, slack: int, align: int, anchor: int | None) -> int:
        """Once more than ``2w`` rows are stored, drain the front down to
        ``w + slack`` rows, the cut rounded DOWN to a multiple of ``align``
        and never past ``anchor - w - slack`` (None = no anchor). The rows
        that stay keep their order and values, so every windowed attend
        answers bit for bit as untrimmed. No-op on an O(1) or bounded layer,
        and on a q8 layer whose field is not frozen yet (the freeze reads
        every stored row). Returns the rows dropped.
        """
        w = V.nonneg_int("w", w)
        slack = V.nonneg_int("slack", slack)
        align = V.nonneg_int("align", align)
        if anchor is not None:
            anchor = V.position("anchor", anchor)
        if self._lifecycle is not Lifecycle.PLAIN or w == 0:
            return 0
        self._tail = w
        if self._seq_len <= 2 * w:
            return 0
        if self.mode.field and not self._st.field_frozen():
            return 0
        align = max(align, 1)
        keep_from = max(self.pos_len - (w + slack), 0)
        if anchor is not None:
            keep_from = min(keep_from, max(anchor - (w + slack), 0))
        new_base = keep_from // align * align
        if new_base <= self._base:
            return 0
        d = new_base - self._base
        self._st.drop_front(d)
        self._base = new_base
        self._seq_len -= d
        # The scanned mark moves with the rows: left in place, rows appended
        # after the trim up to the old mark would never be scanned.
        self._kv_amax_rows = max(self._kv_amax_rows - d, 0)
        self._kv_amax_head = np.maximum(self._kv_amax_head - d, 0)
        return d

    def _evict_bypassed(self) -> bool:
        # An O(1) layer (collecting: still-needed exact prefix; sealed: its
        # state IS the eviction), a bounded ring and a sliding tail each bound
        # themselves; ordinary eviction leaves them alone.
        return self._lifecycle is not Lifecycle.PLAIN or self._tail is not None

    def evict(self, keep_last: int) -> None:
        """Drop the oldest positions, keeping the last ``keep_last``."""
        keep_last = V.nonneg_int("keep_last", keep_last)
        if self._evict_bypassed() or self._seq_len <= keep_last:
            return
        drop = self._seq_len - keep_last
        self._st.drop_front(drop)
        self._kv_rows_changed(0)
        self._seq_len = keep_last

    def evict_born(self, keep_last: int, sink: int, recent: int) -> None:
        """Mass-based eviction: keep the ``sink`` earliest rows, the ``recent``
        latest, and fill the rest of ``keep_last`` with the rows of highest
        accumulated attention mass (ties: the earlier row; NaN mass ranks last).
        """
        keep_last = V.nonneg_int("keep_last", keep_last)
        sink = V.nonneg_int("sink", sink)
        recent = V.nonneg_int("recent", recent)
        if self._evict_bypassed():
            return
        imp = self._st.imp
        stored = imp.shape[0]
        if stored <= keep_last:
            return
        sink_n = min(sink, keep_last)
        recent_n = min(recent, keep_last - sink_n)
        keep = np.zeros(stored, dtype=bool)
        keep[:sink_n] = True
        if recent_n:
            keep[stored - recent_n:] = True
        budget = keep_last - int(keep.sum())
        if budget > 0:
            rest = np.flatnonzero(~keep)
            mass = np.nan_to_num(imp[rest].astype(np.float64), nan=-np.inf)
            order = rest[np.argsort(-mass, kind="stable")]
            keep[order[:budget]] = True
        kept = np.flatnonzero(keep)
        self._st.gather(kept, self.backend.gather_rows)
        self._kv_rows_changed(0)
        self._seq_len = int(kept.size)

    def clear(self) -> None:
        """Forget the conversation. Learned sinks, the tail window and the
        bounded ring's size are the layer's, not the conversation's: kept."""
        self._kv_rows_changed(0)
        self._st.clear()
        self.linear_state = np.zeros(0, dtype=np.float32)
        self.discard_linear_scratch()
        self._init_o1()
        if self.bounded is not None:
            self.bounded.clear()
        self._seq_len = 0
        self._base = 0

    # ── kv_abs_max ──

    def _kv_rows(self) -> int:
        st = self._st
        if st.k is None and st.v is None:
            return 0
        return int(st.lens.max())

    def _kv_rows_changed(self, first: int) -> None:
        self._kv_amax_rows = min(self._kv_amax_rows, first)

    def kv_abs_max(self) -> tuple[float, float]:
        """(max |k|, max |v|) over the f32 K and V rows, +inf once one is inf or
        NaN. Lazy: scans only rows appended since the last call."""
        st = self._st
        rows = self._kv_rows()
        if rows < self._kv_amax_rows:
            self._kv_amax_rows = 0
        if self._kv_amax_rows == 0:
            self._kv_amax = [0.0, 0.0]
            self._kv_amax_head[:] = 0
        # A lowered mark (truncation, clear) applies to every head.
        frm = np.minimum(self._kv_amax_head, self._kv_amax_rows)
        for i, blk in enumerate((st.k, st.v)):
            if blk is None:
                continue
            for h in range(self.num_kv_heads):
                n, f = int(st.lens[h]), int(frm[h])
                if n > f:
                    x = from_half(blk[h, f:n])
                    m = np.inf if not np.isfinite(x).all() else float(np.abs(x).max())
                    self._kv_amax[i] = max(self._kv_amax[i], m)
        self._kv_amax_rows = rows
        self._kv_amax_head = st.lens.astype(np.int64, copy=True)
        return (self._kv_amax[0], self._kv_amax[1])

    def kv_abs_max_after(self, chunk: tuple[int, int, float, float]) -> tuple[float, float]:
        """``kv_abs_max`` folding in the caller's maxima ``(from, upto, kmax,
        vmax)`` of rows it just appended, when they continue the scanned
        prefix and the layer holds exactly ``upto`` rows; else the scan."""
        if not isinstance(chunk, (tuple, list)) or len(chunk) != 4:
            raise ShapeError(f"chunk must be (from, upto, kmax, vmax), got {chunk!r}")
        frm, upto = V.nonneg_int("chunk from", chunk[0]), V.nonneg_int("chunk upto", chunk[1])
        km, vm = (V.real_at_least(f"chunk {n}", x, 0.0) for n, x in (("kmax", chunk[2]), ("vmax", chunk[3])))
        lens = self._st.lens
        # Every head must have continued the scanned prefix: a head that
        # lagged holds new rows below `frm` that the caller's maxima may miss.
        ragged = ((self._kv_amax_head != frm) & (lens != self._kv_amax_head)).any() if frm else False
        if self._kv_amax_rows != frm or self._kv_rows() != upto or frm > upto or ragged:
            return self.kv_abs_max()
        if frm == 0:
            self._kv_amax = [0.0, 0.0]
        self._kv_amax = [max(self._kv_amax[0], float(km)), max(self._kv_amax[1], float(vm))]
        self._kv_amax_rows = upto
        self._kv_amax_head = lens.astype(np.int64, copy=True)
        return (self._kv_amax[0], self._kv_amax[1])

    def _new_generation(self) -> None:
        self._st.renew_generation()

    def __repr__(self) -> str:
        return (f"LayerKvCache(heads={self.num_kv_heads}, hd={self.head_dim}, mode={self.mode.value}, "
                f"rows={self._seq_len}, base={self._base}, backend={self.backend.name})")


def _locked(fn):
    @functools.wraps(fn)
    def method(self, *args, **kwargs):
        with self._lock:
            return fn(self, *args, **kwargs)
    return method


def _serialize_public_api(cls):
    """Wrap every public method and property setter of ``cls`` (its mixins
    included) in the layer's re-entrant lock: two threads on one layer take
    turns instead of interleaving a mutation with a read of half-moved rows
    (issue 18 item 10 measured ~0.05% wrong reads and a pyopencl LogicError).
    Getters of plain state stay unlocked."""
    done = set()
    for klass in cls.__mro__[:-1]:
        for name, attr in vars(klass).items():
            if name.startswith("_") or name in done:
                continue
            done.add(name)
            if isinstance(attr, property):
                if attr.fset is not None:
                    setattr(cls, name, property(attr.fget, _locked(attr.fset), attr.fdel, attr.__doc__))
            elif inspect.isfunction(attr):
                setattr(cls, name, _locked(attr))
    return cls


_serialize_public_api(LayerKvCache)
