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

/* g[i] = g[i] * inv_scale for n fp32 values, in place, and *found = 1 if any g[i] was NaN or
 * +-Inf before the multiply (*found is never cleared). When inv_scale == 1 the values are only
 * read, never written (a check without the multiply). torch's op writes the values back
 * unchanged in that case (which quiets signaling NaNs); mpext leaves memory untouched. */
mp_status mp_unscale_f32(float* g, int64_t n, float inv_scale, int32_t* found);

/* The same for bf16 values: each is widened to fp32 (exact), multiplied in fp32 and rounded
 * back to nearest even — what torch._amp_foreach_non_finite_check_and_unscale_ computes. */
mp_status mp_unscale_bf16(uint16_t* g, int64_t n, float inv_scale, int32_t* found);

/* The same for fp16 values. */
mp_status mp_unscale_fp16(uint16_t* g, int64_t n, float inv_scale, int32_t* found);

/* One step of the dynamic loss-scale rule (see scale_rule.h, mp_update_scale_rule): reads
 * *found_inf, updates *scale and *growth_tracker, and the optional *hysteresis_tracker and
 * stats[2] (NULL when unused). Equal to torch._amp_update_scale_ when hysteresis <= 1,
 * min_scale <= 0, max_scale <= 0. */
mp_status mp_update_scale(float* scale, int32_t* growth_tracker, const float* found_inf,
                          double growth_factor, double backoff_factor, int64_t growth_interval,
                          int32_t* hysteresis_tracker, int32_t hysteresis, double min_scale,
                          double max_scale, int64_t* stats);

#ifdef __cplusplus
}
#endif
#endif /* MPEXT_SCALE_H */
