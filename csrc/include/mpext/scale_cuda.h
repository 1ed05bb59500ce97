/* mpext C API: loss scaling on CUDA devices — the fused unscale-and-check-non-finite kernel and
 * the dynamic loss-scale update, implemented in cuda/scale.cu.
 *
 * The CUDA counterparts of mpext/scale.h, with one difference: every scalar that changes from
 * step to step (inv_scale, found_inf, scale, growth_tracker, ...) is a pointer to device memory
 * that the kernels read and write themselves, so a training step needs no host synchronisation
 * and can be captured in a CUDA graph. found_inf is a device float here (as in torch), where the
 * CPU API takes a host int32_t.
 *
 * bf16 and fp16 values are raw uint16_t bit patterns. Counts may exceed 2^31, any pointer aligned
 * to its element size is accepted (the kernels peel to 16-byte alignment and use 16-byte loads
 * and stores). The
 * launchers enqueue kernels on `stream` and return without waiting; they allocate nothing. Each
 * returns MP_OK; MP_ERR_INVALID_ARGUMENT (and launches nothing) for a bad argument as described
 * per function; or MP_ERR_CUDA when a launch failed, in which case the error is left in place
 * for the caller: cudaGetLastError() returns (and clears) it.
 *
 * Results are those of torch._amp_foreach_non_finite_check_and_unscale_ on CUDA: each value is
 * widened to fp32 (exact), multiplied by *inv_scale in fp32 and rounded back to nearest even
 * (__float2bfloat16_rn / __float2half_rn), bit-identical to the CPU functions of mpext/scale.h
 * for every non-NaN input; a NaN stays NaN, though its payload bits may differ from the CPU's. */
#ifndef MPEXT_SCALE_CUDA_H
#define MPEXT_SCALE_CUDA_H

#include <stdint.h>

#include <cuda_runtime.h>

#include "mpext/mpext.h"
#include "mpext/scale.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Reads the nsegs segments at segs (mpext/scale.h's struct, in host memory, read during the call
 * only; their data in device memory) and, for every
 * element of every one of them, in as few launches as the 4 KB kernel-argument limit allows:
 * reads *inv_scale (device) in the kernel; sets *found_inf (device float) to 1.0f if any element
 * was NaN or +-Inf before the multiply (only 1.0f is ever written; it is never cleared); and,
 * unless *inv_scale == 1.0f, writes g[i] = round(g[i] * *inv_scale) (when it is 1.0f the values
 * are only read, never written). Segments may mix dtypes and must not overlap each other,
 * found_inf or inv_scale. Checks every segment before launching anything: returns
 * MP_ERR_INVALID_ARGUMENT for nsegs < 0, segs null with nsegs > 0, an unknown dtype, n < 0, g
 * null with n > 0, g not aligned to its element size with n > 0, or found_inf / inv_scale null.
 * Segments with n == 0 are skipped; if none is left nothing is launched. */
mp_status mp_unscale_multi_cuda(const mp_unscale_segment* segs, int64_t nsegs, float* found_inf,
                                const float* inv_scale, cudaStream_t stream);

/* One step of the dynamic loss-scale rule (mp_update_scale_rule in scale_rule.h, the same code as
 * the CPU's mp_update_scale) in a one-thread kernel, on u's pointers (device memory; *u itself is
 * host memory, read during the call only). Returns MP_ERR_INVALID_ARGUMENT (launching nothing)
 * where mp_update_scale does. */
mp_status mp_update_scale_cuda(const mp_scale_update* u, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif /* MPEXT_SCALE_CUDA_H */
