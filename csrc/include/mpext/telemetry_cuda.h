/* mpext C API: the gradient telemetry on CUDA devices (cuda/telemetry.cu), the counterpart of
 * mpext/telemetry.h with scale_cuda.h's conventions: every pointer but segs is device memory,
 * read and written by the kernels (no host sync, graph-capturable); the launcher enqueues on
 * `stream`, allocates nothing and returns MP_OK, MP_ERR_INVALID_ARGUMENT (launching nothing) or
 * MP_ERR_CUDA (the error left for cudaGetLastError). */
#ifndef MPEXT_TELEMETRY_CUDA_H
#define MPEXT_TELEMETRY_CUDA_H

#include <stdint.h>

#include <cuda_runtime.h>

#include "mpext/mpext.h"
#include "mpext/telemetry.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One non-empty gradient: n elements of dtype at g, whose statistics go to row `row` of
 * counts / max_abs. */
typedef struct mp_stats_segment {
  void* g;
  int32_t dtype; /* an mp_dtype */
  int64_t n;
  int64_t row;
} mp_stats_segment;

/* mp_unscale_multi_cuda (scale_cuda.h: the same bits in the gradients and in *found_inf) that
 * also, per segment, adds the counts of mpext/telemetry.h to counts[row * MP_TEL_NCOUNTS + j]
 * (int64), merges max_abs[row] with the largest fp32(|g| * *stat_inv_scale) over finite values
 * (as mp_tel_max_bits does: an integer max of the fp32 bits), and lowers *first_nonfinite to
 * the smallest row holding a NaN/Inf. stat_inv_scale may be NULL: *inv_scale is used. The
 * totals are the C core's exactly (integers, and a max of correctly rounded products), whatever
 * the block order. Returns MP_ERR_INVALID_ARGUMENT where mp_unscale_multi_cuda does, and for
 * counts, max_abs or first_nonfinite NULL with nsegs > 0, or a row < 0. */
mp_status mp_unscale_stats_multi_cuda(const mp_stats_segment* segs, int64_t nsegs,
                                      float* found_inf, const float* inv_scale,
                                      const float* stat_inv_scale, int64_t* counts,
                                      float* max_abs, int64_t* first_nonfinite,
                                      cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif /* MPEXT_TELEMETRY_CUDA_H */
