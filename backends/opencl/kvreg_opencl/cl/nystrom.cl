/* One Nyström decode read (kvreg.nystrom.nystrom_step) in float64.
 *
 * Built only for a device with fp64: the far sum â·M̂·diag(e^{c-r})·Θ
 * cancels (M̂ is the pseudo-inverse of an ill-conditioned kernel matrix),
 * so a float32 version would lose ~cond·6e-8 of it and break the step's
 * tolerance.  The exact rows stay float32 in memory and are widened on read,
 * as the reference does.
 *
 * One work-group per Q head of the group (dim 1), L work-items (dim 0).
 * Scalars (maxima, denominators) are reduced by work-item 0 in a fixed
 * order, so the result does not depend on L beyond the strided loops. */
#pragma OPENCL EXTENSION cl_khr_fp64 : enable
#pragma OPENCL FP_CONTRACT OFF

/* max over red[0..n) by one work-item, in index order */
inline double kvreg_max_d(__local const double *red, const int n)
{
    double m = -INFINITY;
    for (int i = 0; i < n; ++i) m = fmax(m, red[i]);
    return m;
}

__kernel void nystrom_step(__global const float *q,       /* [hpk, hd] */
                           __global const float *ke,      /* [e, hd] sinks + window */
                           __global const float *ve,      /* [e, hd] */
                           const int e, const int hd, const int m,   /* m = 0: no far field */
                           const double scale,
                           __global const double *kt,     /* [m, hd] K̃ */
                           __global const double *mh,     /* [hpk, m, m] M̂ */
                           __global const double *r,      /* [hpk, m] */
                           __global const double *c,      /* [hpk, m] */
                           __global const double *z,      /* [hpk, m] */
                           __global const double *th,     /* [hpk, m, hd] Θ */
                           __global double *se,           /* scratch [hpk, e] */
                           __global double *fb,           /* scratch [hpk, 3, m]: â, g, log f */
                           __global float *out,           /* [hpk, hd] */
                           __local double *qloc,          /* [hd] */
                           __local double *red)           /* [L + 4] */
{
    const int l = get_local_id(0);
    const int L = get_local_size(0);
    const int h = get_group_id(1);
    __local double *scal = red + L;   /* mu, den_e, den_f, keep */
    __global double *sh = se + (size_t)h * e;
    __global double *fa = fb + (size_t)h * 3 * m, *fg = fa + m, *fl = fg + m;

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
    if (l == 0) { scal[0] = kvreg_max_d(red, L); scal[2] = 0.0; scal[3] = 0.0; }
    barrier(CLK_LOCAL_MEM_FENCE | CLK_GLOBAL_MEM_FENCE);

    if (m > 0) {
        /* â = exp(q K̃ᵀ s − μa) */
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
        /* u = â·M̂, log f = μa + (c − r); the shared max μ */
        lm = -INFINITY;
        for (int j = l; j < m; j += L) {
            double u = 0.0;
            for (int i = 0; i < m; ++i) u += fa[i] * mh[((size_t)h * m + i) * m + j];
            fg[j] = u;
            fl[j] = mu_a + (c[(size_t)h * m + j] - r[(size_t)h * m + j]);
            lm = fmax(lm, fl[j]);
        }
        red[l] = lm;
        barrier(CLK_LOCAL_MEM_FENCE | CLK_GLOBAL_MEM_FENCE);
        if (l == 0) scal[0] = fmax(scal[0], kvreg_max_d(red, L));
        barrier(CLK_LOCAL_MEM_FENCE);
        const double mu = scal[0];
        for (int j = l; j < m; j += L) fg[j] = fg[j] * exp(fl[j] - mu);
        barrier(CLK_GLOBAL_MEM_FENCE);
        if (l == 0) {
            double den = 0.0;
            for (int j = 0; j < m; ++j) den += fg[j] * z[(size_t)h * m + j];
            /* a non-positive far denominator: the far part contributes nothing */
            scal[2] = den > 0.0 ? den : 0.0;
            scal[3] = den > 0.0 ? 1.0 : 0.0;
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
    const int keep = scal[3] != 0.0;
    for (int d = l; d < hd; d += L) {
        double num = 0.0;
        for (int p = 0; p < e; ++p) num += sh[p] * (double)ve[(size_t)p * hd + d];
        double nf = 0.0;
        if (keep)
            for (int j = 0; j < m; ++j) nf += fg[j] * th[((size_t)h * m + j) * hd + d];
        out[(size_t)h * hd + d] = (float)((num + nf) / den);
    }
}
