/* Fused unscale + non-finite check. Compiled once per ISA path (see isa.h). Each loop reads a
 * value, tests its exponent bits for all-ones (NaN or Inf: integer test, no isfinite, so it
 * vectorizes and ignores the floating-point environment), multiplies in fp32 and writes back;
 * the finding is an OR-reduction the compiler vectorizes too. */
#include <string.h>

#include "half.h"
#include "isa.h"
#include "mpext/numerics.h"

#ifndef MP_ISA_SUFFIX
#error "scale.c must be compiled with -DMP_ISA_SUFFIX=scalar|avx2|avx512"
#endif

static inline uint32_t nonfinite_bits(uint32_t u) {
  return ((u & 0x7F800000u) == 0x7F800000u) ? 1u : 0u;
}

int MP_ISA_FN(mp_k_unscale_f32)(float* restrict g, int64_t n, float inv_scale) {
  uint32_t bad = 0;
  if (inv_scale == 1.0f) {
    for (int64_t i = 0; i < n; ++i) {
      uint32_t u;
      memcpy(&u, g + i, sizeof u);
      bad |= nonfinite_bits(u);
    }
  } else {
    for (int64_t i = 0; i < n; ++i) {
      uint32_t u;
      memcpy(&u, g + i, sizeof u);
      bad |= nonfinite_bits(u);
      g[i] = g[i] * inv_scale;
    }
  }
  return bad != 0;
}

int MP_ISA_FN(mp_k_unscale_bf16)(uint16_t* restrict g, int64_t n, float inv_scale) {
  uint32_t bad = 0;
  if (inv_scale == 1.0f) {
    for (int64_t i = 0; i < n; ++i) bad |= nonfinite_bits(mp_bf16_to_f32_bits(g[i]));
  } else {
    for (int64_t i = 0; i < n; ++i) {
      uint32_t u = mp_bf16_to_f32_bits(g[i]);
      bad |= nonfinite_bits(u);
      float x;
      memcpy(&x, &u, sizeof x);
      x *= inv_scale;
      memcpy(&u, &x, sizeof u);
      g[i] = mp_bf16_rne_bits(u);
    }
  }
  return bad != 0;
}

int MP_ISA_FN(mp_k_unscale_fp16)(uint16_t* restrict g, int64_t n, float inv_scale) {
  uint32_t bad = 0;
  int64_t i = 0;
  if (inv_scale == 1.0f) {
    for (; i < n; ++i) bad |= ((g[i] & 0x7C00u) == 0x7C00u) ? 1u : 0u;
    return bad != 0;
  }
#if defined(MP_HAVE_F16C)
  for (; n - i >= 8; i += 8) {
    float x[8];
    for (int j = 0; j < 8; ++j) bad |= ((g[i + j] & 0x7C00u) == 0x7C00u) ? 1u : 0u;
    mp_f16_to_f32_x8(g + i, x);
    for (int j = 0; j < 8; ++j) x[j] *= inv_scale;
    mp_f32_to_f16_x8(x, g + i);
  }
#endif
  for (; i < n; ++i) {
    uint32_t u = mp_fp16_to_f32_bits(g[i]);
    bad |= nonfinite_bits(u);
    float x;
    memcpy(&x, &u, sizeof x);
    x *= inv_scale;
    memcpy(&u, &x, sizeof u);
    g[i] = mp_fp16_rne_bits(u);
  }
  return bad != 0;
}
