/* What the step's tests share (test_step_*.c, test_fast_paths.c): the moment format of a dtype,
 * element access by dtype, the optimizer's settings and per-step scalars as the torch binding
 * derives them, the Adam element update restated in float arithmetic (rules/adam.h's formula,
 * one rounding per operation), the options of a call, and random values and stochastic rounding
 * to either 16-bit format. Static inline, as test_common.h's helpers are. */
#ifndef MPEXT_TESTS_C_TEST_STEP_H
#define MPEXT_TESTS_C_TEST_STEP_H

#include "mpext/step.h"
#include "test_common.h"

/* The moment format (mpext/formats/formats.h) of moments stored as dtype d: fp32, bf16, or the
 * 8-bit codes (int8 signed, uint8 non-negative); MP_FMT_COUNT (invalid) for any other. */
static inline int32_t fmt_of(mp_dtype d) {
  return d == MP_F32 ? MP_FMT_F32 : d == MP_BF16 ? MP_FMT_BF16 : d == MP_I8 ? MP_FMT_Q8S
         : d == MP_U8 ? MP_FMT_Q8U : MP_FMT_COUNT;
}

static inline uint32_t a_get(const void* p, mp_dtype t, size_t i) {
  return t == MP_F32 ? ((const uint32_t*)p)[i] : ((const uint16_t*)p)[i];
}

static inline void a_put(void* p, mp_dtype t, size_t i, uint32_t b) {
  if (t == MP_F32) {
    ((uint32_t*)p)[i] = b;
  } else {
    ((uint16_t*)p)[i] = (uint16_t)b;
  }
}

/* The value of element bits b of type t (bf16 is the top half of an fp32; fp16 by the field
 * decoder, which is exact). */
static inline float a_value(mp_dtype t, uint32_t b) {
  if (t == MP_F32) return f32_of(b);
  if (t == MP_BF16) return f32_of(b << 16);
  return (float)decode(b, &FP16);
}

static inline int a_isnan(mp_dtype t, uint32_t b) {
  if (t == MP_F32) return (b & 0x7FFFFFFFu) > 0x7F800000u;
  return is_nan_fmt(b, t == MP_BF16 ? &BF16 : &FP16);
}

/* The optimizer's settings as the Python side holds them (lr is a float32 tensor). */
typedef struct adam_cfg {
  float lr;
  double beta1, beta2, eps, weight_decay;
  int decoupled, maximize;
} adam_cfg;

/* The per-step scalars of one call, as this file restates them, plus what the call is made of
 * (the settings, the step count t after the step and the gradient multiplier). */
typedef struct ref_scalars {
  float beta1, beta2, eps, lerp_weight, one_minus_beta2, weight_decay, decay, step_size;
  float bias_correction2_sqrt, inv_scale;
  int decoupled, maximize;
  adam_cfg cfg;
  float t;
} ref_scalars;

/* The per-param scalars, restated from torch's single-tensor Adam: computed in double from the
 * incremented float32 step count t and the float32 lr, each rounded once to float. */
static inline ref_scalars adam_scalars(const adam_cfg* c, float t, float inv_scale) {
  ref_scalars p;
  memset(&p, 0, sizeof p);
  p.cfg = *c;
  p.t = t;
  const double lr = (double)c->lr, td = (double)t;
  p.beta1 = (float)c->beta1;
  p.beta2 = (float)c->beta2;
  p.eps = (float)c->eps;
  p.lerp_weight = (float)(1.0 - c->beta1);
  p.one_minus_beta2 = (float)(1.0 - c->beta2);
  p.weight_decay = c->decoupled ? 0.0f : (float)c->weight_decay;
  p.decay = c->decoupled ? (float)(1.0 - lr * c->weight_decay) : 1.0f;
  p.step_size = (float)(lr / (1.0 - pow(c->beta1, td)));
  p.bias_correction2_sqrt = (float)sqrt(1.0 - pow(c->beta2, td));
  p.inv_scale = inv_scale;
  p.decoupled = c->decoupled ? 1 : 0;
  p.maximize = c->maximize ? 1 : 0;
  return p;
}

/* adam.h's formula for one element: grad is the decoded gradient, *p the fp32 param or master,
 * *m and *v the moments; all three are updated. */
static inline void ref_adam_elem(const ref_scalars* hp, float grad, float* p_io, float* m_io,
                          float* v_io) {
  float g = grad * hp->inv_scale;
  if (hp->maximize) g = -g;
  float p = *p_io;
  if (hp->decoupled) {
    p = p * hp->decay;
  } else {
    const float wp = hp->weight_decay * p;
    g = g + wp;
  }
  const float m0 = *m_io, v0 = *v_io, w = hp->lerp_weight;
  const float diff = g - m0;
  float m;
  if (w < 0.5f) {
    const float step = w * diff;
    m = m0 + step;
  } else {
    const float one_minus_w = 1.0f - w;
    const float back = diff * one_minus_w;
    m = g - back;
  }
  const float vb = v0 * hp->beta2;
  const float a = hp->one_minus_beta2 * g;
  const float aa = a * g;
  const float v = vb + aa;
  const float root = (float)sqrt((double)v);
  const float q = root / hp->bias_correction2_sqrt;
  const float denom = q + hp->eps;
  const float neg_step = -hp->step_size;
  const float num = neg_step * m;
  const float upd = num / denom;
  *p_io = p + upd;
  *m_io = m;
  *v_io = v;
}

/* A random finite fp32 of either sign: 1.f x 2^e with e uniform in [emin, emax]; one in 64 is
 * a zero, one in 64 a subnormal. */
static inline float adam_rand(uint64_t* s, int emin, int emax) {
  uint64_t r = splitmix64(s);
  uint32_t sign = (uint32_t)(r >> 63) << 31;
  uint32_t kind = (uint32_t)(r % 64u);
  if (kind == 0) return f32_of(sign);
  if (kind == 1) return f32_of(sign | (((uint32_t)(r >> 8) & 0x7FFFFFu) | 1u));
  int e = emin + (int)((r >> 6) % (uint64_t)(emax - emin + 1));
  return f32_of(sign | ((uint32_t)(e + 127) << 23) | ((uint32_t)(r >> 32) & 0x7FFFFFu));
}

/* The options of the call hp describes: lr as a value, inv_scale through a pointer. */
static inline mp_step_options adam_options(const ref_scalars* hp, const float* inv_scale) {
  mp_step_options op;
  memset(&op, 0, sizeof op);
  op.beta1 = hp->cfg.beta1;
  op.beta2 = hp->cfg.beta2;
  op.eps = hp->cfg.eps;
  op.weight_decay = hp->cfg.weight_decay;
  op.decoupled = hp->cfg.decoupled;
  op.maximize = hp->cfg.maximize;
  op.lr_value = hp->cfg.lr;
  op.inv_scale = inv_scale;
  return op;
}

/* fp32 value u rounded stochastically to fmt f with 32 random bits r: the dropped fraction of
 * the magnitude as a 32-bit fixed-point number plus r carries (bf16: r's low 16 bits plus the
 * dropped 16 bits). Values past the largest finite (fp16) round as to nearest. */
static inline uint32_t ref_sr_fmt(uint32_t u, uint32_t r, const fmt* f) {
  int nan;
  if (f == &BF16) return ref_sr(u, r & 0xFFFFu, &nan);
  float x = f32_of(u);
  if (isnan(x) || fabs((double)x) >= f->max) return ref_rne(u, f, &nan);
  double ax = fabs((double)x);
  cands c = candidates(ax, f);
  double d32 = floor((ax - c.lo) / c.q * 4294967296.0);
  return encode(d32 + (double)r >= 4294967296.0 ? c.hi : c.lo, (u >> 31) != 0, f);
}

#endif
