// Validation and planning shared by the CPU (cast.cpp) and CUDA (cast_cuda.cpp) cast ops.
#pragma once

#include <ATen/core/Tensor.h>

#include <initializer_list>
#include <vector>

#include "common.h"
#include "mpext/cast.h"

namespace mpext {

// Checks x for a unary cast op (to_bf16, to_fp16, to_fp32): dtype, device type, layout, and a
// non-negative stochastic-rounding offset.
void check_unary_cast(const at::Tensor& x, const char* op,
                      std::initializer_list<at::ScalarType> dtypes, c10::DeviceType device,
                      int64_t offset);

// The output of a unary cast of x to dtype, and the one segment that fills it.
at::Tensor unary_cast_output(const at::Tensor& x, at::ScalarType dtype, int64_t offset,
                             mp_cast_segment* seg);

// Checks every argument of cast_ and returns its non-empty pairs in list order, element k of
// the concatenated list at stochastic-rounding position offset + k. Throws, before anything is
// written, on: lists of different lengths; tensors on different devices; unsupported dtype
// pairs; shape or stride mismatch; layouts that are not dense; destinations overlapping any
// other tensor; stochastic rounding requested for an fp32 -> fp16 pair; a negative offset.
std::vector<mp_cast_segment> plan_cast(at::TensorList dst, at::TensorList src, bool stochastic,
                                       int64_t offset, const char* op);

// The cast ops for one backend: validate everything, then Backend::cast(segs, stochastic, seed,
// device, dst_fresh, op) converts (Backend::kDevice: the device type it implements). dst_fresh:
// the destinations were just allocated by the op (mp_cast says why the CPU cares).
template <class Backend>
struct CastOps {
  static at::Tensor unary(const at::Tensor& x, at::ScalarType dtype, bool stochastic,
                          int64_t seed, int64_t offset, const char* op) {
    mp_cast_segment seg;
    at::Tensor out = unary_cast_output(x, dtype, offset, &seg);
    if (seg.n > 0) Backend::cast({seg}, stochastic, seed, x.device(), /*dst_fresh=*/true, op);
    return out;
  }

  static at::Tensor to_bf16(const at::Tensor& x, bool stochastic, int64_t seed, int64_t offset) {
    check_unary_cast(x, "to_bf16", {at::kFloat}, Backend::kDevice, offset);
    return unary(x, at::kBFloat16, stochastic, seed, offset, "to_bf16");
  }

  static at::Tensor to_fp16(const at::Tensor& x) {
    check_unary_cast(x, "to_fp16", {at::kFloat}, Backend::kDevice, 0);
    return unary(x, at::kHalf, false, 0, 0, "to_fp16");
  }

  static at::Tensor to_fp32(const at::Tensor& x) {
    check_unary_cast(x, "to_fp32", {at::kBFloat16, at::kHalf}, Backend::kDevice, 0);
    return unary(x, at::kFloat, false, 0, 0, "to_fp32");
  }

  static void cast_(at::TensorList dst, at::TensorList src, bool stochastic, int64_t seed,
                    int64_t offset) {
    const std::vector<mp_cast_segment> segs = plan_cast(dst, src, stochastic, offset, "cast_");
    if (segs.empty()) return;
    // plan_cast put every tensor on dst[0]'s device.
    check_backend(dst[0].device(), Backend::kDevice, "cast_", Arg("dst", 0));
    Backend::cast(segs, stochastic, seed, dst[0].device(), /*dst_fresh=*/false, "cast_");
  }

  // A template over torch::Library, so that this header needs no <torch/library.h>: only the
  // units that register (TORCH_LIBRARY_IMPL) pay for it.
  template <class Library>
  static void register_impls(Library& m) {
    m.impl("to_bf16", &to_bf16);
    m.impl("to_fp16", &to_fp16);
    m.impl("to_fp32", &to_fp32);
    m.impl("cast_", &cast_);
  }
};

}  // namespace mpext
