/* mpext: the 8-bit block codes of moments (the formats MP_FMT_Q8S and MP_FMT_Q8U of
 * mpext/formats/formats.h; mpext/step.h, "8-bit moments", has the format): the codec of one
 * element and of a block's reference, shared by the C core (its tile loops:
 * csrc/core/formats/tiles.h), the CUDA kernel (cuda/step.cu) and the tests. Header-only;
 * __host__ __device__ under nvcc. */
#ifndef MPEXT_FORMATS_Q8_H
#define MPEXT_FORMATS_Q8_H

#include <stdint.h>

#include "mpext/numerics.h"    /* MP_HD */
#include "mpext/step_common.h" /* the rounding macros */

/* The codes of 8-bit moments (see mpext/step.h and the functions below). */
#define MP_Q8_M_EBITS 3u /* exp_avg: sign + E3M4 */
#define MP_Q8_M_MBITS 4u
#define MP_Q8_V_EBITS 4u /* exp_avg_sq: E4M4 */
#define MP_Q8_V_MBITS 4u
/* The stream of 8-bit moment rounding: above every 2k and 2k + 1 of the other streams. */
#define MP_Q8_STREAM (UINT64_C(1) << 33)

/* ---- 8-bit moments (see mpext/step.h) ----
 *
 * A magnitude code of EBITS exponent and MBITS mantissa bits relative to a block reference
 * R = 2^(E - 127); every function is integer arithmetic on fp32 bits and branch-free, so the
 * CPU loops over them vectorize, and the CUDA kernels compute the same bits. */

/* The reference exponent E of a block whose absmax has the fp32 bits amax (non-negative, as a
 * uint32 max over the magnitudes' bits gives it): its exponent field once rounded up to the
 * code's 1 + mbits significant bits, so that the absmax never exceeds the top code, and at
 * least 2^ebits, so that R and every code's value are exact fp32 values. >= 255: NaN or Inf. */
MP_HD uint32_t mp_q8_ref_exp(uint32_t amax, uint32_t ebits, uint32_t mbits) {
  const uint32_t e = (amax + ((1u << (23u - mbits)) - 1u)) >> 23;
  return e < (1u << ebits) ? (1u << ebits) : e;
}

/* R as an fp32 value; NaN for a block that is not finite (every element then reads as NaN). */
MP_HD float mp_q8_ref(uint32_t ea) {
  const uint32_t bits = ea >= 255u ? 0x7FC00000u : ea << 23;
  float r;
  __builtin_memcpy(&r, &bits, sizeof r);
  return r;
}

/* The value of magnitude code c relative to R (exact in fp32): 2^(e - T) (1 + f / 2^mbits), or
 * 2^(1 - T) f / 2^mbits for e = 0, T = 2^ebits - 1. */
MP_HD float mp_q8_rel(uint32_t c, uint32_t ebits, uint32_t mbits) {
  /* The code's bits shifted into an fp32 mantissa and exponent are the normal value
   * 2^(e - T) (1 + f / 2^mbits); a subnormal code (e = 0) is read as if its exponent were 1,
   * 2^(1 - T) (1 + f / 2^mbits), less the implicit 2^(1 - T): exact, and fewer operations than
   * two readings and a select. */
  const uint32_t t = (1u << ebits) - 1u;
  const uint32_t sub = c < (1u << mbits) ? 1u : 0u;
  const uint32_t bits = (c << (23u - mbits)) + ((127u - t + sub) << 23);
  const uint32_t one_bits = sub ? (128u - t) << 23 : 0u; /* 2^(1 - T), or +0 */
  float x, one;
  __builtin_memcpy(&x, &bits, sizeof x);
  __builtin_memcpy(&one, &one_bits, sizeof one);
  return MP_FSUB(x, one);
}

/* A code's value: the magnitude's relative value times R -- exact, as both are powers of two
 * times at most 1 + mbits significant bits and no product is below 2^(-125 - mbits) -- negated
 * for an int8 code with bit 7 set. */
MP_HD float mp_q8_decode_m(uint8_t c, float r) {
  const float x = MP_FMUL(mp_q8_rel(c & 0x7Fu, MP_Q8_M_EBITS, MP_Q8_M_MBITS), r);
  uint32_t u;
  __builtin_memcpy(&u, &x, sizeof u);
  u |= (uint32_t)(c & 0x80u) << 24;
  float y;
  __builtin_memcpy(&y, &u, sizeof y);
  return y;
}

MP_HD float mp_q8_decode_v(uint8_t c, float r) {
  return MP_FMUL(mp_q8_rel(c, MP_Q8_V_EBITS, MP_Q8_V_MBITS), r);
}

/* The magnitude code of fp32 magnitude bits a (sign cleared) relative to reference exponent ea
 * (mp_q8_ref_exp, up to 256 for a block that is not finite): to nearest even, or stochastically
 * with 16 random bits r16 (rounds up with probability floor(dropped fraction * 2^16) / 2^16:
 * unbiased to 2^-16 of a code step). Values above the top code (none, for a block's own values)
 * give the top code. Valid for the two formats above (ebits 3 or 4, mbits 4).
 *
 * To nearest: with ce = max(e, 1) - ea + T the value's code exponent and m24 its significand
 * (implicit bit included when e >= 1), the code is (max(ce - 1, 0) << mbits) + m24 / 2^sh,
 * sh = 23 - mbits + max(1 - ce, 0), rounded: for a normal code (ce >= 1) m24 / 2^sh lies in
 * [2^mbits, 2^(mbits+1)) and adds the implicit one to the exponent, so a carry out of the
 * mantissa moves to the next binade, as it should.
 *
 * Stochastic, the same codes in fewer operations (the 8-bit step is bound by its instruction
 * count on a CPU): a normal code is the fp32 bits rebiased by (ea - T) << 23 with r16 added
 * below the kept mantissa bits, as bf16 stochastic rounding is; a subnormal code (a below
 * 2^(1 - T) R) is the value in units of 2^-16 code steps, x 2^k, truncated by the float-to-int
 * conversion. The power 2^k is two fp32 factors, as no one fp32 holds it for every ea, and the
 * products are exact wherever the result is at least 1 (below, both give 0). */
MP_HD uint32_t mp_q8_encode(uint32_t a, uint32_t ea, uint32_t ebits, uint32_t mbits, uint32_t r16,
                            int nearest) {
  const int32_t t = (int32_t)(1u << ebits) - 1;
  const uint32_t top = (1u << (ebits + mbits)) - 1u;
  uint32_t code;
  if (nearest) {
    const uint32_t e = a >> 23;
    const int32_t ce = (int32_t)(e != 0u ? e : 1u) - (int32_t)ea + t;
    const uint32_t m24 = (a & 0x7FFFFFu) | (e != 0u ? 0x800000u : 0u);
    const uint32_t base = ce > 1 ? (uint32_t)(ce - 1) << mbits : 0u;
    const int32_t sh = (int32_t)(23u - mbits) + (ce < 1 ? 1 - ce : 0);
    const uint32_t s = sh > 25 ? 25u : (uint32_t)sh; /* m24 < 2^24: 25 gives 0, as any more */
    const uint32_t q = m24 >> s, rem = m24 & ((1u << s) - 1u), half = 1u << (s - 1u);
    code = base + q + ((rem > half) ? 1u : ((rem == half) ? (q & 1u) : 0u));
  } else {
    const uint32_t rebias = (ea - (uint32_t)t) << 23;
    const uint32_t normal = (a - rebias + (r16 << (7u - mbits))) >> (23u - mbits);
    /* 2^k = 2^16 / (the subnormal code step 2^(1 - T - mbits) R), k in [-103, 145] */
    const int32_t k = 142 + t + (int32_t)mbits - (int32_t)ea;
    const int32_t k1 = ((k + 256) >> 1) - 128;
    const uint32_t s1_bits = (uint32_t)(k1 + 127) << 23, s2_bits = (uint32_t)(k - k1 + 127) << 23;
    float x, s1, s2;
    __builtin_memcpy(&x, &a, sizeof x);
    __builtin_memcpy(&s1, &s1_bits, sizeof s1);
    __builtin_memcpy(&s2, &s2_bits, sizeof s2);
    const float y = MP_FMUL(MP_FMUL(x, s1), s2);
    /* below 2^(16 + mbits) for a subnormal code; the bound keeps the conversion defined for
     * the lanes that take the normal code (and for NaN) */
    const uint32_t fixed = (uint32_t)(int32_t)(y < 16777216.0f ? y : 16777216.0f);
    code = a < rebias + (1u << 23) ? (fixed + r16) >> 16 : normal;
  }
  return code > top ? top : code;
}

/* The codes of a block: exp_avg's (int8) and exp_avg_sq's (uint8), from the new fp32 values
 * and the references of the block's new absmax. */
MP_HD uint8_t mp_q8_encode_m(float x, uint32_t ea, uint32_t r16, int nearest) {
  uint32_t u;
  __builtin_memcpy(&u, &x, sizeof u);
  const uint32_t c = mp_q8_encode(u & 0x7FFFFFFFu, ea, MP_Q8_M_EBITS, MP_Q8_M_MBITS, r16, nearest);
  return (uint8_t)(c | ((u >> 24) & 0x80u));
}

MP_HD uint8_t mp_q8_encode_v(float x, uint32_t ea, uint32_t r16, int nearest) {
  uint32_t u;
  __builtin_memcpy(&u, &x, sizeof u);
  return (uint8_t)mp_q8_encode(u & 0x7FFFFFFFu, ea, MP_Q8_V_EBITS, MP_Q8_V_MBITS, r16, nearest);
}

/* A block's reference exponents from its absmax bits (exp_avg's, exp_avg_sq's). */
MP_HD uint32_t mp_q8_ref_exp_m(uint32_t amax) {
  return mp_q8_ref_exp(amax, MP_Q8_M_EBITS, MP_Q8_M_MBITS);
}

MP_HD uint32_t mp_q8_ref_exp_v(uint32_t amax) {
  return mp_q8_ref_exp(amax, MP_Q8_V_EBITS, MP_Q8_V_MBITS);
}

#endif /* MPEXT_FORMATS_Q8_H */
