// CPU implementations of the cast ops: validate, then split the flat element range across
// threads with at::parallel_for and call the C core on each piece.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>

#include <algorithm>
#include <vector>

#include "cast_common.h"
#include "common.h"
#include "mpext/cast.h"

namespace mpext {
namespace {

// Runs one conversion of n elements; position is the index (within the SR stream) of src[0].
void run_cast_cpu(CastKind kind, const void* src, void* dst, int64_t n, bool stochastic,
                  uint64_t seed, uint64_t position, const char* op) {
  mp_status s = MP_OK;
  switch (kind) {
    case CastKind::F32ToBF16:
      s = stochastic ? mp_to_bf16_sr_f32(static_cast<const float*>(src),
                                         static_cast<uint16_t*>(dst), n, seed, position)
                     : mp_to_bf16_f32(static_cast<const float*>(src),
                                      static_cast<uint16_t*>(dst), n);
      break;
    case CastKind::F32ToF16:
      s = mp_to_fp16_f32(static_cast<const float*>(src), static_cast<uint16_t*>(dst), n);
      break;
    case CastKind::BF16ToF32:
      s = mp_to_fp32_bf16(static_cast<const uint16_t*>(src), static_cast<float*>(dst), n);
      break;
    case CastKind::F16ToF32:
      s = mp_to_fp32_fp16(static_cast<const uint16_t*>(src), static_cast<float*>(dst), n);
      break;
    case CastKind::Copy32:
      std::copy_n(static_cast<const uint32_t*>(src), n, static_cast<uint32_t*>(dst));
      break;
    case CastKind::Copy16:
      std::copy_n(static_cast<const uint16_t*>(src), n, static_cast<uint16_t*>(dst));
      break;
  }
  check_status(s, op);
}

at::Tensor unary_cast_cpu(const at::Tensor& x, CastKind kind, bool stochastic, int64_t seed,
                          int64_t offset, const char* op) {
  at::Tensor out = at::empty_like(x, x.options().dtype(cast_dst_dtype(kind)));
  const char* src = static_cast<const char*>(x.data_ptr());
  char* dst = static_cast<char*>(out.data_ptr());
  const int64_t in_size = x.element_size(), out_size = out.element_size();
  at::parallel_for(0, x.numel(), kGrainSize, [&](int64_t begin, int64_t end) {
    run_cast_cpu(kind, src + begin * in_size, dst + begin * out_size, end - begin, stochastic,
                 static_cast<uint64_t>(seed), static_cast<uint64_t>(offset) + begin, op);
  });
  return out;
}

at::Tensor to_bf16_cpu(const at::Tensor& x, bool stochastic, int64_t seed, int64_t offset) {
  check_unary_cast(x, "to_bf16", {at::kFloat}, x.device().type(), offset);
  return unary_cast_cpu(x, CastKind::F32ToBF16, stochastic, seed, offset, "to_bf16");
}

at::Tensor to_fp16_cpu(const at::Tensor& x) {
  check_unary_cast(x, "to_fp16", {at::kFloat}, x.device().type(), 0);
  return unary_cast_cpu(x, CastKind::F32ToF16, false, 0, 0, "to_fp16");
}

at::Tensor to_fp32_cpu(const at::Tensor& x) {
  check_unary_cast(x, "to_fp32", {at::kBFloat16, at::kHalf}, x.device().type(), 0);
  CastKind kind = x.scalar_type() == at::kBFloat16 ? CastKind::BF16ToF32 : CastKind::F16ToF32;
  return unary_cast_cpu(x, kind, false, 0, 0, "to_fp32");
}

void cast_cpu(at::TensorList dst, at::TensorList src, bool stochastic, int64_t seed,
              int64_t offset) {
  std::vector<CastSegment> segs = plan_cast(dst, src, stochastic, offset, "cast_");
  if (segs.empty()) return;
  // prefix[i] = first element of segment i in the concatenated stream of all elements.
  std::vector<int64_t> prefix(segs.size() + 1, 0);
  for (size_t i = 0; i < segs.size(); ++i) prefix[i + 1] = prefix[i] + segs[i].numel;
  at::parallel_for(0, prefix.back(), kGrainSize, [&](int64_t begin, int64_t end) {
    size_t i = std::upper_bound(prefix.begin(), prefix.end(), begin) - prefix.begin() - 1;
    for (int64_t pos = begin; pos < end; ++i) {
      const CastSegment& s = segs[i];
      int64_t local = pos - prefix[i];
      int64_t count = std::min(end, prefix[i + 1]) - pos;
      run_cast_cpu(s.kind, static_cast<const char*>(s.src) + local * s.src_elem_size,
                   static_cast<char*>(s.dst) + local * s.dst_elem_size, count, stochastic,
                   static_cast<uint64_t>(seed), static_cast<uint64_t>(offset) + pos, "cast_");
      pos += count;
    }
  });
}

}  // namespace

TORCH_LIBRARY_IMPL(mpext, CPU, m) {
  m.impl("to_bf16", &to_bf16_cpu);
  m.impl("to_fp16", &to_fp16_cpu);
  m.impl("to_fp32", &to_fp32_cpu);
  m.impl("cast_", &cast_cpu);
}

}  // namespace mpext
