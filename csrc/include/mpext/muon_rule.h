/* mpext: the Muon rule's elementwise phases (torch.optim.Muon) -- their per-step scalars and
 * their per-element updates over fp32 values -- shared by the C core (csrc/core/adam.c's
 * pipeline), the CUDA kernel (cuda/adam.cu) and their tests. Header-only; __host__ __device__
 * under nvcc. Storage (formats, stochastic rounding, the ema, the unscale) is the engine's.
 *
 * Muon's update is not elementwise: a step is (1) the momentum update, elementwise; (2)
 * Newton-Schulz orthogonalisation of the whole matrix, through torch's BF16 GEMMs (Python,
 * mpext/optim/muon.py); (3) the param update, elementwise. Phases 1 and 3 are two rules of the
 * engine (MP_RULE_MUON_MOMENTUM, MP_RULE_MUON_UPDATE), run by one op (muon_step_, `phase`):
 *
 * Phase 1: the engine's "param" is the update it writes (any dtype; bf16 to nearest even is
 * torch's .bfloat16() of its fp32 update, so NS reads the same bits), its one moment the
 * momentum buffer; the step counts do not advance (phase 3 ends the step). In torch's order,
 * torch's CPU lerp being one fused multiply-add (fma(w, b - a, a), or fma(w - 1, b - a, b) for
 * w >= 0.5) on every length, as measured:
 *   b = lerp(b, g, 1 - momentum);  u = nesterov ? lerp(g, b, momentum) : b
 * Phase 3: the engine's "grad" is the orthogonalised update O, the param in any format:
 *   p = p * (1 - lr * weight_decay);  p = fma(O, -(lr * lr_ratio), p)
 * with lr_ratio _adjust_lr's shape factor (Python doubles, rounded once as torch's alpha). */
#ifndef MPEXT_MUON_RULE_H
#define MPEXT_MUON_RULE_H

#include <stdint.h>

#include "mpext/adam.h"        /* mp_adam_options */
#include "mpext/step_common.h" /* MP_F* */

typedef struct mp_muon_scalars {
  int32_t phase;       /* 1: momentum (MP_RULE_MUON_MOMENTUM), 3: update */
  float w_buf;         /* 1 - momentum, in double as Python computes it */
  float w_buf_m1;      /* w_buf - 1 in fp32 (torch's lerp_vec coefficient for w >= 0.5) */
  float w_nes;         /* momentum */
  float w_nes_m1;      /* momentum - 1 in fp32 */
  int32_t nesterov;
  float decay;         /* 1 - lr * weight_decay, in double */
  float neg_lr;        /* -(lr * lr_ratio), in double */
} mp_muon_scalars;

/* The scalars of a step at learning rate lr_f (options as mpext/adam.h documents them for
 * MP_RULE_MUON_MOMENTUM / MP_RULE_MUON_UPDATE). */
MP_HD mp_muon_scalars mp_muon_scalars_of(const mp_adam_options* o, float lr_f) {
  mp_muon_scalars s;
  s.phase = o->rule == MP_RULE_MUON_MOMENTUM ? 1 : 3;
  s.w_buf = (float)MP_DSUB(1.0, o->beta1);
  s.w_buf_m1 = MP_FSUB(s.w_buf, 1.0f);
  s.w_nes = (float)o->beta1;
  s.w_nes_m1 = MP_FSUB(s.w_nes, 1.0f);
  s.nesterov = o->nesterov ? 1 : 0;
  s.decay = (float)MP_DSUB(1.0, MP_DMUL((double)lr_f, o->weight_decay));
  s.neg_lr = (float)(-MP_DMUL((double)lr_f, o->beta1));
  return s;
}

/* torch's CPU/CUDA lerp(a, b, w) with w_m1 = w - 1: one fused multiply-add from the nearer end. */
MP_HD float mp_muon_lerp(float a, float b, float w, float w_m1) {
  const float d = MP_FSUB(b, a);
  return w < 0.5f ? MP_FFMA(w, d, a) : MP_FFMA(w_m1, d, b);
}

/* Phase 1, one element: unscaled gradient g, buffer *b updated in place; returns the update. */
MP_HD float mp_muon_momentum_element(float g, float* b, const mp_muon_scalars* s) {
  const float nb = mp_muon_lerp(*b, g, s->w_buf, s->w_buf_m1);
  *b = nb;
  return s->nesterov ? mp_muon_lerp(g, nb, s->w_nes, s->w_nes_m1) : nb;
}

/* Phase 3, one element: orthogonalised update o, fp32 value p; returns the new p. */
MP_HD float mp_muon_update_element(float o, float p, const mp_muon_scalars* s) {
  return MP_FFMA(o, s->neg_lr, MP_FMUL(p, s->decay));
}

/* Either phase over one element, as the engine's rule stage calls it. */
MP_HD float mp_muon_element(float g, float p, float* b, const mp_muon_scalars* s) {
  return s->phase == 1 ? mp_muon_momentum_element(g, b, s) : mp_muon_update_element(g, p, s);
}

#endif /* MPEXT_MUON_RULE_H */
