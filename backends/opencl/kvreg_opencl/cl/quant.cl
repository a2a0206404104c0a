/* quantize_rows: the exact class of docs/kernels.md, bit-for-bit with the
 * numpy reference.  Built with -cl-fp32-correctly-rounded-divide-sqrt and
 * never with fast/relaxed math: x / col and r / s must be the IEEE quotient,
 * and no multiply-add may be fused (there is none to fuse, but a contraction
 * of a future edit must not change bits silently). */
#pragma OPENCL FP_CONTRACT OFF
#include "common.h"

/* One work-item per (row, group).  `col` is one field for every row
 * (col_stride 0) or one per row (col_stride hd); x / 1.0f == x exactly. */
__kernel void quantize_rows(__global const float *x,      /* [n, hd] */
                            __global const float *col,    /* [hd] or [n, hd] */
                            const int use_col,
                            const int col_stride,          /* 0 or hd */
                            const int n, const int hd, const int group,
                            __global char *q,             /* [n, hd] */
                            __global float *s)            /* [n, ngroups] */
{
    const int j = get_global_id(0);
    const int row = get_global_id(1);
    const int ng = (hd + group - 1) / group;
    if (row >= n || j >= ng) return;
    const int d0 = j * group;
    const int d1 = min(d0 + group, hd);
    __global const float *xr = x + (size_t)row * hd;
    __global const float *cr = col + (size_t)row * col_stride;
    float absmax = 0.0f;
    for (int d = d0; d < d1; ++d) {
        const float r = use_col ? xr[d] / cr[d] : xr[d];
        /* fmax ignores a NaN operand like Rust's f32::max. */
        absmax = fmax(absmax, fabs(r));
    }
    const float sc = fmax(absmax / 127.0f, 1e-12f);
    s[(size_t)row * ng + j] = sc;
    for (int d = d0; d < d1; ++d) {
        const float r = use_col ? xr[d] / cr[d] : xr[d];
        const float t = round(r / sc);   /* C99 round: half away from zero */
        char out;
        if (isnan(t)) out = 0;           /* Rust `as i8` maps NaN to 0 */
        else out = (char)clamp(t, -127.0f, 127.0f);
        q[(size_t)row * hd + d] = out;
    }
}
