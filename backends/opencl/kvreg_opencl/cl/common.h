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

/* Vector loads, stores and conversions of the attend kernels.
 *
 * KVREG_INLINE_VEC (the host defines it for CPU devices, config.INLINE_VEC):
 * plain dereferences of element-aligned vector types and clang's
 * __builtin_convertvector instead of vloadn / vstoren / convert_floatn.  On
 * PoCL those builtins are calls into its kernel library, and the library can
 * be built for other CPU features than the kernel (seen on an AMD Zen 4:
 * library for skylake-avx512, kernel for znver3), so LLVM cannot inline them:
 * every vload8 of a row was a call, its accumulators spilled, and decode read
 * 2 GB/s where the same loop read 19 GB/s with the dereferences.  Loads are
 * loads and the widenings are exact, so both spellings give the same bits
 * (the tests build both and compare).  Everywhere else the OpenCL builtins. */
#ifdef KVREG_INLINE_VEC
typedef float kvreg_f8u __attribute__((ext_vector_type(8), aligned(4)));
typedef float kvreg_f4u __attribute__((ext_vector_type(4), aligned(4)));
typedef char kvreg_c16u __attribute__((ext_vector_type(16), aligned(1)));
typedef char kvreg_c8u __attribute__((ext_vector_type(8), aligned(1)));
typedef ushort kvreg_u8u __attribute__((ext_vector_type(8), aligned(2)));
typedef ushort kvreg_u4u __attribute__((ext_vector_type(4), aligned(2)));
#define KVREG_LD8G(i, p) ((float8)(*(__global const kvreg_f8u *)((p) + 8 * (size_t)(i))))
#define KVREG_LD8L(i, p) ((float8)(*(__local const kvreg_f8u *)((p) + 8 * (size_t)(i))))
#define KVREG_LD4G(i, p) ((float4)(*(__global const kvreg_f4u *)((p) + 4 * (size_t)(i))))
#define KVREG_LD4L(i, p) ((float4)(*(__local const kvreg_f4u *)((p) + 4 * (size_t)(i))))
#define KVREG_LDC16G(i, p) ((char16)(*(__global const kvreg_c16u *)((p) + 16 * (size_t)(i))))
#define KVREG_LDC8G(i, p) ((char8)(*(__global const kvreg_c8u *)((p) + 8 * (size_t)(i))))
#define KVREG_LDU8G(i, p) ((ushort8)(*(__global const kvreg_u8u *)((p) + 8 * (size_t)(i))))
#define KVREG_LDU4G(i, p) ((ushort4)(*(__global const kvreg_u4u *)((p) + 4 * (size_t)(i))))
#define KVREG_ST8G(x, i, p) (*(__global kvreg_f8u *)((p) + 8 * (size_t)(i)) = (x))
#define KVREG_ST8L(x, i, p) (*(__local kvreg_f8u *)((p) + 8 * (size_t)(i)) = (x))
#define KVREG_C2F8(c) __builtin_convertvector((c), float8)
#define KVREG_U2U8(u) __builtin_convertvector((u), uint8)
#define KVREG_U2U4(u) __builtin_convertvector((u), uint4)
/* IEEE binary16 bits -> float32, exact: the half's exponent and mantissa
 * shifted into a float's and scaled by 2^112 (a power of two: exact, and
 * subnormal halves land on normal floats); inf and NaN keep an all-ones
 * exponent (a NaN's payload shifted like vload_half's). */
#define KVREG_HALF_WIDEN(N)                                                   \
    inline float##N kvreg_half##N(ushort##N h)                                \
    {                                                                         \
        const uint##N u = __builtin_convertvector(h, uint##N);                \
        const uint##N em = u & 0x7fffu;                                       \
        const float##N f = as_float##N(em << 13) * 0x1p112f;                  \
        const float##N big = as_float##N((em << 13) | 0x7f800000u);           \
        const int##N special = as_int##N(em) >= (int##N)(0x7c00);             \
        return as_float##N(as_uint##N(special ? big : f) | ((u & 0x8000u) << 16)); \
    }
KVREG_HALF_WIDEN(8)
KVREG_HALF_WIDEN(4)
#define KVREG_LDH8G(i, p) kvreg_half8(KVREG_LDU8G(i, (__global const ushort *)(p)))
#define KVREG_LDH4G(i, p) kvreg_half4(KVREG_LDU4G(i, (__global const ushort *)(p)))
#else
#define KVREG_LD8G(i, p) vload8(i, p)
#define KVREG_LD8L(i, p) vload8(i, p)
#define KVREG_LD4G(i, p) vload4(i, p)
#define KVREG_LD4L(i, p) vload4(i, p)
#define KVREG_LDC16G(i, p) vload16(i, p)
#define KVREG_LDC8G(i, p) vload8(i, p)
#define KVREG_LDU8G(i, p) vload8(i, p)
#define KVREG_LDU4G(i, p) vload4(i, p)
#define KVREG_ST8G(x, i, p) vstore8(x, i, p)
#define KVREG_ST8L(x, i, p) vstore8(x, i, p)
#define KVREG_C2F8(c) convert_float8(c)
#define KVREG_U2U8(u) convert_uint8(u)
#define KVREG_U2U4(u) convert_uint4(u)
#define KVREG_LDH8G(i, p) vload_half8(i, (__global const half *)(p))
#define KVREG_LDH4G(i, p) vload_half4(i, (__global const half *)(p))
#endif

/* max that propagates NaN (fmax drops it): a NaN score must poison its head
 * (docs/kernels.md, non-finite values), not vanish from the softmax. */
inline float kvreg_max_nan(float m, float x) { return (x > m || x != x) ? x : m; }  /* x != x: isnan, no library call */

/* KVREG_PREFETCH (the host defines it, in bytes, for CPU devices): a read
 * hint for the row `r` (of `hd` elements of `es` bytes) that lies that many
 * bytes ahead of row `r` of `base`: the rows of a block are read in order,
 * and one core's out-of-order window does not cover a DRAM latency (decode
 * of 8k rows on PoCL, one thread: 10 ms without, 7.8 ms with).  A hint
 * never faults, past a buffer's end too, and changes no value.  The cast
 * through an integer: PoCL's CPU address spaces are one flat space. */
#ifdef KVREG_PREFETCH
#define KVREG_PREFETCH_ROW(base, r, hd, es)                                   \
    for (int o_ = 0; o_ < (hd) * (es); o_ += 64)                              \
        __builtin_prefetch((const void *)(size_t)((base) + (size_t)(r) * (hd) * (es) + KVREG_PREFETCH + o_))
#endif

#endif
