/* mpext C API: loss scaling on the CPU — the fused unscale-and-check-non-finite kernel and the
 * dynamic loss-scale update.
 *
 * bf16 and fp16 values are passed as raw uint16_t bit patterns. Counts may exceed 2^31, any
 * alignment is accepted; the functions run on the calling thread (the binding splits work) on
 * the active ISA path (mpext.h). They return MP_OK, or MP_ERR_INVALID_ARGUMENT for n < 0 or a
 * null pointer where one is required. */
#ifndef MPEXT_SCALE_H
#define MPEXT_SCALE_H

#include <stdint.h>

#include "mpext/mpext.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One tensor of a multi-tensor unscale: n elements of dtype at g. The CPU binding splits a list
 * of these across threads (each range through mp_unscale); mpext/scale_cuda.h takes the list. */
typedef struct mp_unscale_segment {
  void* g;
  int32_t dtype; /* an mp_dtype */
  int64_t n;
} mp_unscale_segment;

/* g[i] = g[i] * inv_scale for n values of dtype, in place (bf16/fp16: widened to fp32 exactly,
 * multiplied in fp32, rounded back to nearest even), and *found = 1 if any g[i] was NaN or +-Inf
 * before the multiply (*found is never cleared). The test is on the exponent bits, so it does
 * not depend on the floating-point environment. When inv_scale == 1 the values are only read
 * (nothing is stored, so read-only memory is fine). Same results as
 * torch._amp_foreach_non_finite_check_and_unscale_. Also MP_ERR_INVALID_ARGUMENT for an unknown
 * dtype. */
mp_status mp_unscale(void* g, mp_dtype dtype, int64_t n, float inv_scale, int32_t* found);

/* The loss-scale state and settings of one update (mp_update_scale, mp_update_scale_cuda): the
 * pointers are memory of the tier that runs it (host memory here). */
typedef struct mp_scale_update {
  float* scale;
  int32_t* growth_tracker;
  const float* found_inf;      /* non-zero: an inf/NaN was seen this iteration */
  int32_t* hysteresis_tracker; /* may be NULL when hysteresis <= 1 */
  int64_t* stats;              /* may be NULL: stats[0] skipped steps, stats[1] overflow streak */
  double growth_factor, backoff_factor;
  int64_t growth_interval;
  int32_t hysteresis;
  double min_scale, max_scale; /* 0: no bound */
} mp_scale_update;

/* One step of the dynamic loss-scale rule (mp_update_scale_rule in scale_rule.h): reads
 * *found_inf, updates *scale and *growth_tracker, and the optional *hysteresis_tracker and
 * stats[2]. Equal to torch._amp_update_scale_ when hysteresis <= 1, min_scale <= 0 and
 * max_scale <= 0. Returns MP_ERR_INVALID_ARGUMENT (writing nothing) if u, scale,
 * growth_tracker or found_inf is NULL, or hysteresis > 1 without a hysteresis_tracker. */
mp_status mp_update_scale(const mp_scale_update* u);

#ifdef __cplusplus
}
#endif
#endif /* MPEXT_SCALE_H */
