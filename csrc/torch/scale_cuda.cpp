// CUDA implementations of the loss-scaling ops: validate (the checks shared with the CPU ops in
// scale_common.h), then hand raw device pointers to the launchers of mpext/scale_cuda.h on the
// current stream of the tensors' device. Nothing here reads a device value on the host, so both
// ops are free of host synchronisation and can be captured in a CUDA graph.
//
// The stream comes from c10/cuda/CUDAStream.h (at::cuda::getCurrentCUDAStream is that function),
// not ATen/cuda/CUDAContext.h, which would also need the cuBLAS/cuSPARSE/cuSOLVER headers that a
// minimal CUDA toolkit on a GPU-less builder may lack.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "common.h"
#include "common_cuda.h"
#include "mpext/scale_cuda.h"
#include "scale_common.h"

namespace mpext {
namespace {

int unscale_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return MP_UNSCALE_F32;
    case at::kBFloat16: return MP_UNSCALE_BF16;
    case at::kHalf: return MP_UNSCALE_FP16;
    default: break;
  }
  TORCH_CHECK(false, "mpext.unscale_: unsupported grad dtype ", dtype_name(t));
}

void unscale_cuda(at::TensorList grads, at::Tensor& found_inf, const at::Tensor& inv_scale) {
  // Every argument is checked before anything is launched: a bad call changes nothing.
  check_unscale(grads, found_inf, inv_scale);
  TORCH_CHECK(found_inf.is_cuda(), "mpext.unscale_: found_inf is on ", found_inf.device(),
              " but this implementation is for CUDA");
  // check_unscale put every tensor on found_inf's device; each is dense, so it is flat memory.
  std::vector<mp_unscale_segment> segs;
  segs.reserve(grads.size());
  for (const at::Tensor& g : grads) {
    if (g.numel() == 0) continue;
    segs.push_back({unscale_dtype(g.scalar_type()), g.data_ptr(), g.numel()});
  }
  if (segs.empty()) return;
  const c10::cuda::CUDAGuard guard(found_inf.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  check_cuda_status(mp_unscale_multi_cuda(segs.data(), static_cast<int64_t>(segs.size()),
                                          found_inf.data_ptr<float>(),
                                          inv_scale.const_data_ptr<float>(), stream),
                    "unscale_");
}

void update_scale_cuda(at::Tensor& scale, at::Tensor& growth_tracker, const at::Tensor& found_inf,
                       double growth_factor, double backoff_factor, int64_t growth_interval,
                       const std::optional<at::Tensor>& hysteresis_tracker, int64_t hysteresis,
                       double min_scale, double max_scale, const std::optional<at::Tensor>& stats) {
  check_update_scale(scale, growth_tracker, found_inf, growth_factor, backoff_factor,
                     growth_interval, hysteresis_tracker, hysteresis, min_scale, max_scale, stats);
  TORCH_CHECK(scale.is_cuda(), "mpext.update_scale_: scale is on ", scale.device(),
              " but this implementation is for CUDA");
  const c10::cuda::CUDAGuard guard(scale.device());
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  check_cuda_status(
      mp_update_scale_cuda(scale.data_ptr<float>(), growth_tracker.data_ptr<int32_t>(),
                           found_inf.const_data_ptr<float>(), growth_factor, backoff_factor,
                           growth_interval,
                           hysteresis_tracker ? hysteresis_tracker->data_ptr<int32_t>() : nullptr,
                           static_cast<int32_t>(hysteresis), min_scale, max_scale,
                           stats ? stats->data_ptr<int64_t>() : nullptr, stream),
      "update_scale_");
}

}  // namespace

TORCH_LIBRARY_IMPL(mpext, CUDA, m) {
  m.impl("unscale_", &unscale_cuda);
  m.impl("update_scale_", &update_scale_cuda);
}

}  // namespace mpext
