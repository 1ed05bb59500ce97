/* mpext C API: the fused Adam/AdamW step, with optional FP32 master weights and a fused unscale
 * of the gradient. The structs are shared by the CPU entry points here and the CUDA launcher of
 * mpext/adam_cuda.h; the numerics, per-step scalars included, are mpext/adam_rule.h's, which
 * both tiers call.
 *
 * Per element, in fp32 (adam_rule.h has the exact order of operations):
 *   g = grad * inv_scale;  (unscale_grads: grad = g, rounded to its dtype);  if maximize: g = -g
 *   Adam (L2):      g = g + weight_decay * p
 *   AdamW:          p = p * (1 - lr * weight_decay)
 *   m = lerp(m, g, 1 - beta1);  v = v * beta2 + ((1 - beta2) * g) * g
 *   p = p - (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
 * which is torch.optim.Adam / AdamW's single-tensor path, with t the param's step count plus one.
 * A bf16/fp16 param is updated through its fp32 master and written as the master rounded to
 * nearest even. */
#ifndef MPEXT_ADAM_H
#define MPEXT_ADAM_H

#include <stdint.h>

#include "mpext/mpext.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One param of an Adam step: n elements of each array, all in one memory layout.
 *   param:      n values of param_dtype, updated in place;
 *   grad:       n values of grad_dtype (param_dtype or MP_F32), read (and, with the options'
 *               unscale_grads, overwritten with the unscaled gradient);
 *   master:     n floats, read and written; non-NULL iff param_dtype != MP_F32 (when n > 0);
 *   exp_avg, exp_avg_sq: n floats each, read and written;
 *   step:       one float, the param's step count before this step; never NULL.
 * When n == 0 only step is used (the others may be NULL). */
typedef struct mp_adam_tensor {
  void* param;
  int32_t param_dtype; /* an mp_dtype */
  void* grad;
  int32_t grad_dtype; /* an mp_dtype */
  float* master;
  float* exp_avg;
  float* exp_avg_sq;
  float* step;
  int64_t n;
} mp_adam_tensor;

/* The settings of one call, shared by its params. lr, inv_scale and found_inf point at memory
 * of the tier that runs the call (host memory for the CPU entry points, device memory for CUDA),
 * so that a step needs no host synchronisation. */
typedef struct mp_adam_options {
  double beta1, beta2;    /* in [0, 1) */
  double eps;             /* >= 0, finite */
  double weight_decay;    /* >= 0, finite: L2 for Adam, decoupled for AdamW */
  int32_t decoupled;      /* 1: AdamW, 0: Adam */
  int32_t maximize;       /* 1: ascend */
  const float* lr;        /* the learning rate, or NULL to use lr_value */
  float lr_value;
  const float* inv_scale; /* multiplies every grad, or NULL for 1 */
  const float* found_inf; /* when non-NULL and *found_inf != 0 the step writes nothing */
  int32_t unscale_grads;  /* 1: write grad * inv_scale (rounded to the grad's dtype) back into
                             grad in the same pass, as torch's fused optimizers leave it; nothing
                             is written when inv_scale is NULL or 1 (the values would not change) */
} mp_adam_options;

/* Elements [start, start + count) of t's arrays, on the calling thread and the active ISA path:
 * unless *o->found_inf != 0, reads the grads, updates master (or the fp32 param), exp_avg and
 * exp_avg_sq, and writes the param, from the step count *t->step + 1 (t->step is only read: see
 * mp_adam_advance_steps). Every ISA path gives the same bits. Returns MP_ERR_INVALID_ARGUMENT
 * (writing nothing) for a NULL t or o, a bad dtype or master (as described above), a range
 * outside [0, t->n), a NULL array with count > 0, or options out of range. Arrays of one
 * tensor must not overlap each other or the options' scalars. */
mp_status mp_adam_step(const mp_adam_tensor* t, int64_t start, int64_t count,
                       const mp_adam_options* o);

/* Adds 1 to *ts[k].step for every k < ntensors, unless *o->found_inf != 0: the end of a step
 * whose elements mp_adam_step has updated. Returns MP_ERR_INVALID_ARGUMENT (writing nothing)
 * for ntensors < 0, or NULL ts, o or step pointer. */
mp_status mp_adam_advance_steps(const mp_adam_tensor* ts, int64_t ntensors,
                                const mp_adam_options* o);

#ifdef __cplusplus
}
#endif
#endif /* MPEXT_ADAM_H */
