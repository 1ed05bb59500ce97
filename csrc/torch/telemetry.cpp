// unscale_stats_ (precision telemetry, issue 46): unscale_ plus per-gradient counts taken in the
// same pass. The argument checks shared with CUDA, and the CPU implementation: the C core over
// every grad's elements split across threads, each range's counts merged per gradient.

// No header may bring in every ATen operator: common.h says why.
#define AT_PER_OPERATOR_HEADERS
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include "telemetry_common.h"

#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <mutex>
#include <vector>

#include "common.h"
#include "multi_tensor.h"

namespace mpext {

std::vector<StatsSegment> plan_unscale_stats(at::TensorList grads, const at::Tensor& found_inf,
                                             const at::Tensor& inv_scale,
                                             const at::Tensor& counts, const at::Tensor& max_abs,
                                             const at::Tensor& first_nonfinite,
                                             const std::optional<at::Tensor>& stat_inv_scale) {
  const char* op = "unscale_stats_";
  const c10::Device device = found_inf.device();
  const int64_t ntensors = static_cast<int64_t>(grads.size());
  check_scalars(found_inf, op, "found_inf", at::kFloat, 1, device, "found_inf");
  check_scalars(inv_scale, op, "inv_scale", at::kFloat, 1, device, "found_inf");
  check_scalars(first_nonfinite, op, "first_nonfinite", at::kLong, 1, device, "found_inf");
  if (stat_inv_scale.has_value()) {
    check_scalars(*stat_inv_scale, op, "stat_inv_scale", at::kFloat, 1, device, "found_inf");
  }
  TORCH_CHECK(counts.scalar_type() == at::kLong, "mpext.", op, ": counts must have dtype int64, got ",
              dtype_name(counts.scalar_type()));
  TORCH_CHECK(counts.dim() == 2 && counts.size(0) == ntensors && counts.size(1) == MP_TEL_NCOUNTS,
              "mpext.", op, ": counts must have shape [len(grads), ", int(MP_TEL_NCOUNTS),
              "] = [", ntensors, ", ", int(MP_TEL_NCOUNTS), "], got ", counts.sizes());
  TORCH_CHECK(max_abs.scalar_type() == at::kFloat, "mpext.", op,
              ": max_abs must have dtype float32, got ", dtype_name(max_abs.scalar_type()));
  TORCH_CHECK(max_abs.dim() == 1 && max_abs.size(0) == ntensors, "mpext.", op,
              ": max_abs must have shape [len(grads)] = [", ntensors, "], got ", max_abs.sizes());
  check_device(counts, op, "counts", device, "found_inf");
  check_device(max_abs, op, "max_abs", device, "found_inf");
  TORCH_CHECK(counts.is_contiguous() && max_abs.is_contiguous(), "mpext.", op,
              ": counts and max_abs must be contiguous (rows are addressed as row * 4 / row)");
  std::vector<ByteRange> ranges;
  std::vector<StatsSegment> segs;
  ranges.reserve(grads.size() + 6);
  segs.reserve(grads.size());
  for (int64_t i = 0; i < ntensors; ++i) {
    const at::Tensor& g = grads[i];
    const Arg name("grads", i);
    check_device(g, op, name, device, "found_inf");
    check_dtype(g, op, name, {at::kFloat, at::kBFloat16, at::kHalf});
    check_dense(g, op, name);
    if (g.numel() == 0) continue;
    ranges.push_back(byte_range(g, i, true));
    segs.push_back({g.data_ptr(), to_mp_dtype(g.scalar_type()), g.numel(), i});
  }
  ranges.push_back(byte_range(found_inf, -1, true, "found_inf"));
  ranges.push_back(byte_range(inv_scale, -1, false, "inv_scale"));
  if (ntensors > 0) {
    ranges.push_back(byte_range(counts, -1, true, "counts"));
    ranges.push_back(byte_range(max_abs, -1, true, "max_abs"));
  }
  ranges.push_back(byte_range(first_nonfinite, -1, true, "first_nonfinite"));
  if (stat_inv_scale.has_value()) {
    ranges.push_back(byte_range(*stat_inv_scale, -1, false, "stat_inv_scale"));
  }
  check_no_overlap(std::move(ranges), op, "grads", "grads");
  return segs;
}

namespace {

void unscale_stats_cpu(at::TensorList grads, at::Tensor& found_inf, const at::Tensor& inv_scale,
                       at::Tensor& counts, at::Tensor& max_abs, at::Tensor& first_nonfinite,
                       const std::optional<at::Tensor>& stat_inv_scale) {
  const std::vector<StatsSegment> segs = plan_unscale_stats(
      grads, found_inf, inv_scale, counts, max_abs, first_nonfinite, stat_inv_scale);
  check_backend(found_inf.device(), c10::kCPU, "unscale_stats_", "found_inf");
  if (segs.empty()) return;
  const float inv = inv_scale.const_data_ptr<float>()[0];
  const float stat_inv = stat_inv_scale ? stat_inv_scale->const_data_ptr<float>()[0] : inv;
  // Each thread counts its ranges in a local mp_grad_stats and merges it into its gradient's
  // total under one lock: a merge per range of >= kGrainSize elements costs nothing.
  std::vector<mp_grad_stats> total(segs.size(), mp_grad_stats{{0, 0, 0, 0}, 0.0f});
  std::mutex lock;
  std::atomic<int32_t> any_found{0};
  parallel_segments(segs, kGrainSize, [&](size_t k, int64_t start, int64_t count) {
    const StatsSegment& s = segs[k];
    mp_grad_stats local = {{0, 0, 0, 0}, 0.0f};
    int32_t found = 0;
    check_status(mp_unscale_stats(static_cast<char*>(s.g) + start * MP_DTYPE_BYTES(s.dtype),
                                  static_cast<mp_dtype>(s.dtype), count, inv, stat_inv, &found,
                                  &local),
                 "unscale_stats_");
    if (found) any_found.store(1, std::memory_order_relaxed);
    const std::lock_guard<std::mutex> hold(lock);
    for (int j = 0; j < MP_TEL_NCOUNTS; ++j) total[k].count[j] += local.count[j];
    total[k].max_abs = mp_tel_max_bits(total[k].max_abs, local.max_abs);
  });
  int64_t* c = counts.data_ptr<int64_t>();
  float* m = max_abs.data_ptr<float>();
  int64_t first = -1;
  for (size_t k = 0; k < segs.size(); ++k) {
    const int64_t row = segs[k].row;
    for (int j = 0; j < MP_TEL_NCOUNTS; ++j) c[row * MP_TEL_NCOUNTS + j] += total[k].count[j];
    m[row] = mp_tel_max_bits(m[row], total[k].max_abs);
    if (first < 0 && total[k].count[MP_TEL_NONFINITE] > 0) first = row;
  }
  if (first >= 0) {
    int64_t* f = first_nonfinite.data_ptr<int64_t>();
    *f = std::min(*f, first);
  }
  if (any_found.load()) found_inf.data_ptr<float>()[0] = 1.0f;
}

}  // namespace

TORCH_LIBRARY_IMPL(mpext, CPU, m) { m.impl("unscale_stats_", &unscale_stats_cpu); }

}  // namespace mpext
