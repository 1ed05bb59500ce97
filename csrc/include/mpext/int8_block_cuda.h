/* mpext C API: the int8 block code of saved activations on CUDA devices (cuda/int8_block.cu),
 * the counterpart of mpext/int8_block.h with the same layout and arguments and the same bits
 * (both use mpext/int8_block_rule.h): x, q, scales and out in device memory, each aligned to its
 * element size. The launchers enqueue on `stream`, allocate nothing and return MP_OK;
 * MP_ERR_INVALID_ARGUMENT (launching nothing) for the arguments mpext/int8_block.h rejects or a
 * misaligned pointer; or MP_ERR_CUDA when the launch failed, the error left for the caller
 * (cudaGetLastError()). One warp codes one block. */
#ifndef MPEXT_INT8_BLOCK_CUDA_H
#define MPEXT_INT8_BLOCK_CUDA_H

#include <stdint.h>

#include <cuda_runtime.h>

#include "mpext/int8_block.h"

#ifdef __cplusplus
extern "C" {
#endif

mp_status mp_int8_block_quantize_cuda(const void* x, mp_dtype dtype, int8_t* q, float* scales,
                                      int64_t rows, int64_t cols, int64_t block, int pow2,
                                      cudaStream_t stream);

mp_status mp_int8_block_dequantize_cuda(const int8_t* q, const float* scales, void* out,
                                        mp_dtype out_dtype, int64_t rows, int64_t cols,
                                        int64_t block, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif /* MPEXT_INT8_BLOCK_CUDA_H */
