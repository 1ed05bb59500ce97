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

struct Cuda {
  static constexpr c10::DeviceType kDevice = c10::kCUDA;

  static void unscale(const std::vector<mp_unscale_segment>& segs, at::Tensor& found_inf,
                      const at::Tensor& inv_scale) {
    const c10::cuda::CUDAGuard guard(found_inf.device());
    check_cuda_status(mp_unscale_multi_cuda(segs.data(), static_cast<int64_t>(segs.size()),
                                            found_inf.data_ptr<float>(),
                                            inv_scale.const_data_ptr<float>(),
                                            at::cuda::getCurrentCUDAStream()),
                      "unscale_");
  }

  static void update_scale(const mp_scale_update& u, const c10::Device& device) {
    const c10::cuda::CUDAGuard guard(device);
    check_cuda_status(mp_update_scale_cuda(&u, at::cuda::getCurrentCUDAStream()),
                      "update_scale_");
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(mpext, CUDA, m) {
  m.impl("unscale_", &unscale<Cuda>);
  m.impl("update_scale_", &update_scale<Cuda>);
}

}  // namespace mpext
