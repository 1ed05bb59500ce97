/* mpext: bit-level conversions (round to nearest even and stochastic) and the counter-based
 * random generator, shared by the C core and the CUDA kernels so that both produce the same bits. Header-only, branch-free (so loops over
 * these vectorize), no floating-point environment dependence (no FTZ/DAZ, rounding mode, errno).
 *
 * Everything here is static inline; under nvcc the functions are __host__ __device__. */
#ifndef MPEXT_NUMERICS_H
#define MPEXT_NUMERICS_H

#include <stdint.h>

#if defined(__CUDACC__)
#define MP_HD static inline __host__ __device__
#elif defined(__GNUC__)
/* Always inlined: a loop of the C core vectorizes only if every helper it calls is inlined into
 * it, and GCC's inlining budget otherwise leaves the larger ones (mp_sr_bits in the fused Adam
 * loop) as calls, which keeps that loop scalar. */
#define MP_HD static inline __attribute__((always_inline))
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
 * are handled as in mp_bf16_rne_bits (Inf has no discarded bits, so adding r < 2^16 cannot carry
 * into the kept ones: it needs no test of its own). */
MP_HD uint16_t mp_bf16_sr_bits(uint32_t u, uint32_t r) {
  uint32_t is_nan = (u & 0x7FFFFFFFu) > 0x7F800000u;
  uint32_t up = (u + (r & 0xFFFFu)) >> 16;
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

/* fp32 bits -> fp16 bits, stochastic rounding with 32 random bits r: the part of the magnitude
 * below fp16's last kept bit, as a 32-bit binary fraction (truncated; exact in fp16's normal
 * range), plus r carries into the kept part, so a value between two adjacent fp16 values rounds
 * to the larger magnitude with probability (its distance from the smaller) / (their distance),
 * to 32 bits: the result is unbiased. Values of magnitude >= 65504 (the largest fp16), +-Inf and
 * NaN convert as with mp_fp16_rne_bits, so a finite value never becomes Inf by chance. */
MP_HD uint16_t mp_fp16_sr_bits(uint32_t u, uint32_t r) {
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7FFFFFFFu;
  /* Normal range: 13 mantissa bits dropped, r's top 13 bits added first (a carry may also bump
   * the exponent, which is rounding up). */
  uint32_t normal = (a + 0xC8000000u + (r >> 19)) >> 13;
  /* Subnormal range: |x| / 2^-24 = m * 2^-shift as a 32.32 fixed-point number, plus r. */
  uint32_t e = a >> 23;
  uint32_t m = (a & 0x7FFFFFu) | (e ? 0x800000u : 0u);
  uint32_t shift = 126u - (e ? e : 1u); /* >= 14 in this range */
  uint64_t fixed = shift < 64u ? ((uint64_t)m << 32) >> shift : 0u;
  uint32_t sub = (uint32_t)((fixed + r) >> 32);
  uint32_t out = a < 0x38800000u ? sub : normal;
  out = a >= 0x477FE000u ? (uint32_t)(mp_fp16_rne_bits(u) & 0x7FFFu) : out;
  return (uint16_t)(out | sign);
}

/* The random bits of stochastic rounding: a counter-based generator, so a value depends only on
 * (key, position) -- never on threads, ISA path, device or order -- and any element can be drawn
 * on its own. A 64-bit key names a stream (mp_sr_key); the 32 bits at position pos are one round
 * of a 32-bit integer mixer (multiply-xorshift, constants from C. Wellons' hash prospector) over
 * the position's low half xored with a 32-bit window key, itself the key's low half xored with
 * the mixer of the key's high half and the position's high half (mp_sr_window_key: one value per
 * 2^32 positions, which a loop computes once). Two 32-bit multiplies per draw, which vectorize on
 * every ISA path, where Philox4x32-10 took 20 (and 64-bit products). Until 2026-12-05 a draw was
 * two rounds, mp_mix32(mp_mix32(lo ^ lo(key)) ^ hi ^ hi(key)): on an Intel Xeon their four
 * multiplies and shifts per draw were what the 8-bit and bf16-moment steps waited on, so every
 * stochastically rounded bit changed with this format (docs/lean_state.md, "Stochastic
 * rounding, and how it is reproducible"). */
MP_HD uint32_t mp_mix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x21F0AAADu;
  x ^= x >> 15;
  x *= 0xD35A2D97u;
  x ^= x >> 15;
  return x;
}

MP_HD uint64_t mp_mix64(uint64_t z) { /* splitmix64's finalizer */
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/* The key of the stream for (seed, step, stream): a cast uses (seed, 0, 0) and positions
 * offset + i; an optimizer step t >= 1 of its param number k uses streams 2k (moments) and
 * 2k + 1 (the param) and positions i within the param. */
MP_HD uint64_t mp_sr_key(uint64_t seed, uint64_t step, uint64_t stream) {
  return mp_mix64(mp_mix64(mp_mix64(seed + 0x9E3779B97F4A7C15ull) ^ step) ^ stream);
}

/* The 32-bit key of the positions hi * 2^32 + [0, 2^32) of a stream. */
MP_HD uint32_t mp_sr_window_key(uint64_t key, uint32_t hi) {
  return (uint32_t)key ^ mp_mix32(hi ^ (uint32_t)(key >> 32));
}

/* mp_sr_bits at the position whose halves are lo and hi (pos = hi * 2^32 + lo): the same bits.
 * A loop over positions that share one high half passes it as a loop invariant, so that its
 * position arithmetic stays 32-bit (a 64-bit position among 16-bit arrays keeps GCC from
 * vectorizing the loop at all) and the window key is computed once. */
MP_HD uint32_t mp_sr_bits_hl(uint64_t key, uint32_t lo, uint32_t hi) {
  return mp_mix32(lo ^ mp_sr_window_key(key, hi));
}

MP_HD uint32_t mp_sr_bits(uint64_t key, uint64_t pos) {
  return mp_sr_bits_hl(key, (uint32_t)pos, (uint32_t)(pos >> 32));
}

/* The length of the first piece of the positions [pos, pos + n) (n > 0) that share one high
 * half, for a loop that uses mp_sr_bits_hl with a 32-bit count: at most 2^31, so that a piece
 * starting at a multiple of 2^32 (whose window holds 2^32 positions) still fits the count. */
MP_HD int64_t mp_sr_piece(uint64_t pos, int64_t n) {
  const int64_t to_next = (int64_t)((pos | 0xFFFFFFFFu) - pos) + 1;
  const int64_t most = to_next < ((int64_t)1 << 31) ? to_next : ((int64_t)1 << 31);
  return n < most ? n : most;
}

#endif /* MPEXT_NUMERICS_H */
