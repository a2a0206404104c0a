"""The storage interface: one layer's rows, head-major (docs/kernels.md).

:class:`LayerStorage` owns the arrays every kernel reads. Head ``h``'s rows
are contiguous (``block[h, :lens[h]]``), so a per-head attend reads a straight
slice and a layer kernel can stride over heads. Capacity doubles as rows
arrive (amortized O(1) appends, never a copy of everything per token).

:class:`LayerStorage` is the only writer of its arrays: appends, the
window, the q8 freeze, truncation, trims, eviction, clear and the wire
import's install are its methods, and each one moves :attr:`version`.
Kernels read a frozen :class:`~kvreg.plugin.KvView` (:meth:`view`), never
the storage.

* ``version`` takes a fresh process-wide value on every mutation. A rewrite
  that a device copy cannot follow by row counts (the freeze, trims,
  eviction, clear) also sets ``reset_version``; a truncation logs the
  per-head row counts it left. :meth:`KvView.unchanged_rows` answers from
  these which rows a mirror at an older version still holds.
* ``generation`` is the seed's public counter: a fresh value on clear, trim,
  eviction, import and seal; appends and truncations keep it.
* Dead heads (``alive[h] == False`` at append) store nothing: their ``lens``
  stay, and their pages of the blocks are never written, so never faulted in.

Exact rows (q8 only): the first ``exact_cap`` rows of each head are also held
in float32, ``xk``/``xv [nkv, exact_cap, hd]``, for the quantized side(s).
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

import copy
import functools
import itertools
import weakref
from collections import deque

import numpy as np

from . import _snapshot
from .modes import KV_K_GROUP, Q4_INT8_GROUP, Q4_INT8_ROWS, Q4_K_GROUP, Q4_SINK_ROWS, Q4_V_GROUP, Q4_WINDOW, KvMode
from .plugin import KV_ARRAYS, KV_COUNTS, KvView, readonly
from .quant import dequantize_half_scaled, num_groups, pack_int4, quantize_half_scaled, rotates, to_half

_GEN = itertools.count(1)
# view() spells an unquantized storage's counts out in this order
assert KV_COUNTS == ("lens", "xlen", "b8", "b4", "kcol_set", "vcol_set")


def next_generation() -> int:
    """A process-wide fresh storage generation or version (``next`` on a count is atomic)."""
    return next(_GEN)


_FLOOR_LOG = 64


def _frozen(a: np.ndarray) -> np.ndarray:
    c = a.copy()
    c.setflags(write=False)
    return c


class _Rows:
    """The identity of a set of row arrays, and the storages holding them
    (more than one after :meth:`LayerStorage.fork`). Views name it as their
    ``owner``: forks at one version read the same rows, so a device mirror
    keyed on it serves them all. ``memo`` is a backend's to keep what it
    derives from the arrays alone (a kernel's argument tuple); the storage
    drops it whenever it replaces an array, and a backend checks it against
    an array of the view it reads (identity), so a stale memo is never used."""

    __slots__ = ("holders", "memo", "row_memo", "shared", "__weakref__")

    def __init__(self, holder: "LayerStorage"):
        self.holders = weakref.WeakSet([holder])
        self.memo = None
        #: ``memo``'s twin for a storage's own, writable arrays, which a
        #: fused decode step writes (:meth:`LayerStorage.append_row_attend_by`).
        self.row_memo = None
        #: Whether a second holder ever joined: until then a write needs no
        #: look at the WeakSet (whose len is Python code, on every append).
        self.shared = False

    def join(self, holder: "LayerStorage") -> None:
        self.holders.add(holder)
        self.shared = True


def _writes(method):
    """A method that writes row arrays: rows shared with a fork are copied
    first (copy on write), so the fork keeps its bits."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if self._rows.shared and len(self._rows.holders) > 1:
            self._own()
        return method(self, *args, **kwargs)
    return wrapper


class LayerStorage:
    """Rows of one layer in the layout of docs/kernels.md.

    :meth:`fork` shares the rows copy-on-write (page by page through a
    snapshot for large layers, the arrays until the first write for small
    ones); counts, importance and the change log are the fork's own from the
    start.
    """

    def __init__(self, num_kv_heads: int, head_dim: int, mode: KvMode, exact_rows: int = 0):
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.mode = mode
        # the mode's flags the per-row paths read (a storage's mode never changes)
        self._quantized, self._half = mode.quantized, mode.half
        self.ngk = num_groups(head_dim, KV_K_GROUP)
        self.cap = 0
        self.lens = np.zeros(num_kv_heads, dtype=np.int64)
        self.seq_len = 0
        self._imp = np.zeros(0, dtype=np.float32)
        self.k = self.v = self.kq = self.ks = self.vq = self.vs = None
        self.k4 = self.k4s = self.v4 = self.v4s = None
        self.kcol = np.ones((num_kv_heads, head_dim), dtype=np.float32)
        self.vcol = np.ones((num_kv_heads, head_dim), dtype=np.float32)
        self.kcol_set = np.zeros(num_kv_heads, dtype=bool)
        self.vcol_set = np.zeros(num_kv_heads, dtype=bool)
        self.exact_cap = (Q4_SINK_ROWS if mode.tiered else int(exact_rows)) if mode.quantized else 0
        xshape = (num_kv_heads, self.exact_cap, head_dim)
        self.xk = np.zeros(xshape, np.float32) if self.exact_cap and mode.quant_k else None
        self.xv = np.zeros(xshape, np.float32) if self.exact_cap and mode.quant_v else None
        self.xlen = np.zeros(num_kv_heads, dtype=np.int64)
        self.generation = next_generation()
        self.version = self.reset_version = next_generation()
        self._log_start = 0
        self._floors: deque[tuple[int, np.ndarray]] = deque(maxlen=_FLOOR_LOG)
        self._view: KvView | None = None
        self._blocks: tuple | None = None  # the view's fields up to its arrays (None: rebuild)
        self._still: tuple | None = None   # an unquantized view's frozen xlen, kcol_set, vcol_set (None: rebuild)
        self._rows = _Rows(self)
        self._snap: _snapshot.Snapshot | None = None   # the snapshot its row blocks map (forks)
        self.b8 = self.b4 = None
        self.t8k = self.t8ks = self.t8v = self.t8vs = None
        #: Whether K (V) rows, and so the queries (outputs), live in the
        #: Walsh-Hadamard rotated basis.
        self.rot_k = mode.rotates_k and rotates(head_dim)
        self.rot_v = mode.rotates_v and rotates(head_dim)
        #: The float16 window: each head's newest ``window`` rows of a quantized
        #: side are ``thk``/``thv`` [nkv, window, hd] (oldest first), not yet
        #: integer; rows ``[0, b8)`` are. The window rows' slots in the
        #: integer blocks are allocated but unwritten.
        self.window = mode.window
        self.thk = self.thv = None
        if self.window:
            self.b8 = np.zeros(num_kv_heads, np.int64)
            wshape = (num_kv_heads, self.window, head_dim)
            self.thk = np.zeros(wshape, np.float16) if mode.quant_k else None
            self.thv = np.zeros(wshape, np.float16) if mode.quant_v else None
        if mode.tiered:
            self._init_tiers()

    # ── views ──

    @property
    def imp(self) -> np.ndarray:
        """Accumulated attention mass per stored row (a view, ``[seq_len]``)."""
        return self._imp[: self.seq_len]

    def block_names(self) -> tuple[str, ...]:
        """The per-row blocks (``[nkv, cap, ...]``) this mode stores."""
        if self.mode.tiered:
            return ("k4", "k4s", "v4", "v4s")
        names = ("kq", "ks") if self.mode.quant_k else ("k",)
        return names + (("vq", "vs") if self.mode.quant_v else ("v",))

    def head_rows(self, h: int) -> int:
        return int(self.lens[h])

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

    def attended_rows(self, side: str, h: int, lo: int, n: int) -> np.ndarray:
        """Rows ``[lo, n)`` of head ``h`` as the kernels answer with them
        (:meth:`KvView.attended_rows`)."""
        return self.view().attended_rows(side, h, lo, n)

    def view(self) -> KvView:
        """The frozen, read-only view kernels read (one per version)."""
        v = self._view
        if v is not None and v.version == self.version:
            return v
        if self._blocks is None:  # arrays (re)allocated since the last view
            self._blocks = (self._rows, self.mode, self.num_kv_heads, self.head_dim, self.ngk, self.cap, self.exact_cap,
                            self.window, self.rot_k, self.rot_v) + tuple(readonly(getattr(self, n)) for n in KV_ARRAYS)
        if self._quantized:
            counts = tuple([None if (a := getattr(self, n)) is None else _frozen(a) for n in KV_COUNTS])
        else:
            # Unquantized rows have no exact rows, q8 field or window: of the
            # counts only lens moves, so a decode's view copies that alone
            # (each numpy call costs ~10 µs inside a model, whose matmuls evict
            # the interpreter's working set between layers).
            still = self._still
            if still is None:
                still = self._still = (_frozen(self.xlen), _frozen(self.kcol_set), _frozen(self.vcol_set))
            counts = (_frozen(self.lens), still[0], None, None, still[1], still[2])
        v = self._view = KvView._make(self._blocks + counts + (self.version, self.reset_version, self._log_start,
                                                               tuple(self._floors)))
        return v

    @classmethod
    def of_rows(cls, k: np.ndarray, v: np.ndarray) -> "LayerStorage":
        """An F32 storage over float32 blocks ``[nkv, n, hd]`` (taken, not
        copied): the widened rows a kernel is handed in place of a layer's own."""
        st = cls(k.shape[0], k.shape[2], KvMode.F32)
        st.k, st.v, st.cap = k, v, k.shape[1]
        st.lens[:] = k.shape[1]
        st._touch(arrays=True)
        return st

    # ── forks ──

    def copy(self) -> "LayerStorage":
        """A storage holding its own copy of every row (a deep copy)."""
        new = self._shallow()
        for name in KV_ARRAYS:
            a = getattr(self, name)
            setattr(new, name, None if a is None else a.copy())
        new._snap, new._rows, new._blocks, new._view = None, _Rows(new), None, None
        return new

    def fork(self) -> "LayerStorage":
        """A storage holding the same rows, sharing them copy-on-write.

        Large row blocks, and every block of a storage that already maps a
        snapshot, are shared at the page level (:mod:`kvreg._snapshot`: each
        holder maps one frozen copy privately, so forks decoding on keep
        sharing every row nobody rewrote); small ones, or where the platform
        cannot, share the arrays themselves until either side writes. The
        two never mix: holders of shared arrays are never snapshot holders."""
        new = self._shallow()
        if self._snap is not None or (_snapshot.AVAILABLE and self.cap
                                      and self._block_bytes() >= _snapshot.MIN_BYTES):
            blocks = self.block_names()
            for name in KV_ARRAYS:   # the per-head arrays (windows, tiers, fields, exact rows): small, copied
                a = getattr(self, name)
                if a is not None and name not in blocks:
                    setattr(new, name, a.copy())
            try:
                snap = self._snap if self._snap is not None and self._snap.version == self.version else self._snapshot()
                new._install(snap)
            except OSError:   # out of file descriptors or mappings: rows of its own
                return self.copy()
        self._rows.join(new)
        new._rows = self._rows
        return new

    def _shallow(self) -> "LayerStorage":
        """Every attribute shared, then the small mutable ones made its own."""
        new = copy.copy(self)
        for name, val in vars(self).items():
            if isinstance(val, np.ndarray) and name not in KV_ARRAYS:
                setattr(new, name, val.copy())
        new._floors = deque(self._floors, maxlen=_FLOOR_LOG)
        return new

    def _block_bytes(self) -> int:
        return sum(getattr(self, n).nbytes for n in self.block_names())

    def _snapshot(self) -> "_snapshot.Snapshot":
        """Move this storage's row blocks into a fresh snapshot it maps (a
        new capacity: room for a fork to decode on)."""
        if len(self._rows.holders) > 1:   # holders sharing its arrays keep them, and their identity
            self._rows.holders.discard(self)
            self._rows = _Rows(self)
        n = int(self.lens.max(initial=0))
        cap = max(self.cap, 2 * n, n + 4096)
        snap = _snapshot.Snapshot({b: getattr(self, b) for b in self.block_names()}, self.lens, cap, 0,
                                  int(self.lens.sum()) * self._row_block_bytes())
        self._install(snap)
        self._touch(arrays=True)          # a new capacity: mirrors re-read the layout
        snap.version = self.version
        return snap

    def _install(self, snap: "_snapshot.Snapshot") -> None:
        for name, a in snap.map().items():
            setattr(self, name, a)
        self.cap = snap.specs[0][2][1]
        self._snap = snap
        self._view = None
        self._forget_arrays()

    def shared_block_bytes(self) -> int:
        """Bytes of stored rows this storage shares with forks: all of them
        while arrays are shared, else the rows still read from its snapshot
        (to the page: a holder's first write past a row copies its page)."""
        if self._snap is None:
            return self.stored_bytes() if len(self._rows.holders) > 1 else 0
        floor = self.view().unchanged_rows(self._snap.version)
        if floor is None:
            return 0
        rows = np.minimum(np.minimum(self._snap.lens, self.lens), floor)
        return int(rows.sum()) * self._row_block_bytes()

    def _row_block_bytes(self) -> int:
        """Bytes one row of one head takes across the row blocks."""
        return sum(getattr(self, n)[0, 0].nbytes for n in self.block_names())

    def shared_rows(self) -> tuple[object, int] | None:
        """What this storage shares with forks, as ``(identity, bytes)``: the
        snapshot it maps (held while mapped) or the arrays it shares, with
        the bytes those take once; None when it holds only its own rows."""
        if self._snap is not None:
            return self._snap, self._snap.nbytes
        return (self._rows, self.stored_bytes()) if len(self._rows.holders) > 1 else None

    def _own(self) -> None:
        """Before a write while other holders read these rows: a snapshot's
        holder already writes into its own pages (it only takes a view
        identity of its own); shared arrays are copied."""
        self._rows.holders.discard(self)
        if self._snap is None:
            for name in KV_ARRAYS:
                a = getattr(self, name)
                if a is not None:
                    setattr(self, name, a.copy())
        self._rows = _Rows(self)
        self._view = None
        self._touch(arrays=True)

    # ── versions ──

    def _touch(self, arrays: bool = False) -> None:
        """Every mutation: a new version (``arrays``: an array was replaced)."""
        self.version = next_generation()
        if arrays:
            self._forget_arrays()

    def _forget_arrays(self) -> None:
        """What was derived from the arrays an array replacement outdates: the
        view's blocks, its still counts, a backend's memo on the owner."""
        self._blocks = self._still = None
        self._rows.memo = self._rows.row_memo = None

    def _rewritten(self) -> None:
        """A mutation a copy cannot follow by row counts: every row may differ."""
        self._touch()
        self.reset_version = self.version
        self._floors.clear()
        self._still = None

    def _truncated(self) -> None:
        """Rows past ``lens`` (now) may be rewritten: logged for mirrors."""
        self._touch()
        if len(self._floors) == self._floors.maxlen:
            self._log_start = self._floors[0][0]
        self._floors.append((self.version, self.lens.copy()))

    def renew_generation(self) -> None:
        """A fresh seed generation (a restored ring, a seal)."""
        self.generation = next_generation()
        self._touch()

    def field_frozen(self) -> bool:
        """Whether the q8 field froze (the seed: any head's column is set)."""
        return bool(self.kcol_set.any() or self.vcol_set.any())

    # ── capacity ──

    def _alloc(self, cap: int) -> dict[str, np.ndarray]:
        nkv, hd = self.num_kv_heads, self.head_dim
        fdt = self.mode.float_dtype
        shapes = {
            "k": ((nkv, cap, hd), fdt),
            "v": ((nkv, cap, hd), fdt),
            "kq": ((nkv, cap, hd), np.int8),
            "ks": ((nkv, cap, self.ngk), np.float32),
            "vq": ((nkv, cap, hd), np.int8),
            "vs": ((nkv, cap), np.float32),
            "k4": ((nkv, cap, -(-hd // 2)), np.uint8),
            "k4s": ((nkv, cap, num_groups(hd, Q4_K_GROUP)), np.float16),
            "v4": ((nkv, cap, -(-hd // 2)), np.uint8),
            "v4s": ((nkv, cap, num_groups(hd, Q4_V_GROUP)), np.float16),
        }
        # np.empty: pages a dead head never writes are never faulted in. Under
        # a float16 window (q8, q4) the integer slots of the newest rows are
        # not written yet, and a wire export ships every stored position's
        # slot: zeros (lazily mapped pages too), kept zero by truncate.
        make = np.zeros if self.window else np.empty
        return {n: make(*shapes[n]) for n in self.block_names()}

    @_writes
    def reserve(self, rows: int) -> None:
        """Capacity for ``rows`` rows per head, taken once (doubling)."""
        if rows > self.cap:
            new_cap = max(16, 2 * self.cap, rows)
            fresh = self._alloc(new_cap)
            for name, blk in fresh.items():
                old = getattr(self, name)
                if old is not None:
                    for h in np.flatnonzero(self.lens):
                        blk[h, : self.lens[h]] = old[h, : self.lens[h]]
                setattr(self, name, blk)
            self.cap = new_cap
            self._snap = None   # outgrew a fork's snapshot: its rows are its own now
            self._touch(arrays=True)
        if rows > self._imp.shape[0]:
            imp = np.zeros(max(16, 2 * self._imp.shape[0], rows), dtype=np.float32)
            imp[: self.seq_len] = self._imp[: self.seq_len]
            self._imp = imp

    def reserved_bytes(self) -> int:
        """Bytes of capacity held (stored rows plus room to grow)."""
        blocks = sum(getattr(self, n).nbytes for n in self.block_names() if getattr(self, n) is not None)
        tiers = sum(getattr(self, n).nbytes for n in self.head_block_names())
        return blocks + tiers + self._imp.nbytes

    def stored_bytes(self) -> int:
        """Bytes of stored elements, counted as the seed's ``memory_bytes``."""
        rows = int(self.lens.sum())
        hd, w = self.head_dim, self.mode.float_dtype.itemsize
        if self.mode.tiered:
            return self._tiered_bytes()
        total = 0
        # A window row is held in float16 only (its integer slot is unwritten).
        win = int((self.lens - self.b8).sum()) if self.window else 0
        irows = rows - win
        total += irows * self.ngk * 4 + irows * hd + win * hd * 2 if self.mode.quant_k else rows * hd * w
        total += irows * 4 + irows * hd + win * hd * 2 if self.mode.quant_v else rows * hd * w
        total += int(self.kcol_set.sum() + self.vcol_set.sum()) * hd * 4
        sides = (self.xk is not None) + (self.xv is not None)
        total += int(self.xlen.sum()) * hd * 4 * sides
        return total

    # ── mutations (validated by the caller) ──

    def plain_rows(self) -> bool:
        """Whether a row appends as one slice store per side: an F32/f16/bf16
        storage whose heads all hold the same count (:meth:`append_row`)."""
        if self._quantized:
            return False
        if self.num_kv_heads == 1:
            return True
        lens = self.lens.tolist()
        return lens.count(lens[0]) == len(lens)

    @_writes
    def append_row(self, k: np.ndarray, v: np.ndarray) -> None:
        """One row ``[nkv, hd]`` float32 on every head of a :meth:`plain_rows`
        storage: the bits :meth:`append` stores for it."""
        lens = self.lens
        at = lens.item(0)
        if at >= self.cap or self.seq_len >= self._imp.shape[0]:
            self.reserve(max(at, self.seq_len) + 1)
        if self._half:
            k, v = to_half(k, self.mode.float_dtype), to_half(v, self.mode.float_dtype)
        self.k[:, at] = k
        self.v[:, at] = v
        lens.fill(at + 1)   # every head held ``at`` (plain_rows): a fill, not a ufunc call
        self._imp[self.seq_len] = 0.0
        self.seq_len += 1
        self._touch()

    def append_row_attend_by(self, k: np.ndarray, v: np.ndarray, backend, **attend) -> np.ndarray | None:
        """A decode step's store and the attention over the rows with it in
        one ``backend`` call, :meth:`~kvreg.plugin.Backend.append_attend_layer`
        (``attend``: the query ``q`` and the attention's arguments):
        :meth:`append_row`'s store for F32, f16 and bf16 rows,
        :meth:`append_window_row`'s for a q8 (q8k, q8v) storage. Returns
        the answer, or None having stored nothing: another mode, no room,
        heads holding different counts, a window not yet full, or no fused
        kernel (the layer then appends and attends in two calls)."""
        if not (self._row_steps() and self._row_step_room()):
            return None
        rows = self._rows
        if rows.shared and len(rows.holders) > 1:
            self._own()
            rows = self._rows
        out = backend.append_attend_layer(k, v, attend.pop("q"), self, imp=self._imp, seq=self.seq_len, owner=rows,
                                          **attend)
        if out is not None:
            self.seq_len += 1
            self._touch()
        return out

    def prepare_row_attend_by(self, backend, **attend):
        """:meth:`append_row_attend_by` prepared for a run of decode steps
        (:class:`kvreg.DecodeStep`): ``step(k, v, q)`` does what
        ``append_row_attend_by(k, v, backend, q=q, **attend)`` does, through
        :meth:`~kvreg.plugin.Backend.prepare_append_attend` (``attend``: the
        attention's arguments, ``shape`` and ``out``), or None: another mode
        or no prepared step. Valid while this storage's :attr:`version` is
        the one the step left (its making's, then its last stored row's):
        the caller checks. A step declines (None, nothing stored) where
        :meth:`append_row_attend_by` would copy shared rows first or grow
        the importance: the unprepared call does that."""
        step = self._row_steps() and backend.prepare_append_attend(self, owner=self._rows, **attend)
        if not step:
            return None
        rows = self._rows

        def prepared(k, v, q):
            if not self._row_step_room() or (rows.shared and len(rows.holders) > 1):
                return None
            out = step(k, v, q, self._imp, self.seq_len)
            if out is not None:
                self.seq_len += 1
                self._touch()
            return out
        return prepared

    def _row_steps(self) -> bool:
        """Whether a decode step may store through the backend's fused step:
        F32, f16, bf16 and q8 (q8k, q8v) rows."""
        return not self.mode.tiered and (bool(self.window) or not self._quantized)

    def _row_step_room(self) -> bool:
        """Whether the fused step has the slots it writes: the row's
        importance, and a q8 window's integer slot (an F32, f16 or bf16
        step checks its row's slot itself)."""
        return self.seq_len < self._imp.shape[0] and not (self.window and self.lens.item(0) >= self.cap)

    def window_rows(self) -> bool:
        """Whether a row appends through :meth:`append_window_row`: a q8
        (``Q8``, ``Q8K``, ``Q8V``) storage whose heads all hold the same
        count, a full float16 window and every exact row they keep."""
        if not self.window or self.mode.tiered:
            return False
        lens = self.lens.tolist()
        at = lens[0]
        return lens.count(at) == len(lens) and at >= self.exact_cap and \
            self.b8.tolist().count(at - self.window) == len(lens)

    @_writes
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

    @_writes
    def append_window_row_by(self, k: np.ndarray, v: np.ndarray, kernel) -> bool:
        """:meth:`append_window_row` in one backend call: ``kernel`` is the
        backend's :meth:`~kvreg.plugin.Backend.store_window_row`, which checks
        that this is a :meth:`window_rows` storage, writes the rows, counts
        and importance slot given here and returns False, having written
        nothing, to leave the row to the layer's other paths (not that state,
        a value it refuses, or no fused kernel). False too when the row needs
        more capacity."""
        if self.mode.tiered or self.lens.item(0) >= self.cap or self.seq_len >= self._imp.shape[0]:
            return False
        if not kernel(k, v, rot_k=self.rot_k, rot_v=self.rot_v, thk=self.thk, thv=self.thv, kq=self.kq,
                      ks=self.ks, vq=self.vq, vs=self.vs, kf=self.k, vf=self.v, lens=self.lens, b8=self.b8,
                      imp=self._imp, seq=self.seq_len, exact_cap=self.exact_cap):
            return False
        self.seq_len += 1
        self._touch()
        return True

    @_writes
    def append(self, rows: dict, heads: np.ndarray, n: int, exact: dict | None = None) -> None:
        """Write ``n`` rows to each of ``heads``: ``rows[name]`` is
        ``[len(heads), n, ...]`` for every block of the mode; ``exact``
        (``"xk"``/``"xv"``, ``[len(heads), t, hd]`` in field space, ``t =``
        :meth:`exact_rows_wanted`) the exact copies of their first rows."""
        if n == 0:
            return
        if exact:
            for i, h in enumerate(heads):
                at, xl = int(self.lens[h]), int(self.xlen[h])
                if xl != at or at >= self.exact_cap:
                    continue
                t = min(n, self.exact_cap - at, next(iter(exact.values())).shape[1])
                for name, x in exact.items():
                    getattr(self, name)[h, at:at + t] = x[i, :t]
                self.xlen[h] = at + t
        if heads.size:
            lens = self.lens
            at = int(lens[heads[0]])
            self.reserve(int(lens[heads].max()) + n)
            if heads.size == self.num_kv_heads and (lens == at).all():
                # The common case (no dead head, no ragged head): one slice
                # store per block.
                for name, r in rows.items():
                    getattr(self, name)[:, at:at + n] = r
            else:
                for i, h in enumerate(heads):
                    a = int(lens[h])
                    for name, r in rows.items():
                        getattr(self, name)[h, a:a + n] = r[i]
            lens[heads] += n
        end = self.seq_len + n
        if end > self._imp.shape[0]:
            self.reserve(end)
        self._imp[self.seq_len:end] = 0.0
        self.seq_len = end
        self._touch()

    @_writes
    def truncate(self, d: int) -> None:
        """Drop the last ``d`` rows of every head (generation kept)."""
        self._zero_rows_past(np.maximum(self.lens - d, 0))
        self.lens = np.maximum(self.lens - d, 0)
        np.minimum(self.xlen, self.lens, out=self.xlen)
        if self.window:
            # The newest rows go; older rows keep the form they reached.
            np.minimum(self.b8, self.lens, out=self.b8)
        if self.mode.tiered:
            np.minimum(self.b4, self.lens, out=self.b4)
        if self.window:
            self._zero_window_tails()
        self.seq_len = max(self.seq_len - d, 0)
        self._truncated()

    def _zero_rows_past(self, new_lens: np.ndarray) -> None:
        """Under a float16 window, zero the row slots ``[new_lens[h], lens[h])``
        a shrink leaves behind: a later row's integer slot stays zero until
        the row leaves the window (so equal layers export equal bytes)."""
        if not (self.window and self.cap):
            return
        for h in range(self.num_kv_heads):
            for name in self.block_names():
                getattr(self, name)[h, int(new_lens[h]):int(self.lens[h])] = 0

    def _zero_window_tails(self) -> None:
        """Zero the window's (and q4's int8 tier's) slots past their rows after
        a shrink, for the same reason."""
        for h in range(self.num_kv_heads):
            for t in (self.thk, self.thv):
                if t is not None:
                    t[h, int(self.lens[h] - self.b8[h]):] = 0
            if self.mode.tiered:
                for name in ("t8k", "t8ks", "t8v", "t8vs"):
                    getattr(self, name)[h, int(self.b8[h] - self.b4[h]):] = 0

    @_writes
    def drop_front(self, d: int) -> None:
        """Drop the first ``d`` rows of every head (fewer for a shorter head)."""
        for name in self.block_names():
            blk = getattr(self, name)
            for h in range(self.num_kv_heads):
                n, dh = int(self.lens[h]), min(d, int(self.lens[h]))
                if dh:
                    blk[h, : n - dh] = blk[h, dh:n]
        for h in range(self.num_kv_heads):
            dh, xl = min(d, int(self.lens[h])), int(self.xlen[h])
            left = max(xl - dh, 0)
            for x in (self.xk, self.xv):
                if x is not None and left:
                    x[h, :left] = x[h, dh:xl].copy()
            self.xlen[h] = left
        if self.window:
            for h in range(self.num_kv_heads):
                self._drop_front_tiers(h, min(d, int(self.lens[h])))
        self._zero_rows_past(np.maximum(self.lens - d, 0))
        self.lens = np.maximum(self.lens - d, 0)
        if self.window:
            self._zero_window_tails()
        di = min(d, self.seq_len)
        self._imp[: self.seq_len - di] = self._imp[di : self.seq_len].copy()
        self.seq_len -= di
        self.generation = next_generation()
        self._rewritten()

    @_writes
    def gather(self, kept: np.ndarray, gather_rows) -> None:
        """Keep rows ``kept`` (ascending) of every head, each storage on its own.

        Each block is gathered independently (the seed's review regression:
        in mixed q8k/q8v modes K and V live in different storages).
        """
        for name in self.block_names():
            blk = getattr(self, name)
            for h in range(self.num_kv_heads):
                n = int(self.lens[h])
                if n == 0:
                    continue
                idx = kept[kept < n]
                blk[h, : idx.size] = gather_rows(blk[h], idx)
        for h in range(self.num_kv_heads):
            # kept is ascending, so the exact rows kept stay a prefix
            idx = kept[kept < int(self.xlen[h])]
            for x in (self.xk, self.xv):
                if x is not None and idx.size:
                    x[h, : idx.size] = x[h, idx]
            self.xlen[h] = idx.size
        if self.window:
            for h in range(self.num_kv_heads):
                self._gather_tiers(h, kept[kept < int(self.lens[h])])
        lens = np.array([int(np.count_nonzero(kept < n)) for n in self.lens], dtype=np.int64)
        self._zero_rows_past(lens)
        self.lens = lens
        if self.window:
            self._zero_window_tails()
        imp = self._imp[kept].copy()
        self._imp[: kept.size] = imp
        self.seq_len = int(kept.size)
        self.generation = next_generation()
        self._rewritten()

    @_writes
    def clear(self) -> None:
        """Forget every row and the q8 field; capacity is kept for reuse."""
        self._zero_rows_past(np.zeros_like(self.lens))
        self.lens[:] = 0
        self.xlen[:] = 0
        if self.window:
            self.b8[:] = 0
        if self.mode.tiered:
            self.b4[:] = 0
        if self.window:
            self._zero_window_tails()
        self.seq_len = 0
        self.kcol_set[:] = False
        self.vcol_set[:] = False
        self.kcol[:] = 1.0
        self.vcol[:] = 1.0
        self.generation = next_generation()
        self._rewritten()

    @_writes
    def release(self) -> None:
        """Clear and give the capacity back (an O(1) seal's memory claim)."""
        self.clear()
        self.k = self.v = self.kq = self.ks = self.vq = self.vs = None
        self.k4 = self.k4s = self.v4 = self.v4s = None
        self.cap = 0
        self._snap = None
        self._imp = np.zeros(0, dtype=np.float32)
        self._touch(arrays=True)

    @_writes
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

    @_writes
    def load(self, blocks: dict, lens: np.ndarray, seq_len: int, imp: np.ndarray,
             xlen: np.ndarray | None = None, head_blocks: dict | None = None) -> None:
        """Install an imported record into this (empty) storage: ``blocks[name]``
        one array per head of that head's rows, ``head_blocks[name]`` whole
        per-head state arrays, then the counts and the importance."""
        self.reserve(max(int(np.max(lens, initial=0)), seq_len))
        for name, per_head in blocks.items():
            dst = getattr(self, name)
            for h, a in enumerate(per_head):
                if a.shape[0]:
                    dst[h, : a.shape[0]] = a
        for name, a in (head_blocks or {}).items():
            getattr(self, name)[...] = a
        self.lens[:] = lens
        if xlen is not None:
            self.xlen[:] = xlen
        self.set_importance(imp, seq_len)

    def set_importance(self, imp: np.ndarray, seq_len: int | None = None) -> None:
        """Replace the accumulated importance (an import); ``seq_len`` the positions counted."""
        if seq_len is not None:
            self.reserve(seq_len)
            self.seq_len = seq_len
        self._imp[: imp.shape[0]] = imp
        self._rewritten()

    # ── q4 tiers ──
    #
    # Rows of a head, oldest first: [0, b4) int4 (the k4/v4 blocks, indexed by
    # position), [b4, b8) int8 (t8*, the tier's own buffer, oldest first),
    # [b8, lens) float16 (th*). A row moves down a tier when the tier above
    # it overflows (an append), never back (a truncation leaves the older
    # rows where they are). Every move requantizes the row from the form it
    # leaves, row by row, so n appends and one extend of n rows store the
    # same bits. All three hold rotated rows (``rot_k``, ``rot_v``).

    def head_block_names(self) -> tuple[str, ...]:
        """Per-head state arrays beyond the row blocks (``[nkv, ...]``): the
        float16 window and its bound, q4's int8 tier."""
        if not self.window:
            return ()
        names = ("b8",) + tuple(n for n in ("thk", "thv") if getattr(self, n) is not None)
        return names + (("b4", "t8k", "t8ks", "t8v", "t8vs") if self.mode.tiered else ())

    def _init_tiers(self) -> None:
        nkv, hd = self.num_kv_heads, self.head_dim
        g8 = num_groups(hd, Q4_INT8_GROUP)
        self.b4 = np.zeros(nkv, np.int64)
        self.t8k = np.zeros((nkv, Q4_INT8_ROWS, hd), np.int8)
        self.t8v = np.zeros((nkv, Q4_INT8_ROWS, hd), np.int8)
        self.t8ks = np.zeros((nkv, Q4_INT8_ROWS, g8), np.float16)
        self.t8vs = np.zeros((nkv, Q4_INT8_ROWS, g8), np.float16)

    def tiers_consistent(self) -> str | None:
        """What is wrong with the window/tier counters (None when they are
        sound): an imported record is checked with this before it is installed."""
        if not self.window:
            return None
        b8, lens = self.b8, self.lens
        if not self.mode.tiered:
            if (b8 < 0).any() or (b8 > lens).any() or ((lens - b8) > self.window).any():
                return (f"window bound b8 {b8.tolist()} must lie within {self.window} rows below the rows held "
                        f"{lens.tolist()}")
            return None
        b4 = self.b4
        if (b4 < 0).any() or (b4 > b8).any() or (b8 > lens).any():
            return f"tier bounds b4 {b4.tolist()} <= b8 {b8.tolist()} <= rows {lens.tolist()} do not hold"
        if ((b8 - b4) > Q4_INT8_ROWS).any() or ((lens - b8) > Q4_WINDOW).any():
            return (f"tiers hold more than {Q4_INT8_ROWS} int8 / {Q4_WINDOW} float16 rows "
                    f"(b4 {b4.tolist()}, b8 {b8.tolist()}, rows {lens.tolist()})")
        return None

    @_writes
    def push_window(self, side: str, heads: np.ndarray, x: np.ndarray) -> tuple[tuple, np.ndarray]:
        """q8: ``n`` new float32 rows per head (``[len(heads), n, hd]``) join
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

    @_writes
    def write_quantized(self, side: str, where: tuple, q: np.ndarray, s: np.ndarray) -> None:
        """Integer rows (and their scales) of side ``side`` at ``where``, a
        ``(head, position)`` index pair (:meth:`push_window`)."""
        names = ("kq", "ks") if side == "k" else ("vq", "vs")
        getattr(self, names[0])[where] = q
        getattr(self, names[1])[where] = s if side == "k" else s[:, 0]

    @_writes
    def advance_window(self, heads: np.ndarray, n: int) -> None:
        """The window bound after ``n`` rows joined ``heads`` (before the append counts them)."""
        fh = self.lens[heads] - self.b8[heads]
        self.b8[heads] += np.maximum(fh + n - self.window, 0)
        self._touch()

    @_writes
    def append_tiered(self, rk: np.ndarray, rv: np.ndarray, heads: np.ndarray, n: int) -> None:
        """Tier ``n`` rotated rows per head (``[len(heads), n, hd]`` float32) of
        ``heads`` in; the caller then counts them (:meth:`append`)."""
        if not heads.size or not n:
            return
        self.reserve(int(self.lens[heads].max()) + n)
        # Rows leaving the float16 window, per head (push_window's order).
        out16 = np.maximum(self.lens[heads] - self.b8[heads] + n - Q4_WINDOW, 0)
        starts = np.concatenate([[0], np.cumsum(out16)])
        leaving = {side: self.push_window(side, heads, r)[1] for side, r in (("k", rk), ("v", rv))}
        self.advance_window(heads, n)
        for i, h in enumerate(heads):
            b4, c8 = int(self.b4[h]), int(self.b8[h] - out16[i] - self.b4[h])
            out8 = max(c8 + int(out16[i]) - Q4_INT8_ROWS, 0)       # rows leaving int8
            for side, group in (("k", Q4_K_GROUP), ("v", Q4_V_GROUP)):
                t8, t8s = getattr(self, "t8" + side), getattr(self, "t8" + side + "s")
                codes, sc = quantize_half_scaled(leaving[side][starts[i]:starts[i + 1]], Q4_INT8_GROUP, 127)
                c8_all = np.concatenate([t8[h, :c8], codes])
                s8_all = np.concatenate([t8s[h, :c8], sc])
                if out8:
                    rows = dequantize_half_scaled(c8_all[:out8], s8_all[:out8], Q4_INT8_GROUP)
                    c4, s4 = quantize_half_scaled(rows, group, 7)
                    getattr(self, side + "4")[h, b4:b4 + out8] = pack_int4(c4)
                    getattr(self, side + "4s")[h, b4:b4 + out8] = s4
                t8[h, : c8_all.shape[0] - out8] = c8_all[out8:]
                t8s[h, : c8_all.shape[0] - out8] = s8_all[out8:]
            self.b4[h] = b4 + out8

    def _tiered_bytes(self) -> int:
        hd = self.head_dim
        n4 = int(self.b4.sum())
        n8 = int((self.b8 - self.b4).sum())
        n16 = int((self.lens - self.b8).sum())
        half = -(-hd // 2)
        total = n4 * (2 * half + 2 * (num_groups(hd, Q4_K_GROUP) + num_groups(hd, Q4_V_GROUP)))
        total += n8 * 2 * (hd + 2 * num_groups(hd, Q4_INT8_GROUP))
        total += n16 * 2 * hd * 2
        total += int(self.xlen.sum()) * hd * 4 * 2
        return total

    def _drop_front_tiers(self, h: int, d: int) -> None:
        """Head ``h`` loses its first ``d`` rows (the caller shifts the blocks)."""
        b8 = int(self.b8[h])
        b4 = int(self.b4[h]) if self.mode.tiered else 0
        d8 = min(max(d - b4, 0), b8 - b4) if self.mode.tiered else 0  # q4's int8 rows dropped
        if d8:
            for name in ("t8k", "t8ks", "t8v", "t8vs"):
                t = getattr(self, name)
                t[h, : b8 - b4 - d8] = t[h, d8:b8 - b4].copy()
        d16 = min(max(d - b8, 0), int(self.lens[h]) - b8)  # float16 rows dropped
        if d16:
            for t in (self.thk, self.thv):
                if t is not None:
                    t[h, : int(self.lens[h]) - b8 - d16] = t[h, d16:int(self.lens[h]) - b8].copy()
        if self.mode.tiered:
            self.b4[h] = max(b4 - d, 0)
        self.b8[h] = max(b8 - d, 0)

    def _gather_tiers(self, h: int, kept: np.ndarray) -> None:
        """Head ``h`` keeps rows ``kept`` (ascending, below its length); the
        caller gathers the int4 blocks by position."""
        b8 = int(self.b8[h])
        k16 = kept[kept >= b8] - b8
        for t in (self.thk, self.thv):
            if t is not None:
                t[h, : k16.size] = t[h, k16]
        self.b8[h] = int(np.count_nonzero(kept < b8))
        if self.mode.tiered:
            b4 = int(self.b4[h])
            k8 = kept[(kept >= b4) & (kept < b8)] - b4
            for name in ("t8k", "t8ks", "t8v", "t8vs"):
                t = getattr(self, name)
                t[h, : k8.size] = t[h, k8]
            self.b4[h] = int(np.count_nonzero(kept < b4))
