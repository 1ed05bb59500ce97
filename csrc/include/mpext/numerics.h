/* mpext: bit-level conversions and the counter-based random generator, shared by the C core and
 * the CUDA kernels so that both produce the same bits. Header-only, branch-free (so loops over
 * these vectorize), no floating-point environment dependence (no FTZ/DAZ, rounding mode, errno).
 *
 * Everything here is static inline; under nvcc the functions are __host__ __device__. */
#ifndef MPEXT_NUMERICS_H
#define MPEXT_NUMERICS_H

#include <stdint.h>

#if defined(__CUDACC__)
#define MP_HD static inline __host__ __device__
#else
#define MP_HD static inline
#endif

/* fp32 bits -> bf16 bits, round to nearest even; NaN -> quiet NaN with the same sign. */
MP_HD uint16_t mp_bf16_rne_bits(uint32_t u) {
  uint32_t rounded = (u + 0x7FFFu + ((u >> 16) & 1u)) >> 16;
  uint32_t is_nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  return (uint16_t)(is_nan ? ((u >> 16) | 0x0040u) : rounded);
}

/* fp32 bits -> bf16 bits, stochastic rounding with 16 random bits r (only r's low 16 bits are
 * used): rounds the magnitude up with probability (discarded low 16 bits) / 2^16. Inf and NaN
 * are handled as in mp_bf16_rne_bits (Inf has no discarded bits, so adding r cannot change it). */
MP_HD uint16_t mp_bf16_sr_bits(uint32_t u, uint32_t r) {
  uint32_t is_nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  uint32_t is_inf = (u & 0x7FFFFFFFu) == 0x7F800000u;
  uint32_t up = (u + (is_inf ? 0u : (r & 0xFFFFu))) >> 16;
  return (uint16_t)(is_nan ? ((u >> 16) | 0x0040u) : up);
}

/* fp32 bits -> fp16 (IEEE binary16) bits, round to nearest even, subnormals exact-rounded,
 * overflow to Inf, NaN -> quiet NaN with the same sign. Pure integer arithmetic. */
MP_HD uint16_t mp_fp16_rne_bits(uint32_t u) {
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7FFFFFFFu;
  /* Normal fp16 range (|x| >= 2^-14): rebias the exponent and round the 13 dropped bits. A carry
   * out of the mantissa bumps the exponent, which is what rounding up should do; results at or
   * past 65520 carry into the Inf encoding 0x7C00. */
  uint32_t normal = (a + 0xC8000FFFu + ((a >> 13) & 1u)) >> 13; /* 0xC8000000 = (15-127) << 23 */
  /* Subnormal fp16 range (|x| < 2^-14): result = round(|x| / 2^-24) with the full significand. */
  uint32_t e = a >> 23;
  uint32_t m = (a & 0x7FFFFFu) | (e ? 0x800000u : 0u);
  uint32_t ee = e ? e : 1u;                       /* fp32 subnormals have exponent 1 - 127 */
  uint32_t shift = 126u - (ee < 113u ? ee : 112u); /* >= 14 in this range */
  shift = shift > 31u ? 31u : shift;
  uint32_t q = m >> shift;
  uint32_t rem = m & ((1u << shift) - 1u);
  uint32_t half = 1u << (shift - 1u);
  /* Written with ternaries, not (a > b) | ..., so that the comparisons stay 32-bit and vectorize. */
  uint32_t round_up = (rem > half) ? 1u : ((rem == half) ? (q & 1u) : 0u);
  uint32_t sub = q + round_up;
  uint32_t r = a < 0x38800000u ? sub : (a < 0x47800000u ? normal : 0x7C00u);
  r = a > 0x7F800000u ? (0x7E00u | ((a >> 13) & 0x3FFu)) : r;
  return (uint16_t)(r | sign);
}

/* bf16 bits -> fp32 bits (exact). */
MP_HD uint32_t mp_bf16_to_f32_bits(uint16_t h) { return (uint32_t)h << 16; }

/* fp16 bits -> fp32 bits (exact). Pure integer arithmetic: a subnormal is normalised by
 * counting how far its leading bit sits below the implicit-bit position. */
MP_HD uint32_t mp_fp16_to_f32_bits(uint16_t h) {
  uint32_t sign = ((uint32_t)h & 0x8000u) << 16;
  uint32_t e = ((uint32_t)h >> 10) & 0x1Fu;
  uint32_t m = (uint32_t)h & 0x3FFu;
  uint32_t normal = ((e + 112u) << 23) | (m << 13);
  uint32_t infnan = 0x7F800000u | (m << 13);
  /* Subnormal: value = m * 2^-24. Its leading one is bit p (0..9); fp32 exponent = p - 24.
   * p = 31 - clz(m); computed without a clz so that the loop vectorizes on any ISA. */
  uint32_t p = 0, t = m;
  p += (t >= (1u << 8)) ? 8u : 0u; t = (t >= (1u << 8)) ? (t >> 8) : t;
  p += (t >= (1u << 4)) ? 4u : 0u; t = (t >= (1u << 4)) ? (t >> 4) : t;
  p += (t >= (1u << 2)) ? 2u : 0u; t = (t >= (1u << 2)) ? (t >> 2) : t;
  p += (t >= (1u << 1)) ? 1u : 0u;
  uint32_t sub = m ? (((p + 103u) << 23) | ((m << (23u - p)) & 0x7FFFFFu)) : 0u;
  uint32_t r = e == 0u ? sub : (e == 31u ? infnan : normal);
  return r | sign;
}

/* Philox4x32-10 (Salmon et al., "Parallel random numbers: as easy as 1, 2, 3", SC'11): maps a
 * 128-bit counter and a 64-bit key to 128 random bits. */
#define MP_PHILOX_M0 0xD2511F53u
#define MP_PHILOX_M1 0xCD9E8D57u
#define MP_PHILOX_W0 0x9E3779B9u
#define MP_PHILOX_W1 0xBB67AE85u

MP_HD void mp_philox4x32_10(uint32_t c[4], uint32_t k0, uint32_t k1) {
  for (int round = 0; round < 10; ++round) {
    uint64_t p0 = (uint64_t)MP_PHILOX_M0 * c[0];
    uint64_t p1 = (uint64_t)MP_PHILOX_M1 * c[2];
    uint32_t n0 = (uint32_t)(p1 >> 32) ^ c[1] ^ k0;
    uint32_t n1 = (uint32_t)p1;
    uint32_t n2 = (uint32_t)(p0 >> 32) ^ c[3] ^ k1;
    uint32_t n3 = (uint32_t)p0;
    c[0] = n0; c[1] = n1; c[2] = n2; c[3] = n3;
    k0 += MP_PHILOX_W0;
    k1 += MP_PHILOX_W1;
  }
}

/* The 32 random bits for stochastic-rounding element index idx (= offset + position) under a
 * seed: word (idx % 4) of Philox4x32-10 with key = seed and counter = (idx / 4, 0). Four
 * consecutive indices share one Philox evaluation, see mp_sr_random_block. */
MP_HD void mp_sr_random_block(uint64_t seed, uint64_t block, uint32_t out[4]) {
  block &= 0x3FFFFFFFFFFFFFFFull; /* positions wrap modulo 2^64, so blocks wrap modulo 2^62 */
  out[0] = (uint32_t)block;
  out[1] = (uint32_t)(block >> 32);
  out[2] = 0u;
  out[3] = 0u;
  mp_philox4x32_10(out, (uint32_t)seed, (uint32_t)(seed >> 32));
}

MP_HD uint32_t mp_sr_random_bits(uint64_t seed, uint64_t idx) {
  uint32_t r[4];
  mp_sr_random_block(seed, idx >> 2, r);
  return r[idx & 3u];
}

#endif /* MPEXT_NUMERICS_H */
