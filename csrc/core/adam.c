/* The fused Adam/AdamW step (mpext/adam.h) over one range of one param. Compiled once per ISA
 * path (see isa.h). The element update is mpext/adam_rule.h's, the one the CUDA kernels run; this
 * file only loads and stores. One loop body, specialised by inlining for each (param dtype, grad
 * dtype, flags) combination so that every variant is a straight, vectorizable loop: the loads
 * and stores of bf16/fp16 are the branch-free bit conversions of numerics.h, NaN/Inf follow IEEE
 * arithmetic (no branches), and sqrtf vectorizes because the core is built with
 * -fno-math-errno. */
#include <string.h>

#include "isa.h"
#include "mpext/adam_rule.h"
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

/* The loop, always inlined into a caller with constant dtypes and flags (the flags are written
 * into a local copy of the scalars, so that after inlining the rule's branches are constant). */
static inline __attribute__((always_inline)) void adam_loop(
    void* restrict param, const mp_dtype pt, void* restrict grad, const mp_dtype gt,
    float* restrict master, float* restrict m, float* restrict v, int64_t n,
    const mp_adam_scalars* restrict hp, const int has_master, const int decoupled,
    const int maximize, const int write_grad) {
  mp_adam_scalars s = *hp;
  s.decoupled = decoupled;
  s.maximize = maximize;
  for (int64_t i = 0; i < n; ++i) {
    const float g = mp_adam_unscaled(load_as_f32(grad, i, gt), &s);
    if (write_grad) store_from_f32(grad, i, gt, g);
    const float p0 = has_master ? master[i] : load_as_f32(param, i, MP_F32);
    float mi = m[i], vi = v[i];
    const float p = mp_adam_element(g, p0, &mi, &vi, &s);
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

/* One (decoupled, maximize, write_grad) combination of a dtype pair's loop. */
#define MP_ADAM_FLAGS(PT, GT, HM, D, M, W) \
  adam_loop(param, PT, grad, GT, master, m, v, n, hp, HM, D, M, W)

/* Instantiates the loop for one (param, grad) dtype pair and every flag combination. */
#define MP_ADAM_VARIANT(name, PT, GT, HAS_MASTER)                                              \
  static void name(void* param, void* grad, float* master, float* m, float* v, int64_t n,      \
                   const mp_adam_scalars* hp) {                                               \
    const int d = hp->decoupled != 0, x = hp->maximize != 0, w = hp->write_grad != 0;         \
    switch (d << 2 | x << 1 | w) {                                                            \
      case 0: MP_ADAM_FLAGS(PT, GT, HAS_MASTER, 0, 0, 0); break;                                                  \
      case 1: MP_ADAM_FLAGS(PT, GT, HAS_MASTER, 0, 0, 1); break;                                                  \
      case 2: MP_ADAM_FLAGS(PT, GT, HAS_MASTER, 0, 1, 0); break;                                                  \
      case 3: MP_ADAM_FLAGS(PT, GT, HAS_MASTER, 0, 1, 1); break;                                                  \
      case 4: MP_ADAM_FLAGS(PT, GT, HAS_MASTER, 1, 0, 0); break;                                                  \
      case 5: MP_ADAM_FLAGS(PT, GT, HAS_MASTER, 1, 0, 1); break;                                                  \
      case 6: MP_ADAM_FLAGS(PT, GT, HAS_MASTER, 1, 1, 0); break;                                                  \
      default: MP_ADAM_FLAGS(PT, GT, HAS_MASTER, 1, 1, 1); break;                                                 \
    }                                                                                         \
  }

MP_ADAM_VARIANT(adam_f32_f32, MP_F32, MP_F32, 0)
MP_ADAM_VARIANT(adam_bf16_bf16, MP_BF16, MP_BF16, 1)
MP_ADAM_VARIANT(adam_bf16_f32, MP_BF16, MP_F32, 1)
MP_ADAM_VARIANT(adam_f16_f16, MP_F16, MP_F16, 1)
MP_ADAM_VARIANT(adam_f16_f32, MP_F16, MP_F32, 1)

void MP_ISA_FN(mp_k_adam_step)(const mp_adam_tensor* t, int64_t start, int64_t n,
                               const mp_adam_scalars* s) {
  const int pb = MP_DTYPE_BYTES(t->param_dtype), gb = MP_DTYPE_BYTES(t->grad_dtype);
  void* param = (char*)t->param + start * pb;
  void* grad = (char*)t->grad + start * gb;
  float* master = t->master != NULL ? t->master + start : NULL;
  float* m = t->exp_avg + start;
  float* v = t->exp_avg_sq + start;
  if (t->param_dtype == MP_F32) {
    adam_f32_f32(param, grad, NULL, m, v, n, s);
  } else if (t->param_dtype == MP_BF16) {
    if (t->grad_dtype == MP_BF16) adam_bf16_bf16(param, grad, master, m, v, n, s);
    else adam_bf16_f32(param, grad, master, m, v, n, s);
  } else {
    if (t->grad_dtype == MP_F16) adam_f16_f16(param, grad, master, m, v, n, s);
    else adam_f16_f32(param, grad, master, m, v, n, s);
  }
}
