/* mpext C API: floating-point casts on CUDA devices (fp32 <-> bf16 / fp16).
 *
 * The CUDA counterparts of mpext/cast.h, implemented in cuda/cast.cu. bf16 and fp16 values are
 * raw uint16_t bit patterns. Every launcher converts n contiguous elements of device memory, src
 * and dst must not overlap, each must be aligned to its element size (16-byte aligned pointers
 * take the vectorized path), and n may exceed 2^31. The launchers enqueue kernels on `stream` and
 * return without waiting; they allocate nothing. n == 0 is a no-op that touches nothing (null
 * or misaligned pointers are then accepted). Each returns MP_OK; MP_ERR_INVALID_ARGUMENT (and
 * launches nothing) for n < 0, or a null pointer or one not aligned to its element size with
 * n > 0; or MP_ERR_CUDA when a launch failed, in which case the
 * error is left in place for the caller: cudaGetLastError() returns (and clears) it.
 *
 * Results are bit-identical to the CPU functions of mpext/cast.h for every non-NaN input (round
 * to nearest even is bit-equal to torch's Tensor.to on CUDA; subnormals are rounded, not
 * flushed); NaN stays NaN, though its payload bits may differ from the CPU's on the
 * round-to-nearest paths. Stochastic rounding gives exactly the CPU's bits, NaN included. */
#ifndef MPEXT_CAST_CUDA_H
#define MPEXT_CAST_CUDA_H

#include <stdint.h>

#include <cuda_runtime.h>

#include "mpext/mpext.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Reads n floats at src, writes their bf16 (round to nearest even) to dst. */
mp_status mp_to_bf16_f32_cuda(const float* src, uint16_t* dst, int64_t n, cudaStream_t stream);

/* Reads n floats at src, writes their bf16 with stochastic rounding to dst: element i uses the
 * random bits of stream position offset + i under seed (mp_sr_random_bits in numerics.h), the
 * same bits as mp_to_bf16_sr_f32 on the CPU. */
mp_status mp_to_bf16_sr_f32_cuda(const float* src, uint16_t* dst, int64_t n, uint64_t seed,
                                 uint64_t offset, cudaStream_t stream);

/* Reads n floats at src, writes their fp16 (round to nearest even, overflow to +-Inf) to dst. */
mp_status mp_to_fp16_f32_cuda(const float* src, uint16_t* dst, int64_t n, cudaStream_t stream);

/* Reads n bf16 values at src, writes them exactly as floats to dst. */
mp_status mp_to_fp32_bf16_cuda(const uint16_t* src, float* dst, int64_t n, cudaStream_t stream);

/* Reads n fp16 values at src, writes them exactly as floats to dst. */
mp_status mp_to_fp32_fp16_cuda(const uint16_t* src, float* dst, int64_t n, cudaStream_t stream);

/* What one segment of mp_cast_multi_cuda does. */
typedef enum mp_cast_kind {
  MP_CAST_F32_TO_BF16 = 0, /* float -> bf16, round to nearest even or stochastic */
  MP_CAST_F32_TO_F16 = 1,  /* float -> fp16, round to nearest even */
  MP_CAST_BF16_TO_F32 = 2, /* bf16 -> float, exact */
  MP_CAST_F16_TO_F32 = 3,  /* fp16 -> float, exact */
  MP_CAST_COPY32 = 4,      /* 32-bit copy */
  MP_CAST_COPY16 = 5,      /* 16-bit copy */
  MP_CAST_KIND_COUNT = 6
} mp_cast_kind;

/* One dst <- src conversion of n contiguous elements. sr_position is the random-stream position
 * of element 0 (used by MP_CAST_F32_TO_BF16 under stochastic rounding only): element i uses
 * position sr_position + i. */
typedef struct mp_cast_segment {
  int kind; /* an mp_cast_kind */
  const void* src;
  void* dst;
  int64_t n;
  uint64_t sr_position;
} mp_cast_segment;

/* Reads the nsegs segments at segs (host memory; read during the call only) and converts every
 * one of them, packing many segments into each launch and launching again only when a launch is
 * full. With stochastic != 0, MP_CAST_F32_TO_BF16 segments round stochastically under seed and
 * the other kinds are unaffected. Checks every segment before launching anything: returns
 * MP_ERR_INVALID_ARGUMENT for nsegs < 0, segs null with nsegs > 0, an unknown kind, n < 0, a null
 * or misaligned pointer with n > 0, or stochastic rounding with an MP_CAST_F32_TO_F16 segment. Segments with
 * n == 0 are skipped. */
mp_status mp_cast_multi_cuda(const mp_cast_segment* segs, int64_t nsegs, int stochastic,
                             uint64_t seed, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif /* MPEXT_CAST_CUDA_H */
