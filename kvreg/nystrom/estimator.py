"""The Nyström estimator's math (the package docstring describes it):
landmarks, probes, the ridge fit, and the far field's prefill, absorb and
step, each a pure function over plain arrays (the ``nystrom`` capability's
reference kernels)."""


from __future__ import annotations

import enum
from dataclasses import dataclass, replace

import numpy as np

from kvreg.errors import ConfigError, ShapeError

__all__ = [
    "O1Rect",
    "FarField",
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
    if far.count is None or far.vsum is None or far.vlo is None or far.vhi is None:   # no prior (all or none)
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


