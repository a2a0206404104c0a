"""The natively bounded anchor (``swa_sink_v1``): a fixed-size K/V ring.

A bounded layer stores nothing per position. Each KV head owns a ring of
``window`` raw (un-rotated) key and value rows; token ``t`` lives in slot
``t % window``. A decode step inserts the new raw ``k, v`` and then attends
every Q head over its group's learned sink rows and the newest
``min(len, group_window)`` ring rows, applying RoPE to the query and to each
ring key at its absolute position. Memory is a property of the model file,
not of the conversation: :meth:`BoundedState.state_bytes` is constant in
tokens.

Speculative decoding needs to undo inserts: each insert keeps the rows it
overwrote in a preallocated undo buffer of ``undo_depth`` entries (no
allocation per token), so :meth:`BoundedState.rollback` restores the ring bit
for bit up to that depth.

Kernel contract (:func:`bounded_attend`, which a backend may override): pure,
float32 in and out, no state mutation; must match
:func:`kvreg_conformance.oracle.bounded_attend_oracle` (float64)
within the attention tolerance class.
"""

from __future__ import annotations

import itertools
import operator
import threading
import warnings
from dataclasses import dataclass

import numpy as np

from kvreg.errors import ConfigError, ShapeError, StateError
from kvreg.lifecycle import Lifecycle
from kvreg.views import RingView, readonly

__all__ = [
    "BoundedRope",
    "BoundedSnapshot",
    "BoundedState",
    "BoundedWeights",
    "Ring",
    "RingSlot",
    "bounded_attend",
    "check_bounded_attend_args",
    "ring_view",
]


#: Ring rows are indexed with int32 by the compiled kernels (and the wire's
#: window is a u32): a larger ring is refused, not wrapped.
MAX_WINDOW = 2**31 - 1
#: Ring positions are RoPE angles ``position * inv_freq`` in float64, exact
#: only up to 2**53 (the layer's ``MAX_POSITION``).
MAX_SEEN = 2**53

_VERSIONS = itertools.count(1)


def _next_version() -> int:
    return next(_VERSIONS)


def _count(value, name: str, *, minimum: int, maximum: int = 2**63 - 1) -> int:
    """An integer argument in ``[minimum, maximum]`` as a Python int (numpy
    integers too; bools refused: ``True`` is no count)."""
    if isinstance(value, (bool, np.bool_)):
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    try:
        n = operator.index(value)
    except TypeError:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}") from None
    if n < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {n}")
    if n > maximum:
        raise ConfigError(f"{name} must be an integer <= {maximum}, got {n}")
    return n


def _f32_rows(x, shape: tuple[int, ...], name: str) -> np.ndarray:
    """``x`` as a float32 array of ``shape`` (flat input of the same size is
    accepted), refusing non-numeric dtypes and non-finite values."""
    a = np.asarray(x)
    if a.dtype.kind not in "fiu":
        raise ShapeError(f"{name}: expected real numbers castable to float32, got dtype {a.dtype}")
    if a.shape != shape and a.shape != (int(np.prod(shape)),):
        flat = int(np.prod(shape))
        raise ShapeError(f"{name}: expected shape {shape} or ({flat},), got {a.shape}")
    with np.errstate(over="ignore"):  # an overflow becomes inf, refused just below
        out = a.astype(np.float32, copy=False).reshape(shape)
    # A NaN/inf row would poison every later softmax that reads it (and a
    # float64 value past float32's range turns into inf here), so refuse it
    # at the edge instead of returning NaN outputs window tokens later.
    if not np.isfinite(out).all():
        raise ShapeError(f"{name}: values must be finite in float32")
    return out


@dataclass(frozen=True)
class BoundedRope:
    """Rotate-half RoPE: base ``theta``, the first ``rotary_dims`` channels rotated.

    ``rotary_dims=None`` means all ``head_dim`` channels; it must be even and
    ``<= head_dim`` (0 disables rotation). With ``half = rd / 2``, ``x1`` the
    first ``half`` channels and ``x2`` the next ``half``, a row at position
    ``p`` becomes ``[x1*cos - x2*sin, x2*cos + x1*sin, x[rd:]]`` with angle
    ``p * theta**(-2i/rd)`` for pair ``i``. Angles, cos and sin are computed
    in float64 and rounded once to float32 (positions reach 1e5+, where a
    float32 angle would already be off by ~1e-2 rad); the rotation itself is
    float32 arithmetic.
    """

    theta: float = 10000.0
    rotary_dims: int | None = None

    def __post_init__(self):
        t = self.theta
        if isinstance(t, bool) or not isinstance(t, (int, float, np.number)) or not 0 < t < np.inf:
            raise ConfigError(f"BoundedRope.theta must be a finite number > 0, got {t!r}")
        if self.rotary_dims is not None:
            rd = _count(self.rotary_dims, "BoundedRope.rotary_dims", minimum=0)
            if rd % 2:
                raise ConfigError(f"BoundedRope.rotary_dims must be even, got {rd}")

    def dims(self, head_dim: int) -> int:
        """Rotated channels for ``head_dim``; refuses ``rotary_dims > head_dim``."""
        rd = head_dim if self.rotary_dims is None else self.rotary_dims
        if rd > head_dim or rd % 2:
            raise ConfigError(
                f"BoundedRope: rotary_dims must be even and <= head_dim {head_dim}, got {rd}"
            )
        return rd

    def inv_freq(self, head_dim: int) -> np.ndarray:
        """float64 ``theta**(-2i/rd)`` for the ``rd/2`` rotated pairs."""
        rd = self.dims(head_dim)
        return float(self.theta) ** (-2.0 * np.arange(rd // 2, dtype=np.float64) / max(rd, 1))

    def cos_sin(self, positions, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
        """``(cos, sin)``, float32 ``[len(positions), rotary_dims/2]``."""
        ang = np.asarray(positions, dtype=np.float64)[:, None] * self.inv_freq(head_dim)
        return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)

    def cos_sin_range(self, start: int, n: int, head_dim: int) -> tuple[np.ndarray, np.ndarray]:
        """``cos_sin(range(start, start + n))`` without ``n·rd/2`` fresh trig calls.

        Angle addition on a cached float64 table of offsets ``0..n-1``
        (``cos(a+b) = cos a cos b - sin a sin b``); the float64 result differs
        from direct evaluation by ~1e-15, far below the float32 rounding.
        """
        inv = self.inv_freq(head_dim)
        c0, s0 = offset_table(float(self.theta), inv, n)
        a = start * inv
        ca, sa = np.cos(a), np.sin(a)
        return (ca * c0 - sa * s0).astype(np.float32), (sa * c0 + ca * s0).astype(np.float32)

    def apply(self, x: np.ndarray, positions=None, *, start: int | None = None) -> np.ndarray:
        """Rotated float32 copy of ``x[..., n, hd]``: row ``j`` at ``positions[j]``
        (or at ``start + j`` when ``start`` is given instead)."""
        hd, n = x.shape[-1], x.shape[-2]
        if (positions is None) == (start is None):
            raise ConfigError("BoundedRope.apply: give exactly one of positions or start")
        if start is None:
            cos, sin = self.cos_sin(positions, hd)
        else:
            cos, sin = self.cos_sin_range(start, n, hd)
        half = cos.shape[1]
        out = np.empty(x.shape, np.float32)
        x1, x2 = x[..., :half], x[..., half : 2 * half]
        lo, hi = out[..., :half], out[..., half : 2 * half]
        # Written into slices of `out` to avoid full-size temporaries: this
        # runs over the whole window of keys on every decode step.
        tmp = np.multiply(x2, sin)
        np.multiply(x1, cos, out=lo)
        np.subtract(lo, tmp, out=lo)
        np.multiply(x1, sin, out=tmp)
        np.multiply(x2, cos, out=hi)
        np.add(hi, tmp, out=hi)
        out[..., 2 * half :] = x[..., 2 * half :]
        return out


_OFFSET_TABLES: dict[tuple[float, int], tuple[np.ndarray, np.ndarray]] = {}
_OFFSET_LOCK = threading.Lock()


def offset_table(theta: float, inv: np.ndarray, n: int) -> tuple[np.ndarray, np.ndarray]:
    """float64 cos/sin of ``j * inv`` for ``j < n``, cached per (theta, pairs)
    and grown by doubling (one table per model geometry, bounded by its
    window). A grown table replaces the old one whole, so readers on other
    threads keep the one they hold; backends share this cache."""
    key = (theta, inv.shape[0])
    table = _OFFSET_TABLES.get(key)
    if table is None or table[0].shape[0] < n:
        with _OFFSET_LOCK:
            table = _OFFSET_TABLES.get(key)
            if table is None or table[0].shape[0] < n:
                size = max(n, 2 * (0 if table is None else table[0].shape[0]))
                ang = np.arange(size, dtype=np.float64)[:, None] * inv
                table = _OFFSET_TABLES[key] = (np.cos(ang), np.sin(ang))
    c, s = table
    return c[:n], s[:n]


class BoundedWeights:
    """Learned per-layer weights of the bounded operator.

    ``sink_k``, ``sink_v``: float32 ``[kvh, sink, hd]`` (or flat) position-free
    sink rows per KV group; ``sink`` may be 0. ``group_windows``: ``kvh`` ints,
    each group's window (checked ``<= window`` against the ring at attend).
    Float32 sink arrays are held, not copied (they are model weights).
    """

    def __init__(self, sink_k, sink_v, sink: int, group_windows):
        sink = _count(sink, "BoundedWeights.sink", minimum=0)
        try:
            gws = tuple(_count(w, "BoundedWeights.group_windows[i]", minimum=1)
                        for w in group_windows)
        except TypeError:
            raise ConfigError("BoundedWeights.group_windows must be a sequence of ints") from None
        if not gws:
            raise ConfigError("BoundedWeights.group_windows must name one window per KV group")
        kvh = len(gws)
        arrs = []
        for name, x in (("sink_k", sink_k), ("sink_v", sink_v)):
            a = np.asarray(x)
            per_group = kvh * sink
            if a.ndim == 3 and a.shape[:2] == (kvh, sink):
                hd = a.shape[2]
            elif a.ndim == 1 and (a.size % per_group == 0 if per_group else a.size == 0):
                hd = a.size // per_group if per_group else 0
            else:
                raise ShapeError(
                    f"BoundedWeights.{name}: expected [{kvh}, {sink}, hd] or flat, got {a.shape}"
                )
            arrs.append(_f32_rows(a, (kvh, sink, hd), f"BoundedWeights.{name}"))
        if arrs[0].shape != arrs[1].shape:
            raise ShapeError(
                f"BoundedWeights: sink_k {arrs[0].shape} and sink_v {arrs[1].shape} differ"
            )
        self.sink_k, self.sink_v = arrs
        self.sink = sink
        self.group_windows = gws


@dataclass(frozen=True, eq=False)
class BoundedSnapshot:
    """Bit-for-bit, read-only copy of a :class:`BoundedState` (undo rows included)."""

    num_kv_heads: int
    head_dim: int
    window: int
    undo_depth: int
    seen: int
    ring_k: np.ndarray
    ring_v: np.ndarray
    undo_k: np.ndarray
    undo_v: np.ndarray
    undo_len: int


def _frozen_copy(a: np.ndarray) -> np.ndarray:
    c = a.copy()
    c.setflags(write=False)
    return c


class BoundedState:
    """The ring of one bounded layer: ``ring_k``, ``ring_v`` float32 ``[kvh, window, hd]``.

    ``seen`` counts inserts; token ``t`` lives in slot ``t % window``;
    ``len() == min(seen, window)``; ``head() == seen % window`` (the next slot
    written). Arrays are allocated once and never reallocated (``clear``,
    ``restore`` and ``load`` write in place).
    """

    def __init__(self, num_kv_heads: int, head_dim: int, window: int, *, undo_depth: int = 8):
        self.num_kv_heads = _count(num_kv_heads, "num_kv_heads", minimum=1)
        self.head_dim = _count(head_dim, "head_dim", minimum=1)
        self.window = _count(window, "window", minimum=1, maximum=MAX_WINDOW)
        self.undo_depth = _count(undo_depth, "undo_depth", minimum=0, maximum=MAX_WINDOW)
        shape = (self.num_kv_heads, self.window, self.head_dim)
        try:
            self.ring_k = np.zeros(shape, np.float32)
            self.ring_v = np.zeros(shape, np.float32)
        except MemoryError:
            raise ConfigError(f"bounded ring {shape} float32 (K and V) does not fit in memory") from None
        # Undo entry of insert i lives at i % undo_depth; the slot it
        # overwrote is i % window, so it is implied and not stored.
        ushape = (self.undo_depth, self.num_kv_heads, self.head_dim)
        try:
            self._undo_k = np.zeros(ushape, np.float32)
            self._undo_v = np.zeros(ushape, np.float32)
        except MemoryError:
            raise ConfigError(f"bounded undo buffer {ushape} float32 does not fit in memory") from None
        self._undo_len = 0
        self._seen = 0
        # RingView versions: every mutation moves ``_version``; one that is not
        # an insert (rollback, restore, load, clear) moves ``_reset`` too.
        self._version = self._reset = _next_version()

    def _touch(self, reset: bool) -> None:
        self._version = _next_version()
        if reset:
            self._reset = self._version

    @property
    def version(self) -> int:
        """Moves on every mutation of the ring (a device mirror's key)."""
        return self._version

    def view(self, weights: BoundedWeights, rope: BoundedRope) -> RingView:
        """The ring at this version with what attending it needs, read-only."""
        return ring_view(self.ring_k, self.ring_v, self._seen, weights.sink_k, weights.sink_v,
                         weights.group_windows, rope, owner=self, version=self._version,
                         reset_version=self._reset)

    @property
    def seen(self) -> int:
        """Tokens inserted since the last ``clear`` (the ring's absolute position)."""
        return self._seen

    @property
    def undo_available(self) -> int:
        """How many of the latest inserts ``rollback`` can still undo."""
        return self._undo_len

    def len(self) -> int:
        """Valid ring rows: ``min(seen, window)``."""
        return min(self._seen, self.window)

    __len__ = len

    def head(self) -> int:
        """The slot the next insert writes: ``seen % window``."""
        return self._seen % self.window

    def insert(self, k, v) -> None:
        """Write raw ``k, v`` (``[kvh, hd]`` or flat) into slot ``seen % window``."""
        shape = (self.num_kv_heads, self.head_dim)
        k32 = _f32_rows(k, shape, "BoundedState.insert k")
        v32 = _f32_rows(v, shape, "BoundedState.insert v")
        if self._seen >= MAX_SEEN:
            raise StateError("BoundedState.insert: the ring is at position 2**53, past which "
                             "float64 RoPE angles are not exact")
        slot = self._seen % self.window
        if self.undo_depth:
            u = self._seen % self.undo_depth
            self._undo_k[u] = self.ring_k[:, slot]
            self._undo_v[u] = self.ring_v[:, slot]
            self._undo_len = min(self._undo_len + 1, self.undo_depth)
        self.ring_k[:, slot] = k32
        self.ring_v[:, slot] = v32
        self._seen += 1
        self._touch(False)

    def rollback(self, d: int) -> int:
        """Undo the last ``min(d, undo_available)`` inserts bit for bit; returns that count."""
        d = _count(d, "rollback depth", minimum=0)
        n = min(d, self._undo_len)
        for _ in range(n):
            self._seen -= 1
            slot, u = self._seen % self.window, self._seen % self.undo_depth
            self.ring_k[:, slot] = self._undo_k[u]
            self.ring_v[:, slot] = self._undo_v[u]
        self._undo_len -= n
        if n:
            self._touch(True)
        return n

    def reset_undo(self) -> None:
        """Forget the undo rows (after a wire import they describe inserts
        this side never made, so rolling them back would fabricate state)."""
        self._undo_len = 0

    def snapshot(self) -> BoundedSnapshot:
        """A bit-for-bit copy: rings, ``seen`` and the undo rows."""
        return BoundedSnapshot(
            self.num_kv_heads, self.head_dim, self.window, self.undo_depth, self._seen,
            _frozen_copy(self.ring_k), _frozen_copy(self.ring_v),
            _frozen_copy(self._undo_k), _frozen_copy(self._undo_v), self._undo_len,
        )

    def restore(self, snap: BoundedSnapshot) -> None:
        """Put back a snapshot of a ring of the same geometry, in place."""
        if not isinstance(snap, BoundedSnapshot):
            raise ShapeError(
                f"BoundedState.restore: expected a BoundedSnapshot, got {type(snap).__name__}"
            )
        mine = (self.num_kv_heads, self.head_dim, self.window, self.undo_depth)
        theirs = (snap.num_kv_heads, snap.head_dim, snap.window, snap.undo_depth)
        if mine != theirs:
            raise ShapeError(
                "BoundedState.restore: snapshot (kvh, hd, window, undo_depth) "
                f"{theirs} does not fit this ring {mine}"
            )
        # A hand-built snapshot could carry arrays that disagree with its
        # numbers; check them all before the first copy lands.
        pairs = ((self.ring_k, snap.ring_k), (self.ring_v, snap.ring_v),
                 (self._undo_k, snap.undo_k), (self._undo_v, snap.undo_v))
        bad_len = not 0 <= snap.undo_len <= self.undo_depth
        _count(snap.seen, "BoundedState.restore seen", minimum=0, maximum=MAX_SEEN)
        if bad_len or any(np.shape(b) != a.shape for a, b in pairs):
            raise ShapeError("BoundedState.restore: snapshot arrays do not match its geometry")
        np.copyto(self.ring_k, snap.ring_k)
        np.copyto(self.ring_v, snap.ring_v)
        np.copyto(self._undo_k, snap.undo_k)
        np.copyto(self._undo_v, snap.undo_v)
        self._undo_len = snap.undo_len
        self._seen = snap.seen
        self._touch(True)

    def load(self, ring_k, ring_v, seen: int) -> None:
        """Overwrite the rings and ``seen`` (wire import), in place; undo is reset.

        ``ring_k``/``ring_v`` are ``[kvh, window, hd]`` or flat, in slot order
        (token ``t`` at slot ``t % window``), exactly as ``export`` wrote them.
        """
        seen = _count(seen, "BoundedState.load seen", minimum=0, maximum=MAX_SEEN)
        shape = self.ring_k.shape
        k32 = _f32_rows(ring_k, shape, "BoundedState.load ring_k")
        v32 = _f32_rows(ring_v, shape, "BoundedState.load ring_v")
        np.copyto(self.ring_k, k32)
        np.copyto(self.ring_v, v32)
        self._seen = seen
        self.reset_undo()
        self._touch(True)

    def same_state(self, other: BoundedState) -> bool:
        """Geometry, ``seen`` and both rings equal bit for bit (undo rows not compared)."""
        if not isinstance(other, BoundedState):
            return False
        return (
            self.ring_k.shape == other.ring_k.shape
            and self._seen == other._seen
            and np.array_equal(self.ring_k.view(np.uint32), other.ring_k.view(np.uint32))
            and np.array_equal(self.ring_v.view(np.uint32), other.ring_v.view(np.uint32))
        )

    def clear(self) -> None:
        """Zero the rings in place (same array objects), ``seen = 0``, no undo."""
        self.ring_k.fill(0.0)
        self.ring_v.fill(0.0)
        self._undo_k.fill(0.0)
        self._undo_v.fill(0.0)
        self._undo_len = 0
        self._seen = 0
        self._touch(True)

    def state_bytes(self) -> int:
        """Bytes owned: both rings plus the undo buffer's capacity (constant in tokens)."""
        rings = self.ring_k.nbytes + self.ring_v.nbytes
        return rings + self._undo_k.nbytes + self._undo_v.nbytes

    def attend(
        self, q, num_heads: int, weights: BoundedWeights, rope: BoundedRope, scale: float
    ) -> np.ndarray:
        """Attend raw ``q`` (``[num_heads, hd]``) at position ``seen - 1``.

        Reads only; see :func:`bounded_attend` for the arithmetic.
        """
        if not isinstance(weights, BoundedWeights):
            raise ConfigError(
                f"BoundedState.attend: expected BoundedWeights, got {type(weights).__name__}"
            )
        return bounded_attend(q, self.view(weights, rope), scale=scale, num_heads=num_heads)


def ring_view(ring_k, ring_v, seen, sink_k, sink_v, group_windows, rope, *, owner: object = None,
              version: int | None = None, reset_version: int | None = None) -> RingView:
    """A validated :class:`~kvreg.plugin.RingView` (what ``bounded_attend``
    kernels read): ``ring_k``/``ring_v`` float32 ``[kvh, window, hd]``,
    ``seen >= 1`` tokens inserted, sinks ``[kvh, sink, hd]`` (any empty array:
    none), ``group_windows`` ``kvh`` ints in ``[1, window]``. Without
    ``version`` the view is new state (a fresh version, its own reset)."""
    for name, r in (("ring_k", ring_k), ("ring_v", ring_v)):
        ok = isinstance(r, np.ndarray) and r.dtype == np.float32 and r.ndim == 3
        if not ok or r.shape[1] < 1:
            raise ShapeError(f"bounded attend: {name} must be a float32 [kvh, window, hd] array")
    if ring_k.shape != ring_v.shape:
        raise ShapeError(
            f"bounded attend: ring_k {ring_k.shape} and ring_v {ring_v.shape} differ"
        )
    kvh, window, hd = ring_k.shape
    seen = _count(seen, "bounded attend seen", minimum=0, maximum=MAX_SEEN)
    if seen == 0:
        raise StateError("bounded attend: the ring is empty (insert the token before attending it)")
    if not isinstance(rope, BoundedRope):
        raise ConfigError(f"bounded attend: expected a BoundedRope, got {type(rope).__name__}")
    rope.dims(hd)
    try:
        gws = tuple(group_windows)
    except TypeError:
        raise ConfigError("bounded attend: group_windows must be a sequence of ints") from None
    if len(gws) != kvh or not all(
        isinstance(w, (int, np.integer)) and not isinstance(w, bool) and 1 <= w <= window
        for w in gws
    ):
        raise ConfigError(
            f"bounded attend: group_windows must be {kvh} ints in [1, {window}], got {gws}"
        )
    sk, sv = np.asarray(sink_k), np.asarray(sink_v)
    if sk.size % (kvh * hd) or sk.size != sv.size:
        raise ShapeError(
            f"bounded attend: sink_k/sink_v must be [{kvh}, sink, {hd}], "
            f"got {sk.shape} / {sv.shape}"
        )
    sink = sk.size // (kvh * hd)
    if sink:
        sk = _f32_rows(sk, (kvh, sink, hd), "bounded attend sink_k")
        sv = _f32_rows(sv, (kvh, sink, hd), "bounded attend sink_v")
    else:  # no sinks: any empty array will do, whatever hd it was built for
        sk = sv = np.zeros((kvh, 0, hd), np.float32)
    if version is None:
        version = reset_version = _next_version()
    return RingView(k=readonly(ring_k), v=readonly(ring_v), seen=seen, sink_k=readonly(sk), sink_v=readonly(sv),
                    group_windows=tuple(int(w) for w in gws), rope=rope, owner=owner, version=version,
                    reset_version=version if reset_version is None else reset_version)


def check_bounded_attend_args(q, ring: RingView, scale, num_heads) -> tuple[np.ndarray, float]:
    """Validate a bounded attend's query and parameters against ``ring``
    (shared with backends): ``(q32 [num_heads, hd], scale float)``."""
    if not isinstance(ring, RingView):
        raise ConfigError(f"bounded attend: expected a RingView (kvreg.bounded.ring_view), got {type(ring).__name__}")
    kvh, _, hd = ring.k.shape
    num_heads = _count(num_heads, "bounded attend num_heads", minimum=1)
    if num_heads % kvh:
        raise ConfigError(
            f"bounded attend: num_heads {num_heads} is not a multiple of num_kv_heads {kvh}"
        )
    number = isinstance(scale, (int, float, np.floating)) and not isinstance(scale, bool)
    try:
        with np.errstate(over="ignore"):  # the kernels scale in float32: 1e39 would be inf
            finite32 = number and bool(np.isfinite(np.float32(float(scale))))
    except OverflowError:   # an int past float64
        finite32 = False
    if not finite32:
        raise ConfigError(f"bounded attend: scale must be a number finite in float32, got {scale!r}")
    return _f32_rows(q, (num_heads, hd), "bounded attend q"), float(scale)


def bounded_attend(q, ring: RingView, *, scale: float, num_heads: int) -> np.ndarray:
    """Reference bounded attention; returns float32 ``[num_heads, hd]``. Pure.

    Q head ``h`` reads KV group ``g = h // (num_heads // kvh)``. The query is
    the token at absolute position ``seen - 1`` and is rotated there; the ring
    row of position ``t`` (slot ``t % window``) is rotated at ``t``; sinks are
    position-free. Head ``h`` scores (times ``scale``) its group's sinks and
    the newest ``n_g = min(len, group_windows[g])`` ring rows (positions
    ``seen - n_g .. seen - 1``), softmax in float32 with the max subtracted,
    and returns ``sum p * v`` over the same rows.
    """
    q32, scale = check_bounded_attend_args(q, ring, scale, num_heads)
    ring_k, ring_v, seen, sk, sv, gws, rope = (ring.k, ring.v, ring.seen, ring.sink_k, ring.sink_v,
                                               ring.group_windows, ring.rope)
    kvh, window, hd = ring_k.shape
    hpk = q32.shape[0] // kvh
    qpos = seen - 1
    qr = rope.apply(q32[:, None, :], start=qpos)[:, 0, :]
    # Rotate the widest window once for every group; narrower groups take
    # its tail (their rows are the newest ones too).
    n_max = min(seen, window, max(gws))
    positions = np.arange(seen - n_max, seen, dtype=np.int64)
    slots = positions % window
    keys = rope.apply(ring_k[:, slots, :], start=seen - n_max)
    vals = ring_v[:, slots, :]
    sc = np.float32(scale)
    qg = qr.reshape(kvh, hpk, hd)
    # All groups in one batched product; a group with a narrower window
    # masks its oldest rows to -inf, which exp() turns into exact zeros.
    # keys @ q (not q @ keys.T): BLAS runs the tall-skinny product ~2x faster.
    s_ring = np.matmul(keys, qg.transpose(0, 2, 1)).transpose(0, 2, 1) * sc  # [kvh, hpk, n]
    off = n_max - np.minimum(n_max, np.asarray(gws, dtype=np.int64))
    if off.any():
        hidden = np.arange(n_max)[None, :] < off[:, None]
        s_ring[np.broadcast_to(hidden[:, None, :], s_ring.shape)] = -np.inf
    # Sinks are scored apart and join the shared max and denominator:
    # concatenating them to the ring would copy the whole window per step.
    s_sink = np.matmul(qg, sk.transpose(0, 2, 1)) * sc  # [kvh, hpk, sink]
    m = s_ring.max(axis=2, keepdims=True)
    if sk.shape[1]:
        m = np.maximum(m, s_sink.max(axis=2, keepdims=True))
    e_ring, e_sink = np.exp(s_ring - m), np.exp(s_sink - m)
    z = e_sink.sum(axis=2, keepdims=True) + e_ring.sum(axis=2, keepdims=True)
    out = np.matmul(e_ring / z, vals) + np.matmul(e_sink / z, sv)
    return out.reshape(kvh * hpk, hd)


class Ring:
    """A bounded layer's ring (``layer.ring``): the :class:`BoundedState`
    installed once at load, and the decode step over it on the layer's
    backend. Nothing is stored per position."""

    def __init__(self, num_kv_heads: int, head_dim: int, window: int, *, undo_depth: int = 8):
        self.state = BoundedState(num_kv_heads, head_dim, window, undo_depth=undo_depth)

    def step(self, backend, q, k, v, weights: BoundedWeights, rope: BoundedRope, scale: float,
             num_heads: int) -> np.ndarray:
        """Insert raw ``k, v [kvh, hd]`` into slot ``t mod W``, then attend
        every Q head of raw ``q [nh, hd]`` over its group's sinks and newest
        rows on ``backend``. Everything is validated against the ring as it
        will be after the insert, before the insert: a refused step leaves
        the ring as it was."""
        b = self.state
        after = ring_view(b.ring_k, b.ring_v, b.seen + 1, weights.sink_k, weights.sink_v,
                          weights.group_windows, rope)
        check_bounded_attend_args(q, after, scale, num_heads)
        b.insert(k, v)
        return backend.bounded_attend(q, b.view(weights, rope), scale=scale, num_heads=num_heads)

    def state_bytes(self) -> int:
        return self.state.state_bytes()

    def rollback(self, d: int) -> int:
        """Undo the last ``d`` inserts as far as the undo rows reach (a warning
        says when they do not); returns the positions the ring then holds."""
        rolled = self.state.rollback(d)
        if rolled < d:
            warnings.warn(f"bounded anchor: rollback of {d} exceeds the undo depth ({rolled} restored)",
                          stacklevel=4)
        return self.state.seen


class RingSlot:
    """Where a layer keeps its bounded ring (the layer's part behind the
    seed's ``install_bounded``, ``bounded_step``, ``bounded_snapshot``,
    ``bounded_restore`` and ``bounded_state_bytes``, which call these under
    the layer's lock): empty until :meth:`install` puts a :class:`Ring` in
    it, once, at load."""

    def __init__(self, layer):
        self._layer = layer
        #: The installed ring (None: not a bounded layer).
        self.ring: Ring | None = None

    def install(self, window: int, *, undo_depth: int = 8) -> None:
        """Give the layer its fixed ring (``[kvh, window, hd]`` K and V).
        Called once at load; ``clear()`` zeroes it, nothing reallocates it."""
        from kvreg.wire import WireKind

        lay = self._layer
        if lay.seq_len or lay.storage.seq_len:
            raise StateError(f"install_bounded on a layer holding {lay.seq_len} rows: install at load")
        if lay.lifecycle in (Lifecycle.COLLECTING, Lifecycle.SEALED):
            raise StateError(f"install_bounded on a layer with an O(1) overlay ({lay.lifecycle.value})")
        self.ring = Ring(lay.num_kv_heads, lay.head_dim, window, undo_depth=undo_depth)
        lay.wire.kind = WireKind.Bounded
        lay._lifecycle = Lifecycle.BOUNDED

    def step(self, q, k, v, weights: BoundedWeights, rope: BoundedRope, scale: float, num_heads: int) -> np.ndarray:
        """One position: insert raw ``k, v`` (``[kvh, hd]``) into slot
        ``t mod W``, then attend every Q head of ``q`` (``[nh, hd]``, raw) over
        its group's sinks ∪ newest rows. Returns ``[num_heads, hd]``. A
        refused step leaves the ring and the depth as they were."""
        if self.ring is None:
            raise StateError("bounded_step on a layer without an installed ring (install_bounded)")
        lay = self._layer
        out = self.ring.step(lay.backend, q, k, v, weights, rope, scale, num_heads)
        lay._count_position()
        return out

    def state_bytes(self) -> int:
        """Bytes of the bounded ring (0 on other layers)."""
        return 0 if self.ring is None else self.ring.state_bytes()

    def snapshot(self) -> BoundedSnapshot | None:
        """Bit-for-bit copy of the ring for speculation (None on other layers)."""
        return None if self.ring is None else self.ring.state.snapshot()

    def restore(self, snap: BoundedSnapshot) -> None:
        """Restore a ring snapshot; the layer's ``seq_len`` follows the restored counter."""
        if self.ring is None:
            return
        self.ring.state.restore(snap)
        lay = self._layer
        lay.seq_len = self.ring.state.seen
        lay.storage.renew_generation()
