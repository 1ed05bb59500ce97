/* mpext C API: the multi-tensor L2 norm behind grad_norm on CUDA devices, implemented in
 * cuda/norm.cu.
 *
 * The CUDA counterpart of mpext/norm.h. Each element x contributes y * y with
 * y = float(x) * *inv_scale rounded to fp32, squared and summed in double. One multi-tensor
 * kernel (as few launches as the 4 KB kernel-argument limit allows) gives every chunk of
 * MP_GRAD_NORM_CUDA_CHUNK elements of every tensor one block, which sums its chunk in a fixed
 * order (each thread over a fixed set of elements, then a fixed tree over the threads) and writes
 * one double to the workspace; a second, one-block kernel adds the workspace up in a fixed order
 * and writes sqrt(sum) rounded to fp32 to *out. No atomics: the result has the same bits on every
 * run of the same inputs on the same GPU model. It is not bit-identical to the CPU's (the
 * summation orders differ), only equal within rounding of the double sums.
 *
 * inv_scale and out are device pointers read and written by the kernels, so nothing waits for
 * the host or reads a device value: a call can be captured in a CUDA graph. The launchers
 * enqueue on `stream` and return without waiting; they allocate nothing. bf16 and fp16 values
 * are raw uint16_t bit patterns; counts may exceed 2^31, any element-aligned pointer is accepted.
 * Each function returns MP_OK; MP_ERR_INVALID_ARGUMENT (launching nothing) for a bad argument as
 * described; or MP_ERR_CUDA when a launch failed, the error left for cudaGetLastError(). */
#ifndef MPEXT_NORM_CUDA_H
#define MPEXT_NORM_CUDA_H

#include <stdint.h>

#include <cuda_runtime.h>

#include "mpext/mpext.h"
#include "mpext/norm.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Elements per block (and per workspace entry) of the first kernel: the chunk of the CUDA
 * multi-tensor engine. */
#define MP_GRAD_NORM_CUDA_CHUNK 65536

/* The number of doubles of workspace mp_grad_norm_multi_cuda needs for these segments
 * (mpext/norm.h's struct; their data in device memory): the sum
 * over segments of ceil(n / MP_GRAD_NORM_CUDA_CHUNK). Returns -1 for a bad argument (as
 * mp_grad_norm_multi_cuda checks them). */
int64_t mp_grad_norm_workspace_cuda(const mp_norm_segment* segs, int64_t nsegs);

/* *out (device float) = sqrt(sum over every element x of every segment of
 * (float(x) * *inv_scale)^2), or sqrt of the plain sum of squares when inv_scale is NULL; 0 when
 * there are no elements. segs (host memory) is read during the call only; workspace (device
 * memory, mp_grad_norm_workspace_cuda(segs, nsegs) doubles, may be NULL when that is 0) is
 * overwritten; it, out and inv_scale must not overlap. Returns MP_ERR_INVALID_ARGUMENT for
 * nsegs < 0, segs NULL with nsegs > 0, an unknown dtype, n < 0, x NULL with n > 0, x not aligned
 * to its element size, out NULL, or workspace_len smaller than needed. */
mp_status mp_grad_norm_multi_cuda(const mp_norm_segment* segs, int64_t nsegs,
                                  const float* inv_scale, double* workspace,
                                  int64_t workspace_len, float* out, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif /* MPEXT_NORM_CUDA_H */
