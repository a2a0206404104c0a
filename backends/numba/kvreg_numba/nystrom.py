"""Nyström far-field kernels (``kvreg.nystrom``'s three) in Numba, float64.

Every kernel here is serial and releases the GIL: an O(1) seal runs its KV
groups on threads (``NumbaBackend.parallel_seal``), so a kernel that threads
itself would oversubscribe the cores. The landmark arithmetic stays float64
as in the reference (``φ·P`` cancels in part, see kvreg.nystrom); the exponentials
are :func:`fexp64`, a vectorizable float64 exp.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from llvmlite import ir
from numba import njit
from numba.core import types
from numba.extending import intrinsic

from kvreg.nystrom import absorb_pooled

from . import config

_FM = set(config.FASTMATH)
_CACHE = config.CACHE


@intrinsic
def _f64_from_bits(typingctx, x):
    sig = types.float64(types.int64)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.DoubleType())

    return sig, codegen


_LOG2E = 1.4426950408889634
_LN2_HI = 6.93147180369123816490e-01
_LN2_LO = 1.90821492927058770002e-10
_EXP_LO = -708.0


@njit(nogil=True, cache=_CACHE, inline="always")
def fexp64(x):
    """exp(x) for float64 ``x <= 0``: Cody-Waite reduction to ``|r| <= ln2/2``
    and a degree-12 Taylor polynomial (truncation 2e-16 relative); below
    -708 (and -inf) exactly 0. Arithmetic and selects only, so it vectorizes
    (Numba's np.exp is a scalar libm call per element)."""
    xc = max(x, _EXP_LO)
    n = np.floor(xc * _LOG2E + 0.5)
    r = (xc - n * _LN2_HI) - n * _LN2_LO
    p = 1.0 / 479001600.0
    p = p * r + 1.0 / 39916800.0
    p = p * r + 1.0 / 3628800.0
    p = p * r + 1.0 / 362880.0
    p = p * r + 1.0 / 40320.0
    p = p * r + 1.0 / 5040.0
    p = p * r + 1.0 / 720.0
    p = p * r + 1.0 / 120.0
    p = p * r + 1.0 / 24.0
    p = p * r + 1.0 / 6.0
    p = p * r + 0.5
    p = p * r + 1.0
    p = p * r + 1.0
    y = p * _f64_from_bits((np.int64(n) + np.int64(1023)) << 52)
    return y if x >= _EXP_LO else 0.0


@njit(nogil=True, cache=_CACHE, fastmath=_FM)
def _gemm_nt(A, B, C, M, N, K):
    """``C[:M, :N] = A[:M, :K] @ B[:N, :K].T`` in 4x4 tiles of dot products:
    16 independent accumulators per tile, each A and B row loaded once per
    tile (a quarter of the loads of one dot at a time)."""
    i = 0
    while i + 4 <= M:
        a0 = A[i, :K]
        a1 = A[i + 1, :K]
        a2 = A[i + 2, :K]
        a3 = A[i + 3, :K]
        j = 0
        while j + 4 <= N:
            b0 = B[j, :K]
            b1 = B[j + 1, :K]
            b2 = B[j + 2, :K]
            b3 = B[j + 3, :K]
            c00 = c01 = c02 = c03 = 0.0
            c10 = c11 = c12 = c13 = 0.0
            c20 = c21 = c22 = c23 = 0.0
            c30 = c31 = c32 = c33 = 0.0
            for k in range(K):
                x0 = a0[k]
                x1 = a1[k]
                x2 = a2[k]
                x3 = a3[k]
                y0 = b0[k]
                y1 = b1[k]
                y2 = b2[k]
                y3 = b3[k]
                c00 += x0 * y0
                c01 += x0 * y1
                c02 += x0 * y2
                c03 += x0 * y3
                c10 += x1 * y0
                c11 += x1 * y1
                c12 += x1 * y2
                c13 += x1 * y3
                c20 += x2 * y0
                c21 += x2 * y1
                c22 += x2 * y2
                c23 += x2 * y3
                c30 += x3 * y0
                c31 += x3 * y1
                c32 += x3 * y2
                c33 += x3 * y3
            C[i, j] = c00
            C[i, j + 1] = c01
            C[i, j + 2] = c02
            C[i, j + 3] = c03
            C[i + 1, j] = c10
            C[i + 1, j + 1] = c11
            C[i + 1, j + 2] = c12
            C[i + 1, j + 3] = c13
            C[i + 2, j] = c20
            C[i + 2, j + 1] = c21
            C[i + 2, j + 2] = c22
            C[i + 2, j + 3] = c23
            C[i + 3, j] = c30
            C[i + 3, j + 1] = c31
            C[i + 3, j + 2] = c32
            C[i + 3, j + 3] = c33
            j += 4
        while j < N:
            b0 = B[j, :K]
            for ii in range(4):
                a = A[i + ii, :K]
                s = 0.0
                for k in range(K):
                    s += a[k] * b0[k]
                C[i + ii, j] = s
            j += 1
        i += 4
    while i < M:
        a = A[i, :K]
        for j in range(N):
            b = B[j, :K]
            s = 0.0
            for k in range(K):
                s += a[k] * b[k]
            C[i, j] = s
        i += 1


@njit(nogil=True, cache=_CACHE, fastmath=_FM)
def prefill_kernel(qt, k, v, scale, rows, c, z, theta):
    """Far sums over every row of ``k``/``v`` (f32 ``[n, hd]``) for the
    landmark queries ``qt [L, hd]`` (f64): online softmax over steps of
    ``rows`` rows; ``c``, ``z``, ``theta`` are written (f64 ``[L]``, ``[L]``,
    ``[L, hd]``)."""
    L, hd = qt.shape
    n = k.shape[0]
    kb = np.empty((rows, hd))
    vt = np.empty((hd, rows))
    lg = np.empty((L, rows))
    upd = np.empty((L, hd))
    alpha = np.empty(L)
    for i in range(L):
        c[i] = -np.inf
        z[i] = 0.0
        for d in range(hd):
            theta[i, d] = 0.0
    for lo in range(0, n, rows):
        nr = min(rows, n - lo)
        for r in range(nr):
            src = k[lo + r]
            dst = kb[r]
            for d in range(hd):
                dst[d] = np.float64(src[d])
        for r in range(nr):
            src = v[lo + r]
            for d in range(hd):
                vt[d, r] = np.float64(src[d])
        _gemm_nt(qt, kb, lg, L, nr, hd)
        for i in range(L):
            e = lg[i, :nr]
            mx = -np.inf
            for r in range(nr):
                x = scale * e[r]
                e[r] = x
                mx = max(mx, x)
            cn = max(c[i], mx)
            alpha[i] = fexp64(c[i] - cn)  # exp(-inf) = 0 on the first step
            s = 0.0
            for r in range(nr):
                x = fexp64(e[r] - cn)
                e[r] = x
                s += x
            z[i] = z[i] * alpha[i] + s
            c[i] = cn
        _gemm_nt(lg, vt, upd, L, hd, nr)
        for i in range(L):
            a = alpha[i]
            th = theta[i]
            u = upd[i]
            for d in range(hd):
                th[d] = th[d] * a + u[d]


@njit(nogil=True, cache=_CACHE, fastmath=_FM)
def absorb_kernel(qt, c, z, theta, k_row, v_row, scale, pooled, last_logit):
    """One row into the far sums, in place: ``qt [L, hd]``, ``c``, ``z [L]``,
    ``theta [L, hd]`` (f64, the FarField's arrays flattened over heads). With
    ``pooled`` the sums are residuals: the row's stand-in, logit
    ``last_logit [L]``, is subtracted."""
    L, hd = qt.shape
    for i in range(L):
        q = qt[i]
        s = 0.0
        for d in range(hd):
            s += q[d] * np.float64(k_row[d])
        x = scale * s
        cn = max(c[i], x)
        a = fexp64(c[i] - cn)
        b = fexp64(x - cn)
        if pooled:
            b -= fexp64(last_logit[i] - cn)
        z[i] = z[i] * a + b
        th = theta[i]
        for d in range(hd):
            th[d] = th[d] * a + b * np.float64(v_row[d])
        c[i] = cn


@njit(nogil=True, cache=_CACHE, fastmath=_FM)
def step_kernel(q, k_exact, v_exact, has_far, k_tilde, m_hat, r, c, z, theta, has_pool, count,
                vsum, vlo, vhi, scale, out):
    """One decode read of a group (kvreg.nystrom.nystrom_parts, then the
    ratio): ``q [hpk, hd]`` f32; exact rows ``[e, hd]`` f32; far state f64
    (``k_tilde [m, hd]``, ``m_hat [hpk, m, p]``, ``r``/``c``/``z [hpk, p]``,
    ``theta [hpk, p, hd]``; with ``has_pool`` also ``count [m]``, ``vsum [m,
    hd]``, ``vlo``/``vhi [hd]``, and ``z``/``theta`` are residuals).
    O(e·hd + m·(p + hd) + p·hd) per head."""
    hpk, hd = q.shape
    ne = k_exact.shape[0]
    m = k_tilde.shape[0]
    npr = c.shape[1]
    q64 = np.empty(hd)
    se = np.empty(ne)
    a = np.empty(m)
    u = np.empty(npr)
    num = np.empty(hd)
    nump = np.empty(hd)
    for h in range(hpk):
        for d in range(hd):
            q64[d] = np.float64(q[h, d])
        mu = -np.inf
        for j in range(ne):
            kr = k_exact[j]
            s = 0.0
            for d in range(hd):
                s += q64[d] * np.float64(kr[d])
            s *= scale
            se[j] = s
            mu = max(mu, s)
        for d in range(hd):
            num[d] = 0.0
        den_f = 0.0
        if has_far:
            # a = φ(q)·e^{−μa}
            mu_a = -np.inf
            for i in range(m):
                kt = k_tilde[i]
                s = 0.0
                for d in range(hd):
                    s += q64[d] * kt[d]
                s *= scale
                a[i] = s
                mu_a = max(mu_a, s)
            for i in range(m):
                a[i] = fexp64(a[i] - mu_a)
            # u = a·P; the probes' part under the shared max
            for j in range(npr):
                u[j] = 0.0
            mh = m_hat[h]
            for i in range(m):
                ai = a[i]
                row = mh[i]
                for j in range(npr):
                    u[j] += ai * row[j]
            lf_max = -np.inf
            for j in range(npr):
                lf_max = max(lf_max, mu_a + (c[h, j] - r[h, j]))
            mu = max(mu, lf_max)
            if has_pool:
                mu = max(mu, mu_a)
            th = theta[h]
            for j in range(npr):
                gj = u[j] * fexp64(mu_a + (c[h, j] - r[h, j]) - mu)
                den_f += gj * z[h, j]
                tj = th[j]
                for d in range(hd):
                    num[d] += gj * tj[d]
            if has_pool:
                # pooling a·W₀ plus the correction just summed, then the checks:
                # the Jensen floor and the box of the far values
                sp = fexp64(mu_a - mu)
                den_p = 0.0
                for d in range(hd):
                    nump[d] = 0.0
                for i in range(m):
                    ai = sp * a[i]
                    den_p += ai * count[i]
                    vs = vsum[i]
                    for d in range(hd):
                        nump[d] += ai * vs[d]
                bad = den_f < 0
                den_t = den_p + den_f
                for d in range(hd):
                    x = nump[d] + num[d]
                    num[d] = x
                    if x < den_t * vlo[d] or x > den_t * vhi[d]:
                        bad = True
                if bad:
                    den_f = den_p
                    for d in range(hd):
                        num[d] = nump[d]
                else:
                    den_f = den_t
            elif not den_f > 0:
                den_f = 0.0
                for d in range(hd):
                    num[d] = 0.0
        den_e = 0.0
        for j in range(ne):
            e = fexp64(se[j] - mu)
            den_e += e
            vr = v_exact[j]
            for d in range(hd):
                num[d] += e * np.float64(vr[d])
        den = den_e + den_f
        for d in range(hd):
            out[h, d] = np.float32(num[d] / den)


# ---------------------------------------------------------------------------
# host side: the signatures of kvreg.nystrom
# ---------------------------------------------------------------------------


def _f64(a):
    return np.ascontiguousarray(a, dtype=np.float64)


def _f32(a):
    return np.ascontiguousarray(a, dtype=np.float32)


def nystrom_prefill(probes, k_far, v_far, scale, *, rows=None):
    hpk, m, hd = probes.shape
    L = hpk * m
    c = np.empty(L)
    z = np.empty(L)
    theta = np.empty((L, hd))
    prefill_kernel(_f64(probes).reshape(L, hd), _f32(k_far), _f32(v_far), float(scale),
                   int(rows or config.NYSTROM_PREFILL_ROWS), c, z, theta)
    return c.reshape(hpk, m), z.reshape(hpk, m), theta.reshape(hpk, m, hd)


def nystrom_absorb(far, k_row, v_row, scale):
    """The far field with one more row: the kernel updates fresh float64
    copies of the sums in place; ``far`` is not modified."""
    hpk, p, hd = far.probes.shape
    c, z, theta = (np.array(a, dtype=np.float64, order="C") for a in (far.c, far.z, far.theta))
    pooled = far.pooled
    last = _f64(far.last_logit).reshape(-1) if pooled else _NO_LAST
    absorb_kernel(_f64(far.probes).reshape(hpk * p, hd), c.reshape(-1), z.reshape(-1),
                  theta.reshape(hpk * p, hd), _f32(k_row), _f32(v_row), float(scale), pooled, last)
    # the pooled bookkeeping is O(hd), the reference's own
    return replace(far, c=c, z=z, theta=theta, rows=far.rows + 1, **absorb_pooled(far, v_row))


_NO_LAST = np.empty(0)
_NO_FAR = (np.empty((0, 0)), np.empty((0, 0, 0)), np.empty((0, 0)), np.empty((0, 0)),
           np.empty((0, 0)), np.empty((0, 0, 0)))
_NO_POOL = (np.empty(0), np.empty((0, 0)), np.empty(0), np.empty(0))


def nystrom_step(q_group, k_exact, v_exact, far, scale):
    q = _f32(q_group)
    out = np.empty(q.shape, np.float32)
    if far is None:
        parts = _NO_FAR
    else:
        parts = (_f64(far.k_tilde), _f64(far.m_hat), _f64(far.r), _f64(far.c), _f64(far.z),
                 _f64(far.theta))
    pooled = far is not None and far.pooled
    pool = (tuple(_f64(getattr(far, n)) for n in ("count", "vsum", "vlo", "vhi"))
            if pooled else _NO_POOL)
    step_kernel(q, _f32(k_exact), _f32(v_exact), far is not None, *parts, pooled, *pool,
                float(scale), out)
    return out
