// Shared helpers of the C++ binding: argument checks that name the argument, and the conversion
// of C-core status codes into exceptions. The binding validates everything before any kernel
// runs, so a failed check leaves every tensor unchanged.
#pragma once

// The Tensor class and its methods only. <ATen/ATen.h> declares every ATen operator and takes
// about four times as long to parse, in every unit, which is most of a first build: a unit
// includes the header of each at:: function it calls (<ATen/ops/empty.h>, PyTorch's own
// convention). The CPU units define AT_PER_OPERATOR_HEADERS (which PyTorch's own build defines:
// the installed headers have ops/) and TORCH_ASSERT_ONLY_METHOD_OPERATORS before any include, so
// that a header bringing in every operator (ATen/ATen.h, ATen/Functions.h) fails the build. The
// CUDA units (*_cuda.cpp) include <ATen/ATen.h> themselves.
#include <ATen/core/Tensor.h>

#include <cstdint>
#include <ostream>
#include <string>
#include <vector>

#include "mpext/mpext.h"

namespace mpext {

// Throws if a C-core call did not return MP_OK (after validation this means a bug).
inline void check_status(mp_status s, const char* op) {
  TORCH_CHECK(s == MP_OK, "mpext.", op, ": internal error from the C core: ", mp_status_string(s));
}

// How an argument is named in messages: "x", or "dst[3]" for an entry of a list. Non-owning and
// trivially copyable, so naming an argument costs nothing until a message is formatted, and
// TORCH_CHECK formats its message (through operator<<) only when the check fails. name must
// outlive the Arg (in practice it is always a string literal).
struct Arg {
  const char* name;
  int64_t index = -1;  // position in its list, or -1 for a lone tensor
  constexpr Arg(const char* name_, int64_t index_ = -1) : name(name_), index(index_) {}  // NOLINT
};

inline std::ostream& operator<<(std::ostream& os, const Arg& a) {
  os << a.name;
  if (a.index >= 0) os << '[' << a.index << ']';
  return os;
}

// Element-wise ops treat a tensor as flat memory, which is right for any dense, non-overlapping
// layout (contiguous, channels_last, any permutation); reject the rest (gaps or self-overlap).
inline void check_dense(const at::Tensor& t, const char* op, Arg name) {
  TORCH_CHECK(t.layout() == at::kStrided, "mpext.", op, ": ", name,
              " must be a strided (dense) tensor, got layout ", t.layout());
  TORCH_CHECK(t.is_non_overlapping_and_dense(), "mpext.", op, ": ", name,
              " must be dense and non-overlapping (e.g. contiguous or channels_last); got sizes ",
              t.sizes(), " and strides ", t.strides(), ". Call .contiguous() on it first.");
}

// The name Python users know a dtype by ("float32", not "Float").
inline std::string dtype_name(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return "float32";
    case at::kDouble: return "float64";
    case at::kHalf: return "float16";
    case at::kBFloat16: return "bfloat16";
    case at::kInt: return "int32";
    case at::kLong: return "int64";
    case at::kShort: return "int16";
    case at::kChar: return "int8";
    case at::kByte: return "uint8";
    case at::kBool: return "bool";
    default: return c10::toString(t);
  }
}

inline void check_dtype(const at::Tensor& t, const char* op, Arg name,
                        std::initializer_list<at::ScalarType> allowed) {
  for (auto d : allowed) {
    if (t.scalar_type() == d) return;
  }
  std::string list;
  for (auto d : allowed) {
    if (!list.empty()) list += " or ";
    list += dtype_name(d);
  }
  TORCH_CHECK(false, "mpext.", op, ": ", name, " must have dtype ", list, ", got ",
              dtype_name(t.scalar_type()));
}

// The mp_dtype of a float32, bfloat16 or float16 tensor, or of the int8 / uint8 codes of Adam's
// 8-bit moments (callers check the dtype first).
inline mp_dtype to_mp_dtype(at::ScalarType t) {
  return t == at::kFloat      ? MP_F32
         : t == at::kBFloat16 ? MP_BF16
         : t == at::kChar     ? MP_I8
         : t == at::kByte     ? MP_U8
                              : MP_F16;
}

// t is on `device` (or, when cpu_ok, on the CPU); the one wording of a device mismatch.
inline void check_device(const at::Tensor& t, const char* op, Arg name, const c10::Device& device,
                         Arg owner, bool cpu_ok = false) {
  TORCH_CHECK(t.device() == device || (cpu_ok && t.is_cpu()), "mpext.", op, ": ", name,
              " is on ", t.device(), " but ", owner, " is on ", device,
              cpu_ok ? " (it may also be on the CPU)" : "; all tensors must be on one device");
}

// A small tensor of scalars (a flag, a scale, a step count): dtype, number of elements, device
// and a dense layout, each with its own message.
inline void check_scalars(const at::Tensor& t, const char* op, Arg name, at::ScalarType dtype,
                          int64_t numel, const c10::Device& device, Arg owner,
                          bool cpu_ok = false) {
  TORCH_CHECK(t.scalar_type() == dtype, "mpext.", op, ": ", name, " must have dtype ",
              dtype_name(dtype), ", got ", dtype_name(t.scalar_type()));
  TORCH_CHECK(t.numel() == numel, "mpext.", op, ": ", name, " must have ", numel,
              numel == 1 ? " element" : " elements", ", got ", t.numel());
  check_device(t, op, name, device, owner, cpu_ok);
  check_dense(t, op, name);
}

// Two tensors of one shape map index -> memory alike iff their strides agree on every dimension
// of size > 1 (the stride of a size-1 dimension is never used).
inline bool same_layout(const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes()) return false;
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (a.size(d) > 1 && a.stride(d) != b.stride(d)) return false;
  }
  return true;
}

// t has ref's shape and memory layout: element-wise kernels pair them element by element.
inline void check_same_layout(const at::Tensor& t, Arg name, const at::Tensor& ref, Arg ref_name,
                              const char* op) {
  TORCH_CHECK_VALUE(same_layout(t, ref), "mpext.", op, ": ", name, " (sizes ", t.sizes(),
                    ", strides ", t.strides(), ") must match ", ref_name, " (sizes ", ref.sizes(),
                    ", strides ", ref.strides(), ")");
}

// A backend file's kernels take tensors of one device type: `name` (the tensor the call dispatched
// on) must be on it.
inline void check_backend(const c10::Device& device, c10::DeviceType backend, const char* op,
                          Arg name) {
  TORCH_CHECK(device.type() == backend, "mpext.", op, ": ", name, " is on ", device,
              " but this implementation is for ", backend == c10::kCPU ? "the CPU" : "CUDA");
}

// The [first, last) byte range a dense tensor occupies.
struct ByteRange {
  uintptr_t begin, end;
  int64_t index;             // position in its list
  bool is_dst;               // written by the op
  Arg label = Arg(nullptr);  // the argument's own name ("found_inf", "params[3]"), or unset
};

inline ByteRange byte_range(const at::Tensor& t, int64_t index, bool is_dst,
                            Arg label = Arg(nullptr)) {
  auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
  return {begin, begin + static_cast<uintptr_t>(t.numel()) * t.element_size(), index, is_dst,
          label};
}

// Rejects any destination that overlaps another destination or a source: the kernels assume
// src and dst never alias. Ranges are named label, or dst_name[index] / src_name[index].
// O(n log n) in the number of tensors; ranges that begin at one address keep their order in
// `ranges`, so which pair is reported does not depend on the sort implementation.
void check_no_overlap(std::vector<ByteRange> ranges, const char* op, const char* dst_name,
                      const char* src_name);

// Elements per task for at::parallel_for: large enough that a task outweighs its scheduling.
constexpr int64_t kGrainSize = 1 << 16;

}  // namespace mpext
