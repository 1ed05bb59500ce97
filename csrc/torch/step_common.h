// Validation and planning shared by the CPU (step.cpp) and CUDA (step_cuda.cpp) ops of every
// optimizer rule (the rows of mpext/rules/rules.h: adam_step_, lion_step_, sgd_step_, ...) -- one
// planner (plan_step) for the storage every rule shares; each rule's entry (csrc/torch/rules/:
// its op, the checks of its hyperparameters and its options) builds a RuleLists.
#pragma once

#include <ATen/core/Tensor.h>

#include <functional>
#include <optional>
#include <vector>

#include "common.h"
#include "mpext/step.h"

namespace mpext {

// One step call as the C API takes it (both tiers): a tensor per param (zero-size ones
// included: their step counts advance too) and the call's options, whose lr, inv_scale and
// found_inf point at the tensors' data (lr is given as lr_value instead when it is on the CPU
// while the params are not).
struct StepPlan {
  std::vector<mp_step_tensor> tensors;
  mp_step_options options;
  // telemetry (mpext/telemetry.h): the stats tensor's data, row k (MP_STS_NCOLS doubles) the
  // counters of tensors[k], added to by the counted step; null: the step counts nothing
  double* stats = nullptr;
};

// How a call stores its low-precision params' fp32 values and rounds its bf16 state: the
// keyword arguments of the step ops beyond torch's (see registration.cpp).
struct StepStorage {
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
  // telemetry: a float64 [len(params), MP_STS_NCOLS] tensor the step adds its counters to
  // (mpext/telemetry.h), or none (the step's kernels are then those without counters)
  std::optional<at::Tensor> stats = std::nullopt;
};

// What a rule's call keeps per element: its op's name, the moments it keeps (nmoments: 2 for
// Adam, 1 for Lion and SGD with momentum, 0 for plain SGD) out of its op's moment lists
// (nlists of them: 2 for Adam, 1 for Lion and SGD), the lists with their argument names and
// those of their 8-bit scales (the first nlists entries; no name for a list the op lacks), the
// checks of its hyperparameters (run where plan_step reaches them, after the lists' lengths),
// and the options' rule fields (rule, betas, eps, weight_decay, decoupled, maximize, dampening,
// nesterov; plan_step sets the others).
struct RuleLists {
  const char* op;
  int nmoments;
  int nlists;
  at::TensorList moments[2];
  const char* moment_names[2];
  const char* scale_names[2];
  std::function<void()> check_rule;
  mp_step_options options;
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
// in the param's layout (an empty one: none); an lr on the CPU that is negative or not finite;
// stats that is not a contiguous float64 [len(params), MP_STS_NCOLS] tensor on the params'
// device, or overlaps another tensor of the call.
StepPlan plan_step(const RuleLists& rule, at::TensorList params, at::TensorList grads,
                   at::TensorList masters, at::TensorList steps, const at::Tensor& lr,
                   const std::optional<at::Tensor>& inv_scale,
                   const std::optional<at::Tensor>& found_inf, bool unscale_grads,
                   const StepStorage& storage);

// A rule's hyperparameter in its range ([lo, hi], an end excluded when *_open), else a
// ValueError naming it.
void check_hyper(double value, const char* op, const char* name, double lo, bool lo_open,
                 double hi, bool hi_open);

// The options' fields a rule sets (the rest are plan_step's): which rule (an MP_RULE_*), and its
// hyperparameters as mp_step_options names them.
mp_step_options rule_options(int32_t rule, double beta1, double beta2, double weight_decay,
                             bool maximize);

// Runs a validated plan on one backend: Backend::step(plan, device, op) runs the kernels
// (Backend::kDevice: the device type it implements).
template <class Backend>
void run_plan(const StepPlan& plan, at::TensorList params, const char* op) {
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
              const StepStorage& storage) {
  run_plan<Backend>(plan_step(rule, params, grads, masters, steps, lr, inv_scale, found_inf,
                              unscale_grads, storage),
                    params, rule.op);
}

}  // namespace mpext
