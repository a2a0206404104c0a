/* One Nyström decode read (kvreg.nystrom.nystrom_step) in float64.
 *
 * Built only for a device with fp64: the correction φ·P·diag(e^{c-ν})·Θ
 * cancels in part (P, the ridge fit, has entries of both signs), so a
 * float32 version would lose too much of it and break the step's tolerance.
 * The exact rows stay float32 in memory and are widened on read, as the
 * reference does.
 *
 * One work-group per Q head of the group (dim 1), L work-items (dim 0).
 * Scalars (maxima, denominators, the check) are reduced by work-item 0 in a
 * fixed order, so the result does not depend on L beyond the strided loops.
 *
 * The far part: the correction u = a·P over the p probes' sums; with the
 * pooling prior (pool = 1) those are residuals, the pooled estimate a·W₀ is
 * added, and the checks of kvreg.nystrom apply (a negative correction of the
 * denominator, or a far average outside the box [vlo, vhi] of the far
 * values, leaves the pooled estimate alone). Without the prior a
 * non-positive far denominator drops the far part. */
#pragma OPENCL EXTENSION cl_khr_fp64 : enable
#pragma OPENCL FP_CONTRACT OFF

/* max over red[0..n) by one work-item, in index order */
inline double kvreg_max_d(__local const double *red, const int n)
{
    double m = -INFINITY;
    for (int i = 0; i < n; ++i) m = fmax(m, red[i]);
    return m;
}

/* far-part modes, scal[3]: none, pooled + correction (or the bare fit), pooled only */
#define FAR_DROP 0
#define FAR_FIT 1
#define FAR_POOLED 2

__kernel void nystrom_step(__global const float *q,       /* [hpk, hd] */
                           __global const float *ke,      /* [e, hd] sinks + window */
                           __global const float *ve,      /* [e, hd] */
                           const int e, const int hd,
                           const int m,                   /* landmarks; 0: no far field */
                           const int np,                  /* probes */
                           const int pool,                /* 1: the pooling prior is present */
                           const double scale,
                           __global const double *kt,     /* [m, hd] K̃ */
                           __global const double *mh,     /* [hpk, m, np] P */
                           __global const double *r,      /* [hpk, np] ν */
                           __global const double *c,      /* [hpk, np] */
                           __global const double *z,      /* [hpk, np] */
                           __global const double *th,     /* [hpk, np, hd] Θ */
                           __global const double *cnt,    /* [m] segment sizes */
                           __global const double *vs,     /* [m, hd] segment value sums */
                           __global const double *vlo,    /* [hd] */
                           __global const double *vhi,    /* [hd] */
                           __global double *se,           /* scratch [hpk, e] */
                           __global double *fb,           /* scratch [hpk, m + 2np]: a, g, log f */
                           __global float *out,           /* [hpk, hd] */
                           __local double *qloc,          /* [hd] */
                           __local double *nloc,          /* [hd] far numerator */
                           __local double *ploc,          /* [hd] pooled numerator */
                           __local double *red)           /* [L + 8] */
{
    const int l = get_local_id(0);
    const int L = get_local_size(0);
    const int h = get_group_id(1);
    __local double *scal = red + L;   /* mu, den_e, den_f, mode, den_p, sp */
    __global double *sh = se + (size_t)h * e;
    __global double *fa = fb + (size_t)h * (m + 2 * np), *fg = fa + m, *fl = fg + np;

    for (int d = l; d < hd; d += L) qloc[d] = (double)q[(size_t)h * hd + d];
    barrier(CLK_LOCAL_MEM_FENCE);

    /* exact scores and their max */
    double lm = -INFINITY;
    for (int p = l; p < e; p += L) {
        double dot = 0.0;
        for (int d = 0; d < hd; ++d) dot += qloc[d] * (double)ke[(size_t)p * hd + d];
        const double s = scale * dot;
        sh[p] = s;
        lm = fmax(lm, s);
    }
    red[l] = lm;
    barrier(CLK_LOCAL_MEM_FENCE);
    if (l == 0) { scal[0] = kvreg_max_d(red, L); scal[2] = 0.0; scal[3] = FAR_DROP; }
    barrier(CLK_LOCAL_MEM_FENCE | CLK_GLOBAL_MEM_FENCE);

    if (m > 0) {
        /* a = exp(q K̃ᵀ s − μa) */
        lm = -INFINITY;
        for (int j = l; j < m; j += L) {
            double dot = 0.0;
            for (int d = 0; d < hd; ++d) dot += qloc[d] * kt[(size_t)j * hd + d];
            fa[j] = scale * dot;
            lm = fmax(lm, fa[j]);
        }
        red[l] = lm;
        barrier(CLK_LOCAL_MEM_FENCE | CLK_GLOBAL_MEM_FENCE);
        const double mu_a = kvreg_max_d(red, L);
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int j = l; j < m; j += L) fa[j] = exp(fa[j] - mu_a);
        barrier(CLK_GLOBAL_MEM_FENCE);
        /* u = a·P, log f = μa + (c − ν); the shared max μ */
        lm = -INFINITY;
        for (int j = l; j < np; j += L) {
            double u = 0.0;
            for (int i = 0; i < m; ++i) u += fa[i] * mh[((size_t)h * m + i) * np + j];
            fg[j] = u;
            fl[j] = mu_a + (c[(size_t)h * np + j] - r[(size_t)h * np + j]);
            lm = fmax(lm, fl[j]);
        }
        red[l] = lm;
        barrier(CLK_LOCAL_MEM_FENCE | CLK_GLOBAL_MEM_FENCE);
        if (l == 0) {
            double mu = fmax(scal[0], kvreg_max_d(red, L));
            if (pool) mu = fmax(mu, mu_a);
            scal[0] = mu;
            scal[5] = exp(mu_a - mu);
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        const double mu = scal[0];
        const double sp = scal[5];
        for (int j = l; j < np; j += L) fg[j] = fg[j] * exp(fl[j] - mu);
        barrier(CLK_GLOBAL_MEM_FENCE);
        if (l == 0) {
            double den = 0.0, den_p = 0.0;
            for (int j = 0; j < np; ++j) den += fg[j] * z[(size_t)h * np + j];
            if (pool)
                for (int j = 0; j < m; ++j) den_p += sp * fa[j] * cnt[j];
            scal[2] = den;
            scal[4] = den_p;
        }
        barrier(CLK_LOCAL_MEM_FENCE);
        /* the far numerator (pooled + correction), and whether its average
         * leaves the value box */
        const double den_t = scal[4] + scal[2];
        int outside = 0;
        for (int d = l; d < hd; d += L) {
            double nf = 0.0;
            for (int j = 0; j < np; ++j) nf += fg[j] * th[((size_t)h * np + j) * hd + d];
            if (pool) {
                double npl = 0.0;
                for (int j = 0; j < m; ++j) npl += sp * fa[j] * vs[(size_t)j * hd + d];
                ploc[d] = npl;
                nf = npl + nf;
                outside |= nf < den_t * vlo[d] || nf > den_t * vhi[d];
            }
            nloc[d] = nf;
        }
        red[l] = (double)outside;
        barrier(CLK_LOCAL_MEM_FENCE);
        if (l == 0) {
            const double den_f = scal[2];
            if (pool) {
                int bad = den_f < 0.0;
                for (int i = 0; i < L; ++i) bad |= red[i] != 0.0;
                scal[3] = bad ? FAR_POOLED : FAR_FIT;
                scal[2] = bad ? scal[4] : den_t;
            } else {
                /* a non-positive far denominator: the far part contributes nothing */
                scal[3] = den_f > 0.0 ? FAR_FIT : FAR_DROP;
                scal[2] = den_f > 0.0 ? den_f : 0.0;
            }
        }
        barrier(CLK_LOCAL_MEM_FENCE);
    }

    const double mu = scal[0];
    for (int p = l; p < e; p += L) sh[p] = exp(sh[p] - mu);
    barrier(CLK_GLOBAL_MEM_FENCE);
    if (l == 0) {
        double den = 0.0;
        for (int p = 0; p < e; ++p) den += sh[p];
        scal[1] = den;
    }
    barrier(CLK_LOCAL_MEM_FENCE);
    const double den = scal[1] + scal[2];
    const int mode = (int)scal[3];
    for (int d = l; d < hd; d += L) {
        double num = 0.0;
        for (int p = 0; p < e; ++p) num += sh[p] * (double)ve[(size_t)p * hd + d];
        const double nf = mode == FAR_FIT ? nloc[d] : mode == FAR_POOLED ? ploc[d] : 0.0;
        out[(size_t)h * hd + d] = (float)((num + nf) / den);
    }
}
