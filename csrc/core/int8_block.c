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

static inline __attribute__((always_inline)) void quantize_rows(
    const void* x, int dtype, int8_t* restrict q, float* restrict scales, int64_t rows,
    int64_t cols, int64_t block, int pow2) {
  const int64_t nblocks = (cols + block - 1) / block;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < nblocks; ++b) {
      const int64_t start = r * cols + b * block;
      const int64_t n = cols - b * block < block ? cols - b * block : block;
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
