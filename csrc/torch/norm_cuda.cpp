// CUDA grad_norm: validate (the checks shared with the CPU op in norm_common.h), allocate the
// per-block workspace and the 0-dim result through torch's caching allocator (stream-ordered, no
// synchronisation), and hand raw device pointers to mp_grad_norm_multi_cuda on the current
// stream of the tensors' device. Nothing here reads a device value on the host.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <optional>
#include <vector>

#include "common.h"
#include "common_cuda.h"
#include "mpext/norm_cuda.h"
#include "norm_common.h"

namespace mpext {
namespace {

struct Cuda {
  static constexpr c10::DeviceType kDevice = c10::kCUDA;

  static at::Tensor grad_norm(const std::vector<mp_norm_segment>& segs,
                              const std::optional<at::Tensor>& inv_scale,
                              const c10::Device& device) {
    const int64_t nsegs = static_cast<int64_t>(segs.size());
    const int64_t need = mp_grad_norm_workspace_cuda(segs.data(), nsegs);
    TORCH_CHECK(need >= 0, "mpext.grad_norm: internal error: the C API rejected the segments");
    const c10::cuda::CUDAGuard guard(device);
    const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
    at::Tensor out = at::empty({}, f32);
    at::Tensor workspace = at::empty({need}, f32.dtype(at::kDouble));
    check_cuda_status(
        mp_grad_norm_multi_cuda(segs.data(), nsegs,
                                inv_scale.has_value() ? inv_scale->const_data_ptr<float>()
                                                      : nullptr,
                                workspace.data_ptr<double>(), need, out.data_ptr<float>(),
                                at::cuda::getCurrentCUDAStream()),
        "grad_norm");
    return out;
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(mpext, CUDA, m) { m.impl("grad_norm", &grad_norm<Cuda>); }

}  // namespace mpext
