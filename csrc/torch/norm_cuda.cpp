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

int32_t norm_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return MP_F32;
    case at::kBFloat16: return MP_BF16;
    case at::kHalf: return MP_F16;
    default: break;
  }
  TORCH_CHECK(false, "mpext.grad_norm: unsupported dtype ", dtype_name(t));
}

at::Tensor grad_norm_cuda(at::TensorList tensors, const std::optional<at::Tensor>& inv_scale) {
  const char* op = "grad_norm";
  const c10::Device device = check_grad_norm(tensors, inv_scale);
  TORCH_CHECK(device.is_cuda(), "mpext.grad_norm: the tensors are on ", device,
              " but this implementation is for CUDA");
  std::vector<mp_grad_norm_segment> segs;
  segs.reserve(tensors.size());
  for (const at::Tensor& t : tensors) {
    if (t.numel() == 0) continue;
    segs.push_back({norm_dtype(t.scalar_type()), t.const_data_ptr(), t.numel()});
  }
  const int64_t nsegs = static_cast<int64_t>(segs.size());
  const int64_t need = mp_grad_norm_workspace_cuda(segs.data(), nsegs);
  TORCH_CHECK(need >= 0, "mpext.grad_norm: internal error: the C API rejected the segments");
  const c10::cuda::CUDAGuard guard(device);
  const auto f32 = at::TensorOptions().dtype(at::kFloat).device(device);
  at::Tensor out = at::empty({}, f32);
  at::Tensor workspace = at::empty({need}, f32.dtype(at::kDouble));
  const cudaStream_t stream = c10::cuda::getCurrentCUDAStream(device.index());
  check_cuda_status(
      mp_grad_norm_multi_cuda(segs.data(), nsegs,
                              inv_scale.has_value() ? inv_scale->const_data_ptr<float>() : nullptr,
                              workspace.data_ptr<double>(), need, out.data_ptr<float>(), stream),
      op);
  return out;
}

}  // namespace

TORCH_LIBRARY_IMPL(mpext, CUDA, m) { m.impl("grad_norm", &grad_norm_cuda); }

}  // namespace mpext
