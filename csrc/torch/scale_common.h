// Validation shared by the CPU (scale.cpp) and CUDA (scale_cuda.cpp) loss-scaling ops.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace mpext {

// Checks every argument of unscale_ (before anything is written): found_inf and inv_scale are
// one-element float32 tensors, every grad is float32/bfloat16/float16, dense, on found_inf's
// device, and no grad shares memory with another grad or with found_inf/inv_scale.
void check_unscale(at::TensorList grads, const at::Tensor& found_inf,
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

}  // namespace mpext
