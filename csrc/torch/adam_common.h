// Validation and planning shared by the CPU (adam.cpp) and CUDA (adam_cuda.cpp) ops of every
// optimizer rule: adam_step_, lion_step_, sgd_step_ -- one planner (plan_step) for the storage
// every rule shares, each rule adding the checks of its hyperparameters and its options.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
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
  // per param, >= 0: its first element's position in the whole param (a shard's start) for the
  // random bits; with 8-bit moments a multiple of block_size. Default: all 0.
  at::OptionalIntArrayRef offsets;
};

// What a rule's call keeps per element: its op's name, its moment lists (nmoments of them:
// 2 for Adam, 1 for Lion and SGD with momentum, 0 for plain SGD) with their argument names and
// those of their 8-bit scales, the checks of its hyperparameters (run where plan_step reaches
// them, after the lists' lengths), and the options' rule fields (rule, betas, eps,
// weight_decay, decoupled, maximize, dampening, nesterov; plan_step sets the others).
struct RuleLists {
  const char* op;
  int nmoments;
  at::TensorList moments[2];
  const char* moment_names[2];
  const char* const* scale_names;  // two names
  std::function<void()> check_rule;
  mp_adam_options options;
};

// The checks and plan of any rule's call. Throws (naming the argument) on: lists of different
// lengths (masters and remainders may also be empty); a param that is not
// float32/bfloat16/float16; a grad whose dtype is neither the param's nor float32; a first
// moment neither float32 nor bfloat16 nor int8 codes, a second (Adam's exp_avg_sq) neither
// float32 nor bfloat16 nor uint8 codes (with int8 codes only), codes needing scales entries of
// ceil(numel / block_size) float32 elements (others an empty tensor there); a block_size that is
// not a power of two in [32, 2048]; masters, steps, lr, inv_scale, found_inf not float32,
// remainders not int16; shape or memory-layout mismatches; non-dense tensors; tensors on
// different devices (lr may also be on the CPU); lr, inv_scale, found_inf or a step with more
// than one element; a bf16/fp16 param with no master and no remainder unless master_free (with
// both: refused), a master or remainder for an fp32 param, a remainder for an fp16 param; any
// tensor written by the op overlapping another tensor of the call (grads count as written with
// unscale_grads); the rule's hyperparameters (rule.check_rule); an sr_stream outside [0, 2^32)
// or a list of them of the wrong length; an offset < 0 (or, with 8-bit moments, not a multiple
// of block_size); an ema_decay outside [0, 1], an ema_params entry that is not float32 or not
// in the param's layout (an empty one: none); an lr on the CPU that is negative or not finite.
AdamPlan plan_step(const RuleLists& rule, at::TensorList params, at::TensorList grads,
                   at::TensorList masters, at::TensorList steps, const at::Tensor& lr,
                   const std::optional<at::Tensor>& inv_scale,
                   const std::optional<at::Tensor>& found_inf, bool unscale_grads,
                   const AdamStorage& storage);

// adam_step_: beta1, beta2 in [0, 1), eps >= 0, weight_decay >= 0 (decoupled: AdamW), the
// moments exp_avgs and exp_avg_sqs (8-bit: int8 with uint8 codes, with their scales).
RuleLists adam_rule(at::TensorList exp_avgs, at::TensorList exp_avg_sqs, double beta1,
                    double beta2, double eps, double weight_decay, bool decoupled,
                    bool maximize);

// lion_step_: beta1, beta2 in [0, 1], weight_decay >= 0 (decoupled), one moment (exp_avgs,
// float32, bfloat16 or int8 codes with exp_avg_scales).
RuleLists lion_rule(at::TensorList exp_avgs, double beta1, double beta2, double weight_decay,
                    bool maximize);

// sgd_step_: momentum >= 0 (0: no buffer, momentum_buffers empty, checked here), a finite
// dampening, weight_decay >= 0, nesterov only with a momentum and no dampening (torch's check).
RuleLists sgd_rule(at::TensorList momentum_buffers, double momentum, double dampening,
                   double weight_decay, bool nesterov, bool maximize);

// muon_step_ (muon): Muon's elementwise phases (mpext/muon_rule.h). phase 1: momentum >= 0,
// nesterov, one moment (momentum_buffers); params are the updates it writes. phase 3: lr_ratio
// > 0, weight_decay >= 0 (decoupled), no moment (momentum_buffers empty); grads are the
// orthogonalised updates. Any other phase is refused.
RuleLists muon_rule(at::TensorList momentum_buffers, int64_t phase, double momentum,
                    bool nesterov, double lr_ratio, double weight_decay);

// Runs a validated plan on one backend: Backend::step(plan, device, op) runs the kernels
// (Backend::kDevice: the device type it implements).
template <class Backend>
void run_plan(const AdamPlan& plan, at::TensorList params, const char* op) {
  if (plan.tensors.empty()) return;
  check_backend(params[0].device(), Backend::kDevice, op, Arg("params", 0));
  Backend::step(plan, params[0].device(), op);
}

// A rule's call on one backend: validate everything (plan_step), then run_plan.
template <class Backend>
void run_rule(const RuleLists& rule, at::TensorList params, at::TensorList grads,
              at::TensorList masters, at::TensorList steps, const at::Tensor& lr,
              const std::optional<at::Tensor>& inv_scale,
              const std::optional<at::Tensor>& found_inf, bool unscale_grads,
              const AdamStorage& storage) {
  run_plan<Backend>(plan_step(rule, params, grads, masters, steps, lr, inv_scale, found_inf,
                              unscale_grads, storage),
                    params, rule.op);
}

// The ops for one backend.
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
               std::optional<at::TensorList> ema_params, double ema_decay,
               at::OptionalIntArrayRef offsets) {
  const AdamStorage storage{remainders,     master_free,       stochastic_rounding,
                            moments_round_nearest, seed,       sr_streams,
                            exp_avg_scales, exp_avg_sq_scales, block_size,
                            ema_params,     ema_decay,         offsets};
  run_rule<Backend>(adam_rule(exp_avgs, exp_avg_sqs, beta1, beta2, eps, weight_decay, decoupled,
                              maximize),
                    params, grads, masters, steps, lr, inv_scale, found_inf, unscale_grads,
                    storage);
}

template <class Backend>
void lion_step(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
               at::TensorList masters, at::TensorList steps, const at::Tensor& lr, double beta1,
               double beta2, double weight_decay, bool maximize,
               const std::optional<at::Tensor>& inv_scale,
               const std::optional<at::Tensor>& found_inf, bool unscale_grads,
               std::optional<at::TensorList> remainders, bool master_free,
               bool stochastic_rounding, bool moments_round_nearest, int64_t seed,
               at::OptionalIntArrayRef sr_streams, std::optional<at::TensorList> exp_avg_scales,
               int64_t block_size, std::optional<at::TensorList> ema_params, double ema_decay,
               at::OptionalIntArrayRef offsets) {
  const AdamStorage storage{remainders,     master_free,  stochastic_rounding,
                            moments_round_nearest, seed,  sr_streams,
                            exp_avg_scales, std::nullopt, block_size,
                            ema_params,     ema_decay,    offsets};
  run_rule<Backend>(lion_rule(exp_avgs, beta1, beta2, weight_decay, maximize), params, grads,
                    masters, steps, lr, inv_scale, found_inf, unscale_grads, storage);
}

template <class Backend>
void sgd_step(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
              at::TensorList masters, at::TensorList steps, const at::Tensor& lr,
              double momentum, double dampening, double weight_decay, bool nesterov,
              bool maximize, const std::optional<at::Tensor>& inv_scale,
              const std::optional<at::Tensor>& found_inf, bool unscale_grads,
              std::optional<at::TensorList> remainders, bool master_free,
              bool stochastic_rounding, bool moments_round_nearest, int64_t seed,
              at::OptionalIntArrayRef sr_streams,
              std::optional<at::TensorList> momentum_buffer_scales, int64_t block_size,
              std::optional<at::TensorList> ema_params, double ema_decay,
              at::OptionalIntArrayRef offsets) {
  const AdamStorage storage{remainders,            master_free,  stochastic_rounding,
                            moments_round_nearest, seed,         sr_streams,
                            momentum_buffer_scales, std::nullopt, block_size,
                            ema_params,            ema_decay,    offsets};
  run_rule<Backend>(sgd_rule(momentum_buffers, momentum, dampening, weight_decay, nesterov,
                             maximize),
                    params, grads, masters, steps, lr, inv_scale, found_inf, unscale_grads,
                    storage);
}

// muon
template <class Backend>
void muon_step(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers,
               at::TensorList masters, at::TensorList steps, const at::Tensor& lr,
               int64_t phase, double momentum, bool nesterov, double lr_ratio,
               double weight_decay, const std::optional<at::Tensor>& inv_scale,
               const std::optional<at::Tensor>& found_inf, bool unscale_grads,
               std::optional<at::TensorList> remainders, bool master_free,
               bool stochastic_rounding, bool moments_round_nearest, int64_t seed,
               at::OptionalIntArrayRef sr_streams,
               std::optional<at::TensorList> momentum_buffer_scales, int64_t block_size,
               std::optional<at::TensorList> ema_params, double ema_decay,
               at::OptionalIntArrayRef offsets) {
  const AdamStorage storage{remainders,            master_free,  stochastic_rounding,
                            moments_round_nearest, seed,         sr_streams,
                            momentum_buffer_scales, std::nullopt, block_size,
                            ema_params,            ema_decay,    offsets};
  run_rule<Backend>(muon_rule(momentum_buffers, phase, momentum, nesterov, lr_ratio,
                              weight_decay),
                    params, grads, masters, steps, lr, inv_scale, found_inf, unscale_grads,
                    storage);
}

}  // namespace mpext
