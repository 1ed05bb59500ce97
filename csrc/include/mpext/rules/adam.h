/* mpext: the Adam/AdamW rule -- its range checks, its moment count, its per-step scalars and its
 * per-element update over fp32 values -- shared by the C core's pipeline (csrc/core/step.c), the
 * CUDA kernel (cuda/step.cu) and their tests, so that both tiers compute the same bits.
 * Header-only; __host__ __device__ under nvcc. A row of mpext/rules/rules.h.
 *
 * Options read (mp_step_options): beta1, beta2 in [0, 1), eps >= 0 finite, weight_decay (L2 for
 * Adam, decoupled for AdamW: decoupled), maximize. Two moments, exp_avg and exp_avg_sq.
 *
 * Per element, in fp32:
 *   if maximize: g = -g
 *   Adam (L2):      g = g + weight_decay * p
 *   AdamW:          p = p * (1 - lr * weight_decay)
 *   m = lerp(m, g, 1 - beta1);  v = v * beta2 + ((1 - beta2) * g) * g
 *   p = p - (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
 * which is torch.optim.Adam / AdamW's single-tensor path, with t the param's step count plus one.
 * Every fp32 operation is rounded once, in the order written, and none is fused: the C core is
 * ISO C (no contraction), and on the device the _rn intrinsics are never contracted whatever the
 * compiler flags. The per-step scalars are computed in double from the float32 step count, as
 * torch computes them (but for the power, see mp_pow_exact), and rounded once to fp32. */
/* mpext/step.h first, outside the guard: it includes the rules (this header among them)
 * after the structs they take, so that this header compiles whichever is included first. */
#include "mpext/step.h"
#ifndef MPEXT_RULES_ADAM_H
#define MPEXT_RULES_ADAM_H

#include <math.h>
#include <stdint.h>

#include "mpext/numerics.h"    /* MP_HD */
#include "mpext/step_common.h" /* the rounding macros, mp_pow_exact, mp_lerp */

/* The fp32 scalars one Adam step applies to every element of a param. */
typedef struct mp_adam_scalars {
  float weight_decay;    /* Adam (L2) */
  float decay;           /* AdamW: 1 - lr * weight_decay */
  float lerp_weight;     /* 1 - beta1 (subtracted in double) */
  float lerp_rest;       /* 1 - lerp_weight (in fp32, as torch's lerp) */
  float beta2;
  float one_minus_beta2; /* subtracted in double */
  float eps;
  float neg_step_size;   /* -(lr / (1 - beta1^t)) */
  float bc2_sqrt;        /* sqrt(1 - beta2^t) */
  int32_t decoupled;
  int32_t maximize;
  int32_t lerp_from_start; /* lerp_weight < 0.5: m + w * (g - m); else g - (g - m) * (1 - w) */
} mp_adam_scalars;

/* 1 if the options are valid for Adam: betas in [0, 1), eps finite and >= 0 (weight_decay and
 * the storage's fields are the engine's checks). */
MP_HD int mp_adam_options_ok(const mp_step_options* o) {
  return o->beta1 >= 0.0 && o->beta1 < 1.0 && o->beta2 >= 0.0 && o->beta2 < 1.0 &&
         o->eps >= 0.0 && o->eps - o->eps == 0.0;
}

/* The moments Adam keeps per element: exp_avg and exp_avg_sq. */
MP_HD int mp_adam_moments(const mp_step_options* o) {
  (void)o;
  return 2;
}

/* The scalars of a step at learning rate lr_f of a param whose step count before it is `step`
 * (t = step + 1, in fp32 as torch's float step tensor). */
MP_HD mp_adam_scalars mp_adam_scalars_of(const mp_step_options* o, float lr_f, float step) {
  mp_adam_scalars s;
  const double lr = (double)lr_f;
  const float t_f = MP_FADD(step, 1.0f);
  const double t = (double)t_f;
  const double bc1 = MP_DSUB(1.0, mp_pow_exact(o->beta1, t));
  const double bc2 = MP_DSUB(1.0, mp_pow_exact(o->beta2, t));
  s.weight_decay = (float)o->weight_decay;
  s.decay = o->decoupled ? (float)MP_DSUB(1.0, MP_DMUL(lr, o->weight_decay)) : 1.0f;
  s.lerp_weight = (float)MP_DSUB(1.0, o->beta1);
  s.lerp_rest = MP_FSUB(1.0f, s.lerp_weight);
  s.beta2 = (float)o->beta2;
  s.one_minus_beta2 = (float)MP_DSUB(1.0, o->beta2);
  s.eps = (float)o->eps;
  s.neg_step_size = -(float)MP_DDIV(lr, bc1);
  s.bc2_sqrt = (float)sqrt(bc2);
  s.decoupled = o->decoupled ? 1 : 0;
  s.maximize = o->maximize ? 1 : 0;
  s.lerp_from_start = s.lerp_weight < 0.5f ? 1 : 0;
  return s;
}

/* One element: unscaled gradient g, fp32 param or master value p, moments *m and *v updated in
 * place; returns the new p. */
MP_HD float mp_adam_element(float g, float p, float* m, float* v, const mp_adam_scalars* s) {
  if (s->maximize) g = -g;
  if (s->decoupled) {
    p = MP_FMUL(p, s->decay);
  } else {
    g = MP_FADD(g, MP_FMUL(s->weight_decay, p));
  }
  *m = mp_lerp(*m, g, s->lerp_weight, s->lerp_rest, s->lerp_from_start);
  *v = MP_FADD(MP_FMUL(*v, s->beta2), MP_FMUL(MP_FMUL(s->one_minus_beta2, g), g));
  const float denom = MP_FADD(MP_FDIV(MP_FSQRT(*v), s->bc2_sqrt), s->eps);
  return MP_FADD(p, MP_FDIV(MP_FMUL(s->neg_step_size, *m), denom));
}

#endif /* MPEXT_RULES_ADAM_H */
