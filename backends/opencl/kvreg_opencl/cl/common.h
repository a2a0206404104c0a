/* Shared definitions of the kvreg OpenCL kernels (reached with -I <cl dir>).
 *
 * Everything is float32 and needs no extension (no cl_khr_fp16, no fp64: f16
 * rows are read with core OpenCL's vload_half), so the
 * same sources build on any OpenCL 1.2 device, PoCL's CPU device included;
 * the one exception, nystrom.cl, is float64 and built only on a device that
 * reports fp64. */
#ifndef KVREG_COMMON_H
#define KVREG_COMMON_H

/* q8 keys carry one scale per group of this many channels (seed KV_K_GROUP). */
#define KVREG_K_GROUP 32

/* Horizontal sums in a fixed lane order: every caller gets the same bits for
 * the same inputs, whatever work-item or work-group runs them. */
inline float kvreg_hsum4(float4 a) { return (a.x + a.y) + (a.z + a.w); }

inline float kvreg_hsum8(float8 a) { return kvreg_hsum4(a.lo + a.hi); }

/* max that propagates NaN (fmax drops it): a NaN score must poison its head
 * (docs/kernels.md, non-finite values), not vanish from the softmax. */
inline float kvreg_max_nan(float m, float x) { return (x > m || isnan(x)) ? x : m; }

#endif
