// No header may bring in every ATen operator: common.h says why.
#define AT_PER_OPERATOR_HEADERS
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include "scale_common.h"

#include <cmath>
#include <vector>

#include "common.h"

namespace mpext {
std::vector<mp_unscale_segment> plan_unscale(at::TensorList grads, const at::Tensor& found_inf,
                                             const at::Tensor& inv_scale) {
  const char* op = "unscale_";
  const c10::Device device = found_inf.device();
  check_scalars(found_inf, op, "found_inf", at::kFloat, 1, device, "found_inf");
  check_scalars(inv_scale, op, "inv_scale", at::kFloat, 1, device, "found_inf");
  std::vector<ByteRange> ranges;
  std::vector<mp_unscale_segment> segs;
  ranges.reserve(grads.size() + 2);
  segs.reserve(grads.size());
  for (size_t k = 0; k < grads.size(); ++k) {
    const int64_t i = static_cast<int64_t>(k);
    const at::Tensor& g = grads[k];
    const Arg name("grads", i);
    check_device(g, op, name, device, "found_inf");
    check_dtype(g, op, name, {at::kFloat, at::kBFloat16, at::kHalf});
    check_dense(g, op, name);
    if (g.numel() == 0) continue;
    ranges.push_back(byte_range(g, i, true));
    segs.push_back({g.data_ptr(), to_mp_dtype(g.scalar_type()), g.numel()});
  }
  // found_inf is written too; inv_scale is only read.
  ranges.push_back(byte_range(found_inf, -1, true, "found_inf"));
  ranges.push_back(byte_range(inv_scale, -1, false, "inv_scale"));
  check_no_overlap(std::move(ranges), op, "grads", "grads");
  return segs;
}

void check_update_scale(const at::Tensor& scale, const at::Tensor& growth_tracker,
                        const at::Tensor& found_inf, double growth_factor, double backoff_factor,
                        int64_t growth_interval, const std::optional<at::Tensor>& hysteresis_tracker,
                        int64_t hysteresis, double min_scale, double max_scale,
                        const std::optional<at::Tensor>& stats) {
  const char* op = "update_scale_";
  const c10::Device device = scale.device();
  check_scalars(scale, op, "scale", at::kFloat, 1, device, "scale");
  check_scalars(growth_tracker, op, "growth_tracker", at::kInt, 1, device, "scale");
  check_scalars(found_inf, op, "found_inf", at::kFloat, 1, device, "scale");
  TORCH_CHECK_VALUE(std::isfinite(growth_factor) && growth_factor > 0, "mpext.", op,
                    ": growth_factor must be a positive finite number, got ", growth_factor);
  TORCH_CHECK_VALUE(std::isfinite(backoff_factor) && backoff_factor > 0, "mpext.", op,
                    ": backoff_factor must be a positive finite number, got ", backoff_factor);
  TORCH_CHECK_VALUE(growth_interval >= 1 && growth_interval <= INT32_MAX, "mpext.", op,
                    ": growth_interval must be in [1, 2^31), got ", growth_interval);
  TORCH_CHECK_VALUE(hysteresis >= 1 && hysteresis <= INT32_MAX, "mpext.", op,
                    ": hysteresis must be in [1, 2^31), got ", hysteresis);
  TORCH_CHECK_VALUE(hysteresis == 1 || hysteresis_tracker.has_value(), "mpext.", op,
                    ": hysteresis=", hysteresis, " needs a hysteresis_tracker tensor");
  if (hysteresis_tracker.has_value()) {
    check_scalars(*hysteresis_tracker, op, "hysteresis_tracker", at::kInt, 1, device, "scale");
  }
  if (stats.has_value()) check_scalars(*stats, op, "stats", at::kLong, 2, device, "scale");
  TORCH_CHECK_VALUE(std::isfinite(min_scale) && min_scale >= 0, "mpext.", op,
                    ": min_scale must be a finite number >= 0 (0 = no bound), got ", min_scale);
  TORCH_CHECK_VALUE(std::isfinite(max_scale) && max_scale >= 0, "mpext.", op,
                    ": max_scale must be a finite number >= 0 (0 = no bound), got ", max_scale);
  TORCH_CHECK_VALUE(min_scale == 0 || max_scale == 0 || min_scale <= max_scale, "mpext.", op,
                    ": min_scale (", min_scale, ") must not exceed max_scale (", max_scale, ")");
  std::vector<ByteRange> ranges = {byte_range(scale, -1, true, "scale"),
                                   byte_range(growth_tracker, -1, true, "growth_tracker"),
                                   byte_range(found_inf, -1, false, "found_inf")};
  if (hysteresis_tracker.has_value()) {
    ranges.push_back(byte_range(*hysteresis_tracker, -1, true, "hysteresis_tracker"));
  }
  if (stats.has_value()) ranges.push_back(byte_range(*stats, -1, true, "stats"));
  check_no_overlap(std::move(ranges), op, "", "");
}

}  // namespace mpext
