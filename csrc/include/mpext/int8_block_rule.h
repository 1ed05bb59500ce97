/* mpext: the int8 block code of saved activations (mpext.activations_codes): one signed byte per
 * element on a uniform grid of 255 levels under the block's absmax, and one fp32 scale per block.
 * The element rules, shared by the C core (csrc/core/int8_block.c) and the CUDA kernels
 * (cuda/int8_block.cu) so that both give the same bits; __host__ __device__ under nvcc. Written
 * as selects over floats and bits (no branch per element) so that the loops vectorize.
 *
 * The bits are those of the torch-op code this replaced (tests/test_act_codes.py keeps it as the
 * reference): scale = max(fp32(absmax / 127), 2^-126), with pow2 rounded up to a power of two;
 * q = clamp(round_half_even(fp32(x / scale)), -127, 127), and where that is 0 but x is not, the
 * sign of x (ReLU's backward reads its saved output as the mask of where it passed); restored
 * as q * scale in fp32, rounded once to the output dtype, except bf16: q * bf16(scale) (exact),
 * rounded once. A NaN or Inf in a block makes its scale NaN or Inf, so the whole block restores
 * non-finite (a loss scaler still sees it); an element whose x / scale is NaN gets code 0. */
#ifndef MPEXT_INT8_BLOCK_RULE_H
#define MPEXT_INT8_BLOCK_RULE_H

#include <math.h>
#include <stdint.h>
#include <string.h>

#include "mpext/mpext.h"    /* mp_dtype */
#include "mpext/numerics.h" /* MP_HD, the 16-bit conversions */

#define MP_I8B_QMAX 127
#define MP_I8B_MIN_SCALE_BITS 0x00800000u /* 2^-126, the smallest normal fp32: 1 / s is finite */

/* The running block absmax on bits: the larger of acc and |x|. NaN's bits are above Inf's and
 * Inf's above every finite value's, so a NaN or Inf makes the block's absmax non-finite. */
MP_HD uint32_t mp_i8b_amax_bits(uint32_t acc, uint32_t u) {
  const uint32_t a = u & 0x7FFFFFFFu;
  return acc > a ? acc : a;
}

/* The scale of a block with absmax bits amax_bits: fp32(absmax / 127), at least 2^-126; pow2
 * rounds it up to a power of two (exactly: a nonzero mantissa carries into the exponent). NaN
 * stays NaN and Inf stays Inf. */
MP_HD float mp_i8b_block_scale(uint32_t amax_bits, int pow2) {
  union { uint32_t u; float f; } a, s;
  a.u = amax_bits;
  s.f = a.f / 127.0f;
  s.u = s.u < MP_I8B_MIN_SCALE_BITS ? MP_I8B_MIN_SCALE_BITS : s.u; /* NaN's bits pass */
  const uint32_t up = (s.u + 0x7FFFFFu) & 0x7F800000u;            /* finite: 2^ceil(log2 s) */
  s.u = (pow2 && s.u < 0x7F800000u) ? up : s.u;
  return s.f;
}

/* The code of x (fp32) from y = x / s (or an approximation of it, mp_i8b_near). */
MP_HD int32_t mp_i8b_code_of(float y, float x) {
  /* round half to even for |y| < 2^22 (|y| < 128 here, or NaN): adding 1.5 * 2^23 leaves the
   * integer part in the sum's units, rounded as the hardware rounds, to nearest even */
  float r = (y + 12582912.0f) - 12582912.0f;
  r = r < -127.0f ? -127.0f : r;
  r = r > 127.0f ? 127.0f : r;
  const float sign = x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : 0.0f); /* 0 for +-0 and NaN */
  r = r == 0.0f ? sign : r;
  r = r == r ? r : 0.0f; /* NaN (an element of a NaN block, or Inf / Inf) */
  return (int32_t)r;
}

/* mp_i8b_code_of for a finite block, whose |y| <= 127 * (1 + 2^-23) (the scale is at least
 * absmax / 127 rounded to nearest) and is never NaN: no clamp or NaN select to pay for. */
MP_HD int32_t mp_i8b_code_finite(float y, float x) {
  const float r = (y + 12582912.0f) - 12582912.0f;
  /* |code| = max(|r|, 1 if x != 0), with x's sign (r has it: y = x / s): the never-to-zero
   * rule as a max and a sign copy, which vectorize without the mask juggling of selects */
  const float nz = x != 0.0f ? 1.0f : 0.0f;
  const float a = fabsf(r);
  return (int32_t)copysignf(a > nz ? a : nz, x);
}

/* One element's code: x (fp32) divided by the block's scale s. */
MP_HD int32_t mp_i8b_code(float x, float s) { return mp_i8b_code_of(x / s, x); }

/* Whether y = x * (1 / s) may round to another integer than x / s does, for a finite scale s
 * (>= 2^-126, so 1 / s is finite and |x / s| < 128): y is within 2^-16 + 2^-17 of x / s (two
 * roundings of relative error 2^-24 each, and x / s's own), so they round alike unless y lies
 * within 2^-14 of a half-integer. A block where any element is near is coded again by division
 * (about 1 block in 60 of random data): division costs the CPU's vector units several times a
 * multiply, and the bits must be the division's. */
MP_HD uint32_t mp_i8b_near(float y) {
  const float r = (y + 12582912.0f) - 12582912.0f;
  return fabsf(y - r) >= 0.49993896484375f; /* 0.5 - 2^-14; y - r is exact */
}

/* One element restored as fp32 bits (to be rounded to the output dtype by mp_i8b_store_bits):
 * q * s for fp32 and fp16, q * bf16(s) for bf16 (the torch code multiplied in bf16). */
MP_HD uint32_t mp_i8b_restore_bits(int32_t q, float s, int dtype) {
  union { uint32_t u; float f; } sc, p;
  sc.f = s;
  sc.u = dtype == MP_BF16 ? mp_bf16_to_f32_bits(mp_bf16_rne_bits(sc.u)) : sc.u;
  p.f = (float)q * sc.f;
  return p.u;
}

/* Element i of x (fp32, bf16 or fp16) as fp32, exact. */
MP_HD float mp_i8b_load(const void* x, int64_t i, int dtype) {
  union { uint32_t u; float f; } v;
  if (dtype == MP_F32) {
    memcpy(&v.u, (const float*)x + i, sizeof v.u);
  } else {
    uint16_t h; /* memcpy: any alignment (a plain load where the target allows it) */
    memcpy(&h, (const uint16_t*)x + i, sizeof h);
    v.u = dtype == MP_BF16 ? mp_bf16_to_f32_bits(h) : mp_fp16_to_f32_bits(h);
  }
  return v.f;
}

/* Stores fp32 bits u as element i of out (fp32, or bf16 / fp16 rounded to nearest even). */
MP_HD void mp_i8b_store_bits(void* out, int64_t i, uint32_t u, int dtype) {
  if (dtype == MP_F32) {
    memcpy((float*)out + i, &u, sizeof u);
  } else {
    const uint16_t h = dtype == MP_BF16 ? mp_bf16_rne_bits(u) : mp_fp16_rne_bits(u);
    memcpy((uint16_t*)out + i, &h, sizeof h);
  }
}

#endif /* MPEXT_INT8_BLOCK_RULE_H */
