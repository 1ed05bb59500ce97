// CPU implementations of the int8 block code ops: validate (int8_block_common.h), then the C
// core's mp_int8_block_quantize / _dequantize over whole rows, split across threads.

// No header may bring in every ATen operator: common.h says why.
#define AT_PER_OPERATOR_HEADERS
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>

#include "common.h"
#include "int8_block_common.h"
#include "mpext/int8_block.h"

namespace mpext {
namespace {

// Rows per task: whole rows (a block never crosses one), about kGrainSize elements.
int64_t row_grain(const Int8BlockPlan& p) { return std::max<int64_t>(1, kGrainSize / p.cols); }

int64_t nblocks(const Int8BlockPlan& p) { return (p.cols + p.block - 1) / p.block; }

struct Cpu {
  static constexpr c10::DeviceType kDevice = c10::kCPU;

  static void quantize(const Int8BlockPlan& p, const at::Tensor& x, const at::Tensor& q,
                       const at::Tensor& scales, bool pow2) {
    const char* src = static_cast<const char*>(x.const_data_ptr());
    int8_t* dst = static_cast<int8_t*>(q.data_ptr());
    float* s = scales.data_ptr<float>();
    const mp_dtype dtype = to_mp_dtype(x.scalar_type());
    at::parallel_for(0, p.rows, row_grain(p), [&](int64_t begin, int64_t end) {
      check_status(mp_int8_block_quantize(src + begin * p.cols * MP_DTYPE_BYTES(dtype), dtype,
                                          dst + begin * p.cols, s + begin * nblocks(p),
                                          end - begin, p.cols, p.block, pow2 ? 1 : 0),
                   "int8_block_quantize");
    });
  }

  static void dequantize(const Int8BlockPlan& p, const at::Tensor& q, const at::Tensor& scales,
                         const at::Tensor& out) {
    const int8_t* src = static_cast<const int8_t*>(q.const_data_ptr());
    const float* s = scales.const_data_ptr<float>();
    char* dst = static_cast<char*>(out.data_ptr());
    const mp_dtype dtype = to_mp_dtype(out.scalar_type());
    at::parallel_for(0, p.rows, row_grain(p), [&](int64_t begin, int64_t end) {
      check_status(mp_int8_block_dequantize(src + begin * p.cols, s + begin * nblocks(p),
                                            dst + begin * p.cols * MP_DTYPE_BYTES(dtype), dtype,
                                            end - begin, p.cols, p.block),
                   "int8_block_dequantize");
    });
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(mpext, CPU, m) { Int8BlockOps<Cpu>::register_impls(m); }

}  // namespace mpext
