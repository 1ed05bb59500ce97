// CPU implementations of the FP8 block quantization ops: validate (fp8_common.h), then the C
// core's mp_fp8_quantize / mp_fp8_dequantize over whole rows, split across threads.

// No header may bring in every ATen operator: common.h says why.
#define AT_PER_OPERATOR_HEADERS
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>

#include "common.h"
#include "fp8_common.h"
#include "mpext/fp8.h"

namespace mpext {
namespace {

// Rows per task: whole rows (a block never crosses one), about kGrainSize elements.
int64_t row_grain(const Fp8Plan& p) { return std::max<int64_t>(1, kGrainSize / p.cols); }

int64_t nblocks(const Fp8Plan& p) { return (p.cols + p.block - 1) / p.block; }

struct Cpu {
  static constexpr c10::DeviceType kDevice = c10::kCPU;

  static void quantize(const Fp8Plan& p, const at::Tensor& x, const at::Tensor& q,
                       const at::Tensor& scales, bool pow2, bool sr, uint64_t seed,
                       uint64_t offset) {
    const char* src = static_cast<const char*>(x.const_data_ptr());
    uint8_t* dst = static_cast<uint8_t*>(q.data_ptr());
    float* s = scales.data_ptr<float>();
    const mp_dtype dtype = to_mp_dtype(x.scalar_type());
    at::parallel_for(0, p.rows, row_grain(p), [&](int64_t begin, int64_t end) {
      check_status(mp_fp8_quantize(src + begin * p.cols * MP_DTYPE_BYTES(dtype), dtype,
                                   dst + begin * p.cols, s + begin * nblocks(p), end - begin,
                                   p.cols, p.block, p.fmt, pow2 ? 1 : 0, sr ? 1 : 0, seed,
                                   offset + static_cast<uint64_t>(begin * p.cols)),
                   "fp8_quantize");
    });
  }

  static void dequantize(const Fp8Plan& p, const at::Tensor& q, const at::Tensor& scales,
                         const at::Tensor& out) {
    const uint8_t* src = static_cast<const uint8_t*>(q.const_data_ptr());
    const float* s = scales.const_data_ptr<float>();
    char* dst = static_cast<char*>(out.data_ptr());
    const mp_dtype dtype = to_mp_dtype(out.scalar_type());
    at::parallel_for(0, p.rows, row_grain(p), [&](int64_t begin, int64_t end) {
      check_status(mp_fp8_dequantize(src + begin * p.cols, s + begin * nblocks(p),
                                     dst + begin * p.cols * MP_DTYPE_BYTES(dtype), dtype,
                                     end - begin, p.cols, p.block, p.fmt),
                   "fp8_dequantize");
    });
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(mpext, CPU, m) { Fp8Ops<Cpu>::register_impls(m); }

}  // namespace mpext
