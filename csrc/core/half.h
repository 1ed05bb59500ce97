/* Internal to the C core: fp16 <-> fp32 on blocks of 8, with the F16C instructions when the ISA
 * build has them (avx2, avx512) and the integer code of numerics.h otherwise. VCVTPS2PH with
 * round-to-nearest-even and VCVTPH2PS are exact IEEE conversions (subnormals included) and are
 * what torch's own vectorized CPU casts use; the exhaustive tests check every input. */
#ifndef MPEXT_CORE_HALF_H
#define MPEXT_CORE_HALF_H

#include <stdint.h>
#include <string.h>

#include "mpext/numerics.h"

#if defined(__F16C__)
#include <immintrin.h>
#define MP_HAVE_F16C 1
#endif

/* fp16 bits of fp32 bits u, round to nearest even: mp_fp16_rne_bits's result (every input,
 * tests/test_cast.py's exhaustive sweep), for the CPU loops without F16C. Its fp16-subnormal
 * range is one float addition instead of a shift by a per-value amount, which baseline x86-64
 * has no vector instruction for: 0.5 + |x| rounds |x| to a multiple of 2^-24 (0.5's ulp), to
 * nearest even in the default rounding mode, leaving round(|x| / 2^-24) in the mantissa bits
 * (at most 0x400, the smallest normal's encoding). The loop then vectorizes: ~4x faster. FTZ
 * does not apply (the sum is normal); DAZ zeroes fp32 subnormals, which round to 0 anyway. */
static inline uint16_t mp_fp16_rne_bits_cpu(uint32_t u) {
  uint32_t sign = (u >> 16) & 0x8000u;
  uint32_t a = u & 0x7FFFFFFFu;
  uint32_t normal = (a + 0xC8000FFFu + ((a >> 13) & 1u)) >> 13; /* as mp_fp16_rne_bits */
  float f;
  memcpy(&f, &a, sizeof f);
  f += 0.5f;
  uint32_t sub;
  memcpy(&sub, &f, sizeof sub);
  sub -= 0x3F000000u; /* 0.5's bits */
  uint32_t r = a < 0x38800000u ? sub : (a < 0x47800000u ? normal : 0x7C00u);
  r = a > 0x7F800000u ? (0x7E00u | ((a >> 13) & 0x3FFu)) : r;
  return (uint16_t)(r | sign);
}

/* dst[0..7] = fp16(src[0..7]), round to nearest even. */
static inline void mp_f32_to_f16_x8(const float* src, uint16_t* dst) {
#if defined(MP_HAVE_F16C)
  __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  _mm_storeu_si128((__m128i*)dst, h);
#else
  for (int j = 0; j < 8; ++j) {
    uint32_t u;
    memcpy(&u, src + j, sizeof u);
    dst[j] = mp_fp16_rne_bits_cpu(u);
  }
#endif
}

/* dst[0..7] = fp32(src[0..7]), exact. NaNs keep their payload and stay signalling if they were
 * (VCVTPH2PS sets the quiet bit, the integer code does not): NaN lanes take the integer
 * result, so every ISA path gives the same bits. */
static inline void mp_f16_to_f32_x8(const uint16_t* src, float* dst) {
#if defined(MP_HAVE_F16C)
  __m128i h = _mm_loadu_si128((const __m128i*)src);
  __m256 f = _mm256_cvtph_ps(h);
  __m256i u = _mm256_cvtepu16_epi32(h);
  __m256i mag = _mm256_and_si256(u, _mm256_set1_epi32(0x7FFF));
  __m256i is_nan = _mm256_cmpgt_epi32(mag, _mm256_set1_epi32(0x7C00));
  /* sign | exponent 0xFF | the 10 payload bits on top of the fp32 mantissa */
  __m256i nan_bits = _mm256_or_si256(
      _mm256_slli_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x8000)), 16),
      _mm256_or_si256(_mm256_set1_epi32(0x7F800000),
                      _mm256_slli_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x3FF)), 13)));
  f = _mm256_blendv_ps(f, _mm256_castsi256_ps(nan_bits), _mm256_castsi256_ps(is_nan));
  _mm256_storeu_ps(dst, f);
#else
  for (int j = 0; j < 8; ++j) {
    uint32_t u = mp_fp16_to_f32_bits(src[j]);
    memcpy(dst + j, &u, sizeof u);
  }
#endif
}

/* dst[0..n) = fp16(src[0..n)), round to nearest even: blocks of 8, then the integer code. */
static inline void mp_f32_to_f16_n(const float* restrict src, uint16_t* restrict dst, int64_t n) {
  int64_t i = 0;
#if defined(MP_HAVE_F16C)
  for (; n - i >= 8; i += 8) mp_f32_to_f16_x8(src + i, dst + i);
#endif
  for (; i < n; ++i) {
    uint32_t u;
    memcpy(&u, src + i, sizeof u);
    dst[i] = mp_fp16_rne_bits_cpu(u);
  }
}

/* dst[0..n) = fp32(src[0..n)), exact (NaN payloads kept, as mp_f16_to_f32_x8). */
static inline void mp_f16_to_f32_n(const uint16_t* restrict src, float* restrict dst, int64_t n) {
  int64_t i = 0;
#if defined(MP_HAVE_F16C)
  for (; n - i >= 8; i += 8) mp_f16_to_f32_x8(src + i, dst + i);
#endif
  for (; i < n; ++i) {
    uint32_t u = mp_fp16_to_f32_bits(src[i]);
    memcpy(dst + i, &u, sizeof u);
  }
}

#endif /* MPEXT_CORE_HALF_H */
