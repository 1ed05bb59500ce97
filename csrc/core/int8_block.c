/* The int8 block code (mpext/int8_block.h). Compiled once per ISA path (see isa.h); its table
 * and public entry points are in int8_block_cpu.c. Every loop runs over one block with the dtype
 * a constant (one instantiation per dtype), so that the selects of int8_block_rule.h vectorize.
 * A block is read twice, its absmax then its codes, the second time from L1: one pass over x in
 * memory. Codes are computed with the block's inverse scale and checked (mp_i8b_near): a block
 * where a product could round otherwise than the quotient is coded again by division. */
#include "isa.h"
#include "mpext/int8_block_rule.h"
#include "mpext/numerics.h"

#ifndef MP_ISA_SUFFIX
#error "int8_block.c must be compiled with -DMP_ISA_SUFFIX=scalar|avx2|avx512"
#endif

/* The AVX-512 build: bf16 and fp32 blocks of a multiple of 16 elements (every block of the
 * activations' 128-wide rows) through explicit 16-lane loops: the block is whole vectors (no
 * run-time trip count and epilogue per block, as GCC 12 makes of the generic loops), the absmax
 * a vpmaxud chain and one reduction. Measured in L2 (256K elements, best of 200, this Xeon):
 * the restore 0.25 -> 0.20 ns per element, the coding unchanged (~0.47 f32, ~0.77 bf16). The
 * element rules are int8_block_rule.h's, lane for lane (tests/c/test_act_codes.c compares every
 * ISA path with the scalar one, byte for byte); fp16 and other block lengths take the generic
 * loops. */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define MP_I8B_V512 1

static inline __attribute__((always_inline)) __m512 i8b_load16(const void* x, int64_t i,
                                                               int dtype) {
  if (dtype == MP_F32) return _mm512_loadu_ps((const float*)x + i);
  const __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)x + i));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); /* bf16: exact */
}

/* One block of n (a multiple of 16) elements: its scale, and its codes unless a product may
 * round otherwise than the quotient (returns 1: the caller codes it by division, as the
 * generic loop does). */
static inline __attribute__((always_inline)) int i8b_quantize_block16(
    const void* x, int dtype, int8_t* restrict q, float* restrict scale, int64_t start,
    int64_t n, int pow2) {
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
  __m512i amax = _mm512_setzero_si512();
  for (int64_t i = 0; i < n; i += 16) {
    const __m512i u = _mm512_castps_si512(i8b_load16(x, start + i, dtype));
    amax = _mm512_max_epu32(amax, _mm512_and_si512(u, abs_mask)); /* mp_i8b_amax_bits */
  }
  const float s = mp_i8b_block_scale(_mm512_reduce_max_epu32(amax), pow2);
  *scale = s;
  if (s - s != 0.0f) return 1; /* NaN or Inf scale: divide */
  const __m512 inv = _mm512_set1_ps(1.0f / s), one = _mm512_set1_ps(1.0f);
  const __m512 half = _mm512_set1_ps(0.49993896484375f); /* mp_i8b_near's bound */
  const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
  __mmask16 near = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __m512 v = i8b_load16(x, start + i, dtype); /* from L1 */
    const __m512 y = _mm512_mul_ps(v, inv);
    /* to nearest even, as (y + 1.5 * 2^23) - 1.5 * 2^23 for |y| < 2^22 */
    const __m512 r = _mm512_roundscale_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m512 dist = _mm512_castsi512_ps(_mm512_andnot_si512(
        sign, _mm512_castps_si512(_mm512_sub_ps(y, r))));
    near |= _mm512_cmp_ps_mask(dist, half, _CMP_GE_OQ);
    /* mp_i8b_code_finite: |code| = max(|r|, 1 where x != 0), with x's sign */
    const __mmask16 nz = _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_NEQ_OQ);
    __m512i a = _mm512_andnot_si512(sign, _mm512_castps_si512(r));
    a = _mm512_castps_si512(_mm512_mask_max_ps(_mm512_castsi512_ps(a), nz,
                                               _mm512_castsi512_ps(a), one));
    const __m512i c = _mm512_or_si512(a, _mm512_and_si512(sign, _mm512_castps_si512(v)));
    _mm_storeu_si128((__m128i*)(q + start + i),
                     _mm512_cvtsepi32_epi8(_mm512_cvttps_epi32(_mm512_castsi512_ps(c))));
  }
  return near != 0;
}

/* One block of n (a multiple of 16) codes restored: mp_i8b_restore_bits, then
 * mp_i8b_store_bits (bf16: round to nearest even, NaN quieted). */
static inline __attribute__((always_inline)) void i8b_dequantize_block16(
    const int8_t* restrict q, float s, void* out, int dtype, int64_t start, int64_t n) {
  union { uint32_t u; float f; } sc;
  sc.f = s;
  sc.u = dtype == MP_BF16 ? mp_bf16_to_f32_bits(mp_bf16_rne_bits(sc.u)) : sc.u;
  const __m512 vs = _mm512_set1_ps(sc.f);
  for (int64_t i = 0; i < n; i += 16) {
    const __m128i b = _mm_loadu_si128((const __m128i*)(q + start + i));
    const __m512 p = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b)), vs);
    if (dtype == MP_F32) {
      _mm512_storeu_ps((float*)out + start + i, p);
    } else {
      const __m512i u = _mm512_castps_si512(p);
      const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
      const __m512i rounded = _mm512_srli_epi32(
          _mm512_add_epi32(u, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7FFF))), 16);
      const __mmask16 nan = _mm512_cmpgt_epu32_mask(
          _mm512_and_si512(u, _mm512_set1_epi32(0x7FFFFFFF)), _mm512_set1_epi32(0x7F800000));
      const __m512i h = _mm512_mask_or_epi32(rounded, nan, _mm512_srli_epi32(u, 16),
                                             _mm512_set1_epi32(0x0040));
      _mm256_storeu_si256((__m256i*)((uint16_t*)out + start + i), _mm512_cvtepi32_epi16(h));
    }
  }
}
#endif

static inline __attribute__((always_inline)) void quantize_rows(
    const void* x, int dtype, int8_t* restrict q, float* restrict scales, int64_t rows,
    int64_t cols, int64_t block, int pow2) {
  const int64_t nblocks = (cols + block - 1) / block;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < nblocks; ++b) {
      const int64_t start = r * cols + b * block;
      const int64_t n = cols - b * block < block ? cols - b * block : block;
#ifdef MP_I8B_V512
      if (dtype != MP_F16 && n % 16 == 0) {
        if (i8b_quantize_block16(x, dtype, q, scales + r * nblocks + b, start, n, pow2)) {
          const float s = scales[r * nblocks + b];
          for (int64_t i = 0; i < n; ++i) { /* rare: as the generic loop's division */
            q[start + i] = (int8_t)mp_i8b_code(mp_i8b_load(x, start + i, dtype), s);
          }
        }
        continue;
      }
#endif
      uint32_t amax = 0;
      for (int64_t i = 0; i < n; ++i) {
        union { float f; uint32_t u; } v;
        v.f = mp_i8b_load(x, start + i, dtype);
        amax = mp_i8b_amax_bits(amax, v.u);
      }
      const float s = mp_i8b_block_scale(amax, pow2);
      scales[r * nblocks + b] = s;
      const float inv = 1.0f / s;
      uint32_t near = s - s != 0.0f; /* NaN or Inf scale: divide */
      if (!near) {
        for (int64_t i = 0; i < n; ++i) {
          const float v = mp_i8b_load(x, start + i, dtype);
          const float y = v * inv;
          near |= mp_i8b_near(y);
          q[start + i] = (int8_t)mp_i8b_code_finite(y, v);
        }
      }
      if (near) { /* rare: the division's bits where a product might round otherwise */
        for (int64_t i = 0; i < n; ++i) {
          q[start + i] = (int8_t)mp_i8b_code(mp_i8b_load(x, start + i, dtype), s);
        }
      }
    }
  }
}

static inline __attribute__((always_inline)) void dequantize_rows(
    const int8_t* restrict q, const float* restrict scales, void* out, int dtype, int64_t rows,
    int64_t cols, int64_t block) {
  const int64_t nblocks = (cols + block - 1) / block;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < nblocks; ++b) {
      const int64_t start = r * cols + b * block;
      const int64_t n = cols - b * block < block ? cols - b * block : block;
      const float s = scales[r * nblocks + b];
#ifdef MP_I8B_V512
      if (dtype != MP_F16 && n % 16 == 0) {
        i8b_dequantize_block16(q, s, out, dtype, start, n);
        continue;
      }
#endif
      for (int64_t i = 0; i < n; ++i) {
        mp_i8b_store_bits(out, start + i, mp_i8b_restore_bits(q[start + i], s, dtype), dtype);
      }
    }
  }
}

void MP_ISA_FN(mp_k_int8_block_quantize)(const void* x, int dtype, int8_t* q, float* scales,
                                         int64_t rows, int64_t cols, int64_t block, int pow2) {
  if (dtype == MP_F32) {
    quantize_rows(x, MP_F32, q, scales, rows, cols, block, pow2);
  } else if (dtype == MP_BF16) {
    quantize_rows(x, MP_BF16, q, scales, rows, cols, block, pow2);
  } else {
    quantize_rows(x, MP_F16, q, scales, rows, cols, block, pow2);
  }
}

void MP_ISA_FN(mp_k_int8_block_dequantize)(const int8_t* q, const float* scales, void* out,
                                           int dtype, int64_t rows, int64_t cols, int64_t block) {
  if (dtype == MP_F32) {
    dequantize_rows(q, scales, out, MP_F32, rows, cols, block);
  } else if (dtype == MP_BF16) {
    dequantize_rows(q, scales, out, MP_BF16, rows, cols, block);
  } else {
    dequantize_rows(q, scales, out, MP_F16, rows, cols, block);
  }
}
