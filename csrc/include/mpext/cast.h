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
 * to the fraction of a bf16 ulp that truncation discards, drawing the 16-bit random value from
 * Philox4x32-10 keyed by seed at counter (offset + i) (see philox.h, mp_sr_random_bits), so the
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

#ifdef __cplusplus
}
#endif
#endif /* MPEXT_CAST_H */
