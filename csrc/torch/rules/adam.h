// adam_step_ (Adam/AdamW, mpext/rules/adam.h): the op's entry into the step planner, for any
// backend -- its hyperparameters' checks and options, its two moment lists.
#pragma once

#include <cmath>

#include "../step_common.h"

namespace mpext {

// beta1, beta2 in [0, 1), eps >= 0, weight_decay >= 0 (decoupled: AdamW), the moments exp_avgs
// and exp_avg_sqs (8-bit: int8 with uint8 codes, with their scales). The checks capture their
// values (not references): a RuleLists outlives the call that made it.
inline RuleLists adam_rule(at::TensorList exp_avgs, at::TensorList exp_avg_sqs, double beta1,
                           double beta2, double eps, double weight_decay, bool decoupled,
                           bool maximize) {
  const char* op = "adam_step_";
  auto check = [=]() {
    check_hyper(beta1, op, "beta1", 0.0, false, 1.0, true);
    check_hyper(beta2, op, "beta2", 0.0, false, 1.0, true);
    check_hyper(eps, op, "eps", 0.0, false, INFINITY, true);
    check_hyper(weight_decay, op, "weight_decay", 0.0, false, INFINITY, true);
  };
  mp_step_options o = rule_options(MP_RULE_ADAM, beta1, beta2, weight_decay, maximize);
  o.eps = eps;
  o.decoupled = decoupled ? 1 : 0;
  return {op,    2,    2, {exp_avgs, exp_avg_sqs}, {"exp_avgs", "exp_avg_sqs"},
          {"exp_avg_scales", "exp_avg_sq_scales"}, check, o};
}

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
               at::OptionalIntArrayRef offsets,
               const std::optional<at::Tensor>& stats) {
  const StepStorage storage{remainders,     master_free,       stochastic_rounding,
                            moments_round_nearest, seed,       sr_streams,
                            exp_avg_scales, exp_avg_sq_scales, block_size,
                            ema_params,     ema_decay,         offsets,
                            stats};
  run_rule<Backend>(adam_rule(exp_avgs, exp_avg_sqs, beta1, beta2, eps, weight_decay, decoupled,
                              maximize),
                    params, grads, masters, steps, lr, inv_scale, found_inf, unscale_grads,
                    storage);
}

}  // namespace mpext
