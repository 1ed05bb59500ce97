// Validation shared by the CPU (scale.cpp) and CUDA (scale_cuda.cpp) loss-scaling ops.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

#include "common.h"
#include "mpext/scale.h"

namespace mpext {

// Checks every argument of unscale_ (before anything is written): found_inf and inv_scale are
// one-element float32 tensors, every grad is float32/bfloat16/float16, dense, on found_inf's
// device, and no grad shares memory with another grad or with found_inf/inv_scale. Returns the
// non-empty grads in list order.
std::vector<mp_unscale_segment> plan_unscale(at::TensorList grads, const at::Tensor& found_inf,
                                             const at::Tensor& inv_scale);

// Checks every argument of update_scale_: scale float32 and growth_tracker int32, found_inf
// float32, hysteresis_tracker int32 and stats int64[2] when given, each one element (stats two),
// all on scale's device; growth_interval >= 1, hysteresis >= 1 (a tracker is required when > 1),
// min_scale, max_scale >= 0 and min_scale <= max_scale when both are set.
void check_update_scale(const at::Tensor& scale, const at::Tensor& growth_tracker,
                        const at::Tensor& found_inf, double growth_factor, double backoff_factor,
                        int64_t growth_interval, const std::optional<at::Tensor>& hysteresis_tracker,
                        int64_t hysteresis, double min_scale, double max_scale,
                        const std::optional<at::Tensor>& stats);

// unscale_ and update_scale_ for one backend: validate everything, then Backend::unscale(segs,
// found_inf, inv_scale) / Backend::update_scale(update, device) run the kernels
// (Backend::kDevice: the device type it implements).
template <class Backend>
void unscale(at::TensorList grads, at::Tensor& found_inf, const at::Tensor& inv_scale) {
  const std::vector<mp_unscale_segment> segs = plan_unscale(grads, found_inf, inv_scale);
  check_backend(found_inf.device(), Backend::kDevice, "unscale_", "found_inf");
  if (!segs.empty()) Backend::unscale(segs, found_inf, inv_scale);
}

template <class Backend>
void update_scale(at::Tensor& scale, at::Tensor& growth_tracker, const at::Tensor& found_inf,
                  double growth_factor, double backoff_factor, int64_t growth_interval,
                  const std::optional<at::Tensor>& hysteresis_tracker, int64_t hysteresis,
                  double min_scale, double max_scale, const std::optional<at::Tensor>& stats) {
  check_update_scale(scale, growth_tracker, found_inf, growth_factor, backoff_factor,
                     growth_interval, hysteresis_tracker, hysteresis, min_scale, max_scale, stats);
  check_backend(scale.device(), Backend::kDevice, "update_scale_", "scale");
  const mp_scale_update u = {scale.data_ptr<float>(),
                             growth_tracker.data_ptr<int32_t>(),
                             found_inf.const_data_ptr<float>(),
                             hysteresis_tracker ? hysteresis_tracker->data_ptr<int32_t>() : nullptr,
                             stats ? stats->data_ptr<int64_t>() : nullptr,
                             growth_factor,
                             backoff_factor,
                             growth_interval,
                             static_cast<int32_t>(hysteresis),
                             min_scale,
                             max_scale};
  Backend::update_scale(u, scale.device());
}

}  // namespace mpext
