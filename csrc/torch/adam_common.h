// Validation and planning shared by the CPU (adam.cpp) and CUDA (adam_cuda.cpp) adam_step_.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

#include "common.h"
#include "mpext/adam.h"

namespace mpext {

// One adam_step_ call as the C API takes it (both tiers): a tensor per param (zero-size ones
// included: their step counts advance too) and the call's options, whose lr, inv_scale and
// found_inf point at the tensors' data (lr is given as lr_value instead when it is on the CPU
// while the params are not).
struct AdamPlan {
  std::vector<mp_adam_tensor> tensors;
  mp_adam_options options;
};

// How a call stores its low-precision params' fp32 values and rounds its bf16 state: the
// keyword arguments of adam_step_ beyond torch's (see registration.cpp).
struct AdamStorage {
  std::optional<at::TensorList> remainders;  // int16 remainders of bf16 params, or empty tensors
  bool master_free = false;       // a low param with neither master nor remainder is allowed
  bool stochastic_rounding = false;  // master-free params written with stochastic rounding
  bool moments_round_nearest = false;  // bf16 moments to nearest even (biased; comparisons)
  int64_t seed = 0;
  at::OptionalIntArrayRef sr_streams;  // per param, < 2^32; default: the param's index
  // 8-bit moments (int8 exp_avg with uint8 exp_avg_sq): one float32 absmax per block of
  // block_size elements, or empty tensors for params with other moments
  std::optional<at::TensorList> exp_avg_scales, exp_avg_sq_scales;
  int64_t block_size = 256;
  std::optional<at::TensorList> ema_params;  // fp32 EMAs of the params' values, or empty tensors
  double ema_decay = 0.0;
};

// Checks every argument of adam_step_ before anything is written. Throws (naming the argument)
// on: lists of different lengths (masters and remainders may also be empty); a param that is
// not float32/bfloat16/float16; a grad whose dtype is neither the param's nor float32; exp_avg
// or exp_avg_sq neither float32 nor bfloat16, unless they are int8 and uint8 codes together,
// which need exp_avg_scales / exp_avg_sq_scales entries of ceil(numel / block_size) float32
// elements (others an empty tensor there); a block_size that is not a power of two in
// [32, 2048]; masters, steps, lr, inv_scale, found_inf not
// float32, remainders not int16; shape or memory-layout mismatches; non-dense tensors; tensors
// on different devices (lr may also be on the CPU); lr, inv_scale, found_inf or a step with
// more than one element; a bf16/fp16 param with no master and no remainder unless master_free
// (with both: refused), a master or remainder for an fp32 param, a remainder for an fp16 param;
// any tensor written by the op overlapping another tensor of the call (grads count as written
// with unscale_grads); beta1, beta2 outside [0, 1); eps < 0; weight_decay < 0; any non-finite
// hyperparameter; an sr_stream outside [0, 2^32) or a list of them of the wrong length; an
// ema_decay outside [0, 1], an ema_params entry that is not float32 or not in the param's
// layout (an empty one: none); an lr on the CPU that is negative or not finite.
AdamPlan plan_adam(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                   at::TensorList exp_avg_sqs, at::TensorList masters, at::TensorList steps,
                   const at::Tensor& lr, double beta1, double beta2, double eps,
                   double weight_decay, bool decoupled, bool maximize,
                   const std::optional<at::Tensor>& inv_scale,
                   const std::optional<at::Tensor>& found_inf, bool unscale_grads,
                   const AdamStorage& storage);

// adam_step_ for one backend: validate everything, then Backend::adam_step(plan, device) runs the
// kernels (Backend::kDevice: the device type it implements).
template <class Backend>
void adam_step(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
               at::TensorList exp_avg_sqs, at::TensorList masters, at::TensorList steps,
               const at::Tensor& lr, double beta1, double beta2, double eps, double weight_decay,
               bool decoupled, bool maximize, const std::optional<at::Tensor>& inv_scale,
               const std::optional<at::Tensor>& found_inf, bool unscale_grads,
               std::optional<at::TensorList> remainders, bool master_free,
               bool stochastic_rounding, bool moments_round_nearest, int64_t seed,
               at::OptionalIntArrayRef sr_streams, std::optional<at::TensorList> exp_avg_scales,
               std::optional<at::TensorList> exp_avg_sq_scales, int64_t block_size,
               std::optional<at::TensorList> ema_params, double ema_decay) {
  const AdamStorage storage{remainders,     master_free,       stochastic_rounding,
                            moments_round_nearest, seed,       sr_streams,
                            exp_avg_scales, exp_avg_sq_scales, block_size,
                            ema_params,     ema_decay};
  const AdamPlan plan = plan_adam(params, grads, exp_avgs, exp_avg_sqs, masters, steps, lr, beta1,
                                  beta2, eps, weight_decay, decoupled, maximize, inv_scale,
                                  found_inf, unscale_grads, storage);
  if (plan.tensors.empty()) return;
  check_backend(params[0].device(), Backend::kDevice, "adam_step_", Arg("params", 0));
  Backend::adam_step(plan, params[0].device());
}

}  // namespace mpext
