/* mpext: the SGD rule (torch.optim.SGD: momentum, dampening, Nesterov, L2 weight decay,
 * maximize) -- its per-step scalars and its per-element update over fp32 values -- shared by the
 * C core (csrc/core/step.c's pipeline), the CUDA kernel (cuda/step.cu) and their tests.
 * Header-only; __host__ __device__ under nvcc. A row of mpext/rules/rules.h. Storage is the
 * engine's (mpext/step_storage.h).
 *
 * Options read (mp_step_options): beta1 the momentum (>= 0, finite), dampening (finite),
 * nesterov (only with a momentum and no dampening: torch's check), weight_decay (L2), maximize;
 * eps is not read. The moment exp_avg is the momentum buffer, none when the momentum is 0.
 *
 * Per element, in torch's _single_tensor_sgd order, each add(x, alpha=a) one fused multiply-add
 * as torch's CPU kernels compute it (MP_FFMA):
 *   g = -g if maximize;  g = fma(p, weight_decay, g) if weight_decay != 0
 *   with a momentum: b = g on the param's first step, else fma(g, 1 - dampening, b * momentum);
 *                    g = fma(b, momentum, g) with nesterov, else b
 *   p = fma(g, -lr, p) */
/* mpext/step.h first, outside the guard: it includes the rules (this header among them)
 * after the structs they take, so that this header compiles whichever is included first. */
#include "mpext/step.h"
#ifndef MPEXT_RULES_SGD_H
#define MPEXT_RULES_SGD_H

#include <stdint.h>

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

/* 1 if the options are valid for SGD: a finite momentum >= 0, a finite dampening, nesterov only
 * with a momentum and no dampening. */
MP_HD int mp_sgd_options_ok(const mp_step_options* o) {
  return o->beta1 >= 0.0 && o->beta1 - o->beta1 == 0.0 && o->dampening - o->dampening == 0.0 &&
         (!o->nesterov || (o->beta1 > 0.0 && o->dampening == 0.0));
}

/* The moments SGD keeps per element: the momentum buffer, if there is a momentum. */
MP_HD int mp_sgd_moments(const mp_step_options* o) { return o->beta1 != 0.0 ? 1 : 0; }

/* The scalars of a step at learning rate lr_f of a param whose step count before it is step. */
MP_HD mp_sgd_scalars mp_sgd_scalars_of(const mp_step_options* o, float lr_f, float step) {
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
 * momentum) updated in place (v is not read); returns the new p. */
MP_HD float mp_sgd_element(float g, float p, float* b, float* v, const mp_sgd_scalars* s) {
  (void)v;
  if (s->maximize) g = -g;
  if (s->decay) g = MP_FFMA(p, s->weight_decay, g);
  if (s->has_momentum) {
    const float nb = s->first ? g : MP_FFMA(g, s->damp_rest, MP_FMUL(*b, s->momentum));
    *b = nb;
    g = s->nesterov ? MP_FFMA(nb, s->momentum, g) : nb;
  }
  return MP_FFMA(g, s->neg_lr, p);
}

#endif /* MPEXT_RULES_SGD_H */
