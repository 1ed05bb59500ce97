// CUDA implementations of the cast ops: validate (the checks shared with the CPU ops in
// cast_common.h), then hand raw pointers to the launchers of mpext/cast_cuda.h on the current
// stream of the tensors' device. Nothing here launches a kernel itself.
//
// The stream comes from c10/cuda/CUDAStream.h (at::cuda::getCurrentCUDAStream is that function),
// not ATen/cuda/CUDAContext.h, which would also need the cuBLAS/cuSPARSE/cuSOLVER headers that a
// minimal CUDA toolkit on a GPU-less builder may lack.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <vector>

#include "cast_common.h"
#include "common.h"
#include "common_cuda.h"
#include "mpext/cast_cuda.h"

namespace mpext {
namespace {

int mp_kind(CastKind kind) {
  switch (kind) {
    case CastKind::F32ToBF16: return MP_CAST_F32_TO_BF16;
    case CastKind::F32ToF16: return MP_CAST_F32_TO_F16;
    case CastKind::BF16ToF32: return MP_CAST_BF16_TO_F32;
    case CastKind::F16ToF32: return MP_CAST_F16_TO_F32;
    case CastKind::Copy32: return MP_CAST_COPY32;
    case CastKind::Copy16: return MP_CAST_COPY16;
  }
  TORCH_CHECK(false, "mpext: unknown cast kind");
}

// The output of a unary cast: x's shape and strides (x is dense, so empty_like keeps its memory
// layout and element i of x's memory maps to element i of the output's), dtype of the kind.
at::Tensor unary_cast_cuda(const at::Tensor& x, CastKind kind, bool stochastic, int64_t seed,
                           int64_t offset, const char* op) {
  const c10::cuda::CUDAGuard guard(x.device());
  at::Tensor out = at::empty_like(x, x.options().dtype(cast_dst_dtype(kind)));
  const int64_t n = x.numel();
  if (n == 0) return out;
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  const void* src = x.data_ptr();
  void* dst = out.data_ptr();
  mp_status s = MP_OK;
  switch (kind) {
    case CastKind::F32ToBF16:
      s = stochastic
              ? mp_to_bf16_sr_f32_cuda(static_cast<const float*>(src), static_cast<uint16_t*>(dst),
                                       n, static_cast<uint64_t>(seed),
                                       static_cast<uint64_t>(offset), stream)
              : mp_to_bf16_f32_cuda(static_cast<const float*>(src), static_cast<uint16_t*>(dst),
                                    n, stream);
      break;
    case CastKind::F32ToF16:
      s = mp_to_fp16_f32_cuda(static_cast<const float*>(src), static_cast<uint16_t*>(dst), n,
                              stream);
      break;
    case CastKind::BF16ToF32:
      s = mp_to_fp32_bf16_cuda(static_cast<const uint16_t*>(src), static_cast<float*>(dst), n,
                               stream);
      break;
    case CastKind::F16ToF32:
      s = mp_to_fp32_fp16_cuda(static_cast<const uint16_t*>(src), static_cast<float*>(dst), n,
                               stream);
      break;
    case CastKind::Copy32:
    case CastKind::Copy16:
      TORCH_CHECK(false, "mpext.", op, ": a copy is not a unary cast");
  }
  check_cuda_status(s, op);
  return out;
}

at::Tensor to_bf16_cuda(const at::Tensor& x, bool stochastic, int64_t seed, int64_t offset) {
  check_unary_cast(x, "to_bf16", {at::kFloat}, c10::DeviceType::CUDA, offset);
  return unary_cast_cuda(x, CastKind::F32ToBF16, stochastic, seed, offset, "to_bf16");
}

at::Tensor to_fp16_cuda(const at::Tensor& x) {
  check_unary_cast(x, "to_fp16", {at::kFloat}, c10::DeviceType::CUDA, 0);
  return unary_cast_cuda(x, CastKind::F32ToF16, false, 0, 0, "to_fp16");
}

at::Tensor to_fp32_cuda(const at::Tensor& x) {
  check_unary_cast(x, "to_fp32", {at::kBFloat16, at::kHalf}, c10::DeviceType::CUDA, 0);
  CastKind kind = x.scalar_type() == at::kBFloat16 ? CastKind::BF16ToF32 : CastKind::F16ToF32;
  return unary_cast_cuda(x, kind, false, 0, 0, "to_fp32");
}

void cast_cuda(at::TensorList dst, at::TensorList src, bool stochastic, int64_t seed,
               int64_t offset) {
  std::vector<CastSegment> segs = plan_cast(dst, src, stochastic, offset, "cast_");
  if (segs.empty()) return;
  // plan_cast put every tensor on dst[0]'s device.
  const c10::Device device = dst[0].device();
  TORCH_CHECK(device.is_cuda(), "mpext.cast_: the tensors are on ", device,
              " but this implementation is for CUDA");
  // Element k of the concatenated (non-empty) list has stream position offset + k, as on the CPU.
  std::vector<mp_cast_segment> ms;
  ms.reserve(segs.size());
  uint64_t position = static_cast<uint64_t>(offset);
  for (const CastSegment& s : segs) {
    ms.push_back({mp_kind(s.kind), s.src, s.dst, s.numel, position});
    position += static_cast<uint64_t>(s.numel);
  }
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
  check_cuda_status(mp_cast_multi_cuda(ms.data(), static_cast<int64_t>(ms.size()),
                                       stochastic ? 1 : 0, static_cast<uint64_t>(seed), stream),
                    "cast_");
}

}  // namespace

TORCH_LIBRARY_IMPL(mpext, CUDA, m) {
  m.impl("to_bf16", &to_bf16_cuda);
  m.impl("to_fp16", &to_fp16_cuda);
  m.impl("to_fp32", &to_fp32_cuda);
  m.impl("cast_", &cast_cuda);
}

}  // namespace mpext
