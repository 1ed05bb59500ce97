// CPU grad_norm: validate, cut every tensor into pieces of MP_GRAD_NORM_BLOCK elements (from its
// first element, so the cut depends only on the sizes), compute each piece's sum of squares in
// the C core on any thread (at::parallel_for), then add the pieces up in list order
// (mp_grad_norm_finish). Which thread computes a piece never changes its value, and the pieces
// are combined in one fixed order, so the result has the same bits for every thread count.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <vector>

#include "common.h"
#include "mpext/norm.h"
#include "norm_common.h"

namespace mpext {
namespace {

struct Piece {
  const at::Tensor* t;
  int64_t offset, count;
};

at::Tensor grad_norm_cpu(at::TensorList tensors, const std::optional<at::Tensor>& inv_scale) {
  const char* op = "grad_norm";
  const c10::Device device = check_grad_norm(tensors, inv_scale);
  TORCH_CHECK(device.is_cpu(), "mpext.grad_norm: the tensors are on ", device,
              " but this implementation is for the CPU");
  const float inv = inv_scale.has_value() ? inv_scale->const_data_ptr<float>()[0] : 1.0f;
  std::vector<Piece> pieces;
  int64_t total = 0;
  for (const at::Tensor& t : tensors) {
    total += t.numel();
    for (int64_t off = 0; off < t.numel(); off += MP_GRAD_NORM_BLOCK) {
      pieces.push_back({&t, off, std::min<int64_t>(MP_GRAD_NORM_BLOCK, t.numel() - off)});
    }
  }
  std::vector<double> partials(pieces.size());
  const int64_t npieces = static_cast<int64_t>(pieces.size());
  // A small list is not worth a parallel region: one task takes every piece.
  const int64_t grain = total < 2 * kGrainSize ? std::max<int64_t>(npieces, 1) : 1;
  at::parallel_for(0, npieces, grain, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const Piece& p = pieces[k];
      const char* base = static_cast<const char*>(p.t->const_data_ptr()) +
                         p.offset * static_cast<int64_t>(p.t->element_size());
      mp_status s = MP_OK;
      switch (p.t->scalar_type()) {
        case at::kFloat:
          s = mp_grad_norm_sumsq_f32(reinterpret_cast<const float*>(base), p.count, inv,
                                     &partials[k]);
          break;
        case at::kBFloat16:
          s = mp_grad_norm_sumsq_bf16(reinterpret_cast<const uint16_t*>(base), p.count, inv,
                                      &partials[k]);
          break;
        default:
          s = mp_grad_norm_sumsq_fp16(reinterpret_cast<const uint16_t*>(base), p.count, inv,
                                      &partials[k]);
          break;
      }
      check_status(s, op);
    }
  });
  float norm = 0.0f;
  check_status(mp_grad_norm_finish(partials.data(), static_cast<int64_t>(partials.size()), &norm),
               op);
  return at::scalar_tensor(norm, at::TensorOptions().dtype(at::kFloat).device(device));
}

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

TORCH_LIBRARY_IMPL(mpext, CPU, m) { m.impl("grad_norm", &grad_norm_cpu); }

TORCH_LIBRARY_IMPL(mpext, CompositeExplicitAutograd, m) {
  m.impl("grad_norm", &grad_norm_no_device);
}

}  // namespace mpext
