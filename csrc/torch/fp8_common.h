// Validation and output allocation shared by the CPU (fp8.cpp) and CUDA (fp8_cuda.cpp) FP8 block
// quantization ops; the kernels see a tensor as rows x cols (cols = the last dimension).
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <tuple>

#include "common.h"
#include "mpext/fp8.h"

namespace mpext {

// One call's geometry and pointers, after validation.
struct Fp8Plan {
  int64_t rows, cols, block;
  int fmt;  // MP_FP8_E4M3 or MP_FP8_E5M2
};

// Checks x and the options of fp8_quantize, allocates q and scales, and returns the plan.
Fp8Plan plan_fp8_quantize(const at::Tensor& x, int64_t block_size,
                          const std::optional<at::ScalarType>& fp8_dtype, int64_t offset,
                          c10::DeviceType device, at::Tensor* q, at::Tensor* scales);

// Checks the arguments of fp8_dequantize, allocates out, and returns the plan.
Fp8Plan plan_fp8_dequantize(const at::Tensor& q, const at::Tensor& scales, int64_t block_size,
                            const std::optional<at::ScalarType>& dtype, c10::DeviceType device,
                            at::Tensor* out);

// The ops for one backend: validate everything, then Backend::quantize / dequantize run the
// kernels (Backend::kDevice: the device type it implements).
template <class Backend>
struct Fp8Ops {
  static std::tuple<at::Tensor, at::Tensor> quantize(
      const at::Tensor& x, int64_t block_size, const std::optional<at::ScalarType>& fp8_dtype,
      bool pow2_scale, bool stochastic, int64_t seed, int64_t offset) {
    at::Tensor q, scales;
    const Fp8Plan p = plan_fp8_quantize(x, block_size, fp8_dtype, offset, Backend::kDevice, &q,
                                        &scales);
    if (p.rows * p.cols > 0) {
      Backend::quantize(p, x, q, scales, pow2_scale, stochastic, static_cast<uint64_t>(seed),
                        static_cast<uint64_t>(offset));
    }
    return {q, scales};
  }

  static at::Tensor dequantize(const at::Tensor& q, const at::Tensor& scales, int64_t block_size,
                               const std::optional<at::ScalarType>& dtype) {
    at::Tensor out;
    const Fp8Plan p = plan_fp8_dequantize(q, scales, block_size, dtype, Backend::kDevice, &out);
    if (p.rows * p.cols > 0) Backend::dequantize(p, q, scales, out);
    return out;
  }

  // A template over torch::Library, as in cast_common.h: fp8_common.cpp registers nothing and
  // need not parse <torch/library.h>.
  template <class Library>
  static void register_impls(Library& m) {
    m.impl("fp8_quantize", &quantize);
    m.impl("fp8_dequantize", &dequantize);
  }
};

}  // namespace mpext
