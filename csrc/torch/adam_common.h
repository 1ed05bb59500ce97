// Validation and planning shared by the CPU (adam.cpp) and CUDA (adam_cuda.cpp) adam_step_.
#pragma once

#include <ATen/ATen.h>

#include <optional>
#include <vector>

#include "mpext/adam.h"

namespace mpext {

// One parameter of an adam_step_ call, as raw pointers (all validated).
struct AdamTensor {
  void* param;
  mp_dtype param_dtype;
  const void* grad;
  mp_dtype grad_dtype;
  float* master;  // nullptr for an fp32 param
  float* exp_avg;
  float* exp_avg_sq;
  float* step;    // the param's float32 step count (one element, on the param's device)
  int64_t numel;
  int64_t index;  // position in the lists
};

// Checks every argument of adam_step_ before anything is written and returns the params in list
// order (zero-size ones included, numel 0). Throws (naming the argument) on: lists of different
// lengths (masters may also be empty when every param is fp32); a param that is not
// float32/bfloat16/float16; a grad whose dtype is neither the param's nor float32; exp_avg,
// exp_avg_sq, masters, steps, lr, inv_scale, found_inf not float32; shape or memory-layout
// mismatches; non-dense tensors; tensors on different devices (lr may also be on the CPU when
// params are on CUDA); lr, inv_scale, found_inf or a step with more than one element;
// a master missing for a bf16/fp16 param or present for an fp32 one; any tensor written by the
// op overlapping another tensor of the call; beta1, beta2 outside [0, 1); eps < 0;
// weight_decay < 0; any non-finite hyperparameter.
std::vector<AdamTensor> plan_adam(at::TensorList params, at::TensorList grads,
                                  at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                                  at::TensorList masters, at::TensorList steps,
                                  const at::Tensor& lr, double beta1, double beta2, double eps,
                                  double weight_decay,
                                  const std::optional<at::Tensor>& inv_scale,
                                  const std::optional<at::Tensor>& found_inf);

}  // namespace mpext
