// CPU implementation of adam_step_: validate (plan_adam), decide the skip from found_inf, derive
// each param's step scalars from its incremented step count (in double, as torch does), then run
// the C core over the concatenated element range of all params, split across threads.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "adam_common.h"
#include "common.h"

namespace mpext {
namespace {

// The per-param scalars of one step whose (already incremented) count is t.
mp_adam_params adam_scalars(double lr, double beta1, double beta2, double eps,
                            double weight_decay, bool decoupled, bool maximize, double t,
                            float inv_scale) {
  mp_adam_params p;
  p.beta1 = static_cast<float>(beta1);
  p.beta2 = static_cast<float>(beta2);
  p.eps = static_cast<float>(eps);
  p.lerp_weight = static_cast<float>(1.0 - beta1);
  p.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  p.weight_decay = decoupled ? 0.0f : static_cast<float>(weight_decay);
  p.decay = decoupled ? static_cast<float>(1.0 - lr * weight_decay) : 1.0f;
  p.step_size = static_cast<float>(lr / (1.0 - std::pow(beta1, t)));
  p.bias_correction2_sqrt = static_cast<float>(std::sqrt(1.0 - std::pow(beta2, t)));
  p.inv_scale = inv_scale;
  p.decoupled = decoupled ? 1 : 0;
  p.maximize = maximize ? 1 : 0;
  return p;
}

void adam_step_cpu(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                   at::TensorList exp_avg_sqs, at::TensorList masters, at::TensorList steps,
                   const at::Tensor& lr, double beta1, double beta2, double eps,
                   double weight_decay, bool decoupled, bool maximize,
                   const std::optional<at::Tensor>& inv_scale,
                   const std::optional<at::Tensor>& found_inf) {
  const char* op = "adam_step_";
  std::vector<AdamTensor> plan = plan_adam(params, grads, exp_avgs, exp_avg_sqs, masters, steps,
                                           lr, beta1, beta2, eps, weight_decay, inv_scale,
                                           found_inf);
  if (plan.empty()) return;
  TORCH_CHECK(params[0].is_cpu(), "mpext.adam_step_: params[0] is on ", params[0].device(),
              " but this implementation is for the CPU");
  // The skip decision: on the CPU reading found_inf is free (no device to wait for).
  if (found_inf && found_inf->data_ptr<float>()[0] != 0.0f) return;
  const double lr_value = static_cast<double>(lr.data_ptr<float>()[0]);
  TORCH_CHECK_VALUE(std::isfinite(lr_value) && lr_value >= 0, "mpext.", op,
                    ": lr must be a finite number >= 0, got ", lr_value);
  const float inv = inv_scale ? inv_scale->data_ptr<float>()[0] : 1.0f;

  std::vector<mp_adam_params> scalars;
  std::vector<int64_t> prefix(1, 0);
  std::vector<const AdamTensor*> live;
  scalars.reserve(plan.size());
  for (const AdamTensor& a : plan) {
    const float t = *a.step + 1.0f;  // the step count is a float32 tensor, as torch's
    scalars.push_back(adam_scalars(lr_value, beta1, beta2, eps, weight_decay, decoupled,
                                   maximize, static_cast<double>(t), inv));
    live.push_back(&a);
    prefix.push_back(prefix.back() + a.numel);
  }
  at::parallel_for(0, prefix.back(), kGrainSize, [&](int64_t begin, int64_t end) {
    size_t i = std::upper_bound(prefix.begin(), prefix.end(), begin) - prefix.begin() - 1;
    for (int64_t pos = begin; pos < end; ++i) {
      if (prefix[i + 1] == prefix[i]) continue;  // zero-size param
      const AdamTensor& a = *live[i];
      const int64_t local = pos - prefix[i];
      const int64_t count = std::min(end, prefix[i + 1]) - pos;
      const int psize = a.param_dtype == MP_F32 ? 4 : 2;
      const int gsize = a.grad_dtype == MP_F32 ? 4 : 2;
      check_status(
          mp_adam_step(static_cast<char*>(a.param) + local * psize, a.param_dtype,
                       static_cast<const char*>(a.grad) + local * gsize, a.grad_dtype,
                       a.master ? a.master + local : nullptr, a.exp_avg + local,
                       a.exp_avg_sq + local, count, &scalars[i]),
          op);
      pos += count;
    }
  });
  for (const AdamTensor& a : plan) *a.step += 1.0f;
}

}  // namespace

TORCH_LIBRARY_IMPL(mpext, CPU, m) { m.impl("adam_step_", &adam_step_cpu); }

}  // namespace mpext
