"""The O(1) Nyström far-field state of a sealed layer (one per KV group).

After ``o1_seal`` a layer keeps no per-position storage. Each KV group keeps:

* the **sinks**: the first ``sink`` rows, K and V exact;
* the **window**: the last ``w`` rows, K and V exact, as a ring;
* the **far field**, every row between them, summarized by ``m`` Nyström
  landmarks (rectangle :attr:`O1Rect.Aggregate`: the landmarks aggregate the
  far rows by segment means):

  - ``K̃ [m, hd]``: means of the far keys over ``m`` contiguous segments of
    the far rows ``[sink, t - w)`` at the seal (shared by the group's heads);
  - ``Q̃_h [m, hd]``: the same segment means of head ``h``'s queries;
  - ``M̂_h = pinv(exp(Q̃_h K̃ᵀ·scale − r_h))``, ``r_h[j] = max_i Q̃_hj·K̃_i·scale``
    (row-stabilized, so every entry of the matrix is in (0, 1]);
  - far sums ``Z_h[j] = Σ_far exp(Q̃_hj·k·scale − c_hj)``,
    ``Θ_h[j] = Σ_far exp(Q̃_hj·k·scale − c_hj)·v``, ``c_hj`` = running max of
    the logits summed so far (an online-softmax stabilizer: a larger logit
    rescales the sums, so no exponent is ever positive).

Estimate. Exactly, ``exp(Q̃ K̃ᵀ s) = diag(e^r)·K̂`` and the far kernel rows are
``diag(e^c)·B̂``, so the Nyström estimate of ``Σ_far exp(q·k·s)·v`` is
``e^{μa}·â·M̂·diag(e^{c − r})·Θ̂`` with ``â = exp(q K̃ᵀ s − μa)``. A decode step
puts the exact part (sinks + window) and this far part under ONE shared max
``μ = max(μ_exact, max_j μa + c_j − r_j)``, so every exponent is ≤ 0, and
returns ``(num_exact + num_far) / (den_exact + den_far)``. A negative far
denominator (the pseudo-inverse is not positive) is clamped: the far part then
contributes nothing, numerator and denominator alike.

Precision: the exact rows are stored float32 (they are the cache's rows); the
landmark state (K̃, Q̃, M̂, r, c, Z, Θ) is float64 and the step computes in
float64. ``â·M̂`` has entries of both signs and large magnitude (M̂ is the
inverse of an ill-conditioned kernel matrix), so the far sum cancels; float32
far sums lose ~cond(K̂)·6e-8 of it. The landmark state is O(m·hd) per head, so
the doubled width costs nothing that grows with context. The pseudo-inverse
is a truncated-SVD one (``np.linalg.pinv`` with relative cutoff ``rcond``):
directions below ``rcond·σ_max`` are dropped rather than amplified. The
default ``rcond = 1e-3`` is measured, not guessed: on realistic data
(``kvreg.o1_report``, 2k context, w 256) 1e-6 gave median/p99 output error
0.49/7.4 (m 16) against 0.14/0.55 at 1e-3; 1e-2 and 1e-1 were no better.

Degenerate case: a prompt of ``t <= sink + w`` rows has no far field; the
state is then exact-only. Decode rows keep filling the window; once a row must
leave a full window of an exact-only state it is dropped (the StreamingLLM
fallback: there are no landmarks to fold it into). ``dropped`` counts them.
``o1_seal`` never builds such a state: it waits for ``o1_deferred_boundary``.

Kernels for backends: :func:`nystrom_prefill` (far sums over the prompt's far
rows), :func:`nystrom_absorb` (one row into the far sums) and
:func:`nystrom_step` (one decode read of every head of a group). Each takes and
returns plain arrays; :class:`NystromState` calls them through its
``kernels`` object (this module by default), so a backend passes its own
namespace with the same three names and inherits nothing else.
"""

from __future__ import annotations

import enum
import sys
from dataclasses import dataclass

import numpy as np

from kvreg.errors import ConfigError, ShapeError, StateError

__all__ = [
    "O1Rect",
    "FarField",
    "NystromState",
    "o1_deferred_boundary",
    "segment_bounds",
    "landmarks",
    "landmark_inverse",
    "nystrom_prefill",
    "nystrom_absorb",
    "nystrom_parts",
    "nystrom_step",
]

# Far rows scored per matmul in the prefill: bounds the [hpk, m, chunk]
# logit block to a few MiB whatever the prompt length.
PREFILL_CHUNK = 8192


class O1Rect(enum.Enum):
    """How the landmarks summarize the far rows (the seed's ``O1Rect``)."""

    #: landmarks aggregate the far rows by segment means: ``m`` contiguous
    #: segments, K̃ and Q̃ the means of each segment's keys and queries
    Aggregate = "aggregate"


def o1_deferred_boundary(w: int, sink: int, m: int) -> int:
    """The earliest row count at which a layer may seal: ``w + sink + m + 1``.

    Below it the far field would hold at most ``m`` rows (one per landmark,
    or fewer): a seal there gains nothing over keeping the rows exact.
    """
    for name, val in (("w", w), ("sink", sink), ("m", m)):
        if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < 0:
            raise ConfigError(f"o1_deferred_boundary: {name} must be an int >= 0, got {val!r}")
    return int(w) + int(sink) + int(m) + 1


@dataclass
class FarField:
    """The landmark state of one KV group (all float64, see the module doc).

    ``k_tilde [m, hd]``, ``q_tilde [hpk, m, hd]``, ``m_hat [hpk, m, m]``,
    ``r [hpk, m]`` (landmark-matrix row stabilizers), ``c [hpk, m]`` (far-sum
    stabilizers), ``z [hpk, m]``, ``theta [hpk, m, hd]``; ``rows`` far rows
    summed so far.
    """

    k_tilde: np.ndarray
    q_tilde: np.ndarray
    m_hat: np.ndarray
    r: np.ndarray
    c: np.ndarray
    z: np.ndarray
    theta: np.ndarray
    rows: int

    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.k_tilde, self.q_tilde, self.m_hat, self.r,
                                      self.c, self.z, self.theta))


# ── kernels (pure functions; a backend may override them) ──


def segment_bounds(n: int, m: int) -> np.ndarray:
    """``m + 1`` bounds splitting ``n >= m >= 1`` rows into ``m`` contiguous,
    non-empty segments whose sizes differ by at most one."""
    return (np.arange(m + 1, dtype=np.int64) * n) // m


def landmarks(q_far: np.ndarray, k_far: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Segment means: ``q_far [hpk, n, hd]``, ``k_far [n, hd]``, ``1 <= m <= n``
    -> ``(q_tilde [hpk, m, hd], k_tilde [m, hd])`` float64."""
    n = k_far.shape[0]
    b = segment_bounds(n, m)
    counts = np.diff(b).astype(np.float64)
    # dtype= accumulates in float64 without a float64 copy of the far rows
    k_tilde = np.add.reduceat(k_far, b[:-1], axis=0, dtype=np.float64) / counts[:, None]
    q_tilde = np.add.reduceat(q_far, b[:-1], axis=1, dtype=np.float64) / counts[None, :, None]
    return q_tilde, k_tilde


def landmark_inverse(q_tilde: np.ndarray, k_tilde: np.ndarray, scale: float,
                     rcond: float) -> tuple[np.ndarray, np.ndarray]:
    """``(m_hat [hpk, m, m], r [hpk, m])``: the truncated pseudo-inverse of the
    row-stabilized landmark kernel ``exp(Q̃ K̃ᵀ·scale − r)``, and ``r``."""
    logits = scale * np.einsum("hjd,id->hji", q_tilde, k_tilde)
    r = logits.max(axis=2)
    k_hat = np.exp(logits - r[:, :, None])
    return np.linalg.pinv(k_hat, rcond=rcond), r


def nystrom_prefill(q_tilde: np.ndarray, k_far: np.ndarray, v_far: np.ndarray,
                    scale: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Far sums over ``n >= 1`` far rows: ``q_tilde [hpk, m, hd]``, ``k_far``,
    ``v_far [n, hd]`` -> ``(c [hpk, m], z [hpk, m], theta [hpk, m, hd])``
    float64 with ``c`` the max far logit of each landmark query."""
    hpk, m, hd = q_tilde.shape
    c = np.full((hpk, m), -np.inf)
    z = np.zeros((hpk, m))
    theta = np.zeros((hpk, m, hd))
    # chunked online softmax: the logit block stays small at any context
    for lo in range(0, k_far.shape[0], PREFILL_CHUNK):
        kc = k_far[lo:lo + PREFILL_CHUNK].astype(np.float64)
        vc = v_far[lo:lo + PREFILL_CHUNK].astype(np.float64)
        # one BLAS GEMM for all heads' landmarks (einsum here is a C loop)
        logits = (scale * (q_tilde.reshape(hpk * m, hd) @ kc.T)).reshape(hpk, m, -1)
        c_new = np.maximum(c, logits.max(axis=2))
        alpha = np.exp(c - c_new)  # exp(-inf) = 0 on the first chunk
        e = np.exp(logits - c_new[:, :, None])
        z = z * alpha + e.sum(axis=2)
        theta = theta * alpha[:, :, None] + e @ vc
        c = c_new
    return c, z, theta


def nystrom_absorb(far: FarField, k_row: np.ndarray, v_row: np.ndarray, scale: float) -> None:
    """Fold one row (leaving the window) into the far sums, in place:
    O(m·hd) per head. ``k_row``, ``v_row [hd]``."""
    k64 = k_row.astype(np.float64)
    logits = scale * (far.q_tilde @ k64)  # [hpk, m]
    c_new = np.maximum(far.c, logits)
    alpha = np.exp(far.c - c_new)
    beta = np.exp(logits - c_new)
    far.z *= alpha
    far.z += beta
    far.theta *= alpha[:, :, None]
    far.theta += beta[:, :, None] * v_row.astype(np.float64)[None, None, :]
    far.c = c_new
    far.rows += 1


def nystrom_parts(q_group: np.ndarray, k_exact: np.ndarray, v_exact: np.ndarray,
                  far: FarField | None, scale: float):
    """The unnormalized pieces of one decode read, all scaled by ``e^{−μ}``:
    ``(num_exact [hpk, hd], den_exact [hpk], num_far [hpk, hd], den_far [hpk])``
    float64; ``den_far`` already clamped (a negative one zeroes the far part).
    ``k_exact``/``v_exact [e >= 1, hd]`` are the sinks and window rows."""
    q = q_group.astype(np.float64)
    se = scale * (q @ k_exact.astype(np.float64).T)  # [hpk, e]
    mu = se.max(axis=1)
    hpk, hd = q.shape
    num_f = np.zeros((hpk, hd))
    den_f = np.zeros(hpk)
    if far is not None:
        sa = scale * (q @ far.k_tilde.T)  # [hpk, m]
        mu_a = sa.max(axis=1)
        a = np.exp(sa - mu_a[:, None])
        u = np.einsum("hi,hij->hj", a, far.m_hat)
        log_f = mu_a[:, None] + (far.c - far.r)
        mu = np.maximum(mu, log_f.max(axis=1))
        g = u * np.exp(log_f - mu[:, None])
        den_f = (g * far.z).sum(axis=1)
        num_f = np.einsum("hj,hjd->hd", g, far.theta)
        keep = den_f > 0
        den_f = np.where(keep, den_f, 0.0)
        num_f = np.where(keep[:, None], num_f, 0.0)
    e = np.exp(se - mu[:, None])
    return e @ v_exact.astype(np.float64), e.sum(axis=1), num_f, den_f


def nystrom_step(q_group: np.ndarray, k_exact: np.ndarray, v_exact: np.ndarray,
                 far: FarField | None, scale: float) -> np.ndarray:
    """One decode read of every head of a group: ``q_group [hpk, hd]`` ->
    ``out [hpk, hd]`` float32 (exact sinks + window, plus the far estimate)."""
    num_e, den_e, num_f, den_f = nystrom_parts(q_group, k_exact, v_exact, far, scale)
    return ((num_e + num_f) / (den_e + den_f)[:, None]).astype(np.float32)


# ── the state ──


def _check_finite(name: str, a: np.ndarray) -> None:
    if not np.all(np.isfinite(a)):
        raise ShapeError(f"{name}: expected finite values, found NaN or inf")


class NystromState:
    """One KV group's sealed O(1) attention state; see the module docstring.

    Build with :meth:`new_group`, fill once with :meth:`prefill_group`, then
    :meth:`step_group` per decode token. Memory (``memory_bytes``) is fixed
    at prefill: ``(sink + w)`` exact rows plus the O(hpk·m·(m + hd)) landmark
    state, whatever the context length.
    """

    def __init__(self, m: int, w: int, sink: int, hpk: int, *, scale: float,
                 rect: O1Rect = O1Rect.Aggregate, rcond: float = 1e-3, kernels=None):
        for name, val, lo in (("m", m, 1), ("w", w, 1), ("sink", sink, 0), ("hpk", hpk, 1)):
            if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < lo:
                raise ConfigError(f"NystromState: {name} must be an int >= {lo}, got {val!r}")
        if not (isinstance(scale, (int, float, np.floating)) and np.isfinite(scale) and scale > 0):
            raise ConfigError(f"NystromState: scale must be a finite float > 0, got {scale!r}")
        if not isinstance(rect, O1Rect):
            raise ConfigError(f"NystromState: rect must be an O1Rect, got {rect!r}")
        if not (0 < rcond < 1):
            raise ConfigError(f"NystromState: rcond must be in (0, 1), got {rcond!r}")
        self.m, self.w, self.sink, self.hpk = int(m), int(w), int(sink), int(hpk)
        self.scale = float(scale)
        self.rect = rect
        self.rcond = float(rcond)
        self.kernels = kernels if kernels is not None else sys.modules[__name__]
        self.head_dim: int | None = None
        self.exact_k: np.ndarray | None = None  # [sink + w, hd]: sinks, then the ring
        self.exact_v: np.ndarray | None = None
        self.n_sink = 0  # sink rows held (< sink only for a prompt shorter than sink)
        self.win_head = 0  # ring slot of the oldest window row
        self.win_len = 0
        self.far: FarField | None = None
        self.seen = 0  # rows ever inserted (prompt + decode): the context depth
        self.dropped = 0  # rows lost by an exact-only state (see the module doc)

    @classmethod
    def new_group(cls, m: int, w: int, sink: int, hpk: int, *, scale: float,
                  rect: O1Rect = O1Rect.Aggregate, rcond: float = 1e-3,
                  kernels=None) -> "NystromState":
        """The seed's constructor name; same arguments as ``__init__``."""
        return cls(m, w, sink, hpk, scale=scale, rect=rect, rcond=rcond, kernels=kernels)

    # -- properties

    @property
    def prefilled(self) -> bool:
        return self.exact_k is not None

    @property
    def exact_only(self) -> bool:
        """True when the prompt had no far rows (no landmarks)."""
        return self.prefilled and self.far is None

    @property
    def m_eff(self) -> int:
        """Landmarks actually built: ``min(m, far rows at the seal)``."""
        return 0 if self.far is None else self.far.k_tilde.shape[0]

    def memory_bytes(self) -> int:
        if not self.prefilled:
            return 0
        far = self.far.nbytes() if self.far is not None else 0
        return self.exact_k.nbytes + self.exact_v.nbytes + far

    # -- prefill

    def prefill_group(self, qs, k: np.ndarray, v: np.ndarray) -> None:
        """Seal the prompt: ``qs`` = ``hpk`` query traces ``[t, hd]`` (a list or
        a ``[hpk, t, hd]`` array, rotated queries of this group's heads), ``k``,
        ``v [t, hd]`` the group's rows. Refused (nothing changes) on a second
        call, a shape mismatch, ``t == 0`` or non-finite input."""
        if self.prefilled:
            raise StateError("NystromState.prefill_group: already prefilled (one seal per state)")
        k = np.asarray(k)
        v = np.asarray(v)
        if k.ndim != 2 or k.shape[0] < 1 or v.shape != k.shape:
            raise ShapeError(f"prefill_group: expected k, v [t >= 1, hd] of one shape, "
                             f"got k {k.shape}, v {v.shape}")
        t, hd = k.shape
        if isinstance(qs, np.ndarray):
            q = qs
        else:
            qs = list(qs)
            if len(qs) != self.hpk:
                raise ShapeError(f"prefill_group: expected {self.hpk} query traces, got {len(qs)}")
            q = np.stack([np.asarray(x) for x in qs]) if all(
                np.shape(x) == (t, hd) for x in qs) else None
        if q is None or q.shape != (self.hpk, t, hd):
            got = q.shape if q is not None else [np.shape(x) for x in qs]
            raise ShapeError(f"prefill_group: expected queries [{self.hpk}, {t}, {hd}], got {got}")
        for name, a in (("prefill_group q", q), ("prefill_group k", k), ("prefill_group v", v)):
            _check_finite(name, a)

        # everything validated: build the state
        n_sink = min(self.sink, t)
        n_win = min(self.w, t - n_sink)
        n_far = t - n_sink - n_win
        far = None
        if n_far > 0:
            lo, hi = n_sink, t - n_win
            m_eff = min(self.m, n_far)
            q_tilde, k_tilde = landmarks(q[:, lo:hi], k[lo:hi], m_eff)
            m_hat, r = landmark_inverse(q_tilde, k_tilde, self.scale, self.rcond)
            c, z, theta = self.kernels.nystrom_prefill(q_tilde, k[lo:hi], v[lo:hi], self.scale)
            far = FarField(k_tilde, q_tilde, m_hat, r, c, z, theta, n_far)
        ek = np.zeros((self.sink + self.w, hd), dtype=np.float32)
        ev = np.zeros_like(ek)
        ek[:n_sink], ev[:n_sink] = k[:n_sink], v[:n_sink]
        ek[self.sink:self.sink + n_win] = k[t - n_win:]
        ev[self.sink:self.sink + n_win] = v[t - n_win:]
        self.head_dim = hd
        self.exact_k, self.exact_v = ek, ev
        self.n_sink, self.win_head, self.win_len = n_sink, 0, n_win
        self.far = far
        self.seen = t

    # -- decode

    def _check_step(self, q_group, k_new=None, v_new=None):
        if not self.prefilled:
            raise StateError("NystromState: step before prefill_group")
        hd = self.head_dim
        q = np.asarray(q_group)
        if q.shape != (self.hpk, hd):
            raise ShapeError(f"step_group: expected q_group [{self.hpk}, {hd}], got {q.shape}")
        _check_finite("step_group q_group", q)
        out = [q]
        for name, a in (("k_new", k_new), ("v_new", v_new)):
            if a is None:
                continue
            a = np.asarray(a)
            if a.shape != (hd,):
                raise ShapeError(f"step_group: expected {name} [{hd}], got {a.shape}")
            _check_finite(f"step_group {name}", a)
            out.append(a)
        return out

    def exact_rows(self):
        """Sinks and window rows ``(k, v)`` as contiguous views (no copy): the window
        occupies ring slots in some rotation, which attention does not see."""
        n = self.sink + self.win_len if self.n_sink == self.sink else None
        if n is not None:
            return self.exact_k[:n], self.exact_v[:n]
        # a prompt shorter than `sink`: the window is empty until sinks fill
        return self.exact_k[:self.n_sink], self.exact_v[:self.n_sink]

    def _insert(self, k_row: np.ndarray, v_row: np.ndarray) -> None:
        if self.n_sink < self.sink:
            self.exact_k[self.n_sink], self.exact_v[self.n_sink] = k_row, v_row
            self.n_sink += 1
        elif self.win_len < self.w:
            slot = self.sink + (self.win_head + self.win_len) % self.w
            self.exact_k[slot], self.exact_v[slot] = k_row, v_row
            self.win_len += 1
        else:
            slot = self.sink + self.win_head
            if self.far is not None:
                self.kernels.nystrom_absorb(self.far, self.exact_k[slot], self.exact_v[slot], self.scale)
            else:
                self.dropped += 1
            self.exact_k[slot], self.exact_v[slot] = k_row, v_row
            self.win_head = (self.win_head + 1) % self.w
        self.seen += 1

    def attend_group(self, q_group: np.ndarray) -> np.ndarray:
        """Read the state for ``q_group [hpk, hd]`` without inserting a row:
        ``out [hpk, hd]`` float32."""
        (q,) = self._check_step(q_group)
        ke, ve = self.exact_rows()
        return self.kernels.nystrom_step(q, ke, ve, self.far, self.scale)

    def step_group(self, q_group: np.ndarray, k_new: np.ndarray, v_new: np.ndarray) -> np.ndarray:
        """One decode token: insert ``(k_new, v_new) [hd]`` into the window
        (the row leaving it moves into the far sums), then attend every head:
        ``q_group [hpk, hd]`` -> ``out [hpk, hd]`` float32. Refused before any
        change on a bad shape or a non-finite value."""
        q, k_row, v_row = self._check_step(q_group, k_new, v_new)
        self._insert(k_row, v_row)
        ke, ve = self.exact_rows()
        return self.kernels.nystrom_step(q, ke, ve, self.far, self.scale)

    def window_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """The window's rows, oldest first (copies): ``(k, v) [win_len, hd]``."""
        if not self.prefilled:
            raise StateError("NystromState.window_rows: not prefilled")
        idx = self.sink + (self.win_head + np.arange(self.win_len)) % self.w
        return self.exact_k[idx].copy(), self.exact_v[idx].copy()

    def sink_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """The sink rows (copies): ``(k, v) [n_sink, hd]``."""
        if not self.prefilled:
            raise StateError("NystromState.sink_rows: not prefilled")
        return self.exact_k[:self.n_sink].copy(), self.exact_v[:self.n_sink].copy()
