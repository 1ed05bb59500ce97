// CUDA implementations of the int8 block code ops: validate (int8_block_common.h, shared with
// the CPU ops), then the launchers of mpext/int8_block_cuda.h on the current stream of the
// tensors' device. Nothing here launches a kernel itself.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include "common.h"
#include "common_cuda.h"
#include "int8_block_common.h"
#include "mpext/int8_block_cuda.h"

namespace mpext {
namespace {

struct Cuda {
  static constexpr c10::DeviceType kDevice = c10::kCUDA;

  static void quantize(const Int8BlockPlan& p, const at::Tensor& x, const at::Tensor& q,
                       const at::Tensor& scales, bool pow2) {
    const c10::cuda::CUDAGuard guard(x.device());
    check_cuda_status(
        mp_int8_block_quantize_cuda(x.const_data_ptr(), to_mp_dtype(x.scalar_type()),
                                    static_cast<int8_t*>(q.data_ptr()), scales.data_ptr<float>(),
                                    p.rows, p.cols, p.block, pow2 ? 1 : 0,
                                    at::cuda::getCurrentCUDAStream()),
        "int8_block_quantize");
  }

  static void dequantize(const Int8BlockPlan& p, const at::Tensor& q, const at::Tensor& scales,
                         const at::Tensor& out) {
    const c10::cuda::CUDAGuard guard(q.device());
    check_cuda_status(
        mp_int8_block_dequantize_cuda(static_cast<const int8_t*>(q.const_data_ptr()),
                                      scales.const_data_ptr<float>(), out.data_ptr(),
                                      to_mp_dtype(out.scalar_type()), p.rows, p.cols, p.block,
                                      at::cuda::getCurrentCUDAStream()),
        "int8_block_dequantize");
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(mpext, CUDA, m) { Int8BlockOps<Cuda>::register_impls(m); }

}  // namespace mpext
