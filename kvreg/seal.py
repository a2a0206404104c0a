"""The O(1) seal of a layer: ``layer.seal`` (the seed's ``o1_*`` methods).

A sealed layer holds a constant amount of memory whatever the context: its
exact sinks and window, and a far field standing for every older row.

Collecting: the prompt runs exact attention (the layer's rows are stored as
usual); a self-sealing layer (``begin(..., auto=True)``) or the host records
the prompt's queries. :meth:`Seal.seal` validates everything first and only
then converts: the far field is built from the rows as attention reads them,
and the O(context) storage is released. A seal that cannot proceed latches
an error, clears the layer and refuses appends until ``clear()``. Sealed:
:meth:`Seal.step` (or ``append`` + ``attend_layer`` on a self-sealing
layer) replaces cache attention.

Two far fields:

* ``"tiered"`` (the default, :mod:`kvreg.tiered_seal`): exact rows chosen by
  attention mass all along decode, and the rows that leave them held in 4
  bits in the memory of ``m`` float32 rows; it needs no query trace, and
  every KV mode seals;
* ``"nystrom"`` (the seed's landmark estimator, :mod:`kvreg.nystrom`): the
  far rows summarized by landmark keys fit to the prompt's queries; it needs
  the full query trace. A backend may accelerate it (the Nyström
  capability); the reference runs it everywhere else.
"""

from __future__ import annotations

import logging
import os
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

import numpy as np

from . import _validate as V
from .attention import widened_rows
from .errors import ConfigError, SealError, ShapeError, StateError
from .eviction import observed_mass
from .lifecycle import Lifecycle
from .modes import KvMode
from .nystrom import O1Rect, o1_deferred_boundary, seal_groups
from .tiered_seal import FAR_FORMATS, TieredSeal, exact_format

if TYPE_CHECKING:
    from .layer import LayerKvCache

log = logging.getLogger("kvreg.o1")

#: The far fields a seal can build (``begin(..., far=...)``); the first is the default.
FAR_FIELDS = ("tiered", "nystrom")

#: Rows an observation window's scores are averaged over (SnapKV's pooling):
#: a row next to a heavy one is kept with it.
OBSERVE_POOL = 7


@dataclass
class Collecting:
    m: int
    w: int
    sink: int
    rect: O1Rect
    #: Completed-row barrier: None = the caller asks for a full-prompt seal.
    seal_at: int | None
    #: Rotated queries, one ``[num_heads * hd]`` row per traced position.
    q_rows: list = field(default_factory=list)
    #: Far rows kept exact per group; None = ``m``.
    heavy: int | None = None
    #: Prompt queries whose attention scores the rows at the seal (tiered; 0 = the layer's importance).
    observe: int = 0
    #: The last ``observe`` queries seen, ``[n, nh, hd]`` (tiered, ``observe > 0``).
    recent_q: np.ndarray | None = None

    def q_len(self) -> int:
        return sum(int(r.size) for r in self.q_rows)


@dataclass
class Sealed:
    #: per KV group, a :class:`~kvreg.nystrom.NystromState` (``far="nystrom"``)
    groups: list
    #: every group at once (``far="tiered"``)
    tiered: TieredSeal | None = None


class Seal:
    """A layer's O(1) lifecycle. The layer holds one (``layer.seal``) from
    its construction; it is idle (the layer plain) until :meth:`begin`.
    Every method holds the layer's lock."""

    def __init__(self, layer: LayerKvCache):
        self._layer = layer
        self.reset()

    def reset(self, error: str | None = None) -> None:
        """Idle again (a fresh layer, ``clear``, an import), or latching
        ``error`` (a failed seal)."""
        #: the phase's data: the query trace while collecting, the far field once sealed
        self.phase: Collecting | Sealed | None = None
        #: (m, w, sink, rect, heavy, observe) of the last begin (recollect reuses them)
        self.params: tuple | None = None
        self.scale: float | None = None
        self.q_stride = 1
        #: set by a seal, consumed by take_transition
        self.transitioned = False
        #: a latched seal failure: appends are refused until clear()
        self.error = None if error is None else str(error)
        #: self-sealing (begin(..., auto=True))
        self.auto = False
        #: the query heads of the recorded trace (self-sealing)
        self.num_heads: int | None = None
        #: the row an append on a sealed self-sealing layer handed over, for
        #: the attend_layer that follows
        self.staged: tuple | None = None
        self.far = FAR_FIELDS[0]
        self.far_format = "int4"
        #: a sliding layer's window (tiered): the seal reads the newest ``window`` positions only
        self.window: int | None = None
        lay = self._layer
        if error is not None:
            lay._lifecycle = Lifecycle.FAILED
        else:
            lay._lifecycle = Lifecycle.BOUNDED if lay.ring is not None else Lifecycle.PLAIN

    def _enter(self, state: Lifecycle) -> None:
        self._layer._lifecycle = state

    # ── arming and the query trace ──

    def begin(self, m: int, w: int, sink: int, rect: O1Rect = O1Rect.Aggregate, seal_at: int | None = None, *,
              scale=None, heavy: int | None = None, auto: bool = False, far: str = FAR_FIELDS[0],
              far_format: str = "int4", observe: int = 0, window: int | None = None) -> None:
        """Arm collection for a fresh prompt pass, with an optional
        completed-row seal barrier ``seal_at``.

        The geometry (m >= 4, w > 0) is checked by the seal, as the seed
        does; here only the types. ``scale`` is the score scale (1/√hd by
        default); ``heavy`` the far rows each group keeps exact (None:
        ``m``); ``far`` the far field (module docstring). The tiered far
        field also takes ``far_format`` (how its far rows are stored:
        ``"int4"``, ``"int2"`` or ``"int8"``) and ``observe``: score the
        prompt's rows at the seal, per KV group, by the attention of its last
        ``observe`` queries (SnapKV's observation window, pooled over
        :data:`OBSERVE_POOL` rows) instead of the mass every prompt query
        gave them summed over all heads; ``m = 0`` keeps no far rows (a
        fixed-budget eviction of ``sink + w + heavy`` rows per group);
        ``window`` seals a sliding layer: only rows of the newest ``window``
        positions are kept and read (its far tier holds at most what the
        window leaves).

        ``auto=True`` makes the layer seal itself inside the ordinary decode
        protocol: ``attend_chunk``/``attend_layer`` record the queries they
        see while collecting, the first one-row ``append`` after the prompt
        (once the layer holds the boundary's rows) seals, and a sealed layer
        takes ``append(k, v)`` then ``attend_layer(q)`` as one :meth:`step`.
        A seal the layer cannot make there (a malformed prerequisite) leaves
        it plain, its rows exact, with a warning, instead of latching."""
        lay = self._layer
        with lay.lock:
            m, w, sink = V.nonneg_int("m", m), V.nonneg_int("w", w), V.nonneg_int("sink", sink)
            heavy = None if heavy is None else int(V.nonneg_int("heavy", heavy))
            if seal_at is not None:
                seal_at = V.position("seal_at", seal_at)
            if not isinstance(rect, O1Rect):
                raise ShapeError(f"rect must be an O1Rect, got {rect!r}")
            if lay.ring is not None:
                raise StateError("a bounded-anchor layer cannot take an O(1) overlay")
            scale = float(V.scale(scale) if scale is not None else lay.default_scale)
            auto = V.flag("auto", auto)
            if far not in FAR_FIELDS:
                raise ConfigError(f"far must be one of {', '.join(map(repr, FAR_FIELDS))}, got {far!r}")
            if far_format not in FAR_FORMATS:
                raise ConfigError(f"far_format must be one of {', '.join(map(repr, FAR_FORMATS))}, "
                                  f"got {far_format!r}")
            observe = int(V.nonneg_int("observe", observe))
            if window is not None:
                window = int(V.positive_int("window", window))
            if far != "tiered" and (observe or far_format != "int4" or window is not None):
                raise ConfigError("observe, far_format and window are the tiered far field's; the Nystrom seal "
                                  "reads the whole query trace")
            self.reset()
            self.phase = Collecting(int(m), int(w), int(sink), rect, seal_at, heavy=heavy, observe=observe)
            self.params = (int(m), int(w), int(sink), rect, heavy, observe)
            self.scale, self.auto, self.far, self.far_format, self.window = scale, auto, far, far_format, window
            self._enter(Lifecycle.COLLECTING)

    @property
    def collecting(self) -> bool:
        return self._layer._lifecycle is Lifecycle.COLLECTING

    @property
    def sealed(self) -> bool:
        return self._layer._lifecycle is Lifecycle.SEALED

    # The lifecycle says which phase the layer is in; these name its data
    # for code that checked :attr:`collecting` or :attr:`sealed` first.

    @property
    def _collecting_phase(self) -> Collecting:
        return cast(Collecting, self.phase)

    @property
    def _sealed_phase(self) -> Sealed:
        return cast(Sealed, self.phase)

    def push_q(self, q_all) -> None:
        """Record one traced position's rotated queries (``num_heads*hd``).
        No-op unless collecting."""
        lay = self._layer
        with lay.lock:
            if not self.collecting:
                return
            q = V.flat("q_all", q_all)
            if q.size == 0 or q.size % lay.head_dim:
                raise ShapeError(f"q_all has {q.size} values; expected num_heads * {lay.head_dim}")
            self._collecting_phase.q_rows.append(q.copy() if np.shares_memory(q, q_all) else q)

    def set_q_trace(self, q) -> None:
        """The whole query trace at once, ``[rows / stride][num_heads][hd]``."""
        with self._layer.lock:
            if self.collecting:
                flat = V.flat("q", q)
                self._collecting_phase.q_rows = [flat.copy() if np.shares_memory(flat, q) else flat]

    def set_q_stride(self, stride: int) -> None:
        """One row in ``stride`` is in the query trace."""
        with self._layer.lock:
            self.q_stride = max(V.nonneg_int("stride", stride), 1)

    def q_trace(self) -> np.ndarray | None:
        """The rotated-query trace collected so far (flat), while collecting."""
        with self._layer.lock:
            if not self.collecting:
                return None
            rows = self._collecting_phase.q_rows
            return np.concatenate(rows) if rows else np.zeros(0, dtype=np.float32)

    def recollect(self, k, v, q, stride: int, rows: int) -> bool:
        """Back to collecting over rows kept in host memory (``k``, ``v``:
        ``[rows][nkv][hd]``); the next seal builds the far field anew."""
        lay = self._layer
        with lay.lock:
            if not self.sealed or self.params is None:
                return False
            rows = V.position("rows", rows)
            stride = max(V.nonneg_int("stride", stride), 1)
            nkv, hd = lay.num_kv_heads, lay.head_dim
            kk = V.array("k", k, (rows, nkv, hd))
            vv = V.array("v", v, (rows, nkv, hd))
            qq = V.flat("q", q).copy()
            m, w, sink, rect, heavy, observe = self.params
            lay._replace_rows(kk.transpose(1, 0, 2), vv.transpose(1, 0, 2))
            self.q_stride = stride
            self.phase = Collecting(m, w, sink, rect, rows, [qq], heavy, observe)
            self._enter(Lifecycle.COLLECTING)
            return True

    # ── boundary ──

    def set_boundary(self, at: int) -> None:
        with self._layer.lock:
            at = V.position("at", at)
            if self.collecting:
                self._collecting_phase.seal_at = at

    def pending_boundary(self) -> int | None:
        return self._collecting_phase.seal_at if self.collecting else None

    def boundary_crossed_by(self, count: int) -> bool:
        """Whether appending ``count`` exact rows would cross the deferred
        boundary. A batch that ends exactly on it crosses nothing (all its rows
        are exact; the caller seals after it); ``KVREG_O1_WALK_BOUNDARY=1``
        walks such a batch row by row as before."""
        count = V.nonneg_int("count", count)
        target = self.pending_boundary()
        if target is None:
            return False
        walk = os.environ.get("KVREG_O1_WALK_BOUNDARY") == "1"
        held = self._layer.seq_len
        nxt = held + count
        return target <= held or nxt > target or (walk and nxt == target)

    def take_transition(self) -> bool:
        t, self.transitioned = self.transitioned, False
        return t

    # ── seal ──

    def abort(self, err: str) -> None:
        """Clear the exact storage, drop the overlay and latch ``err``."""
        lay = self._layer
        with lay.lock:
            lay._replace_rows(None, None)
            self.reset(error=str(err))

    def seal(self, num_heads: int) -> bool:
        """Seal; on a malformed prerequisite abort (latch, clear) and return
        False. False also while below the deferred boundary."""
        with self._layer.lock:
            try:
                return self.seal_checked(num_heads)
            except SealError as exc:
                log.error("o1: seal aborted: %s", exc)
                self.abort(str(exc))
                return False

    def seal_checked(self, num_heads: int) -> bool:
        """Checked seal: validation runs while the collecting state and the
        full KV are intact; only a valid completed boundary converts. Raises
        :class:`SealError` (nothing changed) on a malformed prerequisite."""
        lay = self._layer
        with lay.lock:
            if self.error is not None:
                raise SealError(self.error)
            if not self.collecting:
                return self.sealed   # idempotent; a plain layer is not a participant
            col = self._collecting_phase
            floor = self._floor(col)
            target = max(col.seal_at if col.seal_at is not None else floor, floor)
            t = lay.seq_len
            if t < target:
                if col.seal_at != target:
                    col.seal_at = target
                    log.info("o1 deferred seal: current rows=%d, boundary=%d (floor=%d)", t, target, floor)
                return False
            hd, nkv = lay.head_dim, lay.num_kv_heads
            if t == 0:
                raise SealError("o1 seal: cannot seal an empty layer")
            try:
                num_heads = V.gqa(num_heads, nkv)
            except ShapeError:
                raise SealError(f"o1 seal: invalid GQA geometry num_heads={num_heads} num_kv_heads={nkv}") from None
            expected_q = -(-t // self.q_stride) * hd * num_heads
            tiered = self.far == "tiered"
            if col.q_len() != expected_q and not tiered:
                raise SealError(f"o1 seal: query trace has {col.q_len()} values, expected {expected_q}")
            if lay.base or (lay.storage.lens != t).any():
                raise SealError("o1 seal: KV heads are not densely populated")
            if (col.m < 4 and not tiered) or col.w == 0:
                raise SealError(f"o1 seal: invalid geometry m={col.m} w={col.w}")
            scale = cast(float, self.scale)   # begin set it with the phase
            if tiered:
                keys, values = self._rows("tiered")
                if col.recent_q is not None:
                    mass = observed_mass(col.recent_q[-t:], keys, scale, OBSERVE_POOL)
                else:
                    mass = np.array(lay.storage.imp[:t], dtype=np.float32)
                state = TieredSeal(col.m, col.w, col.sink, col.m if col.heavy is None else col.heavy,
                                   num_kv_heads=nkv, hpk=num_heads // nkv, head_dim=hd, scale=scale,
                                   fmt=exact_format(lay.mode), far_format=self.far_format, window=self.window,
                                   kernels=lay.backend)
                state.seal(np.asarray(keys, dtype=np.float32), np.asarray(values, dtype=np.float32), mass)
                return self._sealed(Sealed([], tiered=state))
            rows = col.q_rows
            trace = (rows[0] if len(rows) == 1 else np.concatenate(rows)).reshape(-1, num_heads, hd)
            keys, values = self._rows("Nyström", trace)
            groups = seal_groups(trace, keys, values, m=col.m, w=col.w, sink=col.sink, rect=col.rect,
                                 heavy=col.heavy, stride=self.q_stride, scale=scale, kernels=lay.backend)
            return self._sealed(Sealed(groups))

    def _sealed(self, phase: Sealed) -> bool:
        # The far field carries everything decode needs: release the
        # O(context) storage (this is the memory claim, not a cosmetic).
        self._layer._release_rows()
        self.phase = phase
        self.transitioned = True
        self._enter(Lifecycle.SEALED)
        return True

    def _floor(self, col: Collecting) -> int:
        """The earliest row count a seal happens at: the seed's deferred
        boundary; for the tiered far field, one row past the exact budget
        (``sink + w + heavy``: below it nothing would leave the exact rows)."""
        if self.far == "tiered":
            return col.sink + col.w + (col.m if col.heavy is None else col.heavy) + 1
        return o1_deferred_boundary(col.w, col.sink, col.m)

    def _rows(self, far: str, trace: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
        """The layer's rows ``[nkv, t, hd]`` as attention reads them (widened,
        dequantized, un-rotated float32): every mode seals from them. A
        NaN/inf there (or in the query ``trace``) makes the far field NaN: a
        malformed prerequisite like the others (abort and latch), found
        before anything converts."""
        lay = self._layer
        t, st = lay.seq_len, lay.storage
        keys, values = (st.k[:, :t], st.v[:, :t]) if lay.mode is KvMode.F32 else widened_rows(st, lay.backend, 0, t)
        named = (("query trace", trace),) if trace is not None else ()
        for name, a in named + (("keys", keys), ("values", values)):
            if not np.isfinite(a).all():
                raise SealError(f"o1 seal: the {name} hold NaN/inf; the {far} far field needs finite rows")
        return keys, values

    # ── self-sealing (auto) ──

    def record(self, q: np.ndarray) -> None:
        """A self-sealing layer's attend saw queries ``q [..., nh, hd]``: trace them."""
        if not (self.auto and self.collecting):
            return
        nh = q.shape[-2]
        if self.num_heads not in (None, nh):
            raise ShapeError(f"attend with {nh} query heads on a layer collecting {self.num_heads}-head queries")
        self.num_heads = nh
        col = self._collecting_phase
        if self.far != "tiered":
            col.q_rows.append(np.array(q, dtype=np.float32).ravel())
        elif col.observe:  # the tiered seal keeps only its observation window
            q = np.asarray(q, dtype=np.float32).reshape(-1, nh, q.shape[-1])
            held = q if col.recent_q is None else np.concatenate([col.recent_q, q])
            col.recent_q = held[-col.observe:].copy()

    def auto_append(self, k: np.ndarray, v: np.ndarray) -> bool:
        """``append`` of one row ``k, v [nkv, hd]`` on a self-sealing layer:
        seal at the prompt's end, stage the row on a sealed layer. True when
        the row was taken here (it is not stored as an exact row)."""
        if not self.auto:
            return False
        if self.sealed:
            if not (np.isfinite(k).all() and np.isfinite(v).all()):
                raise ShapeError("append on a sealed layer: k and v must be finite")
            self.staged = (k.copy(), v.copy())
            return True
        if not self.seal_if_ready(stacklevel=5):
            return False
        self.staged = (k.copy(), v.copy())
        return True

    def seal_if_ready(self, stacklevel: int = 4) -> bool:
        """Seal a self-sealing layer that holds its boundary's rows (a host
        that prefilled the whole prompt seals at its end, so the prompt's
        rows are not held past its forward). A seal that cannot be made
        leaves the layer plain, its rows exact, with a warning. Whether the
        layer is sealed now."""
        if not self.auto:
            return False
        with self._layer.lock:
            if self.sealed:
                return True
            held = self._layer.seq_len
            if not self.collecting or not held or self.num_heads is None:
                return False
            col = self._collecting_phase
            if held < max(col.seal_at or 0, self._floor(col)):
                return False  # a short prompt: exact rows until the layer holds the boundary's
            try:
                return self.seal_checked(self.num_heads)
            except SealError as exc:
                warnings.warn(f"kvreg: the O(1) seal could not be made ({exc}); the layer stays exact",
                              stacklevel=stacklevel)
                self.reset()
                return False

    def auto_attend(self, q: np.ndarray) -> np.ndarray:
        """``attend_layer(q)`` on a sealed self-sealing layer: the step of the staged row."""
        if not self.auto:
            raise StateError("attend_layer on a sealed O(1) layer: decode through o1_step "
                             "(or arm the seal with o1_begin(..., auto=True))")
        if self.staged is None:
            raise StateError("attend_layer on a sealed layer needs the position's row first: append(k, v)")
        k, v = self.staged
        self.staged = None
        return self.step(q, k, v, q.shape[0])

    # ── sealed decode ──

    def step(self, q_all, k_new, v_new, num_heads: int) -> np.ndarray:
        """One decode step on a sealed layer: per KV group insert the group's
        fresh (k, v) once and read every Q head. Returns ``[num_heads, hd]``."""
        lay = self._layer
        with lay.lock:
            if not self.sealed:
                raise StateError("o1_step on a layer that is not sealed")
            nkv, hd = lay.num_kv_heads, lay.head_dim
            num_heads = V.gqa(num_heads, nkv)
            q = V.array("q_all", q_all, (num_heads, hd))
            k = V.rows("k_new", k_new, nkv, hd)
            v = V.rows("v_new", v_new, nkv, hd)
            if lay.pos_len >= V.MAX_POSITION:
                raise ShapeError("o1_step past absolute position 2**53: float64 does not resolve positions beyond it")
            # Every group inserts its row: refuse before the first one does.
            if not (np.isfinite(q).all() and np.isfinite(k).all() and np.isfinite(v).all()):
                raise ShapeError("o1_step: q_all, k_new and v_new must be finite")
            hpk = num_heads // nkv
            phase = self._sealed_phase
            tiered = phase.tiered
            if tiered is not None:
                if tiered.hpk != hpk:
                    raise ShapeError(f"o1_step with {num_heads} query heads on a layer sealed for {tiered.hpk * nkv}")
                out = tiered.step(q, k, v)
            else:
                out = np.empty((num_heads, hd), dtype=np.float32)
                for g, state in enumerate(phase.groups):
                    out[g * hpk:(g + 1) * hpk] = state.step_group(q[g * hpk:(g + 1) * hpk], k[g], v[g])
            # The honest context depth: nothing is stored per position.
            lay._count_position()
            return out

    def memory_bytes(self) -> int:
        """Bytes of the overlay: the query trace while collecting, the far
        field once sealed."""
        if self.collecting:
            return self._collecting_phase.q_len() * 4
        if self.sealed:
            phase = self._sealed_phase
            tiered = phase.tiered
            return tiered.memory_bytes() if tiered is not None else sum(g.memory_bytes() for g in phase.groups)
        return 0
