// Validation and planning shared by the CPU (cast.cpp) and CUDA (cast_cuda.cpp) cast ops.
#pragma once

#include <ATen/ATen.h>

#include <initializer_list>
#include <vector>

namespace mpext {

enum class CastKind { F32ToBF16, F32ToF16, BF16ToF32, F16ToF32, Copy32, Copy16 };

at::ScalarType cast_dst_dtype(CastKind kind);

// One dst[i] <- src[i] pair of cast_, as flat memory.
struct CastSegment {
  CastKind kind;
  const void* src;
  void* dst;
  int64_t numel;
  int64_t src_elem_size, dst_elem_size;
  int64_t index;  // i
};

// Checks x for a unary cast op (to_bf16, to_fp16, to_fp32): dtype, device type, layout, and a
// non-negative stochastic-rounding offset.
void check_unary_cast(const at::Tensor& x, const char* op,
                      std::initializer_list<at::ScalarType> dtypes, c10::DeviceType device,
                      int64_t offset);

// Checks every argument of cast_ and returns its non-empty segments in list order. Throws,
// before anything is written, on: lists of different lengths; tensors on different devices;
// unsupported dtype pairs; shape or stride mismatch; layouts that are not dense; destinations
// overlapping any other tensor; stochastic rounding requested for an fp32 -> fp16 pair; a
// negative offset.
std::vector<CastSegment> plan_cast(at::TensorList dst, at::TensorList src, bool stochastic,
                                   int64_t offset, const char* op);

}  // namespace mpext
