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
#include "mpext/step.h"     /* mp_step_stats */

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

/* ---- the optimizer step's counters (the update and state half) ----
 *
 * mp_step_stats is mp_step (mpext/step.h) over a range with counters taken in the same pass, a
 * rule-independent epilogue of the step's tile pipeline. Columns of a param's row (an
 * [ntensors, MP_STS_NCOLS] array of double: counts are whole numbers, exact below 2^53; the
 * sums are in double). "x" is an element's new fp32 value: the master as stored (master or
 * remainder), else the rule's fp32 result before it is rounded to the param's dtype.
 *   ELEMS     elements stepped (nothing is counted when the step is skipped)
 *   CHANGED   bf16/fp16 params only: elements whose fp32 value changed (x != its old value;
 *             NaN counts as changed). Not counted for fp32 params (their value is the param).
 *   UNMOVED   of CHANGED, those whose stored 16-bit param kept its bits: with a master or
 *             remainder "unchanged although the master moved"; master-free with round to
 *             nearest: the update is lost; with stochastic rounding: it did not move this step
 *   SUBHALF   master-free only: of CHANGED, those with |x - old| < half an ulp of the old
 *             stored value (the spacing of its exponent; a subnormal's is the smallest normal
 *             one's): what round to nearest always loses, and stochastic rounding carries in
 *             expectation only
 *   M_ERR, M_ABS  exp_avg in bf16 or 8-bit codes: sum |stored - fp32| and sum |fp32| over the
 *             elements, after the step (stored: the bf16 value, or the code decoded with the
 *             block's new scale); V_ERR, V_ABS the same for exp_avg_sq. Exact over every
 *             element (not sampled). fp32 moments: nothing.
 *   Q8_FLUSHED  8-bit moments: values != 0 whose magnitude code is 0 (exp_avg's and
 *             exp_avg_sq's both): lost to the bottom of the block's range
 *   Q8_SATBLOCKS  8-bit blocks holding a flushed value or with a non-finite absmax
 *   Q8_BLOCKS 8-bit blocks encoded (a pair's block counts once)
 *   EMA_LAG, EMA_ABS  params with an ema: sum |ema - x| and sum |x| after the ema's update
 * The sums are each a fixed tree over 8 lanes (element i in lane i % 8) per tile, added to the
 * row in the range's order: the same bits on every ISA path for the same range. */
enum {
  MP_STS_ELEMS = 0,
  MP_STS_CHANGED = 1,
  MP_STS_UNMOVED = 2,
  MP_STS_SUBHALF = 3,
  MP_STS_M_ERR = 4,
  MP_STS_M_ABS = 5,
  MP_STS_V_ERR = 6,
  MP_STS_V_ABS = 7,
  MP_STS_Q8_FLUSHED = 8,
  MP_STS_Q8_SATBLOCKS = 9,
  MP_STS_Q8_BLOCKS = 10,
  MP_STS_EMA_LAG = 11,
  MP_STS_EMA_ABS = 12,
  MP_STS_NCOLS = 13
};

/* Half an ulp of the 16-bit value h of dtype pt (MP_BF16 or MP_F16), as fp32 (exact: a power of
 * two; a subnormal's is the smallest normal one's): SUBHALF's bound, on both tiers. */
MP_HD float mp_sts_half_ulp(uint32_t h, int pt) {
  uint32_t e = pt == MP_BF16 ? (h >> 7) & 0xFFu : (h >> 10) & 0x1Fu;
  e = e != 0u ? e : 1u;
  const uint32_t bits = pt == MP_BF16 ? (e >= 9u ? (e - 8u) << 23 : 1u << (e + 14u))
                                      : (e + 101u) << 23;
  float f;
  __builtin_memcpy(&f, &bits, sizeof f);
  return f;
}

/* mp_step(t, start, count, o) -- the same checks and the same bits in every array it writes --
 * with the counters above added into row[0 .. MP_STS_NCOLS) (not thread-safe: one row per
 * concurrent caller). Through the mode's counted fast row where one is kept (csrc/core/fast/:
 * the same bits and the same counters as the pipeline), else the tile pipeline. Nothing is
 * counted when the step is skipped (*o->found_inf != 0). Returns MP_ERR_INVALID_ARGUMENT (writing nothing) as mp_step does, or for a NULL row. */
mp_status mp_step_stats(const mp_step_tensor* t, int64_t start, int64_t count,
                        const mp_step_options* o, double* row);

#ifdef __cplusplus
}
#endif
#endif /* MPEXT_TELEMETRY_H */
