// sgd_step_ (SGD, mpext/rules/sgd.h): the op's entry into the step planner, for any backend.
#pragma once

#include <cmath>

#include "../step_common.h"

namespace mpext {

// momentum >= 0 (0: no buffer, momentum_buffers empty, checked here), a finite dampening,
// weight_decay >= 0, nesterov only with a momentum and no dampening (torch's check).
inline RuleLists sgd_rule(at::TensorList momentum_buffers, double momentum, double dampening,
                          double weight_decay, bool nesterov, bool maximize) {
  const char* op = "sgd_step_";
  auto check = [=]() {
    check_hyper(momentum, op, "momentum", 0.0, false, INFINITY, true);
    check_hyper(dampening, op, "dampening", -INFINITY, true, INFINITY, true);
    check_hyper(weight_decay, op, "weight_decay", 0.0, false, INFINITY, true);
    TORCH_CHECK_VALUE(!nesterov || (momentum > 0.0 && dampening == 0.0), "mpext.", op,
                      ": Nesterov momentum requires a momentum and zero dampening");
  };
  const int nmom = momentum != 0.0 ? 1 : 0;
  TORCH_CHECK_VALUE(nmom == 1 || momentum_buffers.empty(), "mpext.", op,
                    ": momentum is 0, which keeps no buffer, so momentum_buffers must be empty, "
                    "got ", momentum_buffers.size(), " tensors");
  // The momentum is the rule's beta1 (mpext/rules/sgd.h says so).
  mp_step_options o = rule_options(MP_RULE_SGD, momentum, 0.0, weight_decay, maximize);
  o.dampening = dampening;
  o.nesterov = nesterov ? 1 : 0;
  return {op,
          nmom,
          1,
          {momentum_buffers, at::TensorList()},
          {"momentum_buffers", nullptr},
          {"momentum_buffer_scales", nullptr},
          check,
          o};
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
              at::OptionalIntArrayRef offsets,
              const std::optional<at::Tensor>& stats) {
  const StepStorage storage{remainders,            master_free,  stochastic_rounding,
                            moments_round_nearest, seed,         sr_streams,
                            momentum_buffer_scales, std::nullopt, block_size,
                            ema_params,            ema_decay,    offsets,
                            stats};
  run_rule<Backend>(sgd_rule(momentum_buffers, momentum, dampening, weight_decay, nesterov,
                             maximize),
                    params, grads, masters, steps, lr, inv_scale, found_inf, unscale_grads,
                    storage);
}

}  // namespace mpext
