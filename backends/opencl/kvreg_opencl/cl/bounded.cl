/* The bounded ring (kvreg.bounded) on the device: storing ring slots already
 * rotated, and merging the sink and ring partial states.
 *
 * Device layout of a ring mirror (kvreg_opencl/bounded.py), per KV head:
 *   rows [0, sink)                    the sink rows (position-free)
 *   rows [sink + s] and [sink + W + s] ring slot s, its key ROTATED at the
 *                                      position it holds ("doubled ring")
 * so the newest n rows of a group, slots (seen - n .. seen - 1) mod W, are
 * the contiguous rows [sink + start, sink + start + n) with
 * start = (seen - n) mod W.  The partial kernel of attend.cl then scores
 * them as a plain row range, token 0 of the launch being the sinks and
 * token 1 the ring.
 *
 * FP_CONTRACT OFF: the rotation is x1*c - x2*s and x2*c + x1*s with each
 * product rounded, as kvreg.bounded.BoundedRope.apply computes it (NumPy
 * never fuses), so the device holds the reference's rotated keys bit for
 * bit given the same float32 cos/sin. */
#pragma OPENCL FP_CONTRACT OFF
#include "common.h"

/* Store n raw slots of every head: one work-item per (channel, slot, head);
 * hr = rotary_dims / 2 rotated pairs ("half" is a type in OpenCL C).
 * raw_k/raw_v [kvh, n, hd]; cs/sn [n, hr] (cos/sin of each slot's
 * position, host-computed in float64 and rounded once); slots [n]. */
__kernel void ring_store(__global const float *raw_k, __global const float *raw_v,
                         __global const float *cs, __global const float *sn,
                         __global const int *slots,
                         const int n, const int hd, const int hr,
                         const int sink, const int window, const int cap,
                         __global float *kbuf, __global float *vbuf)
{
    const int d = get_global_id(0);
    const int i = get_global_id(1);
    const int h = get_global_id(2);
    if (d >= hd) return;
    __global const float *x = raw_k + ((size_t)h * n + i) * hd;
    float y = x[d];
    if (d < hr) {
        const float c = cs[(size_t)i * hr + d], s = sn[(size_t)i * hr + d];
        y = x[d] * c - x[d + hr] * s;
    } else if (d < 2 * hr) {
        const int j = d - hr;
        const float c = cs[(size_t)i * hr + j], s = sn[(size_t)i * hr + j];
        y = x[d] * c + x[j] * s;
    }
    const float vv = raw_v[((size_t)h * n + i) * hd + d];
    const size_t r0 = (size_t)h * cap + sink + slots[i];
    kbuf[r0 * hd + d] = y;
    kbuf[(r0 + window) * hd + d] = y;
    vbuf[r0 * hd + d] = vv;
    vbuf[(r0 + window) * hd + d] = vv;
}

/* Combine the block states of token 0 (sinks) and token 1 (ring) of a
 * partial launch into one softmax: blocks in order, sinks first (the
 * reference's z = Σ e_sink + Σ e_ring).  One work-item per (channel, Q head). */
__kernel void bounded_merge(__global const float *pm, __global const float *ps,
                            __global const float *pacc,
                            __global const int *nlim, __global const int *firsts,
                            const int ng, const int hpk, const int hd,
                            const int br, const int nblk,
                            __global float *out)          /* [nq, hd] */
{
    const int d = get_global_id(0);
    const int qh = get_global_id(1);
    if (d >= hd) return;
    const int nq = ng * hpk;
    const int gl = qh / hpk;
    float m = -INFINITY;
    for (int t = 0; t < 2; ++t) {
        const int n = nlim[t * ng + gl], f = firsts[t * ng + gl];
        const int nb = n > 0 ? (n - f + br - 1) / br : 0;
        const size_t o = (size_t)t * nq + qh;
        for (int b = 0; b < nb; ++b) m = fmax(m, pm[o * nblk + b]);
    }
    float z = 0.0f, acc = 0.0f;
    for (int t = 0; t < 2; ++t) {
        const int n = nlim[t * ng + gl], f = firsts[t * ng + gl];
        const int nb = n > 0 ? (n - f + br - 1) / br : 0;
        const size_t o = (size_t)t * nq + qh;
        for (int b = 0; b < nb; ++b) {
            const float mb = pm[o * nblk + b];
            if (mb == -INFINITY) continue;
            const float e = exp(mb - m);
            z += ps[o * nblk + b] * e;
            acc += pacc[(o * nblk + b) * hd + d] * e;
        }
    }
    out[(size_t)qh * hd + d] = (z > 0.0f) ? acc / z : 0.0f;
}
