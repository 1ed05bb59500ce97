/* mpext: FP8 (E4M3 "fn" and E5M2) with one scale per block of the last dimension: the bit-level
 * conversions, the block scale and the element rules, shared by the C core (csrc/core/fp8.c) and
 * the CUDA kernels (cuda/fp8.cu) so that both give the same bits. Header-only, branch-free
 * integer code apart from the one fp32 multiply and divisions named below (correctly rounded on
 * every ISA path and on the GPU; no FTZ/DAZ dependence); __host__ __device__ under nvcc.
 *
 * The conversions are bit-equal to torch's Tensor.to(torch.float8_e4m3fn / float8_e5m2) and back
 * for every finite input: E4M3 saturates finite values beyond 448 to +-448 and E5M2 overflows to
 * Inf at |x| >= 61440, as round to nearest even puts it; subnormals are rounded, not flushed.
 * One deliberate difference: torch saturates +-Inf to +-448 in E4M3 (which has no Inf), which
 * would hide an overflow from a loss scaler; here Inf becomes NaN (0x7F with the sign), so a
 * non-finite value stays non-finite through every format. NaN stays NaN. */
#ifndef MPEXT_FP8_RULE_H
#define MPEXT_FP8_RULE_H

#include <stdint.h>
#include <string.h>

#include "mpext/mpext.h"    /* mp_dtype */
#include "mpext/numerics.h" /* MP_HD, the 16-bit conversions */

#define MP_FP8_E4M3 0 /* torch.float8_e4m3fn: 4 exponent bits, 3 mantissa bits, max 448 */
#define MP_FP8_E5M2 1 /* torch.float8_e5m2: 5 exponent bits, 2 mantissa bits, max 57344 */

#define MP_FP8_E4M3_MAX_BITS 0x43E00000u /* 448.0f */
#define MP_FP8_E5M2_MAX_BITS 0x47600000u /* 57344.0f */
#define MP_FP8_MIN_SCALE_BITS 0x00800000u /* 2^-126, the smallest normal fp32: the least scale */

/* round(|x| / 2^-k) to nearest even for |x| below the format's smallest normal, where bias_k =
 * 150 - k (141 for E4M3's units of 2^-9, 134 for E5M2's 2^-16): the subnormal code. As floats:
 * |x| 2^k is exact (a power-of-two scaling below 8, so a fused multiply-add rounds the same)
 * and adding 2^23 rounds it to the nearest even integer, the code in the sum's low bits -- the
 * integer shifts and compares this replaces gave the same code for every fp32 input below the
 * smallest normal of both formats (checked exhaustively), at a third of the instructions. Any
 * other input gives a value its caller discards. */
MP_HD uint32_t mp_fp8_sub_rne(uint32_t a, uint32_t bias_k) {
  union { uint32_t u; float f; } x, s, r;
  x.u = a;
  s.u = (277u - bias_k) << 23; /* 2^k */
  r.f = x.f * s.f + 8388608.0f;
  return r.u - 0x4B000000u; /* may be the smallest normal's code: the encodings continue */
}

/* fp32 bits -> fp8 bits of format fmt, round to nearest even. E4M3: finite overflow saturates
 * to +-448, Inf -> NaN; E5M2: overflow -> Inf. */
MP_HD uint32_t mp_fp8_rne_bits(uint32_t u, int fmt) {
  const int e5 = fmt == MP_FP8_E5M2;
  const uint32_t drop = e5 ? 21u : 20u;                    /* fp32 mantissa bits dropped */
  const uint32_t rebias = e5 ? 0xC8000000u : 0xC4000000u; /* exponent bias 127 -> 15 or 7 */
  uint32_t sign = (u >> 24) & 0x80u;
  uint32_t a = u & 0x7FFFFFFFu;
  uint32_t normal = ((a + rebias + ((1u << (drop - 1u)) - 1u) + ((a >> drop) & 1u)) >> drop) & 0xFFu;
  uint32_t sub = mp_fp8_sub_rne(a, e5 ? 134u : 141u); /* units of 2^-16 or 2^-9 */
  uint32_t r = a < (e5 ? 0x38800000u : 0x3C800000u) ? sub : normal;
  /* E5M2 from 65536 up is Inf; E4M3 past 448 by more than half its ulp saturates */
  r = a >= (e5 ? 0x47800000u : 0x43E80000u) ? (e5 ? 0x7Cu : 0x7Eu) : r;
  r = ((a > 0x7F800000u) | ((e5 == 0) & (a == 0x7F800000u))) ? 0x7Fu : r; /* NaN; E4M3's Inf */
  return r | sign;
}

/* fp32 bits -> fp8 bits, stochastic rounding with 32 random bits r: the magnitude rounds up to
 * the next fp8 value with probability (its distance from the one below) / (their distance), to
 * 20 (normal) or 32 (subnormal) bits. Magnitudes at or above the format's largest value, Inf and
 * NaN convert as with round to nearest even, so a finite value never becomes Inf by chance. */
MP_HD uint32_t mp_fp8_sr_bits(uint32_t u, uint32_t r, int fmt) {
  const int e5 = fmt == MP_FP8_E5M2;
  const uint32_t drop = e5 ? 21u : 20u;          /* fp32 mantissa bits below the kept ones */
  const uint32_t min_normal = e5 ? 0x38800000u : 0x3C800000u;
  const uint32_t max_bits = e5 ? MP_FP8_E5M2_MAX_BITS : MP_FP8_E4M3_MAX_BITS;
  uint32_t sign = (u >> 24) & 0x80u;
  uint32_t a = u & 0x7FFFFFFFu;
  /* Normal range: add random bits below the kept mantissa, truncate, convert exactly. */
  uint32_t t = (a + (r >> (32u - drop))) & ~((1u << drop) - 1u);
  uint32_t normal = mp_fp8_rne_bits(t, fmt) & 0x7Fu;
  /* Subnormal range: |x| in units of the subnormal step as 32.32 fixed point, plus r. */
  uint32_t e = a >> 23;
  uint32_t m = (a & 0x7FFFFFu) | (e ? 0x800000u : 0u);
  uint32_t shift = (e5 ? 134u : 141u) - (e ? e : 1u); /* >= 21 here */
  uint64_t fixed = shift < 64u ? ((uint64_t)m << 32) >> shift : 0u;
  uint32_t sub = (uint32_t)((fixed + r) >> 32);
  uint32_t out = a < min_normal ? sub : normal;
  out = a >= max_bits ? (mp_fp8_rne_bits(a, fmt) & 0x7Fu) : out;
  return out | sign;
}

/* E4M3 (fn) bits -> fp32 bits, exact; NaN (0x7F, 0xFF) -> quiet NaN with the sign. */
MP_HD uint32_t mp_fp8_e4m3_to_f32_bits(uint32_t h) {
  uint32_t sign = (h & 0x80u) << 24;
  uint32_t e = (h >> 3) & 0xFu;
  uint32_t m = h & 7u;
  uint32_t normal = ((e + 120u) << 23) | (m << 20);
  union { uint32_t u; float f; } sub; /* a subnormal is m * 2^-9: exact in fp32 */
  sub.f = (float)m * 0.001953125f;
  uint32_t r = e == 0u ? sub.u : normal;
  r = (h & 0x7Fu) == 0x7Fu ? 0x7FC00000u : r;
  return r | sign;
}

/* E5M2 bits -> fp32 bits, exact: E5M2 is the top byte of an fp16. */
MP_HD uint32_t mp_fp8_e5m2_to_f32_bits(uint32_t h) {
  return mp_fp16_to_f32_bits((uint16_t)((h & 0xFFu) << 8));
}

MP_HD uint32_t mp_fp8_to_f32_bits(uint32_t h, int fmt) {
  return fmt == MP_FP8_E5M2 ? mp_fp8_e5m2_to_f32_bits(h) : mp_fp8_e4m3_to_f32_bits(h);
}

/* The running block amax, on bits: the larger of acc and |x| for a finite x (NaN and Inf are
 * left out, so that one of them costs its block nothing and still comes back non-finite). The
 * bits of non-negative floats order as the floats do. */
MP_HD uint32_t mp_fp8_amax_bits(uint32_t acc, uint32_t u) {
  uint32_t a = u & 0x7FFFFFFFu;
  a &= 0u - (uint32_t)(a < 0x7F800000u); /* a mask, not a select: GCC then vectorizes the max */
  return acc > a ? acc : a;
}

/* The scale of a block whose finite amax has bits amax_bits: s = amax / max(format), with pow2
 * rounded up to a power of two, and at least 2^-126 (an all-zero or tiny block: its inverse stays
 * finite). Elements are stored as fp8(x * (1 / s)) and restored as fp8 * s. */
MP_HD float mp_fp8_block_scale(uint32_t amax_bits, int fmt, int pow2) {
  union { uint32_t u; float f; } a, m, s;
  a.u = amax_bits;
  m.u = fmt == MP_FP8_E5M2 ? MP_FP8_E5M2_MAX_BITS : MP_FP8_E4M3_MAX_BITS;
  s.f = a.f / m.f;
  if (pow2 && (s.u & 0x7FFFFFu) != 0u) s.u = (s.u & 0x7F800000u) + 0x800000u;
  if (s.u < MP_FP8_MIN_SCALE_BITS) s.u = MP_FP8_MIN_SCALE_BITS;
  return s.f;
}

/* One element: fp32 bits u times the block's inverse scale, to fp8 bits (stochastic rounding
 * with random bits r when sr). */
MP_HD uint32_t mp_fp8_quantize_bits(uint32_t u, float inv, int fmt, int sr, uint32_t r) {
  union { uint32_t u; float f; } x;
  x.u = u;
  x.f = x.f * inv;
  return sr ? mp_fp8_sr_bits(x.u, r, fmt) : mp_fp8_rne_bits(x.u, fmt);
}

/* One element restored: fp8 bits h times the block's scale, as fp32 bits. */
MP_HD uint32_t mp_fp8_dequantize_bits(uint32_t h, float scale, int fmt) {
  union { uint32_t u; float f; } x;
  x.u = mp_fp8_to_f32_bits(h, fmt);
  x.f = x.f * scale;
  return x.u;
}

/* Element i of x (an fp32, bf16 or fp16 array, dtype an mp_dtype) as fp32 bits, exact. */
MP_HD uint32_t mp_fp8_load_bits(const void* x, int64_t i, int dtype) {
  if (dtype == MP_F32) {
    uint32_t u;
    memcpy(&u, (const float*)x + i, sizeof u);
    return u;
  }
  const uint16_t h = ((const uint16_t*)x)[i];
  return dtype == MP_BF16 ? mp_bf16_to_f32_bits(h) : mp_fp16_to_f32_bits(h);
}

/* Stores fp32 bits u as element i of out (fp32, or bf16 / fp16 rounded to nearest even). */
MP_HD void mp_fp8_store_bits(void* out, int64_t i, uint32_t u, int dtype) {
  if (dtype == MP_F32) {
    memcpy((float*)out + i, &u, sizeof u);
  } else {
    ((uint16_t*)out)[i] = dtype == MP_BF16 ? mp_bf16_rne_bits(u) : mp_fp16_rne_bits(u);
  }
}

#endif /* MPEXT_FP8_RULE_H */
