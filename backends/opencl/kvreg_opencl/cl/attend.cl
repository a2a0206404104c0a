/* Decode / chunk attention over a layer's device-resident rows
 * ("flash-decoding": rows split across work-groups, partial softmax states
 * merged afterwards in a fixed order).
 *
 * Launch geometry (see kvreg_opencl/kernels.py):
 *   dim 0: nblk work-groups of L work-items; block b covers the rows
 *          [first + b*br, first + (b+1)*br) of its KV head.  The grid is
 *          anchored at `first`, so a windowed call, a trimmed layer and an
 *          `upto` call see the same blocks as the call they must equal.
 *   dim 1: (KV group of the launch) x (chunk of at most `hc` Q heads)
 *   dim 2: query token t (1 for decode, b for a prefill chunk)
 * Every Q head's arithmetic reads only its own q row and the shared K/V
 * rows, so the bits of a head do not depend on which heads share its
 * work-group (grouped == per-head, layer == per-group).
 *
 * q8 exact rows: rows [0, xlen[g]) of a quantized side are read from the
 * float32 copies xk/xv (field space, so they stand in for the dequantized
 * row: scores with q ⊙ kcol, values summed before the final vcol) instead of
 * their int8 copies.  Whether a row is exact depends on its index only, so
 * the invariants above still hold.
 *
 * q8 float16 windows (q8, q8k, q8v: wcap > 0): rows [b8[g], n) of a
 * quantized side are read from thk / thv (binary16, as stored: vload_half,
 * row p at p - b8[g] of head g's window) instead of their int8 slots (never
 * written while a row is in the window); exact rows still take precedence.
 * A window row is a plain dot (K) or a weight-1 row (V), as an f16 row.
 *
 * 2-byte rows (f16 / bf16 storage, the KH argument of partial_body): the
 * mirror holds K and V as stored, 2 bytes an element, and the `k` / `v`
 * buffers are read through kv_load8 / kv_load1: IEEE binary16 with
 * vload_half (core OpenCL, no cl_khr_fp16), bfloat16 as ushort shifted into
 * the top half of a float (as_float).  Both widenings are exact and the
 * arithmetic after them is the f32 path's, so a half layer gives the bits the
 * f32 kernel gives on the widened rows. */
#include "common.h"

/* Q heads per work-group, fixed at build time (config.HEADS_PER_WG):
 * private accumulator arrays need a constant size. */
#ifndef KVREG_HC
#define KVREG_HC 8
#endif

/* float8 slices of a V row per pass of the CPU value loop: heads x slices
 * accumulators in registers (16). */
#define KVREG_VW (KVREG_HC >= 8 ? 2 : KVREG_HC >= 4 ? 4 : 8)

#define KV_ARGS                                                               \
    __global const float *q,        /* [T, nq, hd], nq = ng * hpk         */ \
    __global const float *k,        /* [nkv, cap, hd] f32 K (or 2-byte: KH) */ \
    __global const char *kq,        /* [nkv, cap, hd]   (q8 K)            */ \
    __global const float *ks,       /* [nkv, cap, ngk]                    */ \
    __global const float *kcol,     /* [nkv, hd] (ones when no field)     */ \
    __global const float *v,        /* [nkv, cap, hd] f32 V (or 2-byte: KH) */ \
    __global const char *vq,        /* [nkv, cap, hd]   (q8 V)            */ \
    __global const float *vs,       /* [nkv, cap]                         */ \
    __global const float *xk,       /* [nkv, xcap, hd] exact K rows (q8)  */ \
    __global const float *xv,       /* [nkv, xcap, hd] exact V rows (q8)  */ \
    __global const int *xlen,       /* [nkv] exact rows per head          */ \
    const int xcap,                 /* 0: no exact rows                   */ \
    __global const float *thk,      /* [nkv, wcap, hd] binary16 K window  */ \
    __global const float *thv,      /* [nkv, wcap, hd] binary16 V window  */ \
    __global const int *b8,         /* [nkv] first window row per head    */ \
    const int wcap,                 /* 0: no float16 window               */ \
    __global const int *nlim,       /* [T, ng] rows visible to token t    */ \
    __global const int *firsts,     /* [T, ng] first visible row          */ \
    const int g0, const int ng, const int cap, const int hd,                 \
    const int hpk, const int hc, const int br, const int nblk,               \
    const int tg,                   /* storage heads per slot (batch)     */ \
    __global const int *tslot,      /* [T] batch slot of token t (tg > 0) */ \
    const float scale, const float softcap,                                  \
    __global float *pm,             /* [T, nq, nblk] block max            */ \
    __global float *ps,             /* [T, nq, nblk] block sum of exp     */ \
    __global float *pacc,           /* [T, nq, nblk, hd] block Σ e·v      */ \
    __global float *scores,         /* [T, nq, sstride] capped scores     */ \
    const int sstride, const int want_scores,                                \
    __local float *qloc,            /* [hc * hd]                          */ \
    __local float *sloc,            /* [hc * br]                          */ \
    __local float *mloc,            /* [hc]                               */ \
    __local float *vloc             /* [R * hc * hd] value-pass lanes     */

#define KV_PASS q, k, kq, ks, kcol, v, vq, vs, xk, xv, xlen, xcap, thk, thv, b8, wcap, nlim, firsts, g0, ng, cap, hd,  \
    hpk, hc, br, nblk, tg, tslot, scale, softcap, pm, ps, pacc, scores, sstride,         \
    want_scores, qloc, sloc, mloc, vloc

/* Element layout of the unquantized K/V buffers (KH): f32, binary16, bfloat16. */
#define KVREG_F32 0
#define KVREG_F16 1
#define KVREG_BF16 2

/* Channels [8*d8, 8*d8 + 8) of the row starting at element `off` (a multiple of
 * 8) of an unquantized K/V buffer, as float8. */
inline float8 kv_load8(__global const float *base, const size_t off, const int d8, const int KH)
{
    if (KH == KVREG_F16) return KVREG_LDH8G((off >> 3) + d8, base);
    if (KH == KVREG_BF16)
        return as_float8(KVREG_U2U8(KVREG_LDU8G((off >> 3) + d8, (__global const ushort *)base)) << 16);
    return KVREG_LD8G(d8, base + off);
}

/* Channels [4*d4, 4*d4 + 4) (off a multiple of 4). */
inline float4 kv_load4(__global const float *base, const size_t off, const int d4, const int KH)
{
    if (KH == KVREG_F16) return KVREG_LDH4G((off >> 2) + d4, base);
    if (KH == KVREG_BF16)
        return as_float4(KVREG_U2U4(KVREG_LDU4G((off >> 2) + d4, (__global const ushort *)base)) << 16);
    return KVREG_LD4G(d4, base + off);
}

/* Element `i` of an unquantized K/V buffer. */
inline float kv_load1(__global const float *base, const size_t i, const int KH)
{
    if (KH == KVREG_F16) return vload_half(i, (__global const half *)base);
    if (KH == KVREG_BF16) return as_float((uint)((__global const ushort *)base)[i] << 16);
    return base[i];
}

/* score_f32 over a row of an unquantized buffer in any KH layout: the same
 * operations on the widened elements. */
inline float score_kv(__local const float *qh, __global const float *base, const size_t off,
                      const int hd, const int KH)
{
    float dot;
    if ((hd & 3) == 0) {
        float4 a = (float4)(0.0f);
        for (int d4 = 0; d4 < (hd >> 2); ++d4)
            a += KVREG_LD4L(d4, qh) * kv_load4(base, off, d4, KH);
        dot = kvreg_hsum4(a);
    } else {
        dot = 0.0f;
        for (int d = 0; d < hd; ++d) dot += qh[d] * kv_load1(base, off + d, KH);
    }
    return dot;
}

inline float score_f32(__local const float *qh, __global const float *kr, const int hd)
{
    float dot;
    if ((hd & 3) == 0) {
        float4 a = (float4)(0.0f);
        for (int d4 = 0; d4 < (hd >> 2); ++d4)
            a += KVREG_LD4L(d4, qh) * KVREG_LD4G(d4, kr);
        dot = kvreg_hsum4(a);
    } else {
        dot = 0.0f;
        for (int d = 0; d < hd; ++d) dot += qh[d] * kr[d];
    }
    return dot;
}

/* Σ_groups ks[j] · ⟨q ⊙ col, kq[group j]⟩, int8 read as char16 pairs. */
inline float score_q8(__local const float *qh, __global const char *kr,
                      __global const float *ksr, const int hd)
{
    float dot = 0.0f;
    for (int g0 = 0, j = 0; g0 < hd; g0 += KVREG_K_GROUP, ++j) {
        float gd;
        if (g0 + KVREG_K_GROUP <= hd) {
            /* char16 loads, float8 arithmetic (8 lanes = one AVX register;
             * float16 values would change the calling ABI on CPUs) */
            const char16 c0 = KVREG_LDC16G(0, kr + g0), c1 = KVREG_LDC16G(0, kr + g0 + 16);
            float8 a = KVREG_LD8L(0, qh + g0) * KVREG_C2F8(c0.lo);
            a += KVREG_LD8L(1, qh + g0) * KVREG_C2F8(c0.hi);
            a += KVREG_LD8L(2, qh + g0) * KVREG_C2F8(c1.lo);
            a += KVREG_LD8L(3, qh + g0) * KVREG_C2F8(c1.hi);
            gd = kvreg_hsum8(a);
        } else {
            gd = 0.0f;
            for (int d = g0; d < hd; ++d) gd += qh[d] * (float)kr[d];
        }
        dot += gd * ksr[j];
    }
    return dot;
}

inline void partial_body(KV_ARGS, const int KQ, const int VQ, const int KH)
{
    const int KH_BYTES = (KH == KVREG_F32) ? 4 : 2;   /* bytes an element of k / v */
    const int b = get_group_id(0);
    const int L = get_local_size(0);
    const int l = get_local_id(0);
    const int nchunk = (hpk + hc - 1) / hc;
    const int gl = get_global_id(1) / nchunk;       /* group within launch */
    const int hbeg = (get_global_id(1) % nchunk) * hc;
#ifdef KVREG_HC_FULL
    const int hcnt = KVREG_HC;            /* hpk % hc == 0: every chunk full */
#else
    const int hcnt = min(hc, hpk - hbeg);
#endif
    const int t = get_global_id(2);
    /* the storage head: tg = 0 when every token reads one layer's rows (a
     * decode, a prefill chunk); tg = nkv when token t is a sequence of a
     * batch whose layers sit one after another in the buffers, sequence t
     * in slot tslot[t] */
    const int g = g0 + gl + (tg ? tslot[t] * tg : 0);
    const int n = nlim[t * ng + gl];
    const int first = firsts[t * ng + gl];
    const int row0 = first + b * br;
    if (row0 >= n) return;                /* uniform over the work-group */
    const int rows = min(br, n - row0);
    const int nq = ng * hpk;
    const int qh0 = gl * hpk + hbeg;      /* first Q head of this chunk */
    const int ngk = (hd + KVREG_K_GROUP - 1) / KVREG_K_GROUP;
    /* rows [0, xr) of this block are exact rows (q8 sides only) */
    const int xl = (xcap > 0) ? min(xlen[g], xcap) : 0;
    const int xr = clamp(xl - row0, 0, rows);
    const size_t xrow0 = (size_t)g * xcap + row0;   /* exact row of r = 0 */
    /* rows [wr, rows) of this block are float16 window rows (q8 sides) */
    const int wr = (wcap > 0) ? clamp(b8[g] - row0, xr, rows) : rows;
    const size_t wrow0 = (size_t)g * wcap + row0 - (wcap > 0 ? b8[g] : 0);  /* window row of r = 0 */

    for (int i = l; i < hcnt * hd; i += L) {
        float x = q[((size_t)t * nq + qh0) * hd + i];
        if (KQ) x *= kcol[(size_t)g * hd + i % hd];
        qloc[i] = x;
    }
    barrier(CLK_LOCAL_MEM_FENCE);

    /* score pass: one row per work-item, every head of the chunk; the
     * K row is read once for all of them (private accumulators). */
    for (int r = l; r < rows; r += L) {
        const size_t p = (size_t)g * cap + row0 + r;
        float sc[KVREG_HC];
        const int kx = KQ && r < xr;      /* an exact K row: f32 path */
        const int kw = KQ && r >= wr;     /* a float16 window K row: f16 path */
        const int k8 = KQ && !kx && !kw;  /* an int8 K row */
#ifdef KVREG_PREFETCH
        KVREG_PREFETCH_ROW(KQ ? (__global const char *)kq : (__global const char *)k, p, hd, KQ ? 1 : KH_BYTES);
#endif
        __global const float *kr32 = kx ? xk + (xrow0 + r) * hd : (KH == KVREG_F32 ? k + p * hd : k);
        if (k8 && (hd % KVREG_K_GROUP) == 0) {
            /* each 32-channel group converted once for every head; per head
             * the same operations as score_q8 */
            __global const char *kr = kq + p * hd;
            float dot[KVREG_HC];
            _Pragma("unroll") for (int h = 0; h < KVREG_HC; ++h) dot[h] = 0.0f;
            for (int j = 0; j < ngk; ++j) {
                const char16 c0 = KVREG_LDC16G(0, kr + j * KVREG_K_GROUP);
                const char16 c1 = KVREG_LDC16G(0, kr + j * KVREG_K_GROUP + 16);
                const float8 k0 = KVREG_C2F8(c0.lo), k1 = KVREG_C2F8(c0.hi);
                const float8 k2 = KVREG_C2F8(c1.lo), k3 = KVREG_C2F8(c1.hi);
                const float ksj = ks[p * ngk + j];
                _Pragma("unroll") for (int h = 0; h < KVREG_HC; ++h) {
                    if (h < hcnt) {
                        __local const float *qg = qloc + h * hd + j * KVREG_K_GROUP;
                        float8 a = KVREG_LD8L(0, qg) * k0;
                        a += KVREG_LD8L(1, qg) * k1;
                        a += KVREG_LD8L(2, qg) * k2;
                        a += KVREG_LD8L(3, qg) * k3;
                        dot[h] += kvreg_hsum8(a) * ksj;
                    }
                }
            }
            _Pragma("unroll") for (int h = 0; h < KVREG_HC; ++h) sc[h] = dot[h];
        } else if (k8) {
            _Pragma("unroll") for (int h = 0; h < KVREG_HC; ++h)
                if (h < hcnt) sc[h] = score_q8(qloc + h * hd, kq + p * hd, ks + p * ngk, hd);
        } else if ((hd & 7) == 0) {
            /* f32 / 2-byte K row, a q8 side's exact float32 row or its
             * float16 window row */
            __global const float *kb = kx ? kr32 : (kw ? thk : k);
            const size_t koff = kx ? 0 : (kw ? (wrow0 + r) * hd : p * hd);
            const int kh = kx ? KVREG_F32 : (kw ? KVREG_F16 : KH);
            float8 a[KVREG_HC];
            _Pragma("unroll") for (int h = 0; h < KVREG_HC; ++h) a[h] = (float8)(0.0f);
            for (int d8 = 0; d8 < (hd >> 3); ++d8) {
                const float8 kk = kv_load8(kb, koff, d8, kh);
                _Pragma("unroll") for (int h = 0; h < KVREG_HC; ++h)
                    if (h < hcnt) a[h] += KVREG_LD8L(d8, qloc + h * hd) * kk;
            }
            _Pragma("unroll") for (int h = 0; h < KVREG_HC; ++h) sc[h] = kvreg_hsum8(a[h]);
        } else if (kw) {
            _Pragma("unroll") for (int h = 0; h < KVREG_HC; ++h)
                if (h < hcnt) sc[h] = score_kv(qloc + h * hd, thk, (wrow0 + r) * hd, hd, KVREG_F16);
        } else if (KH != KVREG_F32) {
            _Pragma("unroll") for (int h = 0; h < KVREG_HC; ++h)
                if (h < hcnt) sc[h] = score_kv(qloc + h * hd, k, p * hd, hd, KH);
        } else {
            _Pragma("unroll") for (int h = 0; h < KVREG_HC; ++h)
                if (h < hcnt) sc[h] = score_f32(qloc + h * hd, kr32, hd);
        }
        for (int h = 0; h < hcnt; ++h) {
            float s = sc[h] * scale;
            if (softcap > 0.0f) s = softcap * tanh(s / softcap);
            sloc[h * br + r] = s;
            if (want_scores)
                scores[((size_t)t * nq + qh0 + h) * sstride + (row0 - first + r)] = s;
        }
    }
    barrier(CLK_LOCAL_MEM_FENCE);

    for (int h = l; h < hcnt; h += L) {
        float m = -INFINITY;
        for (int r = 0; r < rows; ++r) m = kvreg_max_nan(m, sloc[h * br + r]);
        mloc[h] = m;
    }
    barrier(CLK_LOCAL_MEM_FENCE);

    /* e = exp(s - m), eight scores a call when br % 8 == 0 (the lanes past
     * `rows` are computed and never read: a row's e does not depend on the
     * block's row count).  An all -inf block contributes nothing (not NaN). */
    for (int h = 0; h < hcnt; ++h) {
        const float m = mloc[h];
        __local float *sh = sloc + h * br;
        if ((br & 7) == 0) {
            for (int r8 = l; 8 * r8 < rows; r8 += L)
                KVREG_ST8L((m == -INFINITY) ? (float8)(0.0f) : exp(KVREG_LD8L(r8, sh) - m), r8, sh);
        } else {
            for (int r = l; r < rows; r += L) sh[r] = (m == -INFINITY) ? 0.0f : exp(sh[r] - m);
        }
    }
    barrier(CLK_LOCAL_MEM_FENCE);

    for (int h = l; h < hcnt; h += L) {
        float sum = 0.0f;
        for (int r = 0; r < rows; ++r) sum += sloc[h * br + r];
        const size_t o = ((size_t)t * nq + qh0 + h) * nblk + b;
        pm[o] = mloc[h];
        ps[o] = sum;
    }

    /* value pass.  Row r of the block: where its V comes from (an exact
     * float32 row, a float16 window row, an int8 row with its scale, or the
     * unquantized block), and its 8-channel slice dv widened to float8. */
    const int vec = ((hd & 7) == 0) ? 8 : 1;
    const int nv = hd / vec;
    const int R = max(1, L / nv);
#define V_ROW(r)                                                              \
    const size_t p = (size_t)g * cap + row0 + (r);                            \
    const int vx = VQ && (r) < xr;   /* exact: a float row, scale 1 */        \
    const int vw = VQ && (r) >= wr;  /* float16 window: a weight-1 f16 row */ \
    const int v8 = VQ && !vx && !vw;                                          \
    __global const float *vr32 = vx ? xv + (xrow0 + (r)) * hd : (KH == KVREG_F32 ? v + p * hd : v); \
    const float ws = v8 ? vs[p] : 1.0f
#define V_SLICE8(r, dv)                                                        \
    (v8 ? KVREG_C2F8(KVREG_LDC8G(dv, vq + p * hd))                            \
        : vw ? kv_load8(thv, (wrow0 + (r)) * hd, dv, KVREG_F16)               \
             : KH != KVREG_F32 ? kv_load8(v, p * hd, dv, KH) : KVREG_LD8G(dv, vr32))
    /* the weight of row r for head h: e (times the int8 row's scale) */
#define V_WEIGHT(r, h) (v8 ? sloc[(h) * br + (r)] * ws : sloc[(h) * br + (r)])
    __global float *pacc0 = pacc + (((size_t)t * nq + qh0) * nblk + b) * hd;   /* head h at + h*nblk*hd */
    if (L == 1 && vec == 8) {
        /* one work-item a work-group (a CPU): KVREG_VW slices of every head
         * at a time, their sums in registers across the block's rows (a
         * pass per window of slices; the block's V rows are L2-sized).  Per
         * (head, channel) the additions of the R == 1 loop below, in the
         * same row order: the same bits. */
        for (int dv0 = 0; dv0 < nv; dv0 += KVREG_VW) {
            float8 acc[KVREG_HC][KVREG_VW];
            _Pragma("unroll") for (int h = 0; h < KVREG_HC; ++h)
                _Pragma("unroll") for (int j = 0; j < KVREG_VW; ++j) acc[h][j] = (float8)(0.0f);
            for (int r = 0; r < rows; ++r) {
                V_ROW(r);
#ifdef KVREG_PREFETCH
                if (dv0 == 0)
                    KVREG_PREFETCH_ROW(VQ ? (__global const char *)vq : (__global const char *)v, p, hd,
                                       VQ ? 1 : KH_BYTES);
#endif
                float w[KVREG_HC];
                _Pragma("unroll") for (int h = 0; h < KVREG_HC; ++h) w[h] = (h < hcnt) ? V_WEIGHT(r, h) : 0.0f;
                _Pragma("unroll") for (int j = 0; j < KVREG_VW; ++j)
                    if (dv0 + j < nv) {
                        const float8 vv = V_SLICE8(r, dv0 + j);
                        _Pragma("unroll") for (int h = 0; h < KVREG_HC; ++h)
                            if (h < hcnt) acc[h][j] += w[h] * vv;
                    }
            }
            _Pragma("unroll") for (int h = 0; h < KVREG_HC; ++h)
                _Pragma("unroll") for (int j = 0; j < KVREG_VW; ++j)
                    if (h < hcnt && dv0 + j < nv) KVREG_ST8G(acc[h][j], dv0 + j, pacc0 + (size_t)h * nblk * hd);
        }
        return;
    }
    /* work-item (lane, slice) takes an 8-channel slice (1 when hd % 8) of
     * every head of the chunk over rows lane, lane + R, ...; the V row slice
     * is read once for all heads.  R = L / slices row lanes are then summed
     * in lane order through local memory.  R depends on L and hd only, never
     * on the rows or the heads, so the invariants hold. */
    for (int item = l; item < nv * R; item += L) {
        const int dv = item % nv, lane = item / nv;
        float8 acc[KVREG_HC];
        _Pragma("unroll") for (int h = 0; h < KVREG_HC; ++h) acc[h] = (float8)(0.0f);
        for (int r = lane; r < rows; r += R) {
            V_ROW(r);
            const float8 vv = (vec == 8) ? V_SLICE8(r, dv)
                : (float8)(v8 ? (float)vq[p * hd + dv]
                              : (vw ? kv_load1(thv, (wrow0 + r) * hd + dv, KVREG_F16)
                                    : (KH != KVREG_F32 ? kv_load1(v, p * hd + dv, KH) : vr32[dv])));
            _Pragma("unroll") for (int h = 0; h < KVREG_HC; ++h)
                if (h < hcnt) acc[h] += V_WEIGHT(r, h) * vv;
        }
        for (int h = 0; h < hcnt; ++h) {
            if (R == 1) {
                __global float *o = pacc0 + (size_t)h * nblk * hd;
                if (vec == 8) KVREG_ST8G(acc[h], dv, o);
                else o[dv] = acc[h].s0;
            } else {
                __local float *o = vloc + (lane * hc + h) * hd;
                if (vec == 8) KVREG_ST8L(acc[h], dv, o);
                else o[dv] = acc[h].s0;
            }
        }
    }
#undef V_ROW
#undef V_SLICE8
#undef V_WEIGHT
    if (R > 1) {
        barrier(CLK_LOCAL_MEM_FENCE);
        for (int i = l; i < hcnt * hd; i += L) {
            const int h = i / hd, d = i - h * hd;
            float acc = 0.0f;
            for (int lane = 0; lane < R; ++lane) acc += vloc[(lane * hc + h) * hd + d];
            pacc0[(size_t)h * nblk * hd + d] = acc;
        }
    }
}

__kernel void partial_kf_vf(KV_ARGS) { partial_body(KV_PASS, 0, 0, KVREG_F32); }
__kernel void partial_kq_vf(KV_ARGS) { partial_body(KV_PASS, 1, 0, KVREG_F32); }
__kernel void partial_kf_vq(KV_ARGS) { partial_body(KV_PASS, 0, 1, KVREG_F32); }
__kernel void partial_kq_vq(KV_ARGS) { partial_body(KV_PASS, 1, 1, KVREG_F32); }
/* f16 / bf16 storage: K and V both 2-byte rows (the `k` / `v` buffers) */
__kernel void partial_kh_vh(KV_ARGS) { partial_body(KV_PASS, 0, 0, KVREG_F16); }
__kernel void partial_kb_vb(KV_ARGS) { partial_body(KV_PASS, 0, 0, KVREG_BF16); }

/* Merge the partial states of every block, in block order (fixed, so the
 * answer is deterministic).  Work-item (c, Q head, token) takes the channels
 * c, c + G, ... (G = global size of dim 0): G = hd on a GPU (a channel a
 * work-item), G = 1 on a CPU, where one work-item takes a head's every
 * channel and so computes each block's e^{m_b - M} once instead of once a
 * channel.  Per channel the same operations either way. */
__kernel void merge(__global const float *pm, __global const float *ps,
                    __global const float *pacc,
                    __global const int *nlim, __global const int *firsts,
                    __global const float *sinks,     /* [nq], or [T, nq] with sink_t = nq */
                    const int has_sinks,
                    const int sink_t,
                    __global const float *vcol,      /* [nkv, hd], or [slots * tg, hd] */
                    const int use_vcol,
                    const int g0, const int ng, const int hd, const int hpk,
                    const int br, const int nblk, const int tg,
                    __global const int *tslot,       /* [T] (tg > 0) */
                    __global float *out,             /* [T, nq, hd] */
                    __global float *mz)              /* [T, nq, 2] */
{
    const int c = get_global_id(0);
    const int G = get_global_size(0);
    const int qh = get_global_id(1);
    const int t = get_global_id(2);
    if (c >= hd) return;
    const int nq = ng * hpk;
    const int gl = qh / hpk;
    const int n = nlim[t * ng + gl];
    const int first = firsts[t * ng + gl];
    const size_t o = ((size_t)t * nq + qh);
    __global float *oh = out + o * hd;
    if (n <= 0) {
        for (int d = c; d < hd; d += G) oh[d] = 0.0f;
        if (c == 0) { mz[2 * o] = -INFINITY; mz[2 * o + 1] = 0.0f; }
        return;
    }
    const int nb = (n - first + br - 1) / br;
    float m = -INFINITY;
    for (int b = 0; b < nb; ++b) m = kvreg_max_nan(m, pm[o * nblk + b]);
    if (has_sinks) m = kvreg_max_nan(m, sinks[t * sink_t + qh]);
    float z = 0.0f;
    if (!isfinite(m)) {
        /* a NaN or +inf score, or every visible score -inf and no sink: the
         * softmax is NaN (IEEE, as the reference computes it), and so are
         * every channel of the output and every visible probability. */
        z = NAN;
        for (int d = c; d < hd; d += G) oh[d] = NAN;
    } else {
        /* the channel sums accumulate in `out`, block by block: a block of
         * -inf scores has f = exp(-inf) = 0, and 0 * NaN still carries a NaN
         * value row into the output (IEEE, as the reference computes it) */
        const int v8 = G == 1 && (hd & 7) == 0;
        for (int b = 0; b < nb; ++b) {
            const float f = exp(pm[o * nblk + b] - m);
            z += ps[o * nblk + b] * f;
            __global const float *pb = pacc + (o * nblk + b) * hd;
            if (v8) {
                for (int d8 = 0; d8 < (hd >> 3); ++d8)
                    KVREG_ST8G((b ? KVREG_LD8G(d8, oh) : (float8)(0.0f)) + KVREG_LD8G(d8, pb) * f, d8, oh);
            } else {
                for (int d = c; d < hd; d += G) oh[d] = (b ? oh[d] : 0.0f) + pb[d] * f;
            }
        }
        /* the sink joins the denominator last, as in the seed */
        if (has_sinks) z += exp(sinks[t * sink_t + qh] - m);
    }
    __global const float *vc = vcol + (size_t)(g0 + gl + (tg ? tslot[t] * tg : 0)) * hd;
    for (int d = c; d < hd; d += G) {
        float r = (z > 0.0f || isnan(z)) ? oh[d] / z : 0.0f;
        if (use_vcol) r *= vc[d];
        oh[d] = r;
    }
    if (c == 0) { mz[2 * o] = m; mz[2 * o + 1] = z; }
}

/* Capped scores -> probabilities, in place.  Work-item (c, head, token)
 * takes the rows c, c + G, ... (G = global size of dim 0): one a row on a GPU
 * (G = sstride); on a CPU (G = 1) one work-item a head, eight rows an `exp`
 * call (the host pads sstride to a multiple of 8: the lanes past the span
 * are computed and never read, and every row gets the vector exp). */
/* A head's probability of a capped score `s` (float or float8) from the
 * head's max `m` and sum `z` (`mz` of the merge): `probs` and `importance`
 * both make them this way, so they agree bit for bit. */
#define KVREG_PROB(s, m, z) (exp((s) - (m)) / (z))

__kernel void probs(__global float *scores, __global const float *mz,
                    __global const int *nlim, __global const int *firsts,
                    const int ng, const int hpk, const int sstride)
{
    const int c = get_global_id(0);
    const int G = get_global_size(0);
    const int qh = get_global_id(1);
    const int t = get_global_id(2);
    const int nq = ng * hpk;
    const int gl = qh / hpk;
    const int span = nlim[t * ng + gl] - firsts[t * ng + gl];
    const size_t o = (size_t)t * nq + qh;
    const float m = mz[2 * o], z = mz[2 * o + 1];
    __global float *row = scores + o * sstride;
    /* z is >= 1 (the max's own exp(0)) or NaN (a poisoned head: every
     * visible probability NaN) */
    if (G == 1 && (sstride & 7) == 0) {
        for (int p8 = 0; 8 * p8 < span; ++p8)
            KVREG_ST8G(KVREG_PROB(KVREG_LD8G(p8, row), m, z), p8, row);
    } else {
        for (int pr = c; pr < span; pr += G) row[pr] = KVREG_PROB(row[pr], m, z);
    }
}

/* imp[p] += prob[t, h, p] for every token and head, added one at a time in
 * (token, head) order: the same sequence of float additions as the seed's
 * per-head loop, so per-head and grouped calls accumulate the same bits.
 * Work-item i takes the rows [w*i, w*i + w), w = `width` (1, or 8 on a CPU:
 * eight rows side by side in a float8, each with its own additions in the
 * same order; a row outside a head's span keeps its sum, not + 0).
 * `normalize`: `prob` holds the capped scores still, and each probability
 * is made here as `probs` makes it (exp(s - m) / z with the head's m and z
 * from `mz`; eight rows a vector exp on a CPU, as there): the same bits,
 * without a launch of `probs` and its pass over the scores. */
__kernel void importance(__global float *imp, const int imp_len,
                         __global const float *prob,
                         __global const int *nlim, __global const int *firsts,
                         const int T, const int ng, const int hpk, const int sstride,
                         const int width, __global const float *mz, const int normalize)
{
    const int p0 = get_global_id(0) * width;
    if (p0 >= imp_len) return;
    const int nq = ng * hpk;
    if (width == 8) {
        /* the last item's lanes past imp_len add nothing and are not
         * stored (they still take the vector exp: a scalar one can differ
         * from it in the last bit) */
        const int full = p0 + 8 <= imp_len;
        float tail[8];
        float8 acc;
        if (full) {
            acc = KVREG_LD8G(0, imp + p0);
        } else {
            for (int j = 0; j < 8; ++j) tail[j] = (p0 + j < imp_len) ? imp[p0 + j] : 0.0f;
            acc = vload8(0, tail);
        }
        const int8 pv = (int8)(p0) + (int8)(0, 1, 2, 3, 4, 5, 6, 7);
        for (int t = 0; t < T; ++t) {
            for (int qh = 0; qh < nq; ++qh) {
                const int gl = qh / hpk;
                const int f = firsts[t * ng + gl], n = nlim[t * ng + gl];
                if (p0 + 8 <= f || p0 >= n) continue;
                /* columns p - f of this head's row: one load when all eight
                 * rows are in [f, n), else lane by lane (0 outside); lanes
                 * outside [f, n) keep their sum */
                const size_t o = (size_t)t * nq + qh;
                const size_t base = o * sstride;
                float8 x;
                if (p0 >= f && p0 + 8 <= n) {
                    x = KVREG_LD8G(0, prob + base + (p0 - f));
                } else {
                    float xs[8];
                    for (int j = 0; j < 8; ++j)
                        xs[j] = (p0 + j >= f && p0 + j < n) ? prob[base + (p0 + j - f)] : 0.0f;
                    x = vload8(0, xs);
                }
                if (normalize) x = KVREG_PROB(x, mz[2 * o], mz[2 * o + 1]);
                const int8 in = (pv >= (int8)(f)) & (pv < (int8)(n));
                acc = in ? acc + x : acc;
            }
        }
        if (full) {
            KVREG_ST8G(acc, 0, imp + p0);
        } else {
            vstore8(acc, 0, tail);
            for (int j = 0; j < 8 && p0 + j < imp_len; ++j) imp[p0 + j] = tail[j];
        }
        return;
    }
    for (int p = p0; p < min(p0 + width, imp_len); ++p) {
        float acc = imp[p];
        for (int t = 0; t < T; ++t) {
            for (int qh = 0; qh < nq; ++qh) {
                const int gl = qh / hpk;
                const int f = firsts[t * ng + gl];
                if (p < f || p >= nlim[t * ng + gl]) continue;
                const size_t o = (size_t)t * nq + qh;
                const float x = prob[o * sstride + (p - f)];
                acc += normalize ? KVREG_PROB(x, mz[2 * o], mz[2 * o + 1]) : x;
            }
        }
        imp[p] = acc;
    }
}

/* The batch's importance: token t is sequence t, with its own accumulator
 * imp[t * istride, + imp_len[t]); imp[p] += prob[t, h, p] over the heads in
 * order, the additions of `importance` for that sequence alone (T = 1). */
__kernel void importance_batch(__global float *imp, __global const int *imp_len, const int istride,
                               __global const float *prob,
                               __global const int *nlim, __global const int *firsts,
                               const int ng, const int hpk, const int sstride)
{
    const int p = get_global_id(0);
    const int t = get_global_id(1);
    if (p >= imp_len[t]) return;
    const int nq = ng * hpk;
    float acc = imp[(size_t)t * istride + p];
    for (int qh = 0; qh < nq; ++qh) {
        const int gl = qh / hpk;
        const int f = firsts[t * ng + gl];
        if (p < f || p >= nlim[t * ng + gl]) continue;
        acc += prob[((size_t)t * nq + qh) * sstride + (p - f)];
    }
    imp[(size_t)t * istride + p] = acc;
}
