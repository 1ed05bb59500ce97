/* mpext: the dynamic loss-scale update rule, shared by the CPU op and the one-thread CUDA kernel
 * so that both make exactly the same decisions. Header-only; __host__ __device__ under nvcc. */
#ifndef MPEXT_SCALE_RULE_H
#define MPEXT_SCALE_RULE_H

#include <stdint.h>

#include "mpext/numerics.h" /* MP_HD */
#include "mpext/scale.h"     /* mp_scale_update */

/* One update of the loss scale u->scale after a step whose overflow flag is *u->found_inf
 * (non-zero = an Inf/NaN was seen). With hysteresis == 1, no bounds and no stats this is exactly
 * torch._amp_update_scale_:
 *   overflow: scale = (float)((double)scale * backoff); growth_tracker = 0
 *   clean:    t = growth_tracker + 1; if t == growth_interval: grown = (float)(scale * growth),
 *             scale = grown if finite; growth_tracker = 0; else growth_tracker = t
 * Extensions (used only when asked for):
 *   hysteresis_tracker (may be NULL when hysteresis <= 1): tolerance left. An overflow backs off
 *     only when the tracker is <= 1 (otherwise it is decremented); a clean step refills it to
 *     hysteresis. Every overflow resets growth_tracker.
 *   min_scale > 0: a back-off never goes below min_scale (a scale already below stays put).
 *   max_scale > 0: growth never goes above max_scale (it is clamped to max_scale).
 *   stats (may be NULL): stats[0] += 1 per overflow (skipped steps), stats[1] = consecutive
 *     overflows so far (0 after a clean step). */
MP_HD void mp_update_scale_rule(const mp_scale_update* u) {
  float* scale = u->scale;
  int32_t* growth_tracker = u->growth_tracker;
  int32_t* hysteresis_tracker = u->hysteresis_tracker;
  int64_t* stats = u->stats;
  const int32_t hysteresis = u->hysteresis;
  if (*u->found_inf != 0.0f) {
    int back_off = 1;
    if (hysteresis_tracker != 0 && hysteresis > 1) {
      if (*hysteresis_tracker > 1) {
        *hysteresis_tracker -= 1;
        back_off = 0;
      }
    }
    if (back_off) {
      float backed = (float)((double)*scale * u->backoff_factor);
      if (u->min_scale > 0.0 && (double)backed < u->min_scale) {
        float floor_scale = (float)u->min_scale;
        backed = *scale < floor_scale ? *scale : floor_scale;
      }
      *scale = backed;
    }
    *growth_tracker = 0;
    if (stats != 0) {
      stats[0] += 1;
      stats[1] += 1;
    }
  } else {
    int64_t successful = (int64_t)*growth_tracker + 1;
    if (successful == u->growth_interval) {
      float grown = (float)((double)*scale * u->growth_factor);
      if (u->max_scale > 0.0 && (double)grown > u->max_scale) {
        float cap = (float)u->max_scale;
        grown = *scale > cap ? *scale : cap;
      }
      /* Finite check on the bits: no dependence on isfinite or fast-math. */
      uint32_t bits;
      __builtin_memcpy(&bits, &grown, sizeof bits);
      if ((bits & 0x7F800000u) != 0x7F800000u) *scale = grown;
      *growth_tracker = 0;
    } else {
      *growth_tracker = (int32_t)successful;
    }
    if (hysteresis_tracker != 0 && hysteresis > 1) *hysteresis_tracker = hysteresis;
    if (stats != 0) stats[1] = 0;
  }
}

/* 1 if u can be applied: the pointers the rule needs are there. */
MP_HD int mp_scale_update_ok(const mp_scale_update* u) {
  return u != 0 && u->scale != 0 && u->growth_tracker != 0 && u->found_inf != 0 &&
         (u->hysteresis <= 1 || u->hysteresis_tracker != 0);
}

#endif /* MPEXT_SCALE_RULE_H */
