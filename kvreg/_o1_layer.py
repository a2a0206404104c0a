"""The O(1) Nyström lifecycle of a layer (the seed's ``o1_*`` methods).

Collecting: the prompt runs exact attention while the rotated queries are
recorded (``o1_push_q``). ``o1_seal`` validates everything first and only then
converts: per KV group a :class:`~kvreg.nystrom.NystromState` is built from the
group's rows and queries, and the O(context) storage is released. A seal that
cannot proceed latches an error, clears the layer and refuses appends until
``clear()``. Sealed: ``o1_step`` replaces cache attention.
"""

from __future__ import annotations

import logging
import os
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np

from . import _validate as V
from .errors import ConfigError, SealError, ShapeError, StateError
from .lifecycle import Lifecycle
from .modes import KvMode
from .nystrom import NystromState, O1Rect, o1_deferred_boundary
from .tiered_seal import TieredSeal, exact_format

log = logging.getLogger("kvreg.o1")

#: The far fields a seal can build (``o1_begin(..., far=...)``).
FAR_FIELDS = ("nystrom", "tiered")


@dataclass
class O1Collecting:
    m: int
    w: int
    sink: int
    rect: O1Rect
    #: Completed-row barrier: None = the caller asks for a full-prompt seal.
    seal_at: int | None
    #: Rotated queries, one ``[num_heads * hd]`` row per traced position.
    q_rows: list = field(default_factory=list)
    #: Far rows kept exact per group (:class:`~kvreg.nystrom.NystromState`
    #: ``heavy``); None = ``m``.
    heavy: int | None = None

    def q_len(self) -> int:
        return sum(int(r.size) for r in self.q_rows)


@dataclass
class O1Sealed:
    #: per KV group, a :class:`~kvreg.nystrom.NystromState` (``far="nystrom"``)
    groups: list
    #: every group at once (``far="tiered"``)
    tiered: TieredSeal | None = None


@dataclass
class O1Overlay:
    """Everything a layer's O(1) lifecycle holds, in one place (the layer's
    ``lifecycle`` says which phase it is in). ``phase`` is the phase's data:
    the query trace while collecting, the per-group states once sealed."""

    phase: O1Collecting | O1Sealed | None = None
    #: (m, w, sink, rect, heavy) of the last o1_begin (o1_recollect reuses them)
    params: tuple | None = None
    scale: float | None = None
    q_stride: int = 1
    #: set by a seal, consumed by take_o1_transition
    transitioned: bool = False
    #: a latched seal failure: appends are refused until clear()
    error: str | None = None
    #: self-sealing (``o1_begin(..., auto=True)``): the layer records the
    #: queries its attends see and seals at the first one-row append after the
    #: prompt; a sealed layer then takes ``append`` + ``attend_layer``
    auto: bool = False
    #: the query heads of the recorded trace (self-sealing)
    num_heads: int | None = None
    #: the row an ``append`` on a sealed self-sealing layer handed over, for
    #: the ``attend_layer`` that follows
    staged: tuple | None = None
    #: the far field: "nystrom" (the seed's landmark estimator) or "tiered"
    #: (mass-chosen exact rows and 4-bit far rows, :mod:`kvreg.tiered_seal`)
    far: str = "nystrom"


class O1Mixin:
    """``o1_*`` methods of :class:`~kvreg.layer.LayerKvCache`: they read and
    write the layer's :class:`O1Overlay` (``_o1``), its storage and its
    lifecycle, nothing else."""

    def _init_o1(self, error: str | None = None) -> None:
        """No overlay (a fresh layer, clear, an import, an abort latching ``error``)."""
        self._o1 = O1Overlay(error=error)
        if error is not None:
            self._lifecycle = Lifecycle.FAILED
        else:
            self._lifecycle = Lifecycle.BOUNDED if self.bounded is not None else Lifecycle.PLAIN

    # ── arming and the query trace ──

    def o1_begin(self, m: int, w: int, sink: int, rect: O1Rect = O1Rect.Aggregate, *, scale=None,
                 heavy: int | None = None, auto: bool = False, far: str = "nystrom") -> None:
        """Arm query collection for a fresh prompt pass."""
        self.o1_begin_with_boundary(m, w, sink, rect, None, scale=scale, heavy=heavy, auto=auto, far=far)

    def o1_begin_with_boundary(self, m: int, w: int, sink: int, rect: O1Rect = O1Rect.Aggregate,
                               seal_at: int | None = None, *, scale=None,
                               heavy: int | None = None, auto: bool = False, far: str = "nystrom") -> None:
        """Arm collection with an optional completed-row seal barrier.

        The geometry (m >= 4, w > 0) is checked by the seal, as the seed does;
        here only the types. ``scale`` is the score scale (1/√hd by default);
        ``heavy`` the far rows each group keeps exact (None: ``m``).

        ``auto=True`` makes the layer seal itself inside the ordinary decode
        protocol: ``attend_chunk``/``attend_layer`` record the queries they
        see while collecting, the first one-row ``append`` after the prompt
        (once the layer holds the boundary's rows) seals, and a sealed layer
        takes ``append(k, v)`` then ``attend_layer(q)`` as one ``o1_step``. A
        seal the layer cannot make there (a malformed prerequisite) leaves it
        plain, its rows exact, with a warning, instead of latching.

        ``far`` is the far field: ``"nystrom"`` (the seed's landmark
        estimator, :mod:`kvreg.nystrom`) or ``"tiered"`` (exact rows chosen
        by attention mass all along decode, and the rows that leave them held
        in 4 bits in the memory of ``m`` float32 rows,
        :mod:`kvreg.tiered_seal`; it needs no query trace).
        """
        m, w, sink = V.nonneg_int("m", m), V.nonneg_int("w", w), V.nonneg_int("sink", sink)
        if heavy is not None:
            heavy = V.nonneg_int("heavy", heavy)
        if seal_at is not None:
            seal_at = V.position("seal_at", seal_at)
        if not isinstance(rect, O1Rect):
            raise ShapeError(f"rect must be an O1Rect, got {rect!r}")
        if self.bounded is not None:
            raise StateError("a bounded-anchor layer cannot take an O(1) overlay")
        scale = float(V.scale(scale) if scale is not None else self.default_scale)
        auto = V.flag("auto", auto)
        heavy = None if heavy is None else int(heavy)
        if far not in FAR_FIELDS:
            raise ConfigError(f"far must be one of {', '.join(map(repr, FAR_FIELDS))}, got {far!r}")
        self._o1 = O1Overlay(O1Collecting(int(m), int(w), int(sink), rect, seal_at, heavy=heavy),
                             params=(int(m), int(w), int(sink), rect, heavy), scale=scale, auto=auto,
                             far=far)
        self._lifecycle = Lifecycle.COLLECTING

    def o1_push_q(self, q_all) -> None:
        """Record one traced position's rotated queries (``num_heads*hd``).
        No-op unless collecting."""
        if self._lifecycle is not Lifecycle.COLLECTING:
            return
        q = V.flat("q_all", q_all)
        if q.size == 0 or q.size % self.head_dim:
            raise ShapeError(f"q_all has {q.size} values; expected num_heads * {self.head_dim}")
        self._o1.phase.q_rows.append(q.copy() if np.shares_memory(q, q_all) else q)

    def o1_set_q_trace(self, q) -> None:
        """The whole query trace at once, ``[rows / stride][num_heads][hd]``."""
        if self._lifecycle is Lifecycle.COLLECTING:
            flat = V.flat("q", q)
            self._o1.phase.q_rows = [flat.copy() if np.shares_memory(flat, q) else flat]

    def o1_set_q_stride(self, stride: int) -> None:
        """One row in ``stride`` is in the query trace."""
        self._o1.q_stride = max(V.nonneg_int("stride", stride), 1)

    def o1_q_trace(self) -> np.ndarray | None:
        """The rotated-query trace collected so far (flat), while collecting."""
        if self._lifecycle is not Lifecycle.COLLECTING:
            return None
        rows = self._o1.phase.q_rows
        return np.concatenate(rows) if rows else np.zeros(0, dtype=np.float32)

    def o1_recollect(self, k, v, q, stride: int, rows: int) -> bool:
        """Back to collecting over rows kept in host memory (``k``, ``v``:
        ``[rows][nkv][hd]``); the next seal builds the far field anew."""
        if self._lifecycle is not Lifecycle.SEALED or self._o1.params is None:
            return False
        rows = V.position("rows", rows)
        stride = max(V.nonneg_int("stride", stride), 1)
        nkv, hd = self.num_kv_heads, self.head_dim
        kk = V.array("k", k, (rows, nkv, hd))
        vv = V.array("v", v, (rows, nkv, hd))
        qq = V.flat("q", q).copy()
        m, w, sink, rect, heavy = self._o1.params
        self._kv_rows_changed(0)
        self._st.release()
        self._st.append({"k": kk.transpose(1, 0, 2), "v": vv.transpose(1, 0, 2)}, np.arange(nkv), rows)
        self._seq_len = rows
        self._base = 0
        self._o1.q_stride = stride
        self._o1.phase = O1Collecting(m, w, sink, rect, rows, [qq], heavy)
        self._lifecycle = Lifecycle.COLLECTING
        return True

    # ── boundary ──

    def o1_set_boundary(self, at: int) -> None:
        at = V.position("at", at)
        if self._lifecycle is Lifecycle.COLLECTING:
            self._o1.phase.seal_at = at

    def o1_sealed(self) -> bool:
        return self._lifecycle is Lifecycle.SEALED

    def o1_collecting(self) -> bool:
        return self._lifecycle is Lifecycle.COLLECTING

    def o1_pending_boundary(self) -> int | None:
        return self._o1.phase.seal_at if self._lifecycle is Lifecycle.COLLECTING else None

    def o1_boundary_crossed_by(self, count: int) -> bool:
        """Whether appending ``count`` exact rows would cross the deferred
        boundary. A batch that ends exactly on it crosses nothing (all its rows
        are exact; the caller seals after it); ``KVREG_O1_WALK_BOUNDARY=1``
        walks such a batch row by row as before."""
        count = V.nonneg_int("count", count)
        target = self.o1_pending_boundary()
        if target is None:
            return False
        walk = os.environ.get("KVREG_O1_WALK_BOUNDARY") == "1"
        nxt = self._seq_len + count
        return target <= self._seq_len or nxt > target or (walk and nxt == target)

    def take_o1_transition(self) -> bool:
        t, self._o1.transitioned = self._o1.transitioned, False
        return t

    def take_o1_error(self) -> str | None:
        """The latched seal failure, if any. Deliberately non-consuming: the
        error guards appends until ``clear()``."""
        return self._o1.error

    # ── seal ──

    def o1_abort(self, err: str) -> None:
        """Clear the exact storage, drop the overlay and latch ``err``."""
        self._kv_rows_changed(0)
        self._st.clear()
        self._seq_len = 0
        self._base = 0
        self._init_o1(error=str(err))

    def o1_seal(self, num_heads: int) -> bool:
        """Seal; on a malformed prerequisite abort (latch, clear) and return
        False. False also while below the deferred boundary."""
        try:
            return self.o1_seal_checked(num_heads)
        except SealError as exc:
            log.error("o1: seal aborted: %s", exc)
            self.o1_abort(str(exc))
            return False

    def o1_seal_checked(self, num_heads: int) -> bool:
        """Checked seal: validation runs while the collecting state and the
        full KV are intact; only a valid completed boundary converts. Raises
        :class:`SealError` (nothing changed) on a malformed prerequisite."""
        if self._o1.error is not None:
            raise SealError(self._o1.error)
        if self._lifecycle is not Lifecycle.COLLECTING:
            return self.o1_sealed()   # idempotent; a plain layer is not a participant
        col = self._o1.phase
        floor = self._o1_floor(col)
        target = max(col.seal_at if col.seal_at is not None else floor, floor)
        t = self._seq_len
        if t < target:
            if col.seal_at != target:
                col.seal_at = target
                log.info("o1 deferred seal: current rows=%d, boundary=%d (floor=%d)", t, target, floor)
            return False
        hd, nkv = self.head_dim, self.num_kv_heads
        if t == 0:
            raise SealError("o1 seal: cannot seal an empty layer")
        try:
            num_heads = V.gqa(num_heads, nkv)
        except ShapeError:
            raise SealError(f"o1 seal: invalid GQA geometry num_heads={num_heads} num_kv_heads={nkv}") from None
        stride = self._o1.q_stride
        expected_q = -(-t // stride) * hd * num_heads
        q_len = col.q_len()
        tiered = self._o1.far == "tiered"
        if q_len != expected_q and not tiered:
            raise SealError(f"o1 seal: query trace has {q_len} values, expected {expected_q}")
        if self._base or (self._st.lens != t).any():
            raise SealError("o1 seal: KV heads are not densely populated")
        if col.m < 4 or col.w == 0:
            raise SealError(f"o1 seal: invalid geometry m={col.m} w={col.w}")
        if tiered:
            return self._seal_tiered(col, num_heads)

        hpk = num_heads // nkv
        rows = col.q_rows
        trace = (rows[0] if len(rows) == 1 else np.concatenate(rows)).reshape(-1, num_heads, hd)
        pick = None if stride == 1 else np.arange(t) // stride
        keys, values = self._seal_rows("Nyström", trace)

        def seal_group(g: int) -> NystromState:
            state = NystromState.new_group(col.m, col.w, col.sink, hpk, scale=self._o1.scale,
                                           rect=col.rect, kernels=self._nystrom_kernels(),
                                           heavy=col.heavy)
            # This group's heads, each head's queries contiguous: [hpk, t, hd]
            # (position p reads trace row p // stride).
            qg = trace[:, g * hpk:(g + 1) * hpk]
            qs = np.ascontiguousarray((qg if pick is None else qg[pick]).transpose(1, 0, 2))
            state.prefill_group(qs, keys[g], values[g])
            return state

        # One group's state depends on its rows alone, so groups can seal on
        # threads -- where the backend's kernels release the GIL without
        # threading themselves. The reference's GEMMs are already threaded by
        # BLAS: threads on top oversubscribe the cores (9x slower measured).
        try:
            if nkv > 1 and self.backend.parallel_seal:
                with ThreadPoolExecutor(max_workers=min(nkv, os.cpu_count() or 1)) as pool:
                    groups = list(pool.map(seal_group, range(nkv)))
            else:
                groups = [seal_group(g) for g in range(nkv)]
        except (ShapeError, np.linalg.LinAlgError, FloatingPointError) as exc:
            # Nothing changed yet (the storage is released only below): a
            # fit the states refuse is a failed seal, latched like the rest.
            raise SealError(f"o1 seal: the far-field fit failed: {exc}") from exc
        return self._o1_enter_sealed(O1Sealed(groups))

    def _o1_enter_sealed(self, phase: O1Sealed) -> bool:
        # The states carry everything decode needs: release the O(context)
        # storage (this is the memory claim, not a cosmetic).
        self._kv_rows_changed(0)
        self._st.release()
        self._o1.phase = phase
        self._o1.transitioned = True
        self._lifecycle = Lifecycle.SEALED
        return True

    def _o1_floor(self, col: O1Collecting) -> int:
        """The earliest row count a seal happens at: the seed's deferred
        boundary; for the tiered far field, one row past the exact budget
        (``sink + w + heavy``: below it nothing would leave the exact rows)."""
        if self._o1.far == "tiered":
            return col.sink + col.w + (col.m if col.heavy is None else col.heavy) + 1
        return o1_deferred_boundary(col.w, col.sink, col.m)

    def _seal_rows(self, far: str, trace: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The layer's rows ``[nkv, t, hd]`` as attention reads them (widened,
        dequantized, un-rotated float32): every mode seals from them. A
        NaN/inf there (or in the query ``trace``) makes the far field NaN: a
        malformed prerequisite like the others (abort and latch), found
        before anything converts."""
        t, st = self._seq_len, self._st
        keys, values = (st.k[:, :t], st.v[:, :t]) if self.mode is KvMode.F32 else self._widened_rows(0, t)
        named = (("query trace", trace),) if trace is not None else ()
        for name, a in named + (("keys", keys), ("values", values)):
            if not np.isfinite(a).all():
                raise SealError(f"o1 seal: the {name} hold NaN/inf; the {far} far field needs finite rows")
        return keys, values

    def _seal_tiered(self, col: O1Collecting, num_heads: int) -> bool:
        """The ``far="tiered"`` seal (:mod:`kvreg.tiered_seal`): from the rows
        as attention reads them and their accumulated mass."""
        keys, values = self._seal_rows("tiered")
        mass = np.array(self._st.imp[:self._seq_len], dtype=np.float32)
        state = TieredSeal(col.m, col.w, col.sink, col.m if col.heavy is None else col.heavy,
                           num_kv_heads=self.num_kv_heads, hpk=num_heads // self.num_kv_heads,
                           head_dim=self.head_dim, scale=self._o1.scale, fmt=exact_format(self.mode))
        state.seal(np.asarray(keys, dtype=np.float32), np.asarray(values, dtype=np.float32), mass)
        return self._o1_enter_sealed(O1Sealed([], tiered=state))

    def _nystrom_kernels(self):
        # The state calls nystrom_prefill/absorb/step on the layer's backend.
        return self.backend

    # ── self-sealing (auto) ──

    def _o1_record(self, q: np.ndarray) -> None:
        """A self-sealing layer's attend saw queries ``q [..., nh, hd]``: trace them."""
        o = self._o1
        if not (o.auto and self._lifecycle is Lifecycle.COLLECTING):
            return
        nh = q.shape[-2]
        if o.num_heads not in (None, nh):
            raise ShapeError(f"attend with {nh} query heads on a layer collecting {o.num_heads}-head queries")
        o.num_heads = nh
        if o.far != "tiered":  # the tiered seal needs no query trace
            o.phase.q_rows.append(np.array(q, dtype=np.float32).ravel())

    def _o1_auto_append(self, k: np.ndarray, v: np.ndarray) -> bool:
        """``append`` of one row ``k, v [nkv, hd]`` on a self-sealing layer:
        seal at the prompt's end, stage the row on a sealed layer. True when
        the row was taken here (it is not stored as an exact row)."""
        o = self._o1
        if not o.auto:
            return False
        if self._lifecycle is Lifecycle.SEALED:
            if not (np.isfinite(k).all() and np.isfinite(v).all()):
                raise ShapeError("append on a sealed layer: k and v must be finite")
            o.staged = (k.copy(), v.copy())
            return True
        if self._lifecycle is not Lifecycle.COLLECTING or not self._seq_len or o.num_heads is None:
            return False
        col = o.phase
        if self._seq_len < max(col.seal_at or 0, self._o1_floor(col)):
            return False  # a short prompt: exact rows until the layer holds the boundary's
        try:
            self.o1_seal_checked(o.num_heads)
        except SealError as exc:
            warnings.warn(f"kvreg: the O(1) seal could not be made ({exc}); the layer stays exact", stacklevel=4)
            self._o1 = O1Overlay()
            self._lifecycle = Lifecycle.PLAIN
            return False
        o.staged = (k.copy(), v.copy())
        return True

    def _o1_auto_attend(self, q: np.ndarray) -> np.ndarray:
        """``attend_layer(q)`` on a sealed self-sealing layer: the step of the staged row."""
        o = self._o1
        if not o.auto:
            raise StateError("attend_layer on a sealed O(1) layer: decode through o1_step "
                             "(or arm the seal with o1_begin(..., auto=True))")
        if o.staged is None:
            raise StateError("attend_layer on a sealed layer needs the position's row first: append(k, v)")
        k, v = o.staged
        o.staged = None
        return self.o1_step(q, k, v, q.shape[0])

    # ── sealed decode ──

    def o1_step(self, q_all, k_new, v_new, num_heads: int) -> np.ndarray:
        """One decode step on a sealed layer: per KV group insert the group's
        fresh (k, v) once and read every Q head. Returns ``[num_heads, hd]``."""
        if self._lifecycle is not Lifecycle.SEALED:
            raise StateError("o1_step on a layer that is not sealed")
        nkv, hd = self.num_kv_heads, self.head_dim
        num_heads = V.gqa(num_heads, nkv)
        q = V.array("q_all", q_all, (num_heads, hd))
        k = V.rows("k_new", k_new, nkv, hd)
        v = V.rows("v_new", v_new, nkv, hd)
        if self.pos_len >= V.MAX_POSITION:
            raise ShapeError("o1_step past absolute position 2**53: float64 does not resolve positions beyond it")
        # Every group inserts its row: refuse before the first one does.
        if not (np.isfinite(q).all() and np.isfinite(k).all() and np.isfinite(v).all()):
            raise ShapeError("o1_step: q_all, k_new and v_new must be finite")
        hpk = num_heads // nkv
        tiered = self._o1.phase.tiered
        if tiered is not None:
            if tiered.hpk != hpk:
                raise ShapeError(f"o1_step with {num_heads} query heads on a layer sealed for {tiered.hpk * nkv}")
            out = tiered.step(q, k, v)
            self._seq_len += 1
            return out
        out = np.empty((num_heads, hd), dtype=np.float32)
        for g, state in enumerate(self._o1.phase.groups):
            out[g * hpk:(g + 1) * hpk] = state.step_group(q[g * hpk:(g + 1) * hpk], k[g], v[g])
        # The honest context depth: nothing is stored per position.
        self._seq_len += 1
        return out

    def o1_memory_bytes(self) -> int:
        """Bytes of the overlay: the query trace while collecting, the
        per-group states once sealed."""
        if self._lifecycle is Lifecycle.COLLECTING:
            return self._o1.phase.q_len() * 4
        if self._lifecycle is Lifecycle.SEALED:
            tiered = self._o1.phase.tiered
            return tiered.memory_bytes() if tiered is not None else sum(
                g.memory_bytes() for g in self._o1.phase.groups)
        return 0

