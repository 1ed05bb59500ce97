/* FP8 block quantization (mpext/fp8.h). Compiled once per ISA path (see isa.h). Every loop runs
 * over one block with the dtype and the format constant (fp8_rows() is instantiated per pair), so
 * that the integer code of fp8_rule.h vectorizes: the amax is an unsigned max over bits, the
 * conversions are selects. The random bits of stochastic rounding are drawn lane by lane. */
#include "isa.h"
#include "mpext/fp8_rule.h"
#include "mpext/numerics.h"

#ifndef MP_ISA_SUFFIX
#error "fp8.c must be compiled with -DMP_ISA_SUFFIX=scalar|avx2|avx512"
#endif

static inline __attribute__((always_inline)) void quantize_rows(
    const void* x, int dtype, uint8_t* restrict q, float* restrict scales, int64_t rows,
    int64_t cols, int64_t block, int fmt, int pow2, int sr, uint64_t key, uint64_t position) {
  const int64_t nblocks = (cols + block - 1) / block;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < nblocks; ++b) {
      const int64_t start = r * cols + b * block;
      const int64_t n = cols - b * block < block ? cols - b * block : block;
      uint32_t amax = 0;
      for (int64_t i = 0; i < n; ++i) amax = mp_fp8_amax_bits(amax, mp_fp8_load_bits(x, start + i, dtype));
      const float s = mp_fp8_block_scale(amax, fmt, pow2);
      const float inv = 1.0f / s;
      scales[r * nblocks + b] = s;
      if (sr) {
        const uint64_t pos = position + (uint64_t)start;
        for (int64_t i = 0; i < n; ++i) {
          q[start + i] = (uint8_t)mp_fp8_quantize_bits(mp_fp8_load_bits(x, start + i, dtype), inv, fmt, 1,
                                                       mp_sr_bits(key, pos + (uint64_t)i));
        }
      } else {
        for (int64_t i = 0; i < n; ++i) {
          q[start + i] = (uint8_t)mp_fp8_quantize_bits(mp_fp8_load_bits(x, start + i, dtype), inv, fmt, 0,
                                                       0u);
        }
      }
    }
  }
}

static inline __attribute__((always_inline)) void dequantize_rows(
    const uint8_t* restrict q, const float* restrict scales, void* out, int dtype, int64_t rows,
    int64_t cols, int64_t block, int fmt) {
  const int64_t nblocks = (cols + block - 1) / block;
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t b = 0; b < nblocks; ++b) {
      const int64_t start = r * cols + b * block;
      const int64_t n = cols - b * block < block ? cols - b * block : block;
      const float s = scales[r * nblocks + b];
      for (int64_t i = 0; i < n; ++i) {
        mp_fp8_store_bits(out, start + i, mp_fp8_dequantize_bits(q[start + i], s, fmt), dtype);
      }
    }
  }
}

/* One instantiation per (dtype, format) pair, so the inner loops see constants. */
#define MP_FP8_PAIRS(X) \
  X(MP_F32, MP_FP8_E4M3) X(MP_F32, MP_FP8_E5M2) X(MP_BF16, MP_FP8_E4M3) \
  X(MP_BF16, MP_FP8_E5M2) X(MP_F16, MP_FP8_E4M3) X(MP_F16, MP_FP8_E5M2)

void MP_ISA_FN(mp_k_fp8_quantize)(const void* x, int dtype, uint8_t* q, float* scales,
                                  int64_t rows, int64_t cols, int64_t block, int fmt, int pow2,
                                  int sr, uint64_t key, uint64_t position) {
#define QUANTIZE_CASE(D, F)                                                              \
  if (dtype == D && fmt == F) {                                                          \
    quantize_rows(x, D, q, scales, rows, cols, block, F, pow2, sr, key, position);       \
    return;                                                                              \
  }
  MP_FP8_PAIRS(QUANTIZE_CASE)
#undef QUANTIZE_CASE
}

void MP_ISA_FN(mp_k_fp8_dequantize)(const uint8_t* q, const float* scales, void* out, int dtype,
                                    int64_t rows, int64_t cols, int64_t block, int fmt) {
#define DEQUANTIZE_CASE(D, F)                                               \
  if (dtype == D && fmt == F) {                                             \
    dequantize_rows(q, scales, out, D, rows, cols, block, F);               \
    return;                                                                 \
  }
  MP_FP8_PAIRS(DEQUANTIZE_CASE)
#undef DEQUANTIZE_CASE
}
