// No header may bring in every ATen operator: common.h says why.
#define AT_PER_OPERATOR_HEADERS
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include "cast_common.h"

#include <ATen/ops/empty_like.h>
#include <torch/library.h>

#include "common.h"

namespace mpext {

void check_unary_cast(const at::Tensor& x, const char* op,
                      std::initializer_list<at::ScalarType> dtypes, c10::DeviceType device,
                      int64_t offset) {
  TORCH_CHECK(x.device().type() == device, "mpext.", op, ": x is on ", x.device(),
              " but this implementation is for ", device);
  check_dtype(x, op, "x", dtypes);
  check_dense(x, op, "x");
  TORCH_CHECK_VALUE(offset >= 0, "mpext.", op, ": offset must be >= 0, got ", offset);
}

namespace {

void check_cast_pair(const at::Tensor& d, const at::Tensor& s, int64_t i, const char* op) {
  const at::ScalarType dt = d.scalar_type(), st = s.scalar_type();
  check_dtype(d, op, Arg("dst", i), {at::kFloat, at::kBFloat16, at::kHalf});
  check_dtype(s, op, Arg("src", i), {at::kFloat, at::kBFloat16, at::kHalf});
  TORCH_CHECK(st == dt || st == at::kFloat || dt == at::kFloat, "mpext.", op, ": cannot cast ",
              Arg("src", i), " (", dtype_name(st), ") to ", Arg("dst", i), " (", dtype_name(dt),
              "): one side of each pair must be float32, or both the same dtype");
}

}  // namespace

at::Tensor unary_cast_output(const at::Tensor& x, at::ScalarType dtype, int64_t offset,
                             mp_cast_segment* seg) {
  at::Tensor out = at::empty_like(x, x.options().dtype(dtype));
  *seg = {x.const_data_ptr(), out.data_ptr(), to_mp_dtype(x.scalar_type()), to_mp_dtype(dtype),
          x.numel(), static_cast<uint64_t>(offset)};
  return out;
}

std::vector<mp_cast_segment> plan_cast(at::TensorList dst, at::TensorList src, bool stochastic,
                                       int64_t offset, const char* op) {
  TORCH_CHECK_VALUE(dst.size() == src.size(), "mpext.", op,
                    ": dst and src must have the same length, got ", dst.size(), " and ",
                    src.size());
  TORCH_CHECK_VALUE(offset >= 0, "mpext.", op, ": offset must be >= 0, got ", offset);
  std::vector<mp_cast_segment> segs;
  if (dst.empty()) return segs;
  const c10::Device device = dst[0].device();
  std::vector<ByteRange> ranges;
  ranges.reserve(2 * dst.size());
  segs.reserve(dst.size());
  uint64_t position = static_cast<uint64_t>(offset);
  for (size_t k = 0; k < dst.size(); ++k) {
    const int64_t i = static_cast<int64_t>(k);
    const at::Tensor& d = dst[k];
    const at::Tensor& s = src[k];
    check_device(d, op, Arg("dst", i), device, Arg("dst", 0));
    check_device(s, op, Arg("src", i), device, Arg("dst", 0));
    check_cast_pair(d, s, i, op);
    TORCH_CHECK_VALUE(d.sizes() == s.sizes(), "mpext.", op, ": ", Arg("dst", i),
                      " has shape ", d.sizes(), " but ", Arg("src", i), " has shape ",
                      s.sizes());
    check_dense(d, op, Arg("dst", i));
    check_dense(s, op, Arg("src", i));
    check_same_layout(d, Arg("dst", i), s, Arg("src", i), op);
    TORCH_CHECK_VALUE(!stochastic || !(s.scalar_type() == at::kFloat &&
                                       d.scalar_type() == at::kHalf),
                      "mpext.", op,
                      ": stochastic rounding is implemented for float32 -> bfloat16 only, but ",
                      Arg("dst", i), " is float16");
    if (d.numel() == 0) continue;
    ranges.push_back(byte_range(d, i, true));
    ranges.push_back(byte_range(s, i, false));
    segs.push_back({s.const_data_ptr(), d.data_ptr(), to_mp_dtype(s.scalar_type()),
                    to_mp_dtype(d.scalar_type()), d.numel(), position});
    position += static_cast<uint64_t>(d.numel());
  }
  check_no_overlap(std::move(ranges), op, "dst", "src");
  return segs;
}

}  // namespace mpext

namespace mpext {
namespace {

// Reached when no backend kernel applies: an empty list (no tensor to pick a backend from),
// or tensors on a device mpext has no kernel for.
void cast_fallback(at::TensorList dst, at::TensorList src, bool stochastic, int64_t seed,
                   int64_t offset) {
  const std::vector<mp_cast_segment> segs = plan_cast(dst, src, stochastic, offset, "cast_");
  TORCH_CHECK(segs.empty(), "mpext.cast_: no kernel for tensors on ", dst[0].device(),
              "; mpext supports CPU and CUDA tensors");
}

}  // namespace

TORCH_LIBRARY_IMPL(mpext, CompositeExplicitAutograd, m) { m.impl("cast_", &cast_fallback); }

}  // namespace mpext
