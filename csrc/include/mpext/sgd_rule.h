/* mpext: the SGD rule (torch.optim.SGD: momentum, dampening, Nesterov, L2 weight decay,
 * maximize) -- its per-step scalars and its per-element update over fp32 values -- shared by the
 * C core (csrc/core/adam.c's pipeline), the CUDA kernel (cuda/adam.cu) and their tests.
 * Header-only; __host__ __device__ under nvcc. Storage is the engine's, as for Adam.
 *
 * Per element, in torch's _single_tensor_sgd order, each add(x, alpha=a) one fused multiply-add
 * as torch's CPU kernels compute it (MP_FFMA):
 *   g = -g if maximize;  g = fma(p, weight_decay, g) if weight_decay != 0
 *   with a momentum: b = g on the param's first step, else fma(g, 1 - dampening, b * momentum);
 *                    g = fma(b, momentum, g) with nesterov, else b
 *   p = fma(g, -lr, p) */
#ifndef MPEXT_SGD_RULE_H
#define MPEXT_SGD_RULE_H

#include <stdint.h>

#include "mpext/adam.h"        /* mp_adam_options */
#include "mpext/step_common.h" /* MP_F* */

typedef struct mp_sgd_scalars {
  float neg_lr;        /* -lr */
  float weight_decay;
  float momentum;
  float damp_rest;     /* 1 - dampening, in double as Python passes alpha */
  int32_t maximize;
  int32_t decay;       /* weight_decay != 0 (torch skips the add otherwise) */
  int32_t has_momentum; /* momentum != 0: a buffer is kept */
  int32_t nesterov;
  int32_t first;       /* the param's first step: the buffer becomes g (torch's clone) */
} mp_sgd_scalars;

/* The scalars of a step at learning rate lr_f of a param whose step count before it is step
 * (the options' fields as documented in mpext/adam.h for MP_RULE_SGD). */
MP_HD mp_sgd_scalars mp_sgd_scalars_of(const mp_adam_options* o, float lr_f, float step) {
  mp_sgd_scalars s;
  s.neg_lr = -lr_f;
  s.weight_decay = (float)o->weight_decay;
  s.momentum = (float)o->beta1;
  s.damp_rest = (float)MP_DSUB(1.0, o->dampening);
  s.maximize = o->maximize ? 1 : 0;
  s.decay = o->weight_decay != 0.0 ? 1 : 0;
  s.has_momentum = o->beta1 != 0.0 ? 1 : 0;
  s.nesterov = o->nesterov ? 1 : 0;
  s.first = step == 0.0f ? 1 : 0;
  return s;
}

/* One element: unscaled gradient g, fp32 value p, momentum buffer *b (read only with a
 * momentum) updated in place; returns the new p. */
MP_HD float mp_sgd_element(float g, float p, float* b, const mp_sgd_scalars* s) {
  if (s->maximize) g = -g;
  if (s->decay) g = MP_FFMA(p, s->weight_decay, g);
  if (s->has_momentum) {
    const float nb = s->first ? g : MP_FFMA(g, s->damp_rest, MP_FMUL(*b, s->momentum));
    *b = nb;
    g = s->nesterov ? MP_FFMA(nb, s->momentum, g) : nb;
  }
  return MP_FFMA(g, s->neg_lr, p);
}

#endif /* MPEXT_SGD_RULE_H */
