"""`LayerKvCache`: one layer's KV cache with the seed's full surface.

A facade over its parts: the row storage of its mode's family
(:mod:`kvreg.storage`), the backend's kernels (:mod:`kvreg.plugin`, reached
through :mod:`kvreg.attention`), the O(1) seal (:attr:`LayerKvCache.seal`,
:mod:`kvreg.seal`), a bounded ring (:attr:`LayerKvCache.ring`,
:mod:`kvreg.bounded`) and the wire codec (:attr:`LayerKvCache.wire`, :mod:`kvreg.wire.layer`). Every
public method validates its arguments first and mutates only after: a
refused call leaves the layer as it was. Public methods that read or write
the layer's state hold its re-entrant lock (docs/reliability.md).
"""

from __future__ import annotations

import copy
import functools
import threading
import warnings

import numpy as np

from . import _validate as V
from . import attention as A
from .absmax import AbsMax
from .bounded import Ring, RingSlot
from .decode_step import DecodeStep
from .errors import SealError, ShapeError, StateError
from .eviction import born_keep, window_cut
from .lifecycle import Lifecycle
from .modes import Q8_ABS_MAX, Q8_EXACT_ROWS, KvMode
from .registry import get_backend
from .seal import Seal
from .storage import Storage, make_storage
from .wire.layer import LinearState, WireCodec

__all__ = ["LayerKvCache", "MAX_ROW", "Q8_ABS_MAX"]

#: Channels per position (num_kv_heads × head_dim) a layer takes: far past
#: any model (8×128, 128×256), and small enough that its per-channel fields
#: allocate at once and every element count fits the wire's u32.
MAX_ROW = 2**24


def locked(fn):
    """The method holds the layer's lock: two threads on one layer take turns
    instead of interleaving a mutation with a read of half-moved rows."""
    @functools.wraps(fn)
    def method(self, *args, **kwargs):
        with self._lock:
            return fn(self, *args, **kwargs)
    return method


def _alias(part: str, name: str, doc: str) -> property:
    """A property of the layer that is ``name`` of its part ``part`` (the
    seed's flat names for state its parts hold), set under the layer's lock."""
    def fset(self, value):
        with self._lock:
            setattr(getattr(self, part), name, value)
    return property(lambda self: getattr(getattr(self, part), name), fset, doc=doc)


def _read(attr: str, doc: str) -> property:
    """A read-only property of the layer's attribute ``attr``."""
    return property(lambda self: getattr(self, attr), doc=doc)


def _part(attr: str, method):
    """The layer's method that is ``method`` of its part ``attr``, under the
    layer's lock: the seed's flat names for what the layer's parts do."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        with self._lock:
            return method(getattr(self, attr), *args, **kwargs)
    return call


class LayerKvCache:
    """KV cache of a single layer, head-major.

    ``num_kv_heads`` heads of ``head_dim`` channels. ``mode`` None reads
    ``KVREG_KV``; ``backend`` None reads ``KVREG_BACKEND``/``KVREG_DEVICE``
    (a name or a :class:`~kvreg.plugin.Backend` instance also work).
    ``q8_exact_rows``: under q8, the first rows of each head (the attention
    sinks) are also kept in float32 and attended exactly (see
    :mod:`kvreg.storage.int8`); 0 gives the seed's storage exactly.
    """

    #: Set by :class:`~kvreg.seal.Seal` (and :meth:`install_bounded`), read through :attr:`lifecycle`.
    _lifecycle: Lifecycle

    def __init__(self, num_kv_heads: int, head_dim: int, mode: KvMode | str | None = None,
                 backend=None, *, layer: int = 0, q8_exact_rows: int = Q8_EXACT_ROWS):
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
        self._st = make_storage(self.num_kv_heads, self.head_dim, mode, self.q8_exact_rows)
        self._seq_len = 0
        self._base = 0
        self._tail: int | None = None
        self._sinks: np.ndarray | None = None
        self._args = A.DecodeArgs()
        #: The seed's linear-core recurrent state (carried by the wire).
        self.linear = LinearState()
        self._absmax = AbsMax(self)
        self._fresh: A.Fresh | None = None
        self._ring = RingSlot(self)
        #: The wire record this layer exchanges (v2 header fields) and its codec.
        self.wire = WireCodec(self, layer)
        #: The O(1) seal (idle until ``o1_begin``); it sets the lifecycle.
        self.seal = Seal(self)

    # ── plain state ──

    lock = _read("_lock", "The layer's re-entrant lock, which its public methods and setters hold: hold it "
                          "too to read several getters as one state from another thread (docs/reliability.md).")
    lifecycle = _read("_lifecycle", "Where this layer is in its life (:class:`kvreg.Lifecycle`): plain, "
                                    "collecting, sealed, bounded, or failed.")
    storage = _read("_st", "The row storage kernels read (:mod:`kvreg.storage`; treat as read-only).")
    base = _read("_base", "Absolute position of stored row 0 (trims move it).")
    tail_window = _read("_tail", "The window this layer trims to, once ``trim_window`` ran on it.")
    default_scale = _read("_default_scale", "``1/√hd`` in float32 arithmetic (the seed's ``attend``): the score "
                                            "scale of every call given none.")

    @property
    def mode(self) -> KvMode:
        return self._st.mode

    @mode.setter
    @locked
    def mode(self, mode) -> None:
        mode = KvMode.parse(mode)
        if mode is self._st.mode:
            return
        if self._st.seq_len or self._st.lens.any():
            raise StateError(f"cannot change the KV mode of a layer holding {self._seq_len} rows; clear() it first")
        self._st = make_storage(self.num_kv_heads, self.head_dim, mode, self.q8_exact_rows)

    @property
    def seq_len(self) -> int:
        """Rows stored (dead heads included). Row 0 is absolute position ``base``."""
        return self._seq_len

    @seq_len.setter
    @locked
    def seq_len(self, value: int) -> None:
        # The seed's record-only layers (linear, bounded) set the depth directly.
        self._seq_len = V.position("seq_len", value)

    @property
    def pos_len(self) -> int:
        """Absolute context depth: the position the next append will hold."""
        return self._base + self._seq_len

    @property
    def generation(self) -> int:
        """Storage generation; with the row count, the key of a device copy."""
        return self._st.generation

    @property
    def imp(self) -> np.ndarray:
        """Accumulated attention mass per stored row (read-only view)."""
        v = self._st.imp.view()
        v.flags.writeable = False
        return v

    linear_state = _alias("linear", "state", "Linear-core recurrent state (float32; empty on full layers); "
                                             "it travels on the wire always as f32.")
    linear_scratch = _alias("linear", "scratch", "Tentative recurrent state during speculative verify (float32).")

    @property
    def sinks(self) -> np.ndarray | None:
        """Learned per-Q-head sink logits (weights: ``clear`` and imports keep them)."""
        return self._sinks

    @sinks.setter
    @locked
    def sinks(self, value) -> None:
        self._sinks = None if value is None else V.float_vector("sinks", value)

    @property
    def ring(self) -> Ring | None:
        """The bounded ring, once :meth:`install_bounded` ran (None otherwise)."""
        return self._ring.ring

    @property
    def bounded(self):
        """The bounded ring's :class:`~kvreg.bounded.BoundedState` (None on other layers)."""
        return None if self.ring is None else self.ring.state

    def head_len(self, kv_head: int) -> int:
        """Rows actually stored for a head (0 for a dead head)."""
        return int(self._st.lens[V.index("kv_head", kv_head, self.num_kv_heads)])

    def head_keys(self, kv_head: int) -> np.ndarray:
        """f32 keys of a head, ``[rows, hd]`` read-only (empty when K is int8).
        Under f32 a view, valid until the next mutation of the layer; under
        f16/bf16 the rows widened to float32 (a copy)."""
        return self._st.float_rows("k", V.index("kv_head", kv_head, self.num_kv_heads))

    def head_values(self, kv_head: int) -> np.ndarray:
        """f32 values of a head, ``[rows, hd]`` read-only (empty when V is int8; as :meth:`head_keys`)."""
        return self._st.float_rows("v", V.index("kv_head", kv_head, self.num_kv_heads))

    @locked
    def memory_bytes(self) -> int:
        """Bytes of stored state, counted as the seed counts (elements held)."""
        return (self._st.stored_bytes() + self.linear.state.size * 4 + self.seal.memory_bytes()
                + self.bounded_state_bytes())

    @locked
    def shared_bytes(self) -> int:
        """Of :meth:`memory_bytes`, the stored rows this layer shares with a
        live fork (held once for all of them; 0 when it holds its own)."""
        return self._st.shared_block_bytes()

    @locked
    def reserved_bytes(self) -> int:
        """Bytes of capacity the row storage holds (stored rows + room to grow)."""
        return self._st.reserved_bytes()

    # ── copies ──

    def fork(self) -> LayerKvCache:
        """A new sequence holding this one's rows, copy-on-write: rows are
        held once, and a write of either side copies only what it touches
        (:meth:`Storage.fork <kvreg.storage.Storage.fork>`,
        docs/serving.md). Everything else (lengths, importance, sinks, the
        seal's state, a bounded ring) is the fork's own. It answers as a
        deep copy does, bit for bit."""
        return self._copy({}, share=True)

    def __deepcopy__(self, memo) -> LayerKvCache:
        # The backend (compiled programs, device contexts) is shared, the lock is new.
        return self._copy(memo, share=False)

    def _copy(self, memo: dict, *, share: bool) -> LayerKvCache:
        with self._lock:
            st = self._st.fork() if share else self._st.copy()
            new = object.__new__(type(self))
            memo.update({id(self): new, id(self.backend): self.backend, id(self._st): st,
                         id(self._lock): threading.RLock()})
            for name, val in vars(self).items():
                setattr(new, name, copy.deepcopy(val, memo))
            return new

    set_linear_wire_allowed = _part("wire", WireCodec.allow_linear)
    discard_linear_scratch = _part("linear", LinearState.discard_scratch)

    # ── append ──

    @locked
    def append(self, k, v, alive=None) -> None:
        """Append one position: ``k``, ``v`` are ``num_kv_heads*head_dim`` floats
        (flat or ``[nkv, hd]``); heads with ``alive[h] == False`` store nothing.

        Under q8 the 2f field freezes at the START of the append that finds
        ``seq_len >= 64`` and no field yet (the seed's rule: only rows that
        survived a rollback are in it). A q8 layer refuses non-finite rows
        and rows with |x| > 1e18 (``Q8_ABS_MAX``), whose squares would make
        the field inf."""
        nkv, hd = self.num_kv_heads, self.head_dim
        self._append(V.rows("k", k, nkv, hd), V.rows("v", v, nkv, hd), alive)

    def _append(self, k: np.ndarray, v: np.ndarray, alive) -> None:
        # The decode hot path (every head alive and level): the storage's own one-row store.
        if alive is None and self._lifecycle is Lifecycle.PLAIN and self._base + self._seq_len < V.MAX_POSITION \
                and self._st.append_row(k, v, self.backend):
            self._fresh = None
            self._seq_len += 1
            return
        alive = V.alive_mask(alive, self.num_kv_heads)
        if alive.all() and self.seal.auto_append(k, v):
            return
        self._extend(k[None], v[None], alive)

    @locked
    def extend(self, k, v, alive=None, *, layout: str | None = None) -> None:
        """Append ``n`` positions at once (a prefill chunk): numpy arrays or
        torch tensors, ``[n, nkv, hd]`` or ``[n, nkv*hd]`` (``layout="nhd"``),
        ``[nkv, n, hd]`` (``"hnd"``: no copy before the store) or ``[1, nkv,
        n, hd]`` (``"bhnd"``, transformers' states); None reads the shape and
        refuses one that fits both. The storage ends bit for bit as after
        ``n`` calls of :meth:`append`."""
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
            raise SealError(f"append refused: the O(1) seal of this layer failed ({self.seal.error}); "
                            "clear() it first")
        if state is Lifecycle.BOUNDED:
            raise StateError("append on a bounded-anchor layer: use bounded_step (it stores nothing per position)")
        if state is Lifecycle.SEALED:
            raise StateError("extend on a sealed O(1) layer: it takes one position at a time, through o1_step "
                             "(or append + attend_layer when it seals itself: o1_begin(..., auto=True))")
        if self.pos_len + k.shape[0] > V.MAX_POSITION:
            raise ShapeError(f"append past absolute position 2**53 (the layer is at {self.pos_len}): "
                             "float64 does not resolve positions beyond it")
        st = self._st
        heads = np.flatnonzero(alive)
        every = heads.size == self.num_kv_heads
        st.check_rows(k if every else k[:, heads], v if every else v[:, heads])
        self._fresh = None
        st.store(k, v, heads, self.backend)
        self._seq_len += k.shape[0]
        self._fresh = A.Fresh.of(st, k, v, heads)

    # ── attention ──

    @locked
    def attend(self, q, kv_head: int):
        """Per-head attention over the whole stored row with scale 1/√hd.
        Returns ``(out [hd], probs [rows])``; bit-for-bit the grouped kernel."""
        kv_head = V.index("kv_head", kv_head, self.num_kv_heads)
        qv = V.rows("q", q, 1, self.head_dim)
        probs = np.zeros(int(self._st.lens[kv_head]), dtype=np.float32)
        out = A.rotated_attend(self.backend, self.backend.attend_group, qv, self._st, kv_head,
                               scale=self.default_scale, first=0, upto=None, softcap=0.0, sinks=None, imp=probs)
        return out[0], probs

    attend_group = locked(A.attend_group)

    def attend_group_upto(self, q_group, kv_head: int, *, upto: int, **kwargs) -> np.ndarray:
        """``attend_group`` over the first ``upto`` rows only: bit-identical to the
        call made when the layer held exactly ``upto`` rows."""
        return self.attend_group(q_group, kv_head, upto=upto, **kwargs)

    @locked
    def attend_layer(self, q_all, *, scale: float | None = None, window: int | None = None, softcap: float = 0.0,
                     sinks="layer", importance: bool = True) -> np.ndarray:
        """Decode attention of every KV group in one call: ``q_all [num_heads,
        hd]``, Q head ``h`` reads group ``h // hpk``, each group its newest
        ``window`` rows; ``sinks`` defaults to the layer's learned sinks (None
        disables); ``importance`` accumulates the probabilities (what Born
        eviction reads). Equals ``attend_group`` per group."""
        q = V.heads("q_all", q_all, self.head_dim)
        return self._attend_layer(q, self._decode_args(q.shape[0], scale, window, softcap, sinks, importance))

    def _attend_layer(self, q: np.ndarray, args: dict) -> np.ndarray:
        life = self._lifecycle
        if life is Lifecycle.SEALED:
            return self.seal.auto_attend(q)
        st = self._st
        if st.rot_k or st.rot_v:
            out = A.rotated_attend(self.backend, self.backend.attend_layer, q, st, **args)
        else:
            out = self.backend.attend_layer(q, st.view(), **args)
        if life is Lifecycle.COLLECTING:
            self.seal.record(q)
        return out

    def _decode_args(self, nh: int, scale, window, softcap, sinks, importance) -> dict:
        return self._args.resolve(self, nh, scale, window, softcap, sinks, importance)

    append_attend = locked(A.append_attend)

    decode_step = locked(DecodeStep.prepare)

    attend_chunk = locked(A.attend_chunk)

    @locked
    def accumulate_imp(self, probs) -> None:
        """Add attention mass per stored row (the shorter length wins, as a zip)."""
        p = V.float_vector("probs", probs)
        imp = self._st.imp
        m = min(imp.shape[0], p.shape[0])
        imp[:m] += p[:m]

    # ── rollback, trims, eviction ──

    @locked
    def truncate_last(self, n_drop: int) -> None:
        """Roll back the last ``n_drop`` positions (speculative-decode reject)."""
        n_drop = V.nonneg_int("n_drop", n_drop)
        self.linear.discard_scratch()
        d = min(n_drop, self._seq_len)
        if self.ring is not None:
            self._seq_len = self.ring.rollback(d)
            return
        if self._tail is not None and self._base > 0 and self._seq_len - d < self._tail - 1:
            warnings.warn(f"sliding tail: rollback of {d} leaves {self._seq_len - d} rows under the "
                          f"{self._tail}-row window", stacklevel=3)
        st = self._st
        live = st.lens > 0
        if live.any():
            self._absmax.changed(int((st.lens[live] - d).clip(min=0).min()))
        st.truncate(d)
        self._seq_len -= d

    def trim_window(self, w: int, slack: int, align: int) -> int:
        """Drop the rows a sliding-window layer can never read again (see
        ``trim_window_anchored``). Returns the rows dropped."""
        return self.trim_window_anchored(w, slack, align, None)

    @locked
    def trim_window_anchored(self, w: int, slack: int, align: int, anchor: int | None) -> int:
        """Once more than ``2w`` rows are stored, drain the front down to
        ``w + slack`` rows (:func:`kvreg.eviction.window_cut`): every windowed
        attend answers bit for bit as untrimmed. No-op on an O(1) or bounded
        layer and on a q8_2f layer not frozen yet. Returns the rows dropped."""
        w, slack, align = V.nonneg_int("w", w), V.nonneg_int("slack", slack), V.nonneg_int("align", align)
        if anchor is not None:
            anchor = V.position("anchor", anchor)
        if self._lifecycle is not Lifecycle.PLAIN or w == 0:
            return 0
        self._tail = w
        if self._seq_len <= 2 * w or (self.mode.field and not self._st.field_frozen()):
            return 0
        d = window_cut(self.pos_len, self._base, w + slack, align, anchor)
        if not d:
            return 0
        self._st.drop_front(d)
        self._base += d
        self._seq_len -= d
        self._absmax.dropped_front(d)
        return d

    def _evict_bypassed(self) -> bool:
        # An O(1) layer (collecting: still-needed exact prefix; sealed: its
        # state IS the eviction), a bounded ring and a sliding tail each bound
        # themselves; ordinary eviction leaves them alone.
        return self._lifecycle is not Lifecycle.PLAIN or self._tail is not None

    @locked
    def evict(self, keep_last: int) -> None:
        """Drop the oldest positions, keeping the last ``keep_last``."""
        keep_last = V.nonneg_int("keep_last", keep_last)
        if self._evict_bypassed() or self._seq_len <= keep_last:
            return
        self._st.drop_front(self._seq_len - keep_last)
        self._absmax.changed(0)
        self._seq_len = keep_last

    @locked
    def evict_born(self, keep_last: int, sink: int, recent: int) -> None:
        """Mass-based eviction: keep the ``sink`` earliest rows, the ``recent``
        latest, and fill the rest of ``keep_last`` with the rows of highest
        accumulated attention mass (ties: the earlier row; NaN mass ranks last)."""
        keep_last, sink, recent = (V.nonneg_int(n, x) for n, x in
                                   (("keep_last", keep_last), ("sink", sink), ("recent", recent)))
        if self._evict_bypassed():
            return
        kept = born_keep(self._st.imp, keep_last, sink, recent)
        if kept is None:
            return
        self._st.gather(kept, self.backend.gather_rows)
        self._absmax.changed(0)
        self._seq_len = int(kept.size)

    @locked
    def clear(self) -> None:
        """Forget the conversation. Learned sinks, the tail window and the
        bounded ring's size are the layer's, not the conversation's: kept."""
        self._replace_rows(None, None)
        self.linear.clear()
        if self.ring is not None:
            self.ring.state.clear()
        self.seal.reset()

    # ── what the seal and the wire import change ──

    def _replace_rows(self, k: np.ndarray | None, v: np.ndarray | None) -> None:
        """The rows become ``k, v [nkv, rows, hd]`` float32 from position 0
        (None: none), the storage's capacity given back first when rows come."""
        self._absmax.changed(0)
        self._fresh = None
        if k is None:
            self._st.clear()
            rows = 0
        else:
            self._st.release()
            rows = k.shape[1]
            self._st.append({"k": k, "v": v}, np.arange(self.num_kv_heads), rows)
        self._seq_len = rows
        self._base = 0

    def _release_rows(self) -> None:
        """The seal holds everything now: the O(context) storage goes."""
        self._absmax.changed(0)
        self._fresh = None
        self._st.release()

    def _install_state(self, st: Storage, linear_state: np.ndarray, base: int, seq_len: int) -> None:
        """A wire import's prepared state replaces the conversation (nothing
        here can fail; learned sinks are weights: kept)."""
        self._st = st
        self.linear.install(linear_state)
        self._absmax.changed(0)
        self._fresh = None
        self.seal.reset()
        self._base, self._seq_len = base, seq_len

    def _row_stored(self) -> None:
        """A fused decode step stored one row through the storage."""
        self._fresh = None
        self._seq_len += 1

    def _count_position(self) -> None:
        """A sealed or bounded step took a position (nothing is stored per position)."""
        self._seq_len += 1

    kv_abs_max = _part("_absmax", AbsMax.scan)
    kv_abs_max_after = _part("_absmax", AbsMax.scan_after)

    # ── the bounded ring: the seed's names for :class:`kvreg.bounded.RingSlot`'s methods ──

    install_bounded = _part("_ring", RingSlot.install)
    bounded_step = _part("_ring", RingSlot.step)
    bounded_state_bytes = _part("_ring", RingSlot.state_bytes)
    bounded_snapshot = _part("_ring", RingSlot.snapshot)
    bounded_restore = _part("_ring", RingSlot.restore)

    # ── the O(1) seal: the seed's names for :class:`kvreg.seal.Seal`'s methods ──

    o1_begin = _part("seal", Seal.begin)
    o1_begin_with_boundary = _part("seal", Seal.begin)
    o1_push_q = _part("seal", Seal.push_q)
    o1_set_q_trace = _part("seal", Seal.set_q_trace)
    o1_set_q_stride = _part("seal", Seal.set_q_stride)
    o1_q_trace = _part("seal", Seal.q_trace)
    o1_recollect = _part("seal", Seal.recollect)
    o1_set_boundary = _part("seal", Seal.set_boundary)
    o1_pending_boundary = _part("seal", Seal.pending_boundary)
    o1_boundary_crossed_by = _part("seal", Seal.boundary_crossed_by)
    take_o1_transition = _part("seal", Seal.take_transition)
    o1_abort = _part("seal", Seal.abort)
    o1_seal = _part("seal", Seal.seal)
    o1_seal_checked = _part("seal", Seal.seal_checked)
    o1_step = _part("seal", Seal.step)
    o1_memory_bytes = _part("seal", Seal.memory_bytes)

    def o1_sealed(self) -> bool:
        return self.seal.sealed

    def o1_collecting(self) -> bool:
        return self.seal.collecting

    def take_o1_error(self) -> str | None:
        """The latched seal failure, if any (non-consuming: it guards appends until ``clear()``)."""
        return self.seal.error

    # ── the wire (the seed's names; :class:`kvreg.wire.layer.WireCodec`) ──

    wire_kind = _alias("wire", "kind", "The record kind this layer exports and accepts (Full, Linear or Bounded).")
    wire_layer = _alias("wire", "layer", "The layer index of the v2 header (u32).")
    wire_identity = _alias("wire", "identity", "The operator identity of the v2 header (u64).")
    export_wire = _part("wire", WireCodec.export)
    import_wire = _part("wire", WireCodec.import_)

    def __repr__(self) -> str:
        return (f"LayerKvCache(heads={self.num_kv_heads}, hd={self.head_dim}, mode={self.mode.value}, "
                f"rows={self._seq_len}, base={self._base}, backend={self.backend.name})")
