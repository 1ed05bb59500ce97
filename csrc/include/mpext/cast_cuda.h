/* mpext C API: floating-point casts on CUDA devices (fp32 <-> bf16 / fp16), implemented in
 * cuda/cast.cu.
 *
 * The CUDA counterparts of mpext/cast.h, over mpext/cast.h's segments (src and dst in device
 * memory, each aligned to its element size; 16-byte aligned pairs take the vectorized path; n may
 * exceed 2^31; src and dst must not overlap). The launchers enqueue kernels on `stream` and
 * return without waiting; they allocate nothing. They return MP_OK; MP_ERR_INVALID_ARGUMENT (and
 * launch nothing) for a bad segment: a dtype pair mp_cast_supported rejects, n < 0, or a null or
 * misaligned pointer with n > 0 (segments with n == 0 touch nothing); or MP_ERR_CUDA when a
 * launch failed, in which case the error is left in place for the caller: cudaGetLastError()
 * returns (and clears) it.
 *
 * Results are bit-identical to mp_cast on the CPU for every non-NaN input (round to nearest even
 * is bit-equal to torch's Tensor.to on CUDA; subnormals are rounded, not flushed); NaN stays NaN,
 * though its payload bits may differ from the CPU's on the round-to-nearest paths. Stochastic
 * rounding gives exactly the CPU's bits, NaN included: element i of a segment uses the random
 * bits of stream position sr_position + i under seed (mp_sr_random_bits in numerics.h). */
#ifndef MPEXT_CAST_CUDA_H
#define MPEXT_CAST_CUDA_H

#include <stdint.h>

#include <cuda_runtime.h>

#include "mpext/cast.h"
#include "mpext/mpext.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One segment, as a grid-stride launch over the whole device (the unary ops to_bf16, to_fp16,
 * to_fp32 of one large tensor). */
mp_status mp_cast_cuda(const mp_cast_segment* seg, int stochastic, uint64_t seed,
                       cudaStream_t stream);

/* Every one of the nsegs segments at segs (host memory; read during the call only), packing many
 * segments into each launch and launching again only when a launch is full. With stochastic != 0
 * the fp32 -> bf16 segments round stochastically under seed and the others are unaffected.
 * Checks every segment before launching anything; also MP_ERR_INVALID_ARGUMENT for nsegs < 0 or
 * segs null with nsegs > 0. */
mp_status mp_cast_multi_cuda(const mp_cast_segment* segs, int64_t nsegs, int stochastic,
                             uint64_t seed, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif /* MPEXT_CAST_CUDA_H */
