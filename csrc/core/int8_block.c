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
 * a max chain and one reduction (bf16: in 16-bit lanes), the codes rounded by the conversion to
 * int32 and packed 64 at a time. Measured in L2 (256K elements, best of 5 x 300, one thread,
 * this Xeon, process CPU time): the coding 0.42 -> 0.31 ns per element fp32, 0.53 -> 0.37
 * bf16; the restore ~0.13 fp32, ~0.18 bf16. The element rules are int8_block_rule.h's, lane for
 * lane (tests/c/test_act_codes.c compares every ISA path with a reference, byte for byte); fp16
 * and other block lengths take the generic loops. */
#if defined(__AVX512F__) && defined(__AVX512BW__)
#include <immintrin.h>
#define MP_I8B_V512 1

static inline __attribute__((always_inline)) __m512 i8b_load16(const void* x, int64_t i,
                                                               int dtype) {
  if (dtype == MP_F32) return _mm512_loadu_ps((const float*)x + i);
  const __m256i h = _mm256_loadu_si256((const __m256i*)((const uint16_t*)x + i));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)); /* bf16: exact */
}

/* The codes of one block of n (a multiple of 16) elements: y = x * f (f = 1 / s), or y = x / f
 * (f = s) where `divide`, as int8_block_rule.h's mp_i8b_code_finite (the scale is finite, so
 * |y| <= 127 * (1 + 2^-23)); returns the lanes where a product may round otherwise than the
 * quotient (mp_i8b_near; meaningless when dividing). The division is IEEE's, correctly
 * rounded in every lane as the scalar x / s is: a block coded again by division stays in the
 * vector unit (about 1 block in 60 of random data; the scalar loop it replaced cost ~10% of
 * the whole code). */
static inline __attribute__((always_inline)) __m512i i8b_code16(__m512 v, __m512 vf, int divide,
                                                                __mmask16* near) {
  const __m512 y = divide ? _mm512_div_ps(v, vf) : _mm512_mul_ps(v, vf);
  /* to nearest even (the conversion's rounding, not MXCSR's), exact back in fp32 */
  const __m512i ri = _mm512_cvt_roundps_epi32(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  const __m512 dist = _mm512_abs_ps(_mm512_sub_ps(y, _mm512_cvtepi32_ps(ri)));
  *near |= _mm512_cmp_ps_mask(dist, _mm512_set1_ps(0.49993896484375f), _CMP_GE_OQ);
  /* mp_i8b_code_finite: a code 0 where x != 0 becomes x's sign, +-1 */
  const __mmask16 z = _mm512_mask_cmpeq_epi32_mask(
      _mm512_cmp_ps_mask(v, _mm512_setzero_ps(), _CMP_NEQ_OQ), ri, _mm512_setzero_si512());
  const __m512i sgn1 = _mm512_or_si512(_mm512_srai_epi32(_mm512_castps_si512(v), 31),
                                       _mm512_set1_epi32(1));
  return _mm512_mask_mov_epi32(ri, z, sgn1);
}

static inline __attribute__((always_inline)) __mmask16 i8b_codes16(
    const void* x, int dtype, int8_t* restrict q, int64_t start, int64_t n, float f,
    int divide) {
  const __m512 vf = _mm512_set1_ps(f);
  __mmask16 near = 0;
  int64_t i = 0;
  /* 64 codes at a time: packed with saturation (|code| <= 127: exact) in three shuffles and
   * one permutation, where a narrowing move per 16 costs two */
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  for (; i + 64 <= n; i += 64) {
    const __m512i c0 = i8b_code16(i8b_load16(x, start + i, dtype), vf, divide, &near);
    const __m512i c1 = i8b_code16(i8b_load16(x, start + i + 16, dtype), vf, divide, &near);
    const __m512i c2 = i8b_code16(i8b_load16(x, start + i + 32, dtype), vf, divide, &near);
    const __m512i c3 = i8b_code16(i8b_load16(x, start + i + 48, dtype), vf, divide, &near);
    const __m512i b = _mm512_packs_epi16(_mm512_packs_epi32(c0, c1), _mm512_packs_epi32(c2, c3));
    _mm512_storeu_si512((void*)(q + start + i), _mm512_permutexvar_epi32(order, b));
  }
  for (; i < n; i += 16) {
    const __m512i c = i8b_code16(i8b_load16(x, start + i, dtype), vf, divide, &near);
    _mm_storeu_si128((__m128i*)(q + start + i), _mm512_cvtsepi32_epi8(c));
  }
  return near;
}

/* The absmax bits of one block of n (a multiple of 16) elements (mp_i8b_amax_bits over it).
 * bf16 in 16-bit lanes, 32 a vector: |x|'s bits are the high half of its fp32 bits, so the max
 * of (h & 0x7FFF) shifted up is the max of the fp32 (u & 0x7FFFFFFF), in half the vector
 * operations and no widening (this pass reads x from memory; the code pass reads it again
 * from L1). */
static inline __attribute__((always_inline)) uint32_t i8b_amax16(const void* x, int dtype,
                                                                 int64_t start, int64_t n) {
  if (dtype == MP_BF16) {
    const uint16_t* h = (const uint16_t*)x + start;
    const __m512i abs16 = _mm512_set1_epi16(0x7FFF);
    __m512i m = _mm512_setzero_si512();
    int64_t i = 0;
    for (; i + 32 <= n; i += 32) {
      m = _mm512_max_epu16(m, _mm512_and_si512(_mm512_loadu_si512((const void*)(h + i)), abs16));
    }
    __m256i m2 = _mm256_max_epu16(_mm512_castsi512_si256(m), _mm512_extracti64x4_epi64(m, 1));
    if (i < n) { /* the last 16 */
      m2 = _mm256_max_epu16(m2, _mm256_and_si256(_mm256_loadu_si256((const __m256i*)(h + i)),
                                                 _mm512_castsi512_si256(abs16)));
    }
    return _mm512_reduce_max_epu32(_mm512_cvtepu16_epi32(m2)) << 16;
  }
  const __m512i abs_mask = _mm512_set1_epi32(0x7FFFFFFF);
  __m512i amax = _mm512_setzero_si512();
  for (int64_t i = 0; i < n; i += 16) {
    const __m512i u = _mm512_castps_si512(i8b_load16(x, start + i, dtype));
    amax = _mm512_max_epu32(amax, _mm512_and_si512(u, abs_mask)); /* mp_i8b_amax_bits */
  }
  return _mm512_reduce_max_epu32(amax);
}

/* One block of n (a multiple of 16) elements: its scale, and its codes unless the scale is NaN
 * or Inf (returns 1: the caller codes it by the generic loop's division). */
static inline __attribute__((always_inline)) int i8b_quantize_block16(
    const void* x, int dtype, int8_t* restrict q, float* restrict scale, int64_t start,
    int64_t n, int pow2) {
  const float s = mp_i8b_block_scale(i8b_amax16(x, dtype, start, n), pow2);
  *scale = s;
  if (s - s != 0.0f) return 1; /* NaN or Inf scale: divide */
  if (i8b_codes16(x, dtype, q, start, n, 1.0f / s, 0)) {
    i8b_codes16(x, dtype, q, start, n, s, 1); /* the division's bits, from L1 */
  }
  return 0;
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
          for (int64_t i = 0; i < n; ++i) { /* NaN or Inf: as the generic loop's division */
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
