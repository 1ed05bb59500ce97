/* The fused Adam/AdamW step (mpext/adam.h). Compiled once per ISA path (see isa.h). One loop
 * body, specialised by inlining for each (param dtype, grad dtype, master or not) combination so
 * that every variant is a straight, vectorizable loop: the loads and stores of bf16/fp16 are the
 * branch-free bit conversions of numerics.h, the NaN/Inf handling is IEEE arithmetic (no
 * branches), and sqrtf vectorizes because the core is built with -fno-math-errno. */
#include <math.h>
#include <string.h>

#include "isa.h"
#include "mpext/adam.h"
#include "mpext/numerics.h"

#ifndef MP_ISA_SUFFIX
#error "adam.c must be compiled with -DMP_ISA_SUFFIX=scalar|avx2|avx512"
#endif

static inline float load_as_f32(const void* p, int64_t i, mp_dtype t) {
  uint32_t u;
  if (t == MP_F32) {
    memcpy(&u, (const float*)p + i, sizeof u);
  } else if (t == MP_BF16) {
    u = mp_bf16_to_f32_bits(((const uint16_t*)p)[i]);
  } else {
    u = mp_fp16_to_f32_bits(((const uint16_t*)p)[i]);
  }
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static inline void store_from_f32(void* p, int64_t i, mp_dtype t, float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  if (t == MP_F32) {
    memcpy((float*)p + i, &u, sizeof u);
  } else if (t == MP_BF16) {
    ((uint16_t*)p)[i] = mp_bf16_rne_bits(u);
  } else {
    ((uint16_t*)p)[i] = mp_fp16_rne_bits(u);
  }
}

/* The loop, always inlined into a caller with constant dtypes and flags. */
static inline __attribute__((always_inline)) void adam_loop(
    void* restrict param, const mp_dtype pt, const void* restrict grad, const mp_dtype gt,
    float* restrict master, float* restrict m, float* restrict v, int64_t n,
    const mp_adam_params* restrict hp, const int has_master, const int decoupled,
    const int maximize) {
  const float beta2 = hp->beta2, eps = hp->eps;
  const float w = hp->lerp_weight, one_minus_w = 1.0f - hp->lerp_weight;
  const int lerp_from_start = w < 0.5f;
  const float one_minus_beta2 = hp->one_minus_beta2;
  const float wd = hp->weight_decay, decay = hp->decay, inv_scale = hp->inv_scale;
  const float neg_step_size = -hp->step_size, bc2_sqrt = hp->bias_correction2_sqrt;
  for (int64_t i = 0; i < n; ++i) {
    float g = load_as_f32(grad, i, gt) * inv_scale;
    if (maximize) g = -g;
    float p = has_master ? master[i] : load_as_f32(param, i, MP_F32);
    if (decoupled) {
      p = p * decay;
    } else {
      g = g + wd * p;
    }
    float diff = g - m[i];
    float mi = lerp_from_start ? m[i] + w * diff : g - diff * one_minus_w;
    float vi = v[i] * beta2 + (one_minus_beta2 * g) * g;
    float denom = sqrtf(vi) / bc2_sqrt + eps;
    p = p + (neg_step_size * mi) / denom;
    m[i] = mi;
    v[i] = vi;
    if (has_master) {
      master[i] = p;
      store_from_f32(param, i, pt, p);
    } else {
      store_from_f32(param, i, MP_F32, p);
    }
  }
}

/* Instantiates the loop for one (param, grad) dtype pair and both flags. */
#define MP_ADAM_VARIANT(name, PT, GT, HAS_MASTER)                                              \
  static void name(void* param, const void* grad, float* master, float* m, float* v,          \
                   int64_t n, const mp_adam_params* hp) {                                     \
    const int hm = HAS_MASTER;                                                                \
    if (hp->decoupled) {                                                                      \
      if (hp->maximize) adam_loop(param, PT, grad, GT, master, m, v, n, hp, hm, 1, 1);        \
      else adam_loop(param, PT, grad, GT, master, m, v, n, hp, hm, 1, 0);                     \
    } else {                                                                                  \
      if (hp->maximize) adam_loop(param, PT, grad, GT, master, m, v, n, hp, hm, 0, 1);        \
      else adam_loop(param, PT, grad, GT, master, m, v, n, hp, hm, 0, 0);                     \
    }                                                                                         \
  }

MP_ADAM_VARIANT(adam_f32_f32, MP_F32, MP_F32, 0)
MP_ADAM_VARIANT(adam_bf16_bf16, MP_BF16, MP_BF16, 1)
MP_ADAM_VARIANT(adam_bf16_f32, MP_BF16, MP_F32, 1)
MP_ADAM_VARIANT(adam_f16_f16, MP_F16, MP_F16, 1)
MP_ADAM_VARIANT(adam_f16_f32, MP_F16, MP_F32, 1)

void MP_ISA_FN(mp_k_adam_step)(void* param, mp_dtype param_dtype, const void* grad,
                               mp_dtype grad_dtype, float* master, float* exp_avg,
                               float* exp_avg_sq, int64_t n, const mp_adam_params* p) {
  if (param_dtype == MP_F32) {
    adam_f32_f32(param, grad, NULL, exp_avg, exp_avg_sq, n, p);
  } else if (param_dtype == MP_BF16) {
    if (grad_dtype == MP_BF16) adam_bf16_bf16(param, grad, master, exp_avg, exp_avg_sq, n, p);
    else adam_bf16_f32(param, grad, master, exp_avg, exp_avg_sq, n, p);
  } else {
    if (grad_dtype == MP_F16) adam_f16_f16(param, grad, master, exp_avg, exp_avg_sq, n, p);
    else adam_f16_f32(param, grad, master, exp_avg, exp_avg_sq, n, p);
  }
}
