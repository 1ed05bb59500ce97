/* mpext C API: floating-point casts on the CPU (fp32 <-> bf16 / fp16).
 *
 * bf16 and fp16 values are passed as their raw uint16_t bit patterns. Every function converts n
 * contiguous elements, src and dst must not overlap, any alignment is accepted, and n may exceed
 * 2^31. They run on the calling thread only (the binding splits work across threads) on the
 * active ISA path (mpext.h). Each returns MP_OK, or MP_ERR_INVALID_ARGUMENT for n < 0 or a null
 * pointer with n > 0. */
#ifndef MPEXT_CAST_H
#define MPEXT_CAST_H

#include <stdint.h>

#include "mpext/mpext.h"

#ifdef __cplusplus
extern "C" {
#endif

/* fp32 -> bf16, round to nearest even. Subnormals are rounded, not flushed; +-Inf stay +-Inf;
 * finite values that round past the largest bf16 become +-Inf; NaN stays NaN (quiet). Bit-equal
 * to torch's Tensor.to(torch.bfloat16) for every non-NaN input. */
mp_status mp_to_bf16_f32(const float* src, uint16_t* dst, int64_t n);

/* fp32 -> bf16, stochastic rounding: element i rounds up to the next bf16 with probability equal
 * to the fraction of a bf16 ulp that truncation discards, drawing the 16-bit random value at
 * position offset + i of the stream mp_sr_key(seed, 0, 0) (mpext/numerics.h, mp_sr_bits), so the
 * result depends only on (seed, offset + i), never on threading or device. Values that are
 * already bf16, +-Inf and NaN convert as with round to nearest even. */
mp_status mp_to_bf16_sr_f32(const float* src, uint16_t* dst, int64_t n, uint64_t seed,
                            uint64_t offset);

/* fp32 -> fp16, round to nearest even, IEEE 754 binary16: subnormal results are exact-rounded,
 * values >= 65520 in magnitude become +-Inf, NaN stays NaN (quiet, sign kept). Bit-equal to
 * torch's Tensor.to(torch.float16) for every non-NaN input. */
mp_status mp_to_fp16_f32(const float* src, uint16_t* dst, int64_t n);

/* bf16 -> fp32, exact. */
mp_status mp_to_fp32_bf16(const uint16_t* src, float* dst, int64_t n);

/* fp16 -> fp32, exact (subnormals included). */
mp_status mp_to_fp32_fp16(const uint16_t* src, float* dst, int64_t n);

/* One dst <- src pair of a multi-tensor cast: n elements, src_dtype -> dst_dtype (fp32 <->
 * bf16/fp16, or a copy within one dtype). Element i of the pair has stochastic-rounding stream
 * position sr_position + i. */
typedef struct mp_cast_segment {
  const void* src;
  void* dst;
  int32_t src_dtype; /* an mp_dtype */
  int32_t dst_dtype; /* an mp_dtype */
  int64_t n;
  uint64_t sr_position;
} mp_cast_segment;

/* 1 if a cast from src_dtype to dst_dtype exists (one side fp32, or both the same dtype, and no
 * stochastic rounding into fp16), else 0. */
static inline int mp_cast_supported(int32_t src_dtype, int32_t dst_dtype, int stochastic) {
  if (src_dtype < 0 || src_dtype >= MP_DTYPE_COUNT || dst_dtype < 0 ||
      dst_dtype >= MP_DTYPE_COUNT)
    return 0;
  if (src_dtype != MP_F32 && dst_dtype != MP_F32 && src_dtype != dst_dtype) return 0;
  return !(stochastic && src_dtype == MP_F32 && dst_dtype == MP_F16);
}

/* Converts n elements: the function above for the dtype pair (a plain copy within one dtype),
 * with stochastic rounding keyed by (seed, position) for fp32 -> bf16 when stochastic != 0.
 * dst_fresh != 0 says that dst was just allocated and not yet written: the cast then stores
 * through the cache. Otherwise a large output (8 MiB or more per call) is written with
 * non-temporal stores, which spare reading each destination line first but are slow into pages
 * that the first store faults in (the functions above always stream large outputs). The bits are
 * the same either way. Also MP_ERR_INVALID_ARGUMENT for a pair mp_cast_supported rejects. */
mp_status mp_cast(const void* src, mp_dtype src_dtype, void* dst, mp_dtype dst_dtype, int64_t n,
                  int stochastic, uint64_t seed, uint64_t position, int dst_fresh);

#ifdef __cplusplus
}
#endif
#endif /* MPEXT_CAST_H */
