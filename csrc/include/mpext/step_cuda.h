/* mpext C API: the fused optimizer step on CUDA devices (every rule of mpext/rules/rules.h),
 * implemented in cuda/step.cu.
 *
 * The CUDA counterpart of mpext/step.h, for a whole list of params at once, with the same structs
 * and the same rules and storage (mpext/rules/, mpext/step_storage.h): the same bits as the
 * CPU's mp_step. One
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
#ifndef MPEXT_STEP_CUDA_H
#define MPEXT_STEP_CUDA_H

#include <stdint.h>

#include <cuda_runtime.h>

#include "mpext/adam.h" /* mp_step_* and, for one release, the mp_adam_* names */
#include "mpext/mpext.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One step (the options' rule) over the ntensors params at tensors (host memory, read during the call
 * only; their arrays, step counts and opt's scalars in device memory): if *opt->found_inf != 0,
 * writes nothing (no param, master, moment or step changes); otherwise updates every element of
 * every param, master and moment, and then adds 1 to every param's *step exactly
 * once (zero-size params included). No array of one param may overlap another array of the
 * call, or lr, inv_scale, found_inf. Checks everything before launching: returns
 * MP_ERR_INVALID_ARGUMENT for ntensors < 0, tensors or opt NULL (with ntensors > 0), a tensor or
 * options mpext/step_storage.h rejects (mp_step_tensor_ok, mp_step_options_ok). ntensors == 0
 * launches nothing. Pointers aligned to their element size are enough: chunks whose arrays share
 * their offset modulo 16 bytes take 16-byte loads and stores, others go one element at a time. */
mp_status mp_step_multi_cuda(const mp_step_tensor* tensors, int64_t ntensors,
                             const mp_step_options* opt, cudaStream_t stream);

/* mp_step_multi_cuda -- the same checks, the same bits in every array it writes -- with the
 * step's counters of mpext/telemetry.h (mp_step_stats's columns) added into row k of stats, a
 * device float64 array [ntensors, MP_STS_NCOLS], for tensors[k], in the same pass (a counting
 * variant of the kernel; the uncounted one is unchanged). Nothing is counted when the step is
 * skipped. The counts are exact whatever the block order; the sums of errors are added by
 * float64 atomics in the order the blocks finish, so they equal the C core's to within the
 * rounding of a sum of non-negative terms (not bit for bit, and not run to run). Returns what
 * mp_step_multi_cuda returns, and MP_ERR_INVALID_ARGUMENT (launching nothing) for stats NULL
 * or ntensors > INT32_MAX. */
mp_status mp_step_multi_stats_cuda(const mp_step_tensor* tensors, int64_t ntensors,
                                   const mp_step_options* opt, double* stats,
                                   cudaStream_t stream);

/* mp_step_multi_cuda under its old name, for one release. */
mp_status mp_adam_step_multi_cuda(const mp_adam_tensor* tensors, int64_t ntensors,
                                  const mp_adam_options* opt, cudaStream_t stream);

#ifdef __cplusplus
}
#endif
#endif /* MPEXT_STEP_CUDA_H */
