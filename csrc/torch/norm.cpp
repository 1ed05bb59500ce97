// CPU grad_norm: validate, cut every tensor into pieces of MP_GRAD_NORM_BLOCK elements (from its
// first element, so the cut depends only on the sizes), compute each piece's sum of squares in
// the C core on any thread (at::parallel_for), then add the pieces up in list order
// (mp_grad_norm_finish). Which thread computes a piece never changes its value, and the pieces
// are combined in one fixed order, so the result has the same bits for every thread count.

// No header may bring in every ATen operator: common.h says why.
#define AT_PER_OPERATOR_HEADERS
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include <ATen/core/Tensor.h>
#include <ATen/ops/scalar_tensor.h>
#include <ATen/ops/zeros.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "common.h"
#include "mpext/norm.h"
#include "multi_tensor.h"
#include "norm_common.h"

namespace mpext {
namespace {

struct Cpu {
  static constexpr c10::DeviceType kDevice = c10::kCPU;

  static at::Tensor grad_norm(const std::vector<mp_norm_segment>& segs,
                              const std::optional<at::Tensor>& inv_scale,
                              const c10::Device& device) {
    const float inv = inv_scale.has_value() ? inv_scale->const_data_ptr<float>()[0] : 1.0f;
    // Block b of segment k lands in partials[first[k] + b], whatever thread computes it.
    std::vector<int64_t> first(1, 0);
    int64_t total = 0;
    for (const mp_norm_segment& s : segs) {
      first.push_back(first.back() + (s.n + MP_GRAD_NORM_BLOCK - 1) / MP_GRAD_NORM_BLOCK);
      total += s.n;
    }
    std::vector<double> partials(static_cast<size_t>(first.back()));
    // A small list is not worth a parallel region: one task takes every block.
    const int64_t grain = total < 2 * kGrainSize ? std::max<int64_t>(first.back(), 1) : 1;
    parallel_segments(
        segs, grain,
        [&](size_t k, int64_t start, int64_t count) {
          const mp_norm_segment& s = segs[k];
          for (int64_t off = start; off < start + count; off += MP_GRAD_NORM_BLOCK) {
            const int64_t n = std::min<int64_t>(MP_GRAD_NORM_BLOCK, start + count - off);
            check_status(
                mp_grad_norm_sumsq(static_cast<const char*>(s.x) + off * MP_DTYPE_BYTES(s.dtype),
                                   static_cast<mp_dtype>(s.dtype), n, inv,
                                   &partials[first[k] + off / MP_GRAD_NORM_BLOCK]),
                "grad_norm");
          }
        },
        MP_GRAD_NORM_BLOCK);
    float norm = 0.0f;
    check_status(
        mp_grad_norm_finish(partials.data(), static_cast<int64_t>(partials.size()), &norm),
        "grad_norm");
    return at::scalar_tensor(norm, at::TensorOptions().dtype(at::kFloat).device(device));
  }
};

// A call with no tensor argument at all (an empty list, no inv_scale) has no device to dispatch
// on; torch then runs the CompositeExplicitAutograd kernel, which gives the documented 0.0 on
// the CPU. The same kernel is what a device without an mpext kernel would reach: say so.
at::Tensor grad_norm_no_device(at::TensorList tensors, const std::optional<at::Tensor>& inv_scale) {
  TORCH_CHECK(tensors.empty() && !inv_scale.has_value(), "mpext.grad_norm: no implementation for ",
              !tensors.empty() ? tensors[0].device() : inv_scale->device(),
              " tensors in this build (see mpext.build_info())");
  return at::zeros({}, at::TensorOptions().dtype(at::kFloat));
}

}  // namespace

TORCH_LIBRARY_IMPL(mpext, CPU, m) { m.impl("grad_norm", &grad_norm<Cpu>); }

TORCH_LIBRARY_IMPL(mpext, CompositeExplicitAutograd, m) {
  m.impl("grad_norm", &grad_norm_no_device);
}

}  // namespace mpext
