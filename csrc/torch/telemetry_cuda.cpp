// CUDA implementation of unscale_stats_ (precision telemetry, issue 46): the checks shared with
// the CPU op (telemetry_common.h), then raw device pointers to mp_unscale_stats_multi_cuda on
// the current stream of the tensors' device. Nothing is read on the host: no sync, capturable.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "common.h"
#include "common_cuda.h"
#include "mpext/telemetry_cuda.h"
#include "telemetry_common.h"

namespace mpext {
namespace {

void unscale_stats_cuda(at::TensorList grads, at::Tensor& found_inf, const at::Tensor& inv_scale,
                        at::Tensor& counts, at::Tensor& max_abs, at::Tensor& first_nonfinite,
                        const std::optional<at::Tensor>& stat_inv_scale) {
  const std::vector<StatsSegment> plan = plan_unscale_stats(
      grads, found_inf, inv_scale, counts, max_abs, first_nonfinite, stat_inv_scale);
  check_backend(found_inf.device(), c10::kCUDA, "unscale_stats_", "found_inf");
  if (plan.empty()) return;
  std::vector<mp_stats_segment> segs;
  segs.reserve(plan.size());
  for (const StatsSegment& s : plan) segs.push_back({s.g, s.dtype, s.n, s.row});
  const c10::cuda::CUDAGuard guard(found_inf.device());
  check_cuda_status(
      mp_unscale_stats_multi_cuda(segs.data(), static_cast<int64_t>(segs.size()),
                                  found_inf.data_ptr<float>(), inv_scale.const_data_ptr<float>(),
                                  stat_inv_scale ? stat_inv_scale->const_data_ptr<float>()
                                                 : nullptr,
                                  counts.data_ptr<int64_t>(), max_abs.data_ptr<float>(),
                                  first_nonfinite.data_ptr<int64_t>(),
                                  at::cuda::getCurrentCUDAStream()),
      "unscale_stats_");
}

}  // namespace

TORCH_LIBRARY_IMPL(mpext, CUDA, m) { m.impl("unscale_stats_", &unscale_stats_cuda); }

}  // namespace mpext
