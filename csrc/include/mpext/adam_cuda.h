/* mpext C API: the fused Adam/AdamW step on CUDA devices, implemented in cuda/adam.cu.
 *
 * The CUDA counterpart of mpext/adam.h for a whole list of params at once: one multi-tensor
 * launch (as few as the 4 KB kernel-argument limit allows) updates every param, whatever the mix
 * of param dtypes (fp32, bf16, fp16) and grad dtypes (the param's or fp32), then one tiny launch
 * advances every param's step count. Per element the math is exactly adam.h's, in fp32, every
 * operation rounded in adam.h's order (no fused multiply-adds); a bf16/fp16 param is written as
 * __float2bfloat16_rn / __float2half_rn of its new fp32 master.
 *
 * Every scalar that changes from step to step is device memory that the kernels read
 * themselves: the step counts, found_inf, inv_scale and (optionally) lr. So a call needs no host
 * synchronisation, allocates nothing, and can be captured in a CUDA graph (with lr on the device:
 * a host lr_value is baked into the captured launch).
 *
 * Per param, from its step count s (the value before this call), the kernel uses
 * t = s + 1 (in fp32, as torch's float step tensor) and computes in double, as torch does:
 *   step_size = lr / (1 - beta1^t),  bias_correction2_sqrt = sqrt(1 - beta2^t),
 *   decay = 1 - lr * weight_decay (AdamW),
 * each then rounded to fp32. Every block of a param reads the same s, and s is advanced (to t)
 * only by the second launch, which runs after every block of the first on the same stream.
 *
 * The launchers enqueue kernels on `stream` and return without waiting. They return MP_OK;
 * MP_ERR_INVALID_ARGUMENT (launching nothing) for a bad argument as described below; or
 * MP_ERR_CUDA when a launch failed (launches enqueued before it may have run), in which case the
 * error is left in place for the caller: cudaGetLastError() returns (and clears) it. */
#ifndef MPEXT_ADAM_CUDA_H
#define MPEXT_ADAM_CUDA_H

#include <stdint.h>

#include <cuda_runtime.h>

#include "mpext/adam.h"
#include "mpext/mpext.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One param of a multi-tensor Adam step: n contiguous elements in device memory.
 *   param:      n values of param_dtype, updated in place;
 *   grad:       n values of grad_dtype (param_dtype or MP_F32), read;
 *   master:     n floats, read and written; non-NULL iff param_dtype != MP_F32 (when n > 0);
 *   exp_avg, exp_avg_sq: n floats each, read and written;
 *   step:       one float (the step count), read, then advanced by 1 unless skipped; never NULL.
 * Every pointer must be aligned to its element size (as a tensor's data is); 16-byte alignment
 * is not needed (chunks whose pointers share their offset modulo 16 bytes take 16-byte loads and
 * stores, others go one element at a time). When n == 0 only step is used (the others may be
 * NULL). n may exceed 2^31. */
typedef struct mp_adam_tensor_cuda {
  void* param;
  int32_t param_dtype; /* an mp_dtype */
  const void* grad;
  int32_t grad_dtype; /* an mp_dtype */
  float* master;
  float* exp_avg;
  float* exp_avg_sq;
  float* step;
  int64_t n;
} mp_adam_tensor_cuda;

/* The scalars of one call, shared by every param. */
typedef struct mp_adam_options_cuda {
  double beta1, beta2;       /* in [0, 1) */
  double eps;                /* >= 0 */
  double weight_decay;       /* >= 0: L2 for Adam, decoupled for AdamW */
  int32_t decoupled;         /* 1: AdamW, 0: Adam */
  int32_t maximize;          /* 1: ascend */
  const float* lr;           /* device float read by the kernel, or NULL to use lr_value */
  float lr_value;            /* the learning rate when lr is NULL */
  const float* inv_scale;    /* device float multiplying every grad, or NULL for 1 */
  const float* found_inf;    /* device float, or NULL: when non-zero nothing at all is written */
} mp_adam_options_cuda;

/* One Adam/AdamW step over the ntensors params at tensors (host memory, read during the call
 * only), as described above: reads *opt's device scalars in the kernels; if found_inf is given
 * and *found_inf != 0, writes nothing (no param, master, moment or step changes); otherwise
 * updates every element of every param, master, exp_avg and exp_avg_sq, and then adds 1 to
 * every param's *step exactly once (zero-size params included). No array of one param may
 * overlap another array of the call, or lr, inv_scale, found_inf. Checks everything before
 * launching: returns MP_ERR_INVALID_ARGUMENT for ntensors < 0, tensors or opt NULL (with
 * ntensors > 0), an unknown dtype, a grad dtype that is neither the param's nor MP_F32, n < 0, a
 * NULL step, a NULL array with n > 0, a master given for / missing from a param that needs
 * none / one, a pointer not aligned to its element size, beta1 or beta2 outside [0, 1), or
 * eps or weight_decay negative or not finite. ntensors == 0 launches nothing. */
mp_status mp_adam_step_multi_cuda(const mp_adam_tensor_cuda* tensors, int64_t ntensors,
                                  const mp_adam_options_cuda* opt, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif /* MPEXT_ADAM_CUDA_H */
