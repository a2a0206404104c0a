"""The storage interface (:class:`Storage`) and what every family shares.

A storage owns the arrays every kernel reads, head-major (docs/kernels.md):
head ``h``'s rows are contiguous (``block[h, :lens[h]]``), so a per-head
attend reads a straight slice and a layer kernel can stride over heads.
Capacity doubles as rows arrive (amortized O(1) appends, never a copy of
everything per token).

A storage is the only writer of its arrays: appends, the q8 window and
freeze, truncation, trims, eviction, clear and the wire import's install
are its methods, and each one moves :attr:`Storage.version`. Kernels read a
frozen :class:`~kvreg.views.KvView` (:meth:`Storage.view`), never the
storage.

* ``version`` takes a fresh process-wide value on every mutation. A rewrite
  that a device copy cannot follow by row counts (the freeze, trims,
  eviction, clear) also sets ``reset_version``; a truncation logs the
  per-head row counts it left. :meth:`KvView.unchanged_rows` answers from
  these which rows a mirror at an older version still holds.
* ``generation`` is the seed's public counter: a fresh value on clear, trim,
  eviction, import and seal; appends and truncations keep it.
* Dead heads (``alive[h] == False`` at append) store nothing: their ``lens``
  stay, and their pages of the blocks are never written, so never faulted in.
"""

from __future__ import annotations

import abc
import copy
import functools
import itertools
import weakref
from collections import deque
from typing import Any

import numpy as np

from .. import _snapshot
from .._snapshot import Snapshot
from ..modes import KV_K_GROUP, KvMode
from ..quant import from_half, num_groups, rotates
from ..views import DecodeSlot, DenseRows, ExactRows, KiviRows, KvView, Q8Rows, TierRows, WindowRows, readonly

_GEN = itertools.count(1)

#: Every array a storage may hold (None where its mode has none): the row
#: blocks, the per-head state beyond them, the field and exact rows.
ARRAYS = ("k", "v", "kq", "ks", "vq", "vs", "kcol", "vcol", "xk", "xv", "thk", "thv", "k4", "k4s", "v4", "v4s",
          "t8k", "t8ks", "t8v", "t8vs", "k2", "k2s", "k2z", "v2", "v2s", "v2z")

#: A view's row groups, in :class:`~kvreg.views.KvView`'s order: dense, q8, exact, window, tiers.
Groups = tuple[DenseRows, Q8Rows | None, ExactRows | None, WindowRows | None, TierRows | KiviRows | None]

#: Truncations a storage remembers for device mirrors (older ones: a full re-upload).
FLOOR_LOG = 64


def next_generation() -> int:
    """A process-wide fresh storage generation or version (``next`` on a count is atomic)."""
    return next(_GEN)


def _frozen(a: np.ndarray) -> np.ndarray:
    c = a.copy()
    c.setflags(write=False)
    return c


class _Rows:
    """The identity of a set of row arrays, and the storages holding them
    (more than one after :meth:`Storage.fork`). Views name it as their
    ``owner``: forks at one version read the same rows, so a device mirror
    keyed on it serves them all. ``memo`` is a backend's to keep what it
    derives from the arrays alone (a kernel's argument tuple); the storage
    drops it whenever it replaces an array, and a backend checks it against
    an array of the view it reads (identity), so a stale memo is never used."""

    __slots__ = ("holders", "memo", "row_memo", "shared", "__weakref__")

    def __init__(self, holder: Storage):
        self.holders = weakref.WeakSet([holder])
        self.memo = None
        #: ``memo``'s twin for a storage's own, writable arrays, which a
        #: fused decode step writes.
        self.row_memo = None
        #: Whether a second holder ever joined: until then a write needs no
        #: look at the WeakSet (whose len is Python code, on every append).
        self.shared = False

    def join(self, holder: Storage) -> None:
        self.holders.add(holder)
        self.shared = True


def writes(method):
    """A method that writes row arrays: rows shared with a fork are copied
    first (copy on write), so the fork keeps its bits."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        if self._rows.shared and len(self._rows.holders) > 1:
            self._own()
        return method(self, *args, **kwargs)
    return wrapper


class Storage(abc.ABC):
    """Rows of one layer in the layout of docs/kernels.md: one family of KV
    modes per subclass (:func:`kvreg.storage.make_storage` picks it).

    The interface a layer drives: :meth:`check_rows` then :meth:`store`
    (rows of a prefill or an append, quantized as the family stores them),
    :meth:`append_row` (the decode step's one row, when the family has a
    faster path for it), :meth:`truncate`, :meth:`drop_front`,
    :meth:`gather`, :meth:`clear`, :meth:`release`, :meth:`view`,
    :meth:`fork` and :meth:`copy`, :meth:`stored_bytes`. Every mutation
    moves :attr:`version`; a refused call changes nothing.

    :meth:`fork` shares the rows copy-on-write (page by page through a
    snapshot for large layers, the arrays until the first write for small
    ones); counts, importance and the change log are the fork's own from the
    start.
    """

    #: A removal from the front (:meth:`drop_front`) of a multiple of this
    #: many rows keeps every stored bit; other counts may requantize rows.
    drop_align: int = 1

    # The arrays of ARRAYS and the window and tier bounds: an ndarray where
    # the family and mode hold one, else None. The mode says which, so they
    # are typed Any: ``ndarray | None`` would ask for a None check at every
    # read the mode already vouches for.
    k: Any
    v: Any
    kq: Any
    ks: Any
    vq: Any
    vs: Any
    xk: Any
    xv: Any
    thk: Any
    thv: Any
    k4: Any
    k4s: Any
    v4: Any
    v4s: Any
    t8k: Any
    t8ks: Any
    t8v: Any
    t8vs: Any
    k2: Any
    k2s: Any
    k2z: Any
    v2: Any
    v2s: Any
    v2z: Any
    b8: Any
    b4: Any

    def __init__(self, num_kv_heads: int, head_dim: int, mode: KvMode, exact_rows: int = 0):
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.mode = mode
        self.ngk = num_groups(head_dim, KV_K_GROUP)
        self.cap = 0
        self.lens = np.zeros(num_kv_heads, dtype=np.int64)
        self.seq_len = 0
        self._imp = np.zeros(0, dtype=np.float32)
        for name in ARRAYS:
            setattr(self, name, None)
        # The seed's field state, on every storage alike (ones and unset
        # where the mode has no field): storages compare and travel the same.
        self.kcol = np.ones((num_kv_heads, head_dim), dtype=np.float32)
        self.vcol = np.ones((num_kv_heads, head_dim), dtype=np.float32)
        self.kcol_set = np.zeros(num_kv_heads, dtype=bool)
        self.vcol_set = np.zeros(num_kv_heads, dtype=bool)
        self.exact_cap = 0
        self.xlen = np.zeros(num_kv_heads, dtype=np.int64)
        self.b8 = self.b4 = None
        self.window = 0
        #: Whether K (V) rows, and so the queries (outputs), live in the
        #: Walsh-Hadamard rotated basis.
        self.rot_k = mode.rotates_k and rotates(head_dim)
        self.rot_v = mode.rotates_v and rotates(head_dim)
        self.generation = next_generation()
        self.version = self.reset_version = next_generation()
        self._log_start = 0
        self._floors: deque[tuple[int, np.ndarray]] = deque(maxlen=FLOOR_LOG)
        self._view: KvView | None = None
        self._arrays: dict | None = None   # the view's read-only arrays by name (None: rebuild)
        self._rows = _Rows(self)
        self._snap: Snapshot | None = None   # the snapshot its row blocks map (forks)

    # ── what a family defines ──

    @abc.abstractmethod
    def block_names(self) -> tuple[str, ...]:
        """The per-row blocks (``[nkv, cap, ...]``) this mode stores."""

    @abc.abstractmethod
    def _block_specs(self, cap: int) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
        """``name: (shape, dtype)`` of each row block at capacity ``cap``."""

    @abc.abstractmethod
    def check_rows(self, k: np.ndarray, v: np.ndarray) -> None:
        """Refuse (:class:`~kvreg.errors.ShapeError`) rows ``[n, nkv', hd]``
        float32 of the alive heads this format cannot store; changes nothing."""

    @abc.abstractmethod
    def store(self, k: np.ndarray, v: np.ndarray, heads: np.ndarray, kernels) -> None:
        """Store rows ``k, v [n, nkv, hd]`` float32 on the alive ``heads``
        (checked by :meth:`check_rows`), in this family's format: the bits
        ``n`` one-row stores give. ``kernels``: the layer's backend (its
        exact-class kernels quantize and rotate)."""

    @abc.abstractmethod
    def stored_bytes(self) -> int:
        """Bytes of stored elements, counted as the seed's ``memory_bytes``."""

    def append_row(self, k: np.ndarray, v: np.ndarray, kernels) -> bool:
        """A decode step's one row ``[nkv, hd]`` float32 on every head, by
        this family's fast path: checked, then stored with the bits
        :meth:`store` gives it. False, having done nothing, where the family
        has no such path for this state (the layer then calls :meth:`store`)."""
        return False

    def head_block_names(self) -> tuple[str, ...]:
        """Per-head state arrays beyond the row blocks (``[nkv, ...]``)."""
        return ()

    def written_rows(self, block: str) -> np.ndarray:
        """Per head, how many leading rows of row block ``block`` hold data
        (``[nkv]``): every stored row here; a family whose newest rows live
        elsewhere (a float16 window) leaves their slots zero and says so."""
        return self.lens

    def field_frozen(self) -> bool:
        """Whether the seed's q8 field froze (only the ``_2f`` modes have one)."""
        return False

    def tiers_consistent(self) -> str | None:
        """What is wrong with the window/tier counters (None when they are
        sound): an imported record is checked with this before it is installed."""
        return None

    # ── views ──

    @property
    def imp(self) -> np.ndarray:
        """Accumulated attention mass per stored row (a view, ``[seq_len]``)."""
        return self._imp[: self.seq_len]

    def head_rows(self, h: int) -> int:
        return int(self.lens[h])

    def float_rows(self, side: str, h: int) -> np.ndarray:
        """Head ``h``'s stored ``side`` (``"k"``/``"v"``) rows, float32 and
        read-only: a view under f32, widened under f16/bf16, empty where that
        side is quantized."""
        block = getattr(self, side)
        if block is None:
            return np.zeros((0, self.head_dim), dtype=np.float32)
        rows = from_half(block[h, : self.lens[h]]).view()
        rows.flags.writeable = False
        return rows

    def attended_rows(self, side: str, h: int, lo: int, n: int) -> np.ndarray:
        """Rows ``[lo, n)`` of head ``h`` as the kernels answer with them
        (:meth:`KvView.attended_rows`)."""
        return self.view().attended_rows(side, h, lo, n)

    def view(self) -> KvView:
        """The frozen, read-only view kernels read (one per version)."""
        v = self._view
        if v is not None and v.version == self.version:
            return v
        if self._arrays is None:  # arrays (re)allocated since the last view
            self._arrays = {n: readonly(a) for n in ARRAYS if (a := getattr(self, n)) is not None}
        v = self._view = KvView(self._rows, self.mode, self.num_kv_heads, self.head_dim, self.cap, _frozen(self.lens),
                                self.rot_k, self.rot_v, *self._groups(self._arrays.get, _frozen), self.version,
                                self.reset_version, self._log_start, tuple(self._floors))
        return v

    def slot(self) -> DecodeSlot:
        """What a fused decode step writes: the view's fields over this
        storage's own arrays and live counts (:class:`~kvreg.views.DecodeSlot`)."""
        return DecodeSlot(self._rows, self.mode, self.num_kv_heads, self.head_dim, self.cap, self.lens, self.rot_k,
                          self.rot_v, *self._groups(lambda n: getattr(self, n), lambda a: a), self.version,
                          self.reset_version, self._log_start, tuple(self._floors))

    def _groups(self, array, count) -> Groups:
        """The view's row groups ``(dense, q8, exact, window, tiers)``, each
        array read through ``array(name)`` and each per-head count through
        ``count(a)`` (a frozen copy for a view, the array for a slot)."""
        return DenseRows(array("k"), array("v")), None, None, None, None

    # ── forks ──

    def copy(self) -> Storage:
        """A storage holding its own copy of every row (a deep copy)."""
        new = self._shallow()
        for name in ARRAYS:
            a = getattr(self, name)
            setattr(new, name, None if a is None else a.copy())
        new._snap, new._rows, new._arrays, new._view = None, _Rows(new), None, None
        return new

    def fork(self) -> Storage:
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
            for name in ARRAYS:   # the per-head arrays (windows, tiers, fields, exact rows): small, copied
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

    def _shallow(self) -> Storage:
        """Every attribute shared, then the small mutable ones made its own."""
        new = copy.copy(self)
        for name, val in vars(self).items():
            if isinstance(val, np.ndarray) and name not in ARRAYS:
                setattr(new, name, val.copy())
        new._floors = deque(self._floors, maxlen=FLOOR_LOG)
        return new

    def _block_bytes(self) -> int:
        return sum(getattr(self, n).nbytes for n in self.block_names())

    def _snapshot(self) -> Snapshot:
        """Move this storage's row blocks into a fresh snapshot it maps (a
        new capacity: room for a fork to decode on)."""
        if len(self._rows.holders) > 1:   # holders sharing its arrays keep them, and their identity
            self._rows.holders.discard(self)
            self._rows = _Rows(self)
        n = int(self.lens.max(initial=0))
        cap = max(self.cap, 2 * n, n + 4096)
        snap = Snapshot({b: getattr(self, b) for b in self.block_names()}, self.lens, cap, 0,
                                  int(self.lens.sum()) * self._row_block_bytes())
        self._install(snap)
        self._touch(arrays=True)          # a new capacity: mirrors re-read the layout
        snap.version = self.version
        return snap

    def _install(self, snap: Snapshot) -> None:
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
            for name in ARRAYS:
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
        view's arrays, a backend's memo on the owner."""
        self._arrays = None
        self._rows.memo = self._rows.row_memo = None

    def _rewritten(self) -> None:
        """A mutation a copy cannot follow by row counts: every row may differ."""
        self._touch()
        self.reset_version = self.version
        self._floors.clear()

    def _truncated(self, floor: np.ndarray | None = None) -> None:
        """Rows past ``lens`` (now; ``floor`` per head where a family rewrote
        rows below it too) may be rewritten: logged for mirrors."""
        self._touch()
        if len(self._floors) == self._floors.maxlen:
            self._log_start = self._floors[0][0]
        self._floors.append((self.version, self.lens.copy() if floor is None else np.array(floor, np.int64)))

    def renew_generation(self) -> None:
        """A fresh seed generation (a restored ring, a seal)."""
        self.generation = next_generation()
        self._touch()

    # ── capacity ──

    def _alloc(self, cap: int) -> dict[str, np.ndarray]:
        # np.empty: pages a dead head never writes are never faulted in. Under
        # a float16 window (q8, q4) the integer slots of the newest rows are
        # not written yet, and a wire export ships every stored position's
        # slot: zeros (lazily mapped pages too), kept zero by truncate.
        make = np.zeros if self.window else np.empty
        return {name: make(shape, dtype) for name, (shape, dtype) in self._block_specs(cap).items()}

    @writes
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

    # ── mutations (validated by the caller) ──

    @writes
    def append(self, rows: dict, heads: np.ndarray, n: int, exact: dict | None = None) -> None:
        """Write ``n`` rows to each of ``heads``: ``rows[name]`` is
        ``[len(heads), n, ...]`` for every block of the mode; ``exact``
        (``"xk"``/``"xv"``, ``[len(heads), t, hd]`` in field space) the
        exact copies of their first rows (q8, q4)."""
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

    def _cut(self, new_lens: np.ndarray) -> None:
        """Heads shrink to ``new_lens`` (truncate, drop_front, gather set
        ``lens`` after): a family with per-head state beyond the blocks
        mends it here, before ``lens`` moves."""

    def _after_cut(self) -> None:
        """After ``lens`` moved down: a family's per-head state follows."""

    @writes
    def truncate(self, d: int) -> None:
        """Drop the last ``d`` rows of every head (generation kept)."""
        new = np.maximum(self.lens - d, 0)
        self._cut(new)
        self.lens = new
        np.minimum(self.xlen, self.lens, out=self.xlen)
        self._after_cut()
        self.seq_len = max(self.seq_len - d, 0)
        self._truncated()

    def _drop_front_extra(self, d: int) -> None:
        """drop_front's share of a family's per-head state (exact rows, window, tiers)."""

    @writes
    def drop_front(self, d: int) -> None:
        """Drop the first ``d`` rows of every head (fewer for a shorter head)."""
        for name in self.block_names():
            blk = getattr(self, name)
            for h in range(self.num_kv_heads):
                n, dh = int(self.lens[h]), min(d, int(self.lens[h]))
                if dh:
                    blk[h, : n - dh] = blk[h, dh:n]
        self._drop_front_extra(d)
        new = np.maximum(self.lens - d, 0)
        self._cut(new)
        self.lens = new
        self._after_cut()
        di = min(d, self.seq_len)
        self._imp[: self.seq_len - di] = self._imp[di : self.seq_len].copy()
        self.seq_len -= di
        self.generation = next_generation()
        self._rewritten()

    def _gather_extra(self, kept: np.ndarray) -> None:
        """gather's share of a family's per-head state."""

    @writes
    def gather(self, kept: np.ndarray, gather_rows) -> None:
        """Keep rows ``kept`` (ascending) of every head, each block on its own
        (the seed's review regression: in mixed q8k/q8v modes K and V live in
        different storages). ``gather_rows``: the backend's kernel."""
        for name in self.block_names():
            blk = getattr(self, name)
            for h in range(self.num_kv_heads):
                n = int(self.lens[h])
                if n == 0:
                    continue
                idx = kept[kept < n]
                blk[h, : idx.size] = gather_rows(blk[h], idx)
        self._gather_extra(kept)
        lens = np.array([int(np.count_nonzero(kept < n)) for n in self.lens], dtype=np.int64)
        self._cut(lens)
        self.lens = lens
        self._after_cut()
        imp = self._imp[kept].copy()
        self._imp[: kept.size] = imp
        self.seq_len = int(kept.size)
        self.generation = next_generation()
        self._rewritten()

    def _clear_extra(self) -> None:
        """clear's share of a family's per-head state."""

    @writes
    def clear(self) -> None:
        """Forget every row (and a q8 field); capacity is kept for reuse."""
        self._cut(np.zeros_like(self.lens))
        self.lens[:] = 0
        self.xlen[:] = 0
        self._clear_extra()
        self._after_cut()
        self.seq_len = 0
        self.generation = next_generation()
        self._rewritten()

    @writes
    def release(self) -> None:
        """Clear and give the capacity back (an O(1) seal's memory claim)."""
        self.clear()
        for name in self.block_names():
            setattr(self, name, None)
        self.cap = 0
        self._snap = None
        self._imp = np.zeros(0, dtype=np.float32)
        self._touch(arrays=True)

    @writes
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

    # ── the fused decode step (a backend's append_attend_layer) ──

    def _row_steps(self) -> bool:
        """Whether a decode step may store through the backend's fused step."""
        return False

    def _row_step_room(self) -> bool:
        """Whether the fused step has the slots it writes (the row's importance)."""
        return self.seq_len < self._imp.shape[0]

    def append_row_attend_by(self, k: np.ndarray, v: np.ndarray, backend, **attend) -> np.ndarray | None:
        """A decode step's store and the attention over the rows with it in
        one ``backend`` call, :meth:`~kvreg.plugin.Backend.append_attend_layer`
        (``attend``: the query ``q`` and the attention's arguments), with the
        bits :meth:`append_row` stores. Returns the answer, or None having
        stored nothing: another mode, no room, heads holding different
        counts, a window not yet full, or no fused kernel (the layer then
        appends and attends in two calls)."""
        if not (self._row_steps() and self._row_step_room()):
            return None
        rows = self._rows
        if rows.shared and len(rows.holders) > 1:
            self._own()
            rows = self._rows
        out = backend.append_attend_layer(k, v, attend.pop("q"), self.slot(), imp=self._imp, seq=self.seq_len,
                                          owner=rows, **attend)
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
        step = self._row_steps() and backend.prepare_append_attend(self.slot(), owner=self._rows, **attend)
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
