// Validation shared by the CPU (telemetry.cpp) and CUDA (telemetry_cuda.cpp) unscale_stats_.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

#include "common.h"
#include "mpext/telemetry.h"

namespace mpext {

// One non-empty gradient of unscale_stats_: its data and its row in counts / max_abs (its
// position in the op's list, empty gradients included).
struct StatsSegment {
  void* g;
  int32_t dtype;  // an mp_dtype
  int64_t n;
  int64_t row;
};

// Checks every argument of unscale_stats_ before anything is written: unscale_'s checks on
// grads, found_inf and inv_scale; counts int64 [len(grads), 4] and max_abs float32 [len(grads)]
// contiguous, first_nonfinite int64 with one element, stat_inv_scale float32 with one element,
// all on found_inf's device; nothing written overlaps anything else. Returns the non-empty
// grads in list order.
std::vector<StatsSegment> plan_unscale_stats(at::TensorList grads, const at::Tensor& found_inf,
                                             const at::Tensor& inv_scale,
                                             const at::Tensor& counts, const at::Tensor& max_abs,
                                             const at::Tensor& first_nonfinite,
                                             const std::optional<at::Tensor>& stat_inv_scale);

}  // namespace mpext
