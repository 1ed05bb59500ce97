/* mpext C API: the int8 block code of saved activations (mpext.activations_codes), on the CPU.
 *
 * A tensor is `rows` rows of `cols` contiguous elements; each row is cut into blocks of `block`
 * elements from its first element (the last block of a row may be shorter), so a row has
 * nblocks = ceil(cols / block) blocks and `scales` holds rows * nblocks fp32 values, row-major.
 * Block b of row r has the scale s = mp_i8b_block_scale(absmax) (mpext/int8_block_rule.h:
 * fp32(absmax / 127), at least 2^-126, optionally rounded up to a power of two) and its elements
 * the codes mp_i8b_code(x, s): x / s rounded half to even, clamped to +-127, a nonzero x never
 * coded 0. NaN or Inf make the block's scale non-finite.
 *
 * Values of x and out are raw bits (uint16_t for bf16 / fp16); any alignment is accepted; counts
 * may exceed 2^31. The functions run on the calling thread on the active ISA path (mpext.h),
 * read each input element once from memory, and return MP_OK, or MP_ERR_INVALID_ARGUMENT
 * (having written nothing) for negative rows or cols, block < 1, a dtype other than fp32, bf16
 * or fp16, or a null pointer with rows * cols > 0. */
#ifndef MPEXT_INT8_BLOCK_H
#define MPEXT_INT8_BLOCK_H

#include <stdint.h>

#include "mpext/int8_block_rule.h"
#include "mpext/mpext.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Codes x (rows x cols of dtype) into q (rows x cols int8) and scales (rows x nblocks fp32);
 * pow2 != 0 rounds every scale up to a power of two. */
mp_status mp_int8_block_quantize(const void* x, mp_dtype dtype, int8_t* q, float* scales,
                                 int64_t rows, int64_t cols, int64_t block, int pow2);

/* Restores out (rows x cols of out_dtype: fp32, bf16 or fp16) from q and scales as
 * mp_int8_block_quantize laid them out: q * s (q * bf16(s) for bf16), rounded once to
 * nearest even. */
mp_status mp_int8_block_dequantize(const int8_t* q, const float* scales, void* out,
                                   mp_dtype out_dtype, int64_t rows, int64_t cols, int64_t block);

#ifdef __cplusplus
}
#endif
#endif /* MPEXT_INT8_BLOCK_H */
