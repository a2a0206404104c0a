"""The O(1) Nyström far-field state of a sealed layer (one per KV group).

After ``o1_seal`` a layer keeps no per-position storage. Each KV group keeps:

* the **sinks**: the first ``sink`` rows, K and V exact;
* the **window**: the last ``w`` rows, K and V exact, as a ring;
* the **heavy rows**: ``heavy`` far rows of largest prompt attention mass,
  K and V exact (see "Heavy rows" below);
* the **far field**, every other row between them, summarized by ``m`` landmark
  keys (rectangle :attr:`O1Rect.Aggregate`: ``K̃ [m, hd]`` = means of the far
  keys over ``m`` contiguous segments of the far rows at the seal).

Estimator. For a decode query ``q`` the far field is ``F(q) = Σ_far
exp(s·q·k)·[v, 1]`` (``s`` the logit scale; numerator and denominator of the
far part of attention). It is estimated as ``F(q) ≈ φ(q)·W`` with features
``φ(q) = exp(s·q·K̃ᵀ) [m]`` and a map ``W [m, hd + 1]`` fit at the seal:

* prior ``W₀ = [Σ_seg v, n_seg]`` (the per-segment value sums and sizes):
  ``φ(q)·W₀`` is segment-mean pooling, and by Jensen (``exp`` is convex)
  ``n_j·exp(s·q·k̃_j) ≤ Σ_{i∈j} exp(s·q·k_i)``: its denominator is a lower
  bound on the true far denominator;
* probes ``Q_P [p, hd]`` per head, ``p = m``: ``⌈m/2⌉`` segment means of the
  head's far queries (the Nyström landmark queries: the whole prompt's query
  distribution) and the ``⌊m/2⌋`` most recent distinct prompt queries (where
  decode starts). The exact far sums ``F(Q_P)`` are kept, and scaled by each
  probe's attention denominator at the seal, ``D_s = e^{ν_s}``, so that each
  probe's error counts relative to its attention output;
* ``W = argmin_W ‖diag(1/D)·(Φ·W − F(Q_P))‖² + λ‖W − W₀‖²`` with ``Φ =
  φ(Q_P)``: ridge regression of the far sums on the features, shrunk toward
  pooling, ``λ = rcond·σ_max²`` of the row-scaled ``Φ``. In closed form ``W =
  W₀ + P·(F̂ − Φ·W₀)``, ``F̂ = diag(1/D)·F(Q_P)``, ``P = (ΦᵀΦ + λI)⁻¹Φᵀ``
  (``Φ`` row-scaled too): pooling, plus a correction fit to what pooling
  misses at the probes.

So a decode read is ``φ(q)·W₀ + φ(q)·P·E`` with the probes' residuals ``E =
F̂ − Φ·W₀``: O(m·(p + hd) + p·hd) per head. Both terms are sums over far rows,
so a row leaving the window is absorbed exactly in O(p·hd) per head: it joins
the last segment's sums (``n``, ``Σv``; the segment keeps its key ``k̃``), so
its pooled stand-in is ``exp(s·Q_P·k̃_last)·[v, 1]`` and ``E`` gains
``(exp(s·Q_P·k) − exp(s·Q_P·k̃_last))·[v, 1]`` (scaled by ``1/D``).

Checks. ``φ·P`` has entries of both signs, so the correction can cancel the
pooled part. Two facts of the exact far field bound the estimate: its
denominator is at least the pooled one (Jensen, above; so the correction's
denominator must be ≥ 0) and its average ``num/den`` is a convex combination of
the far values, so it lies in their per-channel box ``[vlo, vhi]`` (kept per
group, widened by every absorbed row). A read that fails either drops the
correction: the pooled estimate passes both. (The clamp of a negative
denominator at zero that they replace let nearly cancelled sums through: p99
output error 9.75 at 8k context, m 16; on the real attention data of
``o1_report --real`` the box check takes the p99 of the far-heavy reads at 2k
context, w 64, m 64 from 15.2 to 2.9.)

Why this estimator (measured with ``research/o1_report.py`` on realistic data,
seeds 0 and 1, and on its real attention data): plain Nyström (``p = m``
segment-mean probes interpolated with a truncated pseudo-inverse, no prior)
came within 0.93x of pooling at 32k context, m 16 (median output error 0.72
against 0.77) and its far denominator cancelled at 8k. With probes from the
recent queries the 32k, m 16 median is 0.45-0.49 (0.51-0.59x pooling; every
row of the report is within 0.6x); the segment-mean probes keep the error
where plain Nyström's is when decode runs 1024 steps past the seal (recent
probes alone drift above it); shrinking toward pooling rather than toward
zero makes the estimate exact when every segment is one row; and ``rcond``
anywhere in 1e-4..1e-2 keeps every row within 0.63x of pooling (1e-6 does
is worse in every row: the fit starts to interpolate noise).

Stored per head (float64): ``probes [p, hd]``, ``m_hat = P [m, p]``, ``r = ν
[p]`` (log ``D_s``), the residual sums with an online-softmax stabilizer ``c
[p]`` (``z``, ``theta``: ``E = e^{c − ν}·[theta, z]``) and ``last_logit [p] =
s·Q_P·k̃_last``; per group ``k_tilde``, ``count``, ``vsum`` (``W₀``), ``vlo`` and
``vhi``. A decode step puts the exact part (sinks + heavy rows + window) and the far part
under ONE shared max ``μ`` (every exponent ≤ 0) and returns ``(num_exact +
num_far) / (den_exact + den_far)``.

Precision: the exact rows are stored float32 (they are the cache's rows); the
landmark state is float64 and the step computes in float64: ``φ·P`` has
entries of both signs, so the correction cancels in part. The landmark state
is O(m·(m + hd)) per head, so the doubled width costs nothing that grows with
context.

Heavy rows. Mean-based summaries cannot represent needle-like far
attention (a few far rows of very high logit: on the real data of
``o1_report --real`` the far estimate recovered ~0.01-0.05 of an exact far
mass of ~0.3). So the seal keeps ``heavy`` far rows (default ``m``: the
memory of ``m`` more exact rows) EXACT, with the sinks and the window: the
far rows of largest attention mass under a sample of the prompt's queries
(:func:`heavy_select`: the ``HEAVY_QUERIES // hpk`` most recent distinct
positions, every head of the group, each query causal and normalized, float32
logits). They leave the far field (segments, pooling prior, value box and
the probes' far sums; the probes' ``ν`` still spans the whole prompt) and
join the exact rows the step takes (``sinks | heavy | window ring``), so the
step kernels are unchanged and a step costs O((sink + heavy + w)·hd +
m·(m + hd)) per head. At least one far row stays (``min(heavy, far − 1)``
are kept). Measured on that real data (2048 rows, decode right after the
seal): the recent queries pick better rows than evenly spaced ones or every
prompt query (``HEAVY_EVEN`` mixes evenly spaced ones in), and 64 query
vectors as well as 256.

Degenerate case: a prompt of ``t <= sink + w`` rows has no far field; the
state is then exact-only. Decode rows keep filling the window; once a row must
leave a full window of an exact-only state it is dropped (the StreamingLLM
fallback: there are no landmarks to fold it into). ``dropped`` counts them.
``o1_seal`` never builds such a state: it waits for ``o1_deferred_boundary``.

Kernels for backends: :func:`nystrom_prefill` (far sums of the probes over the
prompt's far rows), :func:`nystrom_absorb` (one row into the far sums) and
:func:`nystrom_step` (one decode read of every head of a group). Each takes and
returns plain arrays; :class:`NystromState` calls them through its
``kernels`` object (this module by default), so a backend passes its own
namespace with the same three names and inherits nothing else. The seal-time
fit (:func:`far_fit`) is shared: it is small (O(p·m²) per head).
"""

from __future__ import annotations

import enum
import sys
from dataclasses import dataclass, replace

import numpy as np

from kvreg.errors import ConfigError, ShapeError, StateError

__all__ = [
    "O1Rect",
    "FarField",
    "NystromState",
    "o1_deferred_boundary",
    "segment_bounds",
    "segment_means",
    "landmarks",
    "recent_queries",
    "recent_positions",
    "heavy_sample",
    "heavy_mass",
    "heavy_select",
    "probe_log_den",
    "far_fit",
    "landmark_inverse",
    "absorb_pooled",
    "nystrom_prefill",
    "nystrom_absorb",
    "nystrom_parts",
    "nystrom_step",
]

# Far rows scored per matmul in the prefill: bounds the [hpk, p, chunk]
# logit block to a few MiB whatever the prompt length.
PREFILL_CHUNK = 8192

# Rows compared per block while looking back for the recent distinct queries.
RECENT_BLOCK = 256

# Query vectors (sampled positions x the group's heads) scored at the seal to
# pick the heavy rows: one float32 GEMM over the prompt's keys, ~0.1 s of a
# 32k-row, 8-group seal (module doc, "Heavy rows").
HEAVY_QUERIES = 64

# One sampled position in HEAVY_EVEN is evenly spaced over the prompt, the
# others are the most recent ones; 0: recent ones only, the default (module
# doc, "Heavy rows").
HEAVY_EVEN = 0

# float32 logits per block of the heavy-row scoring ([queries, rows]): ~16 MiB.
HEAVY_BLOCK = 1 << 22


class O1Rect(enum.Enum):
    """How the landmarks summarize the far rows (the seed's ``O1Rect``)."""

    #: landmarks aggregate the far rows by segment means: ``m`` contiguous
    #: segments, K̃ the means of each segment's keys (and half of the probe
    #: queries the means of segments' queries)
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


@dataclass(frozen=True)
class FarField:
    """The landmark state of one KV group (all float64, see the module doc).

    Per group ``k_tilde [m, hd]`` (landmark keys); per head ``probes [hpk, p,
    hd]`` (probe queries), ``m_hat [hpk, m, p]`` (``P``), ``r [hpk, p]``
    (``ν``: the probes' log attention denominators at the seal), ``c [hpk,
    p]`` (far-sum stabilizers), ``z [hpk, p]``, ``theta [hpk, p, hd]``;
    ``rows`` far rows summed so far.

    The pooling prior is all or nothing: ``count [m]``, ``vsum [m, hd]``
    (segment sizes and value sums: ``W₀``), ``vlo``/``vhi [hd]`` (per-channel
    min/max of the far values) and ``last_logit [hpk, p]`` (each probe's logit
    of the last segment's key). With it ``z``/``theta`` are the probes'
    residual sums (far sums minus their pooled stand-in); without it they are
    the plain far sums, the estimate is ``φ·P·F̂`` alone and a non-positive far
    denominator drops the far part. The kernels serve both forms, so a far
    field built by hand (kernel tests) needs only the first eight fields.
    """

    k_tilde: np.ndarray
    probes: np.ndarray
    m_hat: np.ndarray
    r: np.ndarray
    c: np.ndarray
    z: np.ndarray
    theta: np.ndarray
    rows: int
    count: np.ndarray | None = None
    vsum: np.ndarray | None = None
    vlo: np.ndarray | None = None
    vhi: np.ndarray | None = None
    last_logit: np.ndarray | None = None

    _POOLED = ("count", "vsum", "vlo", "vhi", "last_logit")

    def __post_init__(self):
        given = [getattr(self, n) is not None for n in self._POOLED]
        if any(given) and not all(given):
            raise ShapeError("FarField: count, vsum, vlo, vhi and last_logit go together "
                             "(all or none)")

    @property
    def pooled(self) -> bool:
        """True when the pooling prior (and its Jensen floor) is present."""
        return self.count is not None

    def nbytes(self) -> int:
        arrays = (self.k_tilde, self.probes, self.m_hat, self.r, self.c, self.z, self.theta,
                  self.count, self.vsum, self.vlo, self.vhi, self.last_logit)
        return sum(a.nbytes for a in arrays if a is not None)


# ── seal-time pieces (shared by every backend) ──


def segment_bounds(n: int, m: int) -> np.ndarray:
    """``m + 1`` bounds splitting ``n >= m >= 1`` rows into ``m`` contiguous,
    non-empty segments whose sizes differ by at most one."""
    return (np.arange(m + 1, dtype=np.int64) * n) // m


def segment_means(x: np.ndarray, m: int) -> np.ndarray:
    """Means of ``x [..., n, hd]`` over ``m`` segments of its rows (axis -2,
    :func:`segment_bounds`): ``[..., m, hd]`` float64. One float64-accumulating
    sum per segment: several times faster than ``np.add.reduceat(...,
    dtype=float64)`` on float32 rows, and the same sums."""
    b = segment_bounds(x.shape[-2], m)
    sums = np.stack([x[..., b[j]:b[j + 1], :].sum(axis=-2, dtype=np.float64) for j in range(m)],
                    axis=-2)
    return sums / np.diff(b).astype(np.float64)[:, None]


def landmarks(q_far: np.ndarray, k_far: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Segment means: ``q_far [hpk, n, hd]``, ``k_far [n, hd]``, ``1 <= m <= n``
    -> ``(q_tilde [hpk, m, hd], k_tilde [m, hd])`` float64."""
    return segment_means(q_far, m), segment_means(k_far, m)


def recent_positions(q: np.ndarray, n: int) -> np.ndarray:
    """Positions of the last ``n`` distinct query rows of a trace ``q [hpk, t,
    hd]``, oldest first (int64): consecutive equal rows (a trace recorded with
    a stride repeats each row) count once, at the last row of their run; a
    trace with fewer distinct rows gives them all."""
    t = q.shape[1]
    picked: list[int] = []  # positions, newest first: the last row of each run
    end = t
    while end > 0 and len(picked) < n:
        lo = max(0, end - RECENT_BLOCK)
        blk = q[:, lo:min(t, end + 1)]  # one row of overlap: a run may cross blocks
        differs = np.any(blk[:, 1:] != blk[:, :-1], axis=(0, 2))  # row i vs row i + 1
        for i in range(end - lo - 1, -1, -1):
            p = lo + i
            if p == t - 1 or differs[i]:
                picked.append(p)
                if len(picked) == n:
                    break
        end = lo
    return np.array(picked[::-1], dtype=np.int64)


def recent_queries(q: np.ndarray, n: int) -> np.ndarray:
    """The last ``n`` distinct query rows of a trace ``q [hpk, t, hd]``, oldest
    first: ``[hpk, <= n, hd]`` float64 (:func:`recent_positions`)."""
    return q[:, recent_positions(q, n)].astype(np.float64)


def heavy_sample(q: np.ndarray, lo: int, n: int) -> np.ndarray:
    """The prompt positions whose queries score the heavy rows, sorted
    (int64): the last ``n − e`` distinct ones (:func:`recent_positions`:
    where decode starts) and ``e = ⌊n/HEAVY_EVEN⌋`` (none for ``HEAVY_EVEN =
    0``) evenly spaced over ``[lo, t)`` (``lo + ⌊(j + 1)·(t − lo)/e⌋ − 1``: the
    whole prompt's queries that can see a far row), duplicates once."""
    t = q.shape[1]
    n_even = n // HEAVY_EVEN if HEAVY_EVEN else 0
    even = lo + ((np.arange(n_even, dtype=np.int64) + 1) * (t - lo)) // max(n_even, 1) - 1
    return np.unique(np.concatenate([recent_positions(q, n - n_even), even]))


def heavy_mass(q: np.ndarray, k: np.ndarray, pos: np.ndarray, lo: int, hi: int,
               scale: float) -> np.ndarray:
    """``[hi − lo]`` float64: the attention mass that the queries at positions
    ``pos`` (sorted) of every head of ``q [hpk, t, hd]`` put on each row of
    ``[lo, hi)`` of ``k [t, hd]``, each query causal (rows ``<= p``) and
    normalized over its rows, summed over the queries and heads. float32
    logits, blocks of queries of at most :data:`HEAVY_BLOCK` logits: a
    ranking, not an estimate."""
    hpk, _, hd = q.shape
    pos = np.asarray(pos, dtype=np.int64)
    qs = (np.float32(scale) * q[:, pos].astype(np.float32)).transpose(1, 0, 2).reshape(-1, hd)
    qpos = np.repeat(pos, hpk)  # position-major: a block spans few positions
    k32 = np.asarray(k, dtype=np.float32)
    mass = np.zeros(hi - lo)
    if qs.shape[0] == 0:
        return mass
    step = max(1, HEAVY_BLOCK // int(qpos[-1] + 1))
    for a in range(0, qs.shape[0], step):
        pb = qpos[a:a + step]
        end = int(pb[-1]) + 1  # the block's last query sees rows [0, end)
        s = qs[a:a + step] @ k32[:end].T  # [b, end]
        for i in np.flatnonzero(pb < end - 1):
            s[i, pb[i] + 1:] = -np.inf  # causal
        s -= s.max(axis=1, keepdims=True)
        np.exp(s, out=s)
        top = min(hi, end)
        if top > lo:
            mass[:top - lo] += (1.0 / s.sum(axis=1)) @ s[:, lo:top]
    return mass


def heavy_select(q: np.ndarray, k: np.ndarray, lo: int, hi: int, n: int,
                 scale: float) -> np.ndarray:
    """The ``n`` rows of ``[lo, hi)`` of largest :func:`heavy_mass` over the
    queries of :func:`heavy_sample` (``HEAVY_QUERIES // hpk`` positions),
    sorted positions (int64); none for ``n = 0``."""
    n = min(int(n), hi - lo)
    if n <= 0:
        return np.zeros(0, dtype=np.int64)
    pos = heavy_sample(q, lo, max(1, HEAVY_QUERIES // q.shape[0]))
    neg = -heavy_mass(q, k, pos, lo, hi, scale)
    # the n largest, ties to the earlier row (a stable argsort's order, by
    # partition: a full sort of 32k rows costs as much as the scoring's exp)
    kth = np.partition(neg, n - 1)[n - 1]
    above = np.flatnonzero(neg < kth)
    tied = np.flatnonzero(neg == kth)[:n - above.size]
    return lo + np.sort(np.concatenate([above, tied]))


def probe_log_den(probes: np.ndarray, k_exact: np.ndarray, c: np.ndarray, z: np.ndarray,
                  scale: float) -> np.ndarray:
    """``ν [hpk, p]``: log of each probe's attention denominator at the seal,
    over the exact rows ``k_exact [e, hd]`` (sinks, heavy rows, window) and the far rows
    (through their sums ``c``, ``z [hpk, p]``)."""
    nu = c + np.log(z)
    if k_exact.shape[0]:
        le = scale * (probes @ k_exact.astype(np.float64).T)  # [hpk, p, e]
        mx = le.max(axis=2)
        nu = np.logaddexp(nu, mx + np.log(np.exp(le - mx[:, :, None]).sum(axis=2)))
    return nu


def far_fit(probes: np.ndarray, k_tilde: np.ndarray, nu: np.ndarray, scale: float,
            rcond: float) -> np.ndarray:
    """``P [hpk, m, p]`` of the ridge fit ``W = W₀ + P·(F̂ − Φ·W₀)`` (module
    doc): with ``Φ = exp(s·probes·K̃ᵀ − ν)`` (rows scaled by the probes'
    denominators), ``P = (ΦᵀΦ + λI)⁻¹Φᵀ``, ``λ = rcond·σ_max(Φ)²``. Computed
    from the SVD of ``Φ`` (``P = V·diag(σ/(σ² + λ))·Uᵀ``), per head."""
    phi = np.exp(scale * np.einsum("hjd,id->hji", probes, k_tilde) - nu[:, :, None])
    u, sv, vt = np.linalg.svd(phi, full_matrices=False)
    lam = rcond * sv[:, :1] ** 2
    f = np.divide(sv, sv ** 2 + lam, out=np.zeros_like(sv), where=sv > 0)
    return np.einsum("hki,hk,hjk->hij", vt, f, u)


def landmark_inverse(q_tilde: np.ndarray, k_tilde: np.ndarray, scale: float,
                     rcond: float) -> tuple[np.ndarray, np.ndarray]:
    """``(m_hat [hpk, m, m], r [hpk, m])``: the plain Nyström interpolation
    (probes = the landmark queries ``Q̃``, each scaled by its largest
    landmark logit ``r``, no prior), regularized as in :func:`far_fit`. The
    estimator before the pooling prior; kernel tests build far fields with
    it."""
    r = scale * np.einsum("hjd,id->hji", q_tilde, k_tilde).max(axis=2)
    return far_fit(q_tilde, k_tilde, r, scale, rcond), r


# ── kernels (pure functions; a backend may override them) ──


def nystrom_prefill(probes: np.ndarray, k_far: np.ndarray, v_far: np.ndarray,
                    scale: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Far sums over ``n >= 1`` far rows: ``probes [hpk, p, hd]`` (the probe
    queries), ``k_far``, ``v_far [n, hd]`` -> ``(c [hpk, p], z [hpk, p], theta
    [hpk, p, hd])`` float64 with ``c`` the max far logit of each probe."""
    hpk, p, hd = probes.shape
    c = np.full((hpk, p), -np.inf)
    z = np.zeros((hpk, p))
    theta = np.zeros((hpk, p, hd))
    # chunked online softmax: the logit block stays small at any context
    for lo in range(0, k_far.shape[0], PREFILL_CHUNK):
        kc = k_far[lo:lo + PREFILL_CHUNK].astype(np.float64)
        vc = v_far[lo:lo + PREFILL_CHUNK].astype(np.float64)
        # one BLAS GEMM for all heads' probes (einsum here is a C loop)
        logits = (scale * (probes.reshape(hpk * p, hd) @ kc.T)).reshape(hpk, p, -1)
        c_new = np.maximum(c, logits.max(axis=2))
        alpha = np.exp(c - c_new)  # exp(-inf) = 0 on the first chunk
        e = np.exp(logits - c_new[:, :, None])
        z = z * alpha + e.sum(axis=2)
        theta = theta * alpha[:, :, None] + e @ vc
        c = c_new
    return c, z, theta


def absorb_pooled(far: FarField, v_row: np.ndarray) -> dict:
    """The pooled half of an absorb: the row joins the last segment
    (``count``, ``vsum``; the segment keeps its key) and the value box
    (``vlo``, ``vhi``). Returns the new arrays (empty without the prior) for
    :func:`dataclasses.replace`. O(hd), shared by every backend's
    ``nystrom_absorb`` (whose probe half subtracts the row's pooled stand-in
    from the residuals)."""
    if not far.pooled:
        return {}
    v64 = v_row.astype(np.float64)
    count, vsum = far.count.copy(), far.vsum.copy()
    count[-1] += 1.0
    vsum[-1] += v64
    return dict(count=count, vsum=vsum, vlo=np.minimum(far.vlo, v64), vhi=np.maximum(far.vhi, v64))


def nystrom_absorb(far: FarField, k_row: np.ndarray, v_row: np.ndarray, scale: float) -> FarField:
    """The far field with one more row (leaving the window) folded into its
    sums, O(p·hd) per head; ``far`` is not modified. ``k_row``, ``v_row
    [hd]``. With the pooling prior the sums are residuals: the row adds its
    kernel value minus that of its pooled stand-in, the last segment's key
    (``last_logit <= c``: a mean key's logit is at most the largest logit of
    its segment, so no exponent is positive)."""
    k64 = k_row.astype(np.float64)
    logits = scale * (far.probes @ k64)  # [hpk, p]
    c_new = np.maximum(far.c, logits)
    alpha = np.exp(far.c - c_new)
    beta = np.exp(logits - c_new)
    if far.pooled:
        beta = beta - np.exp(far.last_logit - c_new)
    z = far.z * alpha
    z += beta
    theta = far.theta * alpha[:, :, None]
    theta += beta[:, :, None] * v_row.astype(np.float64)[None, None, :]
    return replace(far, c=c_new, z=z, theta=theta, rows=far.rows + 1, **absorb_pooled(far, v_row))


def nystrom_parts(q_group: np.ndarray, k_exact: np.ndarray, v_exact: np.ndarray,
                  far: FarField | None, scale: float):
    """The unnormalized pieces of one decode read, all scaled by ``e^{−μ}``:
    ``(num_exact [hpk, hd], den_exact [hpk], num_far [hpk, hd], den_far [hpk])``
    float64; the far part already checked (pooled: a far denominator below
    the pooled one, or a far average ``num/den`` outside the box of the far
    values, takes the pooled estimate) or clamped (no prior: a non-positive
    denominator zeroes the far part). ``k_exact``/``v_exact [e >= 1, hd]`` are
    the sinks, heavy and window rows."""
    q = q_group.astype(np.float64)
    se = scale * (q @ k_exact.astype(np.float64).T)  # [hpk, e]
    mu = se.max(axis=1)
    hpk, hd = q.shape
    num_f = np.zeros((hpk, hd))
    den_f = np.zeros(hpk)
    if far is not None:
        sa = scale * (q @ far.k_tilde.T)  # [hpk, m]
        mu_a = sa.max(axis=1)
        a = np.exp(sa - mu_a[:, None])  # φ(q)·e^{−μa}
        u = np.einsum("hi,hij->hj", a, far.m_hat)  # φ·P (times e^{−μa}), [hpk, p]
        log_f = mu_a[:, None] + (far.c - far.r)
        mu = np.maximum(mu, log_f.max(axis=1))
        if far.pooled:
            mu = np.maximum(mu, mu_a)
        g = u * np.exp(log_f - mu[:, None])
        den_f = (g * far.z).sum(axis=1)
        num_f = np.einsum("hj,hjd->hd", g, far.theta)
        if far.pooled:
            # pooling φ·W₀ plus the correction φ·P·E just summed
            ap = np.exp(mu_a - mu)[:, None] * a
            den_p = ap @ far.count  # a lower bound on the far denominator (Jensen)
            num_p = ap @ far.vsum
            den_t, num_t = den_p + den_f, num_p + num_f
            # the correction may not take the denominator below the bound, nor
            # the far average (a convex combination of far values) out of their box
            bad = ((den_f < 0) | (num_t < den_t[:, None] * far.vlo).any(axis=1)
                   | (num_t > den_t[:, None] * far.vhi).any(axis=1))
            den_f = np.where(bad, den_p, den_t)
            num_f = np.where(bad[:, None], num_p, num_t)
        else:
            keep = den_f > 0
            den_f = np.where(keep, den_f, 0.0)
            num_f = np.where(keep[:, None], num_f, 0.0)
    e = np.exp(se - mu[:, None])
    return e @ v_exact.astype(np.float64), e.sum(axis=1), num_f, den_f


def nystrom_step(q_group: np.ndarray, k_exact: np.ndarray, v_exact: np.ndarray,
                 far: FarField | None, scale: float) -> np.ndarray:
    """One decode read of every head of a group: ``q_group [hpk, hd]`` ->
    ``out [hpk, hd]`` float32 (exact sinks + heavy rows + window, plus the far estimate)."""
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
    at prefill: ``(sink + heavy + w)`` exact rows plus the O(hpk·m·(m + hd))
    landmark state, whatever the context length. ``rcond`` is the fit's ridge
    ``λ`` relative to ``σ_max²`` (:func:`far_fit`). ``heavy``: the far rows
    kept exact (module doc, "Heavy rows"); ``None`` = ``m`` (the memory of
    ``m`` more exact rows), ``0`` = none.
    """

    def __init__(self, m: int, w: int, sink: int, hpk: int, *, scale: float,
                 rect: O1Rect = O1Rect.Aggregate, rcond: float = 1e-3, kernels=None,
                 heavy: int | None = None):
        if heavy is None:
            heavy = m
        for name, val, lo in (("m", m, 1), ("w", w, 1), ("sink", sink, 0), ("hpk", hpk, 1),
                              ("heavy", heavy, 0)):
            if isinstance(val, bool) or not isinstance(val, (int, np.integer)) or val < lo:
                raise ConfigError(f"NystromState: {name} must be an int >= {lo}, got {val!r}")
        if not (isinstance(scale, (int, float, np.floating)) and np.isfinite(scale) and scale > 0):
            raise ConfigError(f"NystromState: scale must be a finite float > 0, got {scale!r}")
        if not isinstance(rect, O1Rect):
            raise ConfigError(f"NystromState: rect must be an O1Rect, got {rect!r}")
        if not (0 < rcond < 1):
            raise ConfigError(f"NystromState: rcond must be in (0, 1), got {rcond!r}")
        self.m, self.w, self.sink, self.hpk = int(m), int(w), int(sink), int(hpk)
        self.heavy = int(heavy)
        self.scale = float(scale)
        self.rect = rect
        self.rcond = float(rcond)
        self.kernels = kernels if kernels is not None else sys.modules[__name__]
        self.head_dim: int | None = None
        self.exact_k: np.ndarray | None = None  # [sink + n_heavy + w, hd]: sinks, heavy, ring
        self.exact_v: np.ndarray | None = None
        self.n_sink = 0  # sink rows held (< sink only for a prompt shorter than sink)
        self.n_heavy = 0  # heavy rows held (min(heavy, far rows - 1); 0 without far rows)
        self.heavy_pos = np.zeros(0, dtype=np.int64)  # their prompt positions (diagnostic)
        self._ring = self.sink  # slot of the ring's first row: sink + n_heavy
        self.win_head = 0  # ring slot of the oldest window row
        self.win_len = 0
        self.far: FarField | None = None
        self.seen = 0  # rows ever inserted (prompt + decode): the context depth
        self.dropped = 0  # rows lost by an exact-only state (see the module doc)

    @classmethod
    def new_group(cls, m: int, w: int, sink: int, hpk: int, *, scale: float,
                  rect: O1Rect = O1Rect.Aggregate, rcond: float = 1e-3,
                  kernels=None, heavy: int | None = None) -> "NystromState":
        """The seed's constructor name; same arguments as ``__init__``."""
        return cls(m, w, sink, hpk, scale=scale, rect=rect, rcond=rcond, kernels=kernels,
                   heavy=heavy)

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
        heavy = np.zeros(0, dtype=np.int64)
        if n_far > 0:
            # at least one row stays far: the landmarks absorb later rows
            heavy = heavy_select(q, k, n_sink, t - n_win, min(self.heavy, n_far - 1), self.scale)
            far = self._far_field(q, k, v, n_sink, t - n_win, heavy)
        n_heavy = heavy.size
        ring = self.sink + n_heavy
        ek = np.zeros((ring + self.w, hd), dtype=np.float32)
        ev = np.zeros_like(ek)
        ek[:n_sink], ev[:n_sink] = k[:n_sink], v[:n_sink]
        ek[self.sink:ring], ev[self.sink:ring] = k[heavy], v[heavy]
        ek[ring:ring + n_win] = k[t - n_win:]
        ev[ring:ring + n_win] = v[t - n_win:]
        self.head_dim = hd
        self.exact_k, self.exact_v = ek, ev
        self.n_sink, self.win_head, self.win_len = n_sink, 0, n_win
        self.n_heavy, self.heavy_pos, self._ring = n_heavy, heavy, ring
        self.far = far
        self.seen = t

    def _far_field(self, q: np.ndarray, k: np.ndarray, v: np.ndarray, lo: int,
                   hi: int, heavy: np.ndarray) -> FarField:
        """The landmark state of the far rows ``[lo, hi)`` of a prompt but
        the ``heavy`` ones (module doc): ``m_eff = min(m, far rows)`` segments
        of the remaining rows (in order), ``⌈m_eff/2⌉`` segment-mean probes
        (of the queries at every position of ``[lo, hi)``) and up to
        ``⌊m_eff/2⌋`` recent ones per head, the fit, the pooling prior and
        the probes' residuals."""
        if heavy.size:
            keep = np.ones(hi - lo, dtype=bool)
            keep[heavy - lo] = False
            kf, vf = k[lo:hi][keep], v[lo:hi][keep]
            k_exact = np.concatenate([k[:lo], k[heavy], k[hi:]])
        else:
            kf, vf = k[lo:hi], v[lo:hi]
            k_exact = np.concatenate([k[:lo], k[hi:]])
        n_far = kf.shape[0]
        m_eff = min(self.m, n_far)
        n_seg = (m_eff + 1) // 2
        k_tilde = segment_means(kf, m_eff)
        probes = segment_means(q[:, lo:hi], n_seg)
        if m_eff > n_seg:
            probes = np.concatenate([probes, recent_queries(q, m_eff - n_seg)], axis=1)
        c, z, theta = self.kernels.nystrom_prefill(probes, kf, vf, scale=self.scale)
        nu = probe_log_den(probes, k_exact, c, z, self.scale)
        m_hat = far_fit(probes, k_tilde, nu, self.scale, self.rcond)
        # the pooling prior W₀, and the probes' residuals E = F̂ − Φ·W₀ (in
        # units of e^{c − ν}: Φ·W₀·e^{ν − c} = exp(s·probes·K̃ᵀ − c)·W₀)
        b = segment_bounds(n_far, m_eff)
        count = np.diff(b).astype(np.float64)
        vsum = np.stack([vf[b[j]:b[j + 1]].sum(axis=0, dtype=np.float64)
                         for j in range(m_eff)])
        pl = self.scale * np.einsum("hjd,id->hji", probes, k_tilde)  # [hpk, p, m]
        stand_in = np.exp(pl - c[:, :, None])
        z = z - stand_in @ count
        theta = theta - stand_in @ vsum
        vlo = vf.min(axis=0).astype(np.float64)
        vhi = vf.max(axis=0).astype(np.float64)
        return FarField(k_tilde, probes, m_hat, nu, c, z, theta, n_far, count, vsum, vlo, vhi,
                        np.ascontiguousarray(pl[:, :, -1]))

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
        """Sinks, heavy and window rows ``(k, v)`` as contiguous views (no
        copy): the window occupies ring slots in some rotation, which attention
        does not see."""
        n = self._ring + self.win_len if self.n_sink == self.sink else None
        if n is not None:
            return self.exact_k[:n], self.exact_v[:n]
        # a prompt shorter than `sink`: the window is empty until sinks fill
        return self.exact_k[:self.n_sink], self.exact_v[:self.n_sink]

    def _insert(self, k_row: np.ndarray, v_row: np.ndarray) -> None:
        if self.n_sink < self.sink:
            self.exact_k[self.n_sink], self.exact_v[self.n_sink] = k_row, v_row
            self.n_sink += 1
        elif self.win_len < self.w:
            slot = self._ring + (self.win_head + self.win_len) % self.w
            self.exact_k[slot], self.exact_v[slot] = k_row, v_row
            self.win_len += 1
        else:
            slot = self._ring + self.win_head
            if self.far is not None:
                self.far = self.kernels.nystrom_absorb(self.far, self.exact_k[slot], self.exact_v[slot],
                                                       scale=self.scale)
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
        return self.kernels.nystrom_step(q, ke, ve, self.far, scale=self.scale)

    def step_group(self, q_group: np.ndarray, k_new: np.ndarray, v_new: np.ndarray) -> np.ndarray:
        """One decode token: insert ``(k_new, v_new) [hd]`` into the window
        (the row leaving it moves into the far sums), then attend every head:
        ``q_group [hpk, hd]`` -> ``out [hpk, hd]`` float32. Refused before any
        change on a bad shape or a non-finite value."""
        q, k_row, v_row = self._check_step(q_group, k_new, v_new)
        self._insert(k_row, v_row)
        ke, ve = self.exact_rows()
        return self.kernels.nystrom_step(q, ke, ve, self.far, scale=self.scale)

    def window_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """The window's rows, oldest first (copies): ``(k, v) [win_len, hd]``."""
        if not self.prefilled:
            raise StateError("NystromState.window_rows: not prefilled")
        idx = self._ring + (self.win_head + np.arange(self.win_len)) % self.w
        return self.exact_k[idx].copy(), self.exact_v[idx].copy()

    def sink_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """The sink rows (copies): ``(k, v) [n_sink, hd]``."""
        if not self.prefilled:
            raise StateError("NystromState.sink_rows: not prefilled")
        return self.exact_k[:self.n_sink].copy(), self.exact_v[:self.n_sink].copy()

    def heavy_rows(self) -> tuple[np.ndarray, np.ndarray]:
        """The heavy rows (copies), in prompt order (positions
        ``heavy_pos``): ``(k, v) [n_heavy, hd]``."""
        if not self.prefilled:
            raise StateError("NystromState.heavy_rows: not prefilled")
        sl = slice(self.sink, self._ring)
        return self.exact_k[sl].copy(), self.exact_v[sl].copy()
