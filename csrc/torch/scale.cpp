// CPU implementations of the loss-scaling ops: validate, then run the C core — unscale_ over the
// concatenated element range of all grads split across threads, update_scale_ on the scalars.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <vector>

#include "common.h"
#include "mpext/scale.h"
#include "scale_common.h"

namespace mpext {
namespace {

void unscale_cpu(at::TensorList grads, at::Tensor& found_inf, const at::Tensor& inv_scale) {
  check_unscale(grads, found_inf, inv_scale);
  const char* op = "unscale_";
  TORCH_CHECK(found_inf.is_cpu(), "mpext.unscale_: found_inf is on ", found_inf.device(),
              " but this implementation is for the CPU");
  std::vector<const at::Tensor*> live;
  std::vector<int64_t> prefix(1, 0);
  for (const at::Tensor& g : grads) {
    if (g.numel() == 0) continue;
    live.push_back(&g);
    prefix.push_back(prefix.back() + g.numel());
  }
  if (live.empty()) return;
  const float inv = inv_scale.data_ptr<float>()[0];
  std::atomic<int32_t> any_found{0};
  at::parallel_for(0, prefix.back(), kGrainSize, [&](int64_t begin, int64_t end) {
    int32_t found = 0;
    size_t i = std::upper_bound(prefix.begin(), prefix.end(), begin) - prefix.begin() - 1;
    for (int64_t pos = begin; pos < end; ++i) {
      const at::Tensor& g = *live[i];
      const int64_t local = pos - prefix[i];
      const int64_t count = std::min(end, prefix[i + 1]) - pos;
      mp_status s = MP_OK;
      switch (g.scalar_type()) {
        case at::kFloat:
          s = mp_unscale_f32(static_cast<float*>(g.data_ptr()) + local, count, inv, &found);
          break;
        case at::kBFloat16:
          s = mp_unscale_bf16(static_cast<uint16_t*>(g.data_ptr()) + local, count, inv, &found);
          break;
        default:
          s = mp_unscale_fp16(static_cast<uint16_t*>(g.data_ptr()) + local, count, inv, &found);
          break;
      }
      check_status(s, op);
      pos += count;
    }
    if (found) any_found.store(1, std::memory_order_relaxed);
  });
  if (any_found.load()) found_inf.data_ptr<float>()[0] = 1.0f;
}

void update_scale_cpu(at::Tensor& scale, at::Tensor& growth_tracker, const at::Tensor& found_inf,
                      double growth_factor, double backoff_factor, int64_t growth_interval,
                      const std::optional<at::Tensor>& hysteresis_tracker, int64_t hysteresis,
                      double min_scale, double max_scale, const std::optional<at::Tensor>& stats) {
  check_update_scale(scale, growth_tracker, found_inf, growth_factor, backoff_factor,
                     growth_interval, hysteresis_tracker, hysteresis, min_scale, max_scale, stats);
  TORCH_CHECK(scale.is_cpu(), "mpext.update_scale_: scale is on ", scale.device(),
              " but this implementation is for the CPU");
  check_status(
      mp_update_scale(scale.data_ptr<float>(), growth_tracker.data_ptr<int32_t>(),
                      found_inf.data_ptr<float>(), growth_factor, backoff_factor, growth_interval,
                      hysteresis_tracker ? hysteresis_tracker->data_ptr<int32_t>() : nullptr,
                      static_cast<int32_t>(hysteresis), min_scale, max_scale,
                      stats ? stats->data_ptr<int64_t>() : nullptr),
      "update_scale_");
}

}  // namespace

TORCH_LIBRARY_IMPL(mpext, CPU, m) {
  m.impl("unscale_", &unscale_cpu);
  m.impl("update_scale_", &update_scale_cpu);
}

}  // namespace mpext
