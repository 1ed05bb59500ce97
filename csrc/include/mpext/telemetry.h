/* mpext C API: precision telemetry of the gradients -- the fused unscale-and-check of scale.h
 * that also counts, in the same pass, what the gradient's dtype costs at the current loss scale.
 *
 * Every count is taken on the STORED values, i.e. the scaled gradient as backward left it, before
 * the multiply (a = |g| as bits of the gradient's own dtype):
 *   zeros      a == 0 (+-0; includes values that backward flushed to zero)
 *   subnormal  0 < a < the dtype's smallest normal (2^-126 fp32/bf16, 2^-14 fp16): values that
 *              underflowed at this loss scale and kept only part of their precision
 *   headroom   finite and a >= 2^emax (2^127 fp32/bf16, 2^15 fp16), which for stored values is
 *              exactly |g| * 2 > the dtype's max: these would overflow at twice the scale
 *   nonfinite  NaN or +-Inf (the condition that sets found_inf)
 *   max_abs    fp32(max finite |g| * stat_inv_scale), 0 when there is none: the largest
 *              unscaled magnitude, before it is rounded back to the gradient's dtype (rounding
 *              is monotone, so this is max_i fp32(|g_i| * stat_inv_scale) exactly)
 * All of these are exact integers or one correctly rounded product, so every ISA path, the
 * CUDA kernels (mpext/telemetry_cuda.h) and a pure-Python reference agree bit for bit.
 *
 * bf16 and fp16 values are raw uint16_t bit patterns. Counts may exceed 2^31. */
#ifndef MPEXT_TELEMETRY_H
#define MPEXT_TELEMETRY_H

#include <stdint.h>

#include "mpext/mpext.h"
#include "mpext/numerics.h" /* MP_HD */

#ifdef __cplusplus
extern "C" {
#endif

/* Columns of a tensor's row of counts (an int64 [ntensors, MP_TEL_NCOUNTS] array). */
enum { MP_TEL_ZEROS = 0, MP_TEL_SUBNORMAL = 1, MP_TEL_HEADROOM = 2, MP_TEL_NONFINITE = 3,
       MP_TEL_NCOUNTS = 4 };

/* The counts of one range of one tensor (mp_unscale_stats adds into it). */
typedef struct mp_grad_stats {
  int64_t count[MP_TEL_NCOUNTS];
  float max_abs; /* merged as a max of the fp32 bit patterns (mp_tel_max_bits) */
} mp_grad_stats;

/* The absolute-value bit limits of a dtype: subnormal below `normal`, headroom from `top`,
 * non-finite from `inf` (abs bits of the dtype's own width). */
MP_HD uint32_t mp_tel_normal(int dtype) {
  return dtype == MP_F32 ? 0x00800000u : dtype == MP_BF16 ? 0x0080u : 0x0400u;
}
MP_HD uint32_t mp_tel_top(int dtype) {
  return dtype == MP_F32 ? 0x7F000000u : dtype == MP_BF16 ? 0x7F00u : 0x7800u;
}
MP_HD uint32_t mp_tel_inf(int dtype) {
  return dtype == MP_F32 ? 0x7F800000u : dtype == MP_BF16 ? 0x7F80u : 0x7C00u;
}

/* The larger of two fp32 values compared as signed 32-bit patterns: for values >= 0 (all that
 * max_abs ever holds) this is the numeric max, and it is what CUDA's integer atomicMax does, so
 * both tiers merge identically whatever an accumulator held. */
MP_HD float mp_tel_max_bits(float a, float b) {
  int32_t x, y;
  __builtin_memcpy(&x, &a, sizeof x);
  __builtin_memcpy(&y, &b, sizeof y);
  return x >= y ? a : b;
}

/* Exactly mp_unscale (scale.h): g[i] *= inv_scale in place for n values of dtype (same bits,
 * nothing stored when inv_scale == 1), *found = 1 if any was NaN/Inf (never cleared); and, from
 * the values as they were before the multiply, adds the counts above to stats->count and
 * merges max_abs (with stat_inv_scale, the inverse of the loss scale the stored values carry:
 * inv_scale itself, unless the caller only checks with inv_scale == 1) into stats->max_abs.
 * Runs on the calling thread on the active ISA path. Returns MP_OK, or MP_ERR_INVALID_ARGUMENT
 * (changing nothing) for n < 0, an unknown dtype, found or stats NULL, or g NULL with n > 0. */
mp_status mp_unscale_stats(void* g, mp_dtype dtype, int64_t n, float inv_scale,
                           float stat_inv_scale, int32_t* found, mp_grad_stats* stats);

#ifdef __cplusplus
}
#endif
#endif /* MPEXT_TELEMETRY_H */
