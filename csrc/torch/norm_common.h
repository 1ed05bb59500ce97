// Validation and planning shared by the CPU (norm.cpp) and CUDA (norm_cuda.cpp) grad_norm.
#pragma once

#include <ATen/core/Tensor.h>

#include <optional>
#include <vector>

#include "common.h"
#include "mpext/norm.h"

namespace mpext {

// The device the result goes to: the tensors' device, else inv_scale's, else the CPU (an empty
// list without inv_scale).
c10::Device grad_norm_device(at::TensorList tensors, const std::optional<at::Tensor>& inv_scale);

// Checks every argument of grad_norm: every tensor is float32/bfloat16/float16, dense (treated
// as flat memory) and on grad_norm_device; inv_scale, when given, is a one-element dense float32
// tensor on that device. Returns the non-empty tensors in list order.
std::vector<mp_norm_segment> plan_grad_norm(at::TensorList tensors,
                                            const std::optional<at::Tensor>& inv_scale);

// grad_norm for one backend: validate everything, then Backend::grad_norm(segs, inv_scale, device)
// computes the 0-dim result on the device (Backend::kDevice: the device type it implements).
template <class Backend>
at::Tensor grad_norm(at::TensorList tensors, const std::optional<at::Tensor>& inv_scale) {
  const std::vector<mp_norm_segment> segs = plan_grad_norm(tensors, inv_scale);
  const c10::Device device = grad_norm_device(tensors, inv_scale);
  check_backend(device, Backend::kDevice, "grad_norm", "tensors[0]");
  return Backend::grad_norm(segs, inv_scale, device);
}

}  // namespace mpext
