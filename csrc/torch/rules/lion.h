// lion_step_ (Lion, mpext/rules/lion.h): the op's entry into the step planner, for any backend.
#pragma once

#include <cmath>

#include "../step_common.h"

namespace mpext {

// beta1, beta2 in [0, 1], weight_decay >= 0 (decoupled), one moment (exp_avgs, float32, bfloat16
// or int8 codes with exp_avg_scales).
inline RuleLists lion_rule(at::TensorList exp_avgs, double beta1, double beta2,
                           double weight_decay, bool maximize) {
  const char* op = "lion_step_";
  auto check = [=]() {
    check_hyper(beta1, op, "beta1", 0.0, false, 1.0, false);
    check_hyper(beta2, op, "beta2", 0.0, false, 1.0, false);
    check_hyper(weight_decay, op, "weight_decay", 0.0, false, INFINITY, true);
  };
  mp_step_options o = rule_options(MP_RULE_LION, beta1, beta2, weight_decay, maximize);
  o.decoupled = 1;
  return {op, 1, 1, {exp_avgs, at::TensorList()}, {"exp_avgs", nullptr}, {"exp_avg_scales", nullptr},
          check, o};
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
               at::OptionalIntArrayRef offsets,
               const std::optional<at::Tensor>& stats) {
  const StepStorage storage{remainders,     master_free,  stochastic_rounding,
                            moments_round_nearest, seed,  sr_streams,
                            exp_avg_scales, std::nullopt, block_size,
                            ema_params,     ema_decay,    offsets,
                            stats};
  run_rule<Backend>(lion_rule(exp_avgs, beta1, beta2, weight_decay, maximize), params, grads,
                    masters, steps, lr, inv_scale, found_inf, unscale_grads, storage);
}

}  // namespace mpext
