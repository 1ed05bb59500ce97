/* mpext C API: the multi-tensor L2 norm behind grad_norm, on the CPU.
 *
 * The norm of a list of tensors is built from sums of squares over pieces of them:
 *   norm = sqrt(sum over pieces, in order, of mp_grad_norm_sumsq(piece))
 * (mp_grad_norm_finish does the last step). Each element x contributes y * y where
 * y = float(x) * inv_scale is rounded to fp32 (the value an unscale pass would have written),
 * squared and summed in double: y * y is exact in double, so a value whose square overflows fp32
 * still counts correctly, and a NaN anywhere gives NaN, an Inf (and no NaN) gives +Inf.
 *
 * Determinism: inside one call the elements are summed in a fixed order (16 interleaved double
 * accumulators, element i into accumulator i % 16, the tail into the first ones, then combined
 * as a fixed tree), which every ISA path follows exactly, so the result depends only on the
 * values and n, never on the ISA path, alignment or thread. Callers that split a list into fixed
 * pieces (the binding uses pieces of MP_GRAD_NORM_BLOCK elements per tensor) and combine the
 * pieces in a fixed order get the same bits whatever the thread count.
 *
 * bf16 and fp16 values are raw uint16_t bit patterns. Counts may exceed 2^31, any alignment is
 * accepted; the functions run on the calling thread on the active ISA path (mpext.h). They
 * return MP_OK, or MP_ERR_INVALID_ARGUMENT for n < 0, a null out, or a null x with n > 0. */
#ifndef MPEXT_NORM_H
#define MPEXT_NORM_H

#include <stdint.h>

#include "mpext/mpext.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Elements per piece in the binding's fixed decomposition (each tensor is cut into pieces of
 * this many elements from its first element; the last piece of a tensor may be shorter). */
#define MP_GRAD_NORM_BLOCK 65536

/* One tensor of a multi-tensor norm: n elements of dtype at x. */
typedef struct mp_norm_segment {
  const void* x;
  int32_t dtype; /* an mp_dtype */
  int64_t n;
} mp_norm_segment;

/* *out = the sum over the n values of dtype at x of (float(x[i]) * inv_scale)^2, the product
 * rounded to fp32 and squared and summed in double, in the fixed order described above. Also
 * MP_ERR_INVALID_ARGUMENT for an unknown dtype. */
mp_status mp_grad_norm_sumsq(const void* x, mp_dtype dtype, int64_t n, float inv_scale,
                             double* out);

/* *out = sqrt(partials[0] + partials[1] + ... + partials[n - 1]), summed left to right in double,
 * the square root taken in double and rounded once to fp32 (+Inf beyond the fp32 range; the
 * canonical quiet NaN 0x7FC00000 if any partial is NaN); 0 for n == 0. Returns
 * MP_ERR_INVALID_ARGUMENT for n < 0, a null out or a null partials with n > 0. */
mp_status mp_grad_norm_finish(const double* partials, int64_t n, float* out);

#ifdef __cplusplus
}
#endif
#endif /* MPEXT_NORM_H */
