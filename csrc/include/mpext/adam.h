/* mpext C API: the fused Adam/AdamW step on the CPU, with optional FP32 master weights and a
 * fused unscale of the gradient.
 *
 * One call updates n elements of one parameter in one pass over memory: it reads the gradient,
 * multiplies it by inv_scale, updates the fp32 moments and the fp32 master (or the fp32 param),
 * and writes the param (for a bf16/fp16 param: the round-to-nearest-even of the new master).
 * The math is torch.optim.Adam / AdamW's single-tensor path, per element in fp32:
 *   g = grad * inv_scale;  if maximize: g = -g
 *   Adam (L2):      g = g + weight_decay * p
 *   AdamW:          p = p * decay              (decay = 1 - lr * weight_decay)
 *   m = lerp(m, g, 1 - beta1)       (m + w * (g - m) for w < 0.5, else g - (g - m) * (1 - w))
 *   v = v * beta2 + ((1 - beta2) * g) * g
 *   p = p + ((-step_size) * m) / (sqrt(v) / bias_correction2_sqrt + eps)
 * with every operation rounded to fp32 in this order and no fused multiply-add (the core is
 * compiled as ISO C, which does not contract), so every ISA path gives the same bits. torch's own
 * vectorized CPU kernels contract some of these into FMAs, so its results can differ from these
 * in the last bit of an element; the scalars are derived exactly as torch derives them.
 * where the caller computes, from the incremented step count t, step_size = lr / (1 - beta1^t)
 * and bias_correction2_sqrt = sqrt(1 - beta2^t) (in double, as torch does).
 *
 * Pointers may have any alignment, n may exceed 2^31; src/dst arrays must not overlap. The
 * function runs on the calling thread (the binding splits the work) on the active ISA path. */
#ifndef MPEXT_ADAM_H
#define MPEXT_ADAM_H

#include <stdint.h>

#include "mpext/mpext.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Element types of params and grads. */
typedef enum mp_dtype { MP_F32 = 0, MP_BF16 = 1, MP_F16 = 2 } mp_dtype;

/* The per-parameter scalars of one step (see the formula above). */
typedef struct mp_adam_params {
  float beta1, beta2, eps;
  float lerp_weight;           /* (float)(1 - beta1), the subtraction done in double */
  float one_minus_beta2;       /* (float)(1 - beta2), the subtraction done in double */
  float weight_decay;          /* Adam (L2) only; AdamW uses decay */
  float decay;                 /* AdamW: 1 - lr * weight_decay; 1 for Adam */
  float step_size;             /* lr / (1 - beta1^t) */
  float bias_correction2_sqrt; /* sqrt(1 - beta2^t) */
  float inv_scale;             /* 1 when the gradient is not scaled */
  int32_t decoupled;           /* 1: AdamW, 0: Adam with L2 weight decay */
  int32_t maximize;
} mp_adam_params;

/* One Adam/AdamW step over n elements.
 *   param:  n values of param_dtype, updated in place (for bf16/fp16: written as the RNE of the
 *           new master);
 *   grad:   n values of grad_dtype (param_dtype or MP_F32), read;
 *   master: n fp32 values, read and written; required (non-NULL) iff param_dtype != MP_F32;
 *   exp_avg, exp_avg_sq: n fp32 values each, read and written.
 * Returns MP_ERR_INVALID_ARGUMENT (writing nothing) for n < 0, a missing pointer, an unknown
 * dtype, a grad dtype that is neither the param's nor fp32, or a master given for / missing
 * from a param that needs none / one. */
mp_status mp_adam_step(void* param, mp_dtype param_dtype, const void* grad, mp_dtype grad_dtype,
                       float* master, float* exp_avg, float* exp_avg_sq, int64_t n,
                       const mp_adam_params* p);

#ifdef __cplusplus
}
#endif
#endif /* MPEXT_ADAM_H */
