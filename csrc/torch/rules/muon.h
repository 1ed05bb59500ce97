// muon_momentum_step_ and muon_update_step_ (Muon's elementwise phases, mpext/rules/muon.h):
// the ops' entries into the step planner, for any backend.
#pragma once

#include <cmath>

#include "../step_common.h"

namespace mpext {

// Phase 1: momentum >= 0, nesterov; one moment (momentum_buffers: float32, bfloat16 or int8
// codes with momentum_buffer_scales); params are the updates it writes.
inline RuleLists muon_momentum_rule(at::TensorList momentum_buffers, double momentum,
                                    bool nesterov) {
  const char* op = "muon_momentum_step_";
  auto check = [=]() { check_hyper(momentum, op, "momentum", 0.0, false, INFINITY, true); };
  // The momentum is the rule's beta1 (mpext/rules/muon.h says so).
  mp_step_options o = rule_options(MP_RULE_MUON_MOMENTUM, momentum, 0.0, 0.0, false);
  o.nesterov = nesterov ? 1 : 0;
  return {op, 1, 1, {momentum_buffers, at::TensorList()}, {"momentum_buffers", nullptr},
          {"momentum_buffer_scales", nullptr}, check, o};
}

// Phase 3: lr_ratio > 0, weight_decay >= 0 (decoupled); no moment; grads are the
// orthogonalised updates.
inline RuleLists muon_update_rule(double lr_ratio, double weight_decay) {
  const char* op = "muon_update_step_";
  auto check = [=]() {
    check_hyper(lr_ratio, op, "lr_ratio", 0.0, true, INFINITY, true);
    check_hyper(weight_decay, op, "weight_decay", 0.0, false, INFINITY, true);
  };
  // The lr ratio is the rule's beta1 (mpext/rules/muon.h says so).
  mp_step_options o = rule_options(MP_RULE_MUON_UPDATE, lr_ratio, 0.0, weight_decay, false);
  o.decoupled = 1;
  return {op, 0, 0, {at::TensorList(), at::TensorList()}, {nullptr, nullptr}, {"unused_scales", nullptr},
          check, o};
}

template <class Backend>
void muon_momentum_step(at::TensorList params, at::TensorList grads,
                        at::TensorList momentum_buffers, at::TensorList masters,
                        at::TensorList steps, const at::Tensor& lr, double momentum,
                        bool nesterov, const std::optional<at::Tensor>& inv_scale,
                        const std::optional<at::Tensor>& found_inf, bool unscale_grads,
                        std::optional<at::TensorList> remainders, bool master_free,
                        bool stochastic_rounding, bool moments_round_nearest, int64_t seed,
                        at::OptionalIntArrayRef sr_streams,
                        std::optional<at::TensorList> momentum_buffer_scales,
                        int64_t block_size, std::optional<at::TensorList> ema_params,
                        double ema_decay, at::OptionalIntArrayRef offsets,
                        const std::optional<at::Tensor>& stats) {
  const StepStorage storage{remainders,            master_free,  stochastic_rounding,
                            moments_round_nearest, seed,         sr_streams,
                            momentum_buffer_scales, std::nullopt, block_size,
                            ema_params,            ema_decay,    offsets,
                            stats};
  run_rule<Backend>(muon_momentum_rule(momentum_buffers, momentum, nesterov), params, grads,
                    masters, steps, lr, inv_scale, found_inf, unscale_grads, storage);
}

template <class Backend>
void muon_update_step(at::TensorList params, at::TensorList grads, at::TensorList masters,
                      at::TensorList steps, const at::Tensor& lr, double lr_ratio,
                      double weight_decay, const std::optional<at::Tensor>& inv_scale,
                      const std::optional<at::Tensor>& found_inf, bool unscale_grads,
                      std::optional<at::TensorList> remainders, bool master_free,
                      bool stochastic_rounding, bool moments_round_nearest, int64_t seed,
                      at::OptionalIntArrayRef sr_streams, int64_t block_size,
                      std::optional<at::TensorList> ema_params, double ema_decay,
                      at::OptionalIntArrayRef offsets,
                      const std::optional<at::Tensor>& stats) {
  const StepStorage storage{remainders,            master_free,  stochastic_rounding,
                            moments_round_nearest, seed,         sr_streams,
                            std::nullopt,          std::nullopt, block_size,
                            ema_params,            ema_decay,    offsets,
                            stats};
  run_rule<Backend>(muon_update_rule(lr_ratio, weight_decay), params, grads, masters, steps, lr,
                    inv_scale, found_inf, unscale_grads, storage);
}

}  // namespace mpext
