// Validation shared by the CPU (norm.cpp) and CUDA (norm_cuda.cpp) grad_norm.
#pragma once

#include <ATen/ATen.h>

#include <optional>

namespace mpext {

// Checks every argument of grad_norm: every tensor is float32/bfloat16/float16, dense
// (treated as flat memory) and on tensors[0]'s device; inv_scale, when given, is a one-element
// dense float32 tensor on that device. Returns the device the result goes to: the tensors'
// device, else inv_scale's, else the CPU (an empty list without inv_scale).
c10::Device check_grad_norm(at::TensorList tensors, const std::optional<at::Tensor>& inv_scale);

}  // namespace mpext
