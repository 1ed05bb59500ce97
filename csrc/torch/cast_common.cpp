#include "cast_common.h"

#include <torch/library.h>

#include "common.h"

namespace mpext {

at::ScalarType cast_dst_dtype(CastKind kind) {
  switch (kind) {
    case CastKind::F32ToBF16: return at::kBFloat16;
    case CastKind::F32ToF16: return at::kHalf;
    case CastKind::BF16ToF32:
    case CastKind::F16ToF32:
    case CastKind::Copy32: return at::kFloat;
    case CastKind::Copy16: break;
  }
  TORCH_CHECK(false, "mpext: cast_dst_dtype is undefined for a 16-bit copy");
}

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

CastKind kind_for(const at::Tensor& d, const at::Tensor& s, int64_t i, const char* op) {
  const at::ScalarType dt = d.scalar_type(), st = s.scalar_type();
  auto ok_dtype = [](at::ScalarType t) {
    return t == at::kFloat || t == at::kBFloat16 || t == at::kHalf;
  };
  TORCH_CHECK(ok_dtype(dt), "mpext.", op, ": ", Arg("dst", i),
              " must be float32, bfloat16 or float16, got ", dtype_name(dt));
  TORCH_CHECK(ok_dtype(st), "mpext.", op, ": ", Arg("src", i),
              " must be float32, bfloat16 or float16, got ", dtype_name(st));
  if (st == dt) return st == at::kFloat ? CastKind::Copy32 : CastKind::Copy16;
  if (st == at::kFloat) return dt == at::kBFloat16 ? CastKind::F32ToBF16 : CastKind::F32ToF16;
  TORCH_CHECK(dt == at::kFloat, "mpext.", op, ": cannot cast ", Arg("src", i), " (",
              dtype_name(st), ") to ", Arg("dst", i), " (", dtype_name(dt),
              "): one side of each pair must be float32, or both the same dtype");
  return st == at::kBFloat16 ? CastKind::BF16ToF32 : CastKind::F16ToF32;
}

// Two dense tensors of one shape map index -> memory alike iff their strides agree on every
// dimension of size > 1 (the stride of a size-1 dimension is never used).
bool same_memory_layout(const at::Tensor& a, const at::Tensor& b) {
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (a.size(d) > 1 && a.stride(d) != b.stride(d)) return false;
  }
  return true;
}

}  // namespace

std::vector<CastSegment> plan_cast(at::TensorList dst, at::TensorList src, bool stochastic,
                                   int64_t offset, const char* op) {
  TORCH_CHECK_VALUE(dst.size() == src.size(), "mpext.", op,
                    ": dst and src must have the same length, got ", dst.size(), " and ",
                    src.size());
  TORCH_CHECK_VALUE(offset >= 0, "mpext.", op, ": offset must be >= 0, got ", offset);
  std::vector<CastSegment> segs;
  if (dst.empty()) return segs;
  const c10::Device device = dst[0].device();
  std::vector<ByteRange> ranges;
  ranges.reserve(2 * dst.size());
  segs.reserve(dst.size());
  for (size_t k = 0; k < dst.size(); ++k) {
    const int64_t i = static_cast<int64_t>(k);
    const at::Tensor& d = dst[k];
    const at::Tensor& s = src[k];
    TORCH_CHECK(d.device() == device, "mpext.", op, ": all tensors must be on one device; ",
                Arg("dst", i), " is on ", d.device(), " but dst[0] is on ", device);
    TORCH_CHECK(s.device() == device, "mpext.", op, ": all tensors must be on one device; ",
                Arg("src", i), " is on ", s.device(), " but dst[0] is on ", device);
    CastKind kind = kind_for(d, s, i, op);
    TORCH_CHECK_VALUE(d.sizes() == s.sizes(), "mpext.", op, ": ", Arg("dst", i),
                      " has shape ", d.sizes(), " but ", Arg("src", i), " has shape ",
                      s.sizes());
    check_dense(d, op, Arg("dst", i));
    check_dense(s, op, Arg("src", i));
    TORCH_CHECK_VALUE(same_memory_layout(d, s), "mpext.", op, ": ",
                      Arg("dst", i), " has strides ", d.strides(), " but ",
                      Arg("src", i), " has strides ", s.strides(),
                      "; both must share one memory layout");
    TORCH_CHECK_VALUE(!stochastic || kind != CastKind::F32ToF16, "mpext.", op,
                      ": stochastic rounding is implemented for float32 -> bfloat16 only, but ",
                      Arg("dst", i), " is float16");
    if (d.numel() == 0) continue;
    ranges.push_back(byte_range(d, i, true));
    ranges.push_back(byte_range(s, i, false));
    segs.push_back({kind, s.data_ptr(), d.data_ptr(), d.numel(), s.element_size(),
                    d.element_size(), i});
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
  std::vector<CastSegment> segs = plan_cast(dst, src, stochastic, offset, "cast_");
  TORCH_CHECK(segs.empty(), "mpext.cast_: no kernel for tensors on ", dst[0].device(),
              "; mpext supports CPU and CUDA tensors");
}

}  // namespace

TORCH_LIBRARY_IMPL(mpext, CompositeExplicitAutograd, m) { m.impl("cast_", &cast_fallback); }

}  // namespace mpext
