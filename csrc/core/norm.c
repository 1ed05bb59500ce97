/* Sums of squares for the multi-tensor L2 norm (mpext/norm.h). Compiled once per ISA path (see
 * isa.h). Each loop keeps 16 independent double accumulators, element i of a group of 16 going
 * into accumulator i: the additions of one accumulator happen in element order and no two
 * accumulators are ever combined before the end, so the compiler vectorizes the loop without
 * reassociating anything (SSE2: 8 registers of 2, AVX2: 4 of 4, AVX-512: 2 of 8) and every ISA
 * path computes the same bits. No fused multiply-add: the core is compiled as ISO C11, where GCC
 * and Clang do not contract, and the square of an fp32 value is exact in double anyway. */
#include <string.h>

#include "half.h"
#include "isa.h"
#include "mpext/numerics.h"

#ifndef MP_ISA_SUFFIX
#error "norm.c must be compiled with -DMP_ISA_SUFFIX=scalar|avx2|avx512"
#endif

#define LANES 16

/* The accumulators combined as a fixed balanced tree. */
static inline double combine(const double acc[LANES]) {
  double a[LANES / 2];
  for (int j = 0; j < LANES / 2; ++j) a[j] = acc[2 * j] + acc[2 * j + 1];
  double b[LANES / 4];
  for (int j = 0; j < LANES / 4; ++j) b[j] = a[2 * j] + a[2 * j + 1];
  return ((b[0] + b[1]) + (b[2] + b[3]));
}

static inline double square(float y) { return (double)y * (double)y; }

static inline float f32_of_bits(uint32_t u) {
  float x;
  memcpy(&x, &u, sizeof x);
  return x;
}

double MP_ISA_FN(mp_k_grad_norm_sumsq_f32)(const float* restrict x, int64_t n, float inv) {
  double acc[LANES] = {0};
  int64_t i = 0;
  for (; n - i >= LANES; i += LANES) {
    for (int j = 0; j < LANES; ++j) acc[j] += square(x[i + j] * inv);
  }
  for (int j = 0; i < n; ++i, ++j) acc[j] += square(x[i] * inv);
  return combine(acc);
}

double MP_ISA_FN(mp_k_grad_norm_sumsq_bf16)(const uint16_t* restrict x, int64_t n, float inv) {
  double acc[LANES] = {0};
  int64_t i = 0;
  for (; n - i >= LANES; i += LANES) {
    for (int j = 0; j < LANES; ++j) {
      acc[j] += square(f32_of_bits(mp_bf16_to_f32_bits(x[i + j])) * inv);
    }
  }
  for (int j = 0; i < n; ++i, ++j) acc[j] += square(f32_of_bits(mp_bf16_to_f32_bits(x[i])) * inv);
  return combine(acc);
}

double MP_ISA_FN(mp_k_grad_norm_sumsq_fp16)(const uint16_t* restrict x, int64_t n, float inv) {
  double acc[LANES] = {0};
  int64_t i = 0;
  for (; n - i >= LANES; i += LANES) {
    float v[LANES];
#if defined(MP_HAVE_F16C)
    mp_f16_to_f32_x8(x + i, v);
    mp_f16_to_f32_x8(x + i + 8, v + 8);
#else
    for (int j = 0; j < LANES; ++j) v[j] = f32_of_bits(mp_fp16_to_f32_bits(x[i + j]));
#endif
    for (int j = 0; j < LANES; ++j) acc[j] += square(v[j] * inv);
  }
  for (int j = 0; i < n; ++i, ++j) acc[j] += square(f32_of_bits(mp_fp16_to_f32_bits(x[i])) * inv);
  return combine(acc);
}
