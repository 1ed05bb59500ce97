// Validation and output allocation shared by the CPU (int8_block.cpp) and CUDA
// (int8_block_cuda.cpp) ops of the int8 block code of saved activations; the kernels see a tensor
// as rows x cols (cols = the last dimension), as the FP8 ops do (fp8_common.h).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

#include "common.h"
#include "mpext/int8_block.h"

namespace mpext {

// One call's geometry, after validation.
struct Int8BlockPlan {
  int64_t rows, cols, block;
};

// Checks x and block_size of int8_block_quantize, allocates q and scales, and returns the plan.
Int8BlockPlan plan_int8_block_quantize(const at::Tensor& x, int64_t block_size,
                                       c10::DeviceType device, at::Tensor* q, at::Tensor* scales);

// Checks the arguments of int8_block_dequantize, allocates out, and returns the plan.
Int8BlockPlan plan_int8_block_dequantize(const at::Tensor& q, const at::Tensor& scales,
                                         int64_t block_size,
                                         const std::optional<at::ScalarType>& dtype,
                                         c10::DeviceType device, at::Tensor* out);

// The ops for one backend: validate everything, then Backend::quantize / dequantize run the
// kernels (Backend::kDevice: the device type it implements).
template <class Backend>
struct Int8BlockOps {
  static std::tuple<at::Tensor, at::Tensor> quantize(const at::Tensor& x, int64_t block_size,
                                                     bool pow2_scale) {
    at::Tensor q, scales;
    const Int8BlockPlan p = plan_int8_block_quantize(x, block_size, Backend::kDevice, &q, &scales);
    if (p.rows * p.cols > 0) Backend::quantize(p, x, q, scales, pow2_scale);
    return {q, scales};
  }

  static at::Tensor dequantize(const at::Tensor& q, const at::Tensor& scales, int64_t block_size,
                               const std::optional<at::ScalarType>& dtype) {
    at::Tensor out;
    const Int8BlockPlan p =
        plan_int8_block_dequantize(q, scales, block_size, dtype, Backend::kDevice, &out);
    if (p.rows * p.cols > 0) Backend::dequantize(p, q, scales, out);
    return out;
  }

  // A template over torch::Library, as in fp8_common.h.
  template <class Library>
  static void register_impls(Library& m) {
    m.impl("int8_block_quantize", &quantize);
    m.impl("int8_block_dequantize", &dequantize);
  }
};

}  // namespace mpext
