/* mpext C API: FP8 quantization with one scale per block of the last dimension, on the CPU (the
 * storage of compressed saved activations, mpext.activations).
 *
 * A tensor is `rows` rows of `cols` contiguous elements; each row is cut into blocks of `block`
 * elements from its first element (the last block of a row may be shorter), so a row has
 * nblocks = ceil(cols / block) blocks and `scales` holds rows * nblocks fp32 values, row-major.
 * Block b of row r has the scale s = mp_fp8_block_scale(amax) (mpext/fp8_rule.h: amax is the
 * largest finite |x| of the block, s = amax / max(format), optionally rounded up to a power of
 * two, at least 2^-126); its elements are stored as fp8(x * (1 / s)), rounded to nearest even or
 * stochastically, and restored as fp8 * s rounded to the output dtype. NaN stays NaN; Inf stays
 * Inf in E5M2 and becomes NaN in E4M3 (which has no Inf; torch's own cast would saturate it to
 * 448): non-finite values stay non-finite.
 *
 * Values of x and out are raw bits (uint16_t for bf16 / fp16); any alignment is accepted; counts
 * may exceed 2^31. The functions run on the calling thread on the active ISA path (mpext.h) and
 * return MP_OK, or MP_ERR_INVALID_ARGUMENT (having written nothing) for negative rows or cols,
 * block < 1, an unknown dtype or format, or a null pointer with rows * cols > 0. */
#ifndef MPEXT_FP8_H
#define MPEXT_FP8_H

#include <stdint.h>

#include "mpext/fp8_rule.h"
#include "mpext/mpext.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Quantizes x (rows x cols, dtype fp32, bf16 or fp16) into q (rows x cols fp8 bits of format
 * fmt, MP_FP8_E4M3 or MP_FP8_E5M2) and scales (rows x nblocks). pow2 != 0 rounds each scale up
 * to a power of two (then x * (1 / s) is exact before the fp8 rounding). stochastic != 0 rounds
 * element (r, c) with the random bits at stream position position + r * cols + c of the stream
 * mp_sr_key(seed, 0, 0) (mpext/numerics.h), as the casts do. */
mp_status mp_fp8_quantize(const void* x, mp_dtype dtype, uint8_t* q, float* scales, int64_t rows,
                          int64_t cols, int64_t block, int fmt, int pow2, int stochastic,
                          uint64_t seed, uint64_t position);

/* Restores out (rows x cols of out_dtype: fp32, bf16 or fp16, rounded to nearest even) from q
 * and scales as mp_fp8_quantize laid them out: out = round(fp32(q) * s). */
mp_status mp_fp8_dequantize(const uint8_t* q, const float* scales, void* out, mp_dtype out_dtype,
                            int64_t rows, int64_t cols, int64_t block, int fmt);

#ifdef __cplusplus
}
#endif
#endif /* MPEXT_FP8_H */
