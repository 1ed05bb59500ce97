/* mpext: the step engine's storage side, whichever the rule -- the argument checks, the per-step
 * scalars of the storage (the unscale, stochastic rounding streams, the ema, 8-bit blocks) and
 * the per-element helpers around a rule's update -- shared by the C core (csrc/core/step.c), the
 * CUDA kernel (cuda/step.cu) and their tests, so that both tiers compute the same bits.
 * Header-only; __host__ __device__ under nvcc. The rules' own checks and scalars are their
 * headers' (mpext/rules/), reached through the generated mp_rule_* of mpext/rules/rules.h. */
#ifndef MPEXT_STEP_STORAGE_H
#define MPEXT_STEP_STORAGE_H

#include <math.h>
#include <stdint.h>

#include "mpext/numerics.h"    /* MP_HD */
#include "mpext/step.h"        /* the structs, and the rules */
#include "mpext/step_common.h" /* the rounding macros, the storage and 8-bit codecs */

/* The fp32 scalars of a param's storage in one step (every rule). */
typedef struct mp_step_scalars {
  float inv_scale;         /* 1 when the grads are not scaled */
  int32_t write_grad;      /* unscale_grads with an inv_scale other than 1 */
  int32_t sr_params;       /* a master-free param is rounded stochastically */
  int32_t moments_nearest; /* bf16 moments rounded to nearest even */
  uint64_t key_moments;    /* the stochastic-rounding streams of this param and step */
  uint64_t key_param;
  float ema_weight;        /* 1 - ema_decay (subtracted in double); 1 on the first step */
  float ema_rest;          /* 1 - ema_weight, in fp32 */
  int32_t ema_from_start;  /* ema_weight < 0.5, as torch's lerp */
  int32_t ema_copy;        /* the first step: the ema becomes the value, whatever it held */
  uint64_t key_q8;
  int64_t q8_block;        /* elements per block of 8-bit moments */
  float q8_inv_k;          /* 8-bit moment pairs: v is raised to at least m * m * q8_inv_k */
} mp_step_scalars;

/* 1 if the call's found_inf says to write nothing. */
MP_HD int mp_step_skip(const mp_step_options* o) {
  return o->found_inf != 0 && *o->found_inf != 0.0f;
}

/* 1 if the options are valid: weight_decay finite and >= 0, ema_decay in [0, 1], a known rule
 * that accepts its hyperparameters (mp_rule_options_ok). */
MP_HD int mp_step_options_ok(const mp_step_options* o) {
  return o->weight_decay >= 0.0 && o->weight_decay - o->weight_decay == 0.0 &&
         o->ema_decay >= 0.0 && o->ema_decay <= 1.0 && mp_rule_options_ok(o);
}

/* 1 if t's moments are in a block format (coded per block of q8_block elements, with scales),
 * for a rule keeping at least one. */
MP_HD int mp_step_blocks(const mp_step_tensor* t) { return mp_format_block(t->exp_avg_format); }

/* 1 if b is a valid q8_block: a power of two in [MP_Q8_BLOCK_MIN, MP_Q8_BLOCK_MAX]. */
MP_HD int mp_q8_block_ok(int64_t b) {
  return b >= MP_Q8_BLOCK_MIN && b <= MP_Q8_BLOCK_MAX && (b & (b - 1)) == 0;
}

/* 1 if t is a valid param (see mp_step_tensor) of a rule keeping nmom moments (2: exp_avg and
 * exp_avg_sq; 1: exp_avg alone, exp_avg_sq NULL; 0: neither), each array aligned to its element
 * size. */
MP_HD int mp_step_tensor_ok(const mp_step_tensor* t, int nmom) {
  const int32_t pd = t->param_dtype, gd = t->grad_dtype;
  /* the formats of the moments the rule keeps (those it does not are not read) */
  const int32_t mf = nmom >= 1 ? t->exp_avg_format : MP_FMT_F32;
  const int32_t vf = nmom >= 2 ? t->exp_avg_sq_format : MP_FMT_F32;
  if (pd < 0 || pd >= MP_DTYPE_COUNT || gd < 0 || gd >= MP_DTYPE_COUNT) return 0;
  if (gd != pd && gd != MP_F32) return 0;
  if (!mp_format_ok(mf) || !mp_format_ok(vf) || !mp_format_signed(mf)) return 0;
  /* a pair is coded together: both in block formats (the second non-negative) or neither */
  const int q8 = nmom >= 1 && mp_format_block(mf);
  if (nmom >= 2 && (mp_format_block(vf) != q8 || (q8 && mp_format_signed(vf)))) return 0;
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
         ((uintptr_t)t->exp_avg % (uintptr_t)mp_format_bytes(mf)) == 0u &&
         ((uintptr_t)t->exp_avg_sq % (uintptr_t)mp_format_bytes(vf)) == 0u &&
         ((uintptr_t)t->master & 3u) == 0u && ((uintptr_t)t->remainder & 1u) == 0u &&
         ((uintptr_t)t->ema & 3u) == 0u;
}

/* 1 if mp_step(t, start, count, o) is a valid call (mpext/step.h says what is): t and o valid,
 * the range within t, and with 8-bit moments a range of whole blocks. */
MP_HD int mp_step_call_ok(const mp_step_tensor* t, int64_t start, int64_t count,
                          const mp_step_options* o) {
  if (t == 0 || o == 0 || !mp_step_options_ok(o) || !mp_step_tensor_ok(t, mp_rule_moments(o)))
    return 0;
  if (start < 0 || count < 0 || start > t->n || count > t->n - start) return 0;
  /* a block is updated whole, by one call */
  return !(mp_rule_moments(o) > 0 && mp_step_blocks(t) &&
           (!mp_q8_block_ok(o->q8_block) || start % o->q8_block != 0 ||
            t->offset % o->q8_block != 0 || (count % o->q8_block != 0 && start + count != t->n)));
}

/* The storage's scalars of a step whose param has step count `step` before it (t = step + 1,
 * in fp32 as torch's float step tensor) and gradient multiplier inv_scale. */
MP_HD mp_step_scalars mp_step_scalars_of(const mp_step_options* o, float step, float inv_scale,
                                         uint64_t sr_stream) {
  mp_step_scalars s;
  const float t_f = MP_FADD(step, 1.0f);
  s.inv_scale = inv_scale;
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
  /* 1/K, K the bound of m^2 / v for exponential averages m, v (decays beta1, beta2: a rule
   * keeping a pair of moments reads them so) of the same gradients g_k:
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

/* The learning rate of a call as its pointers give it (host or device memory of the running
 * tier). */
MP_HD float mp_step_lr(const mp_step_options* o) { return o->lr != 0 ? *o->lr : o->lr_value; }

/* The storage's scalars of a param's step as the call's pointers give them: its step count at
 * `step`, its streams numbered sr_stream. */
MP_HD mp_step_scalars mp_step_scalars_now(const mp_step_options* o, const float* step,
                                          uint64_t sr_stream) {
  return mp_step_scalars_of(o, *step, o->inv_scale != 0 ? *o->inv_scale : 1.0f, sr_stream);
}

/* The rule's scalars of a param's step as the call's pointers give them. */
MP_HD mp_rule_scalars mp_rule_scalars_now(const mp_step_options* o, const float* step) {
  return mp_rule_scalars_of(o, mp_step_lr(o), *step);
}

/* A moment as stored in bf16: stochastically rounded with 16 random bits (unbiased, so a
 * second moment decaying by beta2 = 0.999 still moves, which round to nearest cannot: 0.999 is
 * within half a bf16 ulp of 1), or to nearest even when asked. */
MP_HD uint16_t mp_step_bf16_moment(float x, uint32_t r16, const mp_step_scalars* s) {
  uint32_t u;
  __builtin_memcpy(&u, &x, sizeof u);
  return s->moments_nearest ? mp_bf16_rne_bits(u) : mp_bf16_sr_bits(u, r16);
}

/* A decoded second moment v raised to m^2 / K (see mp_step_scalars_of): v itself whenever an
 * exact average could have produced the pair (m, v); NaN stays NaN. */
MP_HD float mp_step_q8_floor_v(float m, float v, const mp_step_scalars* s) {
  const float w = MP_FMUL(MP_FMUL(m, m), s->q8_inv_k);
  return w > v ? w : v;
}

/* The unscaled gradient of element value gin (widened to fp32): what the update uses, and what
 * is written back into the gradient when s->write_grad. */
MP_HD float mp_step_unscaled(float gin, const mp_step_scalars* s) {
  return MP_FMUL(gin, s->inv_scale);
}

/* The ema of an element after a step whose new fp32 value is x (see mp_step_tensor). */
MP_HD float mp_step_ema(float ema, float x, const mp_step_scalars* s) {
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

#endif /* MPEXT_STEP_STORAGE_H */
