/* mpext C API: FP8 block quantization on CUDA devices (cuda/fp8.cu), the counterpart of
 * mpext/fp8.h with the same layout and arguments and the same bits (both use mpext/fp8_rule.h):
 * x, q, scales and out in device memory, each aligned to its element size. The launchers enqueue
 * on `stream`, allocate nothing and return MP_OK; MP_ERR_INVALID_ARGUMENT (launching nothing) for
 * the arguments mpext/fp8.h rejects or a misaligned pointer; or MP_ERR_CUDA when the launch
 * failed, the error left for the caller (cudaGetLastError()). One warp quantizes one block. */
#ifndef MPEXT_FP8_CUDA_H
#define MPEXT_FP8_CUDA_H

#include <stdint.h>

#include <cuda_runtime.h>

#include "mpext/fp8.h"

#ifdef __cplusplus
extern "C" {
#endif

mp_status mp_fp8_quantize_cuda(const void* x, mp_dtype dtype, uint8_t* q, float* scales,
                               int64_t rows, int64_t cols, int64_t block, int fmt, int pow2,
                               int stochastic, uint64_t seed, uint64_t position,
                               cudaStream_t stream);

mp_status mp_fp8_dequantize_cuda(const uint8_t* q, const float* scales, void* out,
                                 mp_dtype out_dtype, int64_t rows, int64_t cols, int64_t block,
                                 int fmt, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif /* MPEXT_FP8_CUDA_H */
