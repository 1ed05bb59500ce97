// CUDA implementations of the FP8 block quantization ops: validate (fp8_common.h, shared with
// the CPU ops), then the launchers of mpext/fp8_cuda.h on the current stream of the tensors'
// device. Nothing here launches a kernel itself.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include "common.h"
#include "common_cuda.h"
#include "fp8_common.h"
#include "mpext/fp8_cuda.h"

namespace mpext {
namespace {

struct Cuda {
  static constexpr c10::DeviceType kDevice = c10::kCUDA;

  static void quantize(const Fp8Plan& p, const at::Tensor& x, const at::Tensor& q,
                       const at::Tensor& scales, bool pow2, bool sr, uint64_t seed,
                       uint64_t offset) {
    const c10::cuda::CUDAGuard guard(x.device());
    check_cuda_status(
        mp_fp8_quantize_cuda(x.const_data_ptr(), to_mp_dtype(x.scalar_type()),
                             static_cast<uint8_t*>(q.data_ptr()), scales.data_ptr<float>(),
                             p.rows, p.cols, p.block, p.fmt, pow2 ? 1 : 0, sr ? 1 : 0, seed,
                             offset, at::cuda::getCurrentCUDAStream()),
        "fp8_quantize");
  }

  static void dequantize(const Fp8Plan& p, const at::Tensor& q, const at::Tensor& scales,
                         const at::Tensor& out) {
    const c10::cuda::CUDAGuard guard(q.device());
    check_cuda_status(
        mp_fp8_dequantize_cuda(static_cast<const uint8_t*>(q.const_data_ptr()),
                               scales.const_data_ptr<float>(), out.data_ptr(),
                               to_mp_dtype(out.scalar_type()), p.rows, p.cols, p.block, p.fmt,
                               at::cuda::getCurrentCUDAStream()),
        "fp8_dequantize");
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(mpext, CUDA, m) { Fp8Ops<Cuda>::register_impls(m); }

}  // namespace mpext
