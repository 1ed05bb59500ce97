/* mpext: the Muon rule's elementwise phases (torch.optim.Muon), two rows of mpext/rules/rules.h
 * -- muon_momentum (phase 1) and muon_update (phase 3) -- shared by the C core
 * (csrc/core/step.c's pipeline), the CUDA kernel (cuda/step.cu) and their tests. Header-only;
 * __host__ __device__ under nvcc. Storage (formats, stochastic rounding, the ema, the unscale)
 * is the engine's (mpext/step_storage.h).
 *
 * Muon's update is not elementwise: a step is (1) the momentum update, elementwise; (2)
 * Newton-Schulz orthogonalisation of the whole matrix, through torch's BF16 GEMMs (Python,
 * mpext/optim/muon.py); (3) the param update, elementwise. Phases 1 and 3 are two rules of the
 * engine, so each gets every storage format and both tiers.
 *
 * muon_momentum (options read: beta1 the momentum, >= 0 and finite; nesterov). One moment,
 * the momentum buffer (exp_avg). The engine's "param" is the update it writes (any dtype: bf16
 * to nearest even is torch's .bfloat16() of its fp32 update, so NS reads the same bits); its
 * old value is not read. In torch's order, torch's CPU lerp being one fused multiply-add
 * (fma(w, b - a, a), or fma(w - 1, b - a, b) for w >= 0.5) on every length, as measured:
 *   b = lerp(b, g, 1 - momentum);  u = nesterov ? lerp(g, b, momentum) : b
 * muon_update (options read: beta1 the lr ratio, > 0 and finite; weight_decay, decoupled). No
 * moment; the engine's "grad" is the orthogonalised update O:
 *   p = p * (1 - lr * weight_decay);  p = fma(O, -(lr * lr_ratio), p)
 * with lr_ratio _adjust_lr's shape factor (Python doubles, rounded once as torch's alpha). */
/* mpext/step.h first, outside the guard (see mpext/rules/lion.h). */
#include "mpext/step.h"
#ifndef MPEXT_RULES_MUON_H
#define MPEXT_RULES_MUON_H

#include <stdint.h>

#include "mpext/step_common.h" /* MP_F* */

/* torch's CPU/CUDA lerp(a, b, w) with w_m1 = w - 1: one fused multiply-add from the nearer end. */
MP_HD float mp_muon_lerp(float a, float b, float w, float w_m1) {
  const float d = MP_FSUB(b, a);
  return w < 0.5f ? MP_FFMA(w, d, a) : MP_FFMA(w_m1, d, b);
}

/* ---- phase 1: muon_momentum ---- */

typedef struct mp_muon_momentum_scalars {
  float w_buf;    /* 1 - momentum, in double as Python computes it */
  float w_buf_m1; /* w_buf - 1 in fp32 (torch's lerp coefficient for w >= 0.5) */
  float w_nes;    /* momentum */
  float w_nes_m1; /* momentum - 1 in fp32 */
  int32_t nesterov;
} mp_muon_momentum_scalars;

MP_HD int mp_muon_momentum_options_ok(const mp_step_options* o) {
  return o->beta1 >= 0.0 && o->beta1 - o->beta1 == 0.0;
}

MP_HD int mp_muon_momentum_moments(const mp_step_options* o) {
  (void)o;
  return 1;
}

MP_HD mp_muon_momentum_scalars mp_muon_momentum_scalars_of(const mp_step_options* o, float lr,
                                                           float step) {
  (void)lr;
  (void)step;
  mp_muon_momentum_scalars s;
  s.w_buf = (float)MP_DSUB(1.0, o->beta1);
  s.w_buf_m1 = MP_FSUB(s.w_buf, 1.0f);
  s.w_nes = (float)o->beta1;
  s.w_nes_m1 = MP_FSUB(s.w_nes, 1.0f);
  s.nesterov = o->nesterov ? 1 : 0;
  return s;
}

/* One element: unscaled gradient g, buffer *b updated in place (p and v are not read);
 * returns the update. */
MP_HD float mp_muon_momentum_element(float g, float p, float* b, float* v,
                                     const mp_muon_momentum_scalars* s) {
  (void)p;
  (void)v;
  const float nb = mp_muon_lerp(*b, g, s->w_buf, s->w_buf_m1);
  *b = nb;
  return s->nesterov ? mp_muon_lerp(g, nb, s->w_nes, s->w_nes_m1) : nb;
}

/* ---- phase 3: muon_update ---- */

typedef struct mp_muon_update_scalars {
  float decay;  /* 1 - lr * weight_decay, in double */
  float neg_lr; /* -(lr * lr_ratio), in double */
} mp_muon_update_scalars;

MP_HD int mp_muon_update_options_ok(const mp_step_options* o) {
  return o->beta1 > 0.0 && o->beta1 - o->beta1 == 0.0;
}

MP_HD int mp_muon_update_moments(const mp_step_options* o) {
  (void)o;
  return 0;
}

MP_HD mp_muon_update_scalars mp_muon_update_scalars_of(const mp_step_options* o, float lr_f,
                                                       float step) {
  (void)step;
  mp_muon_update_scalars s;
  s.decay = (float)MP_DSUB(1.0, MP_DMUL((double)lr_f, o->weight_decay));
  s.neg_lr = (float)(-MP_DMUL((double)lr_f, o->beta1));
  return s;
}

/* One element: orthogonalised update o, fp32 value p (no moment); returns the new p. */
MP_HD float mp_muon_update_element(float o, float p, float* m, float* v,
                                   const mp_muon_update_scalars* s) {
  (void)m;
  (void)v;
  return MP_FFMA(o, s->neg_lr, MP_FMUL(p, s->decay));
}

#endif /* MPEXT_RULES_MUON_H */
