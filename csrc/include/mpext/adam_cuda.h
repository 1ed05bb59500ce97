/* mpext C API: the fused Adam/AdamW step on CUDA devices, implemented in cuda/adam.cu.
 *
 * The CUDA counterpart of mpext/adam.h, for a whole list of params at once, with the same structs
 * and the same rule (mpext/adam_rule.h): the same bits as the CPU's mp_adam_step. One
 * multi-tensor launch (as few as the 4 KB kernel-argument limit allows) updates every param,
 * whatever the mix of param and grad dtypes, then one tiny launch advances every param's step
 * count. Every block of a param reads the same step count, which only the second launch changes.
 *
 * Every scalar that changes from step to step is device memory that the kernels read themselves:
 * the step counts, found_inf, inv_scale and (optionally) lr. So a call needs no host
 * synchronisation, allocates nothing, and can be captured in a CUDA graph (with lr on the
 * device: a host lr_value is baked into the captured launch).
 *
 * The launcher enqueues kernels on `stream` and returns without waiting. It returns MP_OK;
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

/* One Adam/AdamW step over the ntensors params at tensors (host memory, read during the call
 * only; their arrays, step counts and opt's scalars in device memory): if *opt->found_inf != 0,
 * writes nothing (no param, master, moment or step changes); otherwise updates every element of
 * every param, master, exp_avg and exp_avg_sq, and then adds 1 to every param's *step exactly
 * once (zero-size params included). No array of one param may overlap another array of the
 * call, or lr, inv_scale, found_inf. Checks everything before launching: returns
 * MP_ERR_INVALID_ARGUMENT for ntensors < 0, tensors or opt NULL (with ntensors > 0), a tensor or
 * options mpext/adam_rule.h rejects (mp_adam_tensor_ok, mp_adam_options_ok). ntensors == 0
 * launches nothing. Pointers aligned to their element size are enough: chunks whose arrays share
 * their offset modulo 16 bytes take 16-byte loads and stores, others go one element at a time. */
mp_status mp_adam_step_multi_cuda(const mp_adam_tensor* tensors, int64_t ntensors,
                                  const mp_adam_options* opt, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif /* MPEXT_ADAM_CUDA_H */
