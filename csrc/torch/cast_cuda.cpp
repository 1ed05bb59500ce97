// CUDA implementations of the cast ops: validate (the checks shared with the CPU ops in
// cast_common.h), then hand raw pointers to the launchers of mpext/cast_cuda.h on the current
// stream of the tensors' device. Nothing here launches a kernel itself.
//
// The stream comes from c10/cuda/CUDAStream.h (at::cuda::getCurrentCUDAStream is that function),
// not ATen/cuda/CUDAContext.h, which would also need the cuBLAS/cuSPARSE/cuSOLVER headers that a
// minimal CUDA toolkit on a GPU-less builder may lack.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <vector>

#include "cast_common.h"
#include "common.h"
#include "common_cuda.h"
#include "mpext/cast_cuda.h"

namespace mpext {
namespace {

struct Cuda {
  static constexpr c10::DeviceType kDevice = c10::kCUDA;

  static void cast(const std::vector<mp_cast_segment>& segs, bool stochastic, int64_t seed,
                   const c10::Device& device, bool /*dst_fresh: a CPU matter*/, const char* op) {
    const c10::cuda::CUDAGuard guard(device);
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    const int sr = stochastic ? 1 : 0;
    // One large tensor: a grid-stride launch over the whole device; a list: packed launches.
    check_cuda_status(segs.size() == 1 ? mp_cast_cuda(segs.data(), sr, seed, stream)
                                       : mp_cast_multi_cuda(segs.data(),
                                                            static_cast<int64_t>(segs.size()), sr,
                                                            static_cast<uint64_t>(seed), stream),
                      op);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(mpext, CUDA, m) { CastOps<Cuda>::register_impls(m); }

}  // namespace mpext
