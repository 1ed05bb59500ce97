/* mpext: the Adam/AdamW rule -- the argument checks, the per-step scalars and the per-element
 * update -- shared by the C core (csrc/core/adam.c), the CUDA kernels (cuda/adam.cu) and their
 * tests, so that both tiers compute the same bits. Header-only; __host__ __device__ under nvcc.
 *
 * Every fp32 operation is rounded once, in the order written, and none is fused: the C core is
 * ISO C (no contraction), and on the device the _rn intrinsics are never contracted whatever the
 * compiler flags. The per-step scalars are computed in double from the float32 step count, as
 * torch computes them (but for the power, see mp_adam_pow), and rounded once to fp32. */
#ifndef MPEXT_ADAM_RULE_H
#define MPEXT_ADAM_RULE_H

#include <math.h>
#include <stdint.h>

#include "mpext/adam.h"
#include "mpext/numerics.h" /* MP_HD */
#include "mpext/step_common.h" /* the rounding macros, the storage and 8-bit codecs */


/* The fp32 scalars one step applies to every element of a param. */
typedef struct mp_adam_scalars {
  float inv_scale;       /* 1 when the grads are not scaled */
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
  int32_t write_grad;      /* unscale_grads with an inv_scale other than 1 */
  int32_t sr_params;       /* a master-free param is rounded stochastically */
  int32_t moments_nearest; /* bf16 moments rounded to nearest even */
  uint64_t key_moments;    /* the stochastic-rounding streams of this param and step */
  uint64_t key_param;
  float ema_weight;        /* 1 - ema_decay (subtracted in double); 1 on the first step */
  float ema_rest;          /* 1 - ema_weight, in fp32 */
  int32_t ema_from_start;  /* ema_weight < 0.5, as lerp_from_start */
  int32_t ema_copy;        /* the first step: the ema becomes the value, whatever it held */
  uint64_t key_q8;
  int64_t q8_block;        /* elements per block of 8-bit moments */
  float q8_inv_k;          /* 8-bit moments: v is raised to at least m * m * q8_inv_k */
} mp_adam_scalars;


/* 1 if the call's found_inf says to write nothing. */
MP_HD int mp_adam_skip(const mp_adam_options* o) {
  return o->found_inf != 0 && *o->found_inf != 0.0f;
}

/* The moments the options' rule keeps per element: 2 (Adam), 1 (Lion; SGD with momentum) or 0
 * (SGD without). */
MP_HD int mp_rule_moments(const mp_adam_options* o) {
  if (o->rule == MP_RULE_MUON_MOMENTUM) return 1; /* muon */
  if (o->rule == MP_RULE_MUON_UPDATE) return 0;   /* muon */
  return o->rule == MP_RULE_ADAM ? 2 : (o->rule == MP_RULE_LION || o->beta1 != 0.0) ? 1 : 0;
}

/* 1 if the options are valid: betas in [0, 1) (Lion: [0, 1]; SGD: a momentum >= 0, a finite
 * dampening), eps and weight_decay finite and >= 0, ema_decay in [0, 1], a known rule, an
 * SGD nesterov only with a momentum and no dampening. */
MP_HD int mp_adam_options_ok(const mp_adam_options* o) {
  const int common = o->weight_decay >= 0.0 && o->weight_decay - o->weight_decay == 0.0 &&
                     o->ema_decay >= 0.0 && o->ema_decay <= 1.0;
  if (o->rule == MP_RULE_LION)
    return common && o->beta1 >= 0.0 && o->beta1 <= 1.0 && o->beta2 >= 0.0 && o->beta2 <= 1.0;
  if (o->rule == MP_RULE_MUON_MOMENTUM) /* muon */
    return common && o->beta1 >= 0.0 && o->beta1 - o->beta1 == 0.0;
  if (o->rule == MP_RULE_MUON_UPDATE) /* muon */
    return common && o->beta1 > 0.0 && o->beta1 - o->beta1 == 0.0;
  if (o->rule == MP_RULE_SGD)
    return common && o->beta1 >= 0.0 && o->beta1 - o->beta1 == 0.0 &&
           o->dampening - o->dampening == 0.0 &&
           (!o->nesterov || (o->beta1 > 0.0 && o->dampening == 0.0));
  return o->rule == MP_RULE_ADAM && common && o->beta1 >= 0.0 && o->beta1 < 1.0 &&
         o->beta2 >= 0.0 && o->beta2 < 1.0 && o->eps >= 0.0 && o->eps - o->eps == 0.0;
}

/* 0 for a rule's phase after which the step goes on (Muon's momentum phase): its call leaves
 * the step counts as they are. */
MP_HD int mp_rule_ends_step(const mp_adam_options* o) {
  return o->rule != MP_RULE_MUON_MOMENTUM;
}

/* 1 if t has 8-bit moments (exp_avg MP_I8, exp_avg_sq MP_U8). */
MP_HD int mp_adam_q8(const mp_adam_tensor* t) { return t->exp_avg_dtype == MP_I8; }

/* 1 if b is a valid q8_block: a power of two in [MP_Q8_BLOCK_MIN, MP_Q8_BLOCK_MAX]. */
MP_HD int mp_adam_q8_block_ok(int64_t b) {
  return b >= MP_Q8_BLOCK_MIN && b <= MP_Q8_BLOCK_MAX && (b & (b - 1)) == 0;
}

/* 1 if t is a valid param (see mp_adam_tensor) of a rule keeping nmom moments (2: exp_avg and
 * exp_avg_sq; 1: exp_avg alone, exp_avg_sq NULL; 0: neither), each array aligned to its element
 * size. */
MP_HD int mp_step_tensor_ok(const mp_adam_tensor* t, int nmom) {
  const int32_t pd = t->param_dtype, gd = t->grad_dtype;
  const int32_t md = nmom >= 1 ? t->exp_avg_dtype : MP_F32;
  const int32_t vd = nmom >= 2 ? t->exp_avg_sq_dtype : (md == MP_I8 ? MP_U8 : MP_F32);
  if (pd < 0 || pd >= MP_DTYPE_COUNT || gd < 0 || gd >= MP_DTYPE_COUNT) return 0;
  if (gd != pd && gd != MP_F32) return 0;
  const int q8 = md == MP_I8 && vd == MP_U8;
  if (!q8 && ((md != MP_F32 && md != MP_BF16) || (vd != MP_F32 && vd != MP_BF16))) return 0;
  if (!q8 && (t->exp_avg_scale != 0 || t->exp_avg_sq_scale != 0)) return 0;
  if (nmom < 2 && t->exp_avg_sq_scale != 0) return 0;
  if (t->n < 0 || t->step == 0 || ((uintptr_t)t->step & 3u) != 0u) return 0;
  if (t->sr_stream > 0xFFFFFFFFu) return 0; /* 32 bits travel in the CUDA launch argument */
  if (t->offset < 0 || t->offset > INT64_MAX - t->n) return 0;
  if (t->n == 0) return 1;
  if (t->param == 0 || t->grad == 0) return 0;
  if ((nmom >= 1) != (t->exp_avg != 0) || (nmom >= 2) != (t->exp_avg_sq != 0)) return 0;
  if (pd == MP_F32 && (t->master != 0 || t->remainder != 0)) return 0;
  if (t->master != 0 && t->remainder != 0) return 0;
  if (t->remainder != 0 && pd != MP_BF16) return 0;
  if (q8 && (t->exp_avg_scale == 0 || ((uintptr_t)t->exp_avg_scale & 3u) != 0u ||
             (nmom >= 2 && (t->exp_avg_sq_scale == 0 ||
                            ((uintptr_t)t->exp_avg_sq_scale & 3u) != 0u))))
    return 0;
  return ((uintptr_t)t->param % (uintptr_t)MP_DTYPE_BYTES(pd)) == 0u &&
         ((uintptr_t)t->grad % (uintptr_t)MP_DTYPE_BYTES(gd)) == 0u &&
         ((uintptr_t)t->exp_avg % (uintptr_t)MP_DTYPE_BYTES(md)) == 0u &&
         ((uintptr_t)t->exp_avg_sq % (uintptr_t)MP_DTYPE_BYTES(vd)) == 0u &&
         ((uintptr_t)t->master & 3u) == 0u && ((uintptr_t)t->remainder & 1u) == 0u &&
         ((uintptr_t)t->ema & 3u) == 0u;
}

/* 1 if t is a valid param of an Adam step (two moments). */
MP_HD int mp_adam_tensor_ok(const mp_adam_tensor* t) { return mp_step_tensor_ok(t, 2); }

/* The scalars of a step whose param has step count `step` before it (t = step + 1, in fp32 as
 * torch's float step tensor), learning rate lr and gradient multiplier inv_scale. */
MP_HD mp_adam_scalars mp_adam_scalars_of(const mp_adam_options* o, float lr_f, float step,
                                         float inv_scale, uint64_t sr_stream) {
  mp_adam_scalars s;
  const double lr = (double)lr_f;
  const float t_f = MP_FADD(step, 1.0f);
  const double t = (double)t_f;
  const double bc1 = MP_DSUB(1.0, mp_adam_pow(o->beta1, t));
  const double bc2 = MP_DSUB(1.0, mp_adam_pow(o->beta2, t));
  s.inv_scale = inv_scale;
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
  s.write_grad = o->unscale_grads && inv_scale != 1.0f ? 1 : 0;
  s.sr_params = o->sr_params ? 1 : 0;
  s.moments_nearest = o->moments_nearest ? 1 : 0;
  /* The step count names the streams: a whole number (torch's float step), read as one. */
  const uint64_t t_int = t_f >= 1.0f && t_f < 18446744073709551616.0f ? (uint64_t)t_f : 0u;
  s.key_moments = mp_sr_key(o->seed, t_int, 2u * sr_stream);
  s.key_param = mp_sr_key(o->seed, t_int, 2u * sr_stream + 1u);
  s.ema_weight = step == 0.0f ? 1.0f : (float)MP_DSUB(1.0, o->ema_decay);
  s.ema_rest = MP_FSUB(1.0f, s.ema_weight);
  s.ema_from_start = s.ema_weight < 0.5f ? 1 : 0;
  s.ema_copy = step == 0.0f ? 1 : 0;
  s.key_q8 = mp_sr_key(o->seed, t_int, MP_Q8_STREAM + sr_stream);
  s.q8_block = o->q8_block;
  /* 1/K, K the bound of m^2 / v for exponential averages of the same gradients g_k:
   * m^2 = (1-b1)^2 (sum b1^k g_k)^2 <= (1-b1)^2 (sum (b1^2/b2)^k) (sum b2^k g_k^2)
   *     <= (1-b1)^2 / (1 - b1^2/b2) * v / (1-b2)   (Cauchy-Schwarz), when b1^2 < b2;
   * one step keeps m^2 <= K v once it holds, so raising v to m^2 / K changes nothing an exact
   * average could reach. No bound (0: no floor) when b1^2 >= b2. */
  const double r = o->beta2 > 0.0 ? MP_DDIV(MP_DMUL(o->beta1, o->beta1), o->beta2)
                                  : (o->beta1 > 0.0 ? 2.0 : 0.0);
  s.q8_inv_k = r < 1.0 ? (float)MP_DDIV(MP_DMUL(MP_DSUB(1.0, o->beta2), MP_DSUB(1.0, r)),
                                         MP_DMUL(MP_DSUB(1.0, o->beta1), MP_DSUB(1.0, o->beta1)))
                       : 0.0f;
  return s;
}

/* The scalars of a param's step as the call's pointers give them (host or device memory of the
 * running tier): its step count at `step`, its streams numbered sr_stream. */
MP_HD mp_adam_scalars mp_adam_scalars_now(const mp_adam_options* o, const float* step,
                                          uint64_t sr_stream) {
  return mp_adam_scalars_of(o, o->lr != 0 ? *o->lr : o->lr_value, *step,
                            o->inv_scale != 0 ? *o->inv_scale : 1.0f, sr_stream);
}

/* A moment as stored in bf16: stochastically rounded with 16 random bits (unbiased, so a
 * second moment decaying by beta2 = 0.999 still moves, which round to nearest cannot: 0.999 is
 * within half a bf16 ulp of 1), or to nearest even when asked. */
MP_HD uint16_t mp_adam_bf16_moment(float x, uint32_t r16, const mp_adam_scalars* s) {
  uint32_t u;
  __builtin_memcpy(&u, &x, sizeof u);
  return s->moments_nearest ? mp_bf16_rne_bits(u) : mp_bf16_sr_bits(u, r16);
}

/* A decoded second moment v raised to m^2 / K (see mp_adam_scalars_of): v itself whenever an
 * exact average could have produced the pair (m, v); NaN stays NaN. */
MP_HD float mp_adam_q8_floor_v(float m, float v, const mp_adam_scalars* s) {
  const float w = MP_FMUL(MP_FMUL(m, m), s->q8_inv_k);
  return w > v ? w : v;
}

/* The unscaled gradient of element value gin (widened to fp32): what the update uses, and what
 * is written back into the gradient when s->write_grad. */
MP_HD float mp_adam_unscaled(float gin, const mp_adam_scalars* s) {
  return MP_FMUL(gin, s->inv_scale);
}

MP_HD float mp_adam_ema(float ema, float x, const mp_adam_scalars* s) {
  /* a copy on the first step, as AveragedModel's first update: lerp with weight 1 would turn
   * an ema that held an Inf or NaN (uninitialized memory, say) into NaN. Selected by a mask,
   * not a branch, so that the CPU loops around it stay vectorized. */
  const float l = mp_lerp(ema, x, s->ema_weight, s->ema_rest, s->ema_from_start);
  uint32_t lb, xb;
  __builtin_memcpy(&lb, &l, sizeof lb);
  __builtin_memcpy(&xb, &x, sizeof xb);
  const uint32_t copy = 0u - (uint32_t)s->ema_copy;
  const uint32_t rb = (xb & copy) | (lb & ~copy);
  float r;
  __builtin_memcpy(&r, &rb, sizeof r);
  return r;
}

/* One element: unscaled gradient g (mp_adam_unscaled), fp32 param or master value p, moments *m
 * and *v updated in place; returns the new p. */
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

#endif /* MPEXT_ADAM_RULE_H */
