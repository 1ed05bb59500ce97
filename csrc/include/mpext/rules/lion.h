/* mpext: the Lion rule (Chen et al. 2023, as the lion-pytorch package computes it) -- its
 * per-step scalars and its per-element update over fp32 values -- shared by the C core
 * (csrc/core/step.c's pipeline), the CUDA kernel (cuda/step.cu) and their tests. Header-only;
 * __host__ __device__ under nvcc. A row of mpext/rules/rules.h. The storage of every value
 * (formats, stochastic rounding, the ema, the unscale) is the engine's (mpext/step_storage.h).
 *
 * Options read (mp_step_options): beta1, beta2 in [0, 1], weight_decay (decoupled), maximize.
 * One moment, exp_avg.
 *
 * Per element, in lion-pytorch's order of operations, each torch op rounded as torch's CPU
 * kernels round it: torch's add(x, alpha=a) is one fused multiply-add (its vectorized loop and
 * its scalar tail alike), so MP_FFMA here:
 *   g = -g if maximize;  p = p * (1 - lr * weight_decay)
 *   u = sign(fma(g, 1 - beta1, m * beta1))          (sign 0 for 0 and NaN, as torch.sgn)
 *   p = fma(u, -lr, p);  m = fma(g, 1 - beta2, m * beta2) */
/* mpext/step.h first, outside the guard: it includes the rules (this header among them)
 * after the structs they take, so that this header compiles whichever is included first. */
#include "mpext/step.h"
#ifndef MPEXT_RULES_LION_H
#define MPEXT_RULES_LION_H

#include <stdint.h>

#include "mpext/step_common.h" /* MP_F* */

typedef struct mp_lion_scalars {
  float decay;           /* 1 - lr * weight_decay, in double as Python computes it */
  float neg_lr;          /* -lr */
  float beta1, one_minus_beta1; /* 1 - beta1 in double, as Python passes alpha */
  float beta2, one_minus_beta2;
  int32_t maximize;
} mp_lion_scalars;

/* 1 if the options are valid for Lion: betas in [0, 1]. */
MP_HD int mp_lion_options_ok(const mp_step_options* o) {
  return o->beta1 >= 0.0 && o->beta1 <= 1.0 && o->beta2 >= 0.0 && o->beta2 <= 1.0;
}

/* The moments Lion keeps per element: exp_avg. */
MP_HD int mp_lion_moments(const mp_step_options* o) {
  (void)o;
  return 1;
}

/* The scalars of a step at learning rate lr_f (the step count is not read). */
MP_HD mp_lion_scalars mp_lion_scalars_of(const mp_step_options* o, float lr_f, float step) {
  (void)step;
  mp_lion_scalars s;
  s.decay = (float)MP_DSUB(1.0, MP_DMUL((double)lr_f, o->weight_decay));
  s.neg_lr = -lr_f;
  s.beta1 = (float)o->beta1;
  s.one_minus_beta1 = (float)MP_DSUB(1.0, o->beta1);
  s.beta2 = (float)o->beta2;
  s.one_minus_beta2 = (float)MP_DSUB(1.0, o->beta2);
  s.maximize = o->maximize ? 1 : 0;
  return s;
}

/* torch.sgn of a real: 1, -1, or 0 for +-0 and NaN; comparisons only, so it vectorizes. */
MP_HD float mp_lion_sign(float x) {
  return (x > 0.0f ? 1.0f : 0.0f) - (x < 0.0f ? 1.0f : 0.0f);
}

/* One element: unscaled gradient g, fp32 value p, moment *m updated in place (v is not read);
 * returns the new p. */
MP_HD float mp_lion_element(float g, float p, float* m, float* v, const mp_lion_scalars* s) {
  (void)v;
  if (s->maximize) g = -g;
  p = MP_FMUL(p, s->decay);
  const float u = mp_lion_sign(MP_FFMA(g, s->one_minus_beta1, MP_FMUL(*m, s->beta1)));
  p = MP_FFMA(u, s->neg_lr, p);
  *m = MP_FFMA(g, s->one_minus_beta2, MP_FMUL(*m, s->beta2));
  return p;
}

#endif /* MPEXT_RULES_LION_H */
