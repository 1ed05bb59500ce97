// CUDA implementation of adam_step_: validate (plan_adam, shared with the CPU op), then hand raw
// device pointers to the multi-tensor launcher of mpext/adam_cuda.h on the current stream of the
// params' device. The skip decision (found_inf), the step counts, inv_scale and a device lr are
// read by the kernels themselves, so nothing here waits for the device: the op is free of host
// synchronisation and can be captured in a CUDA graph (with lr on the device).
//
// The stream comes from c10/cuda/CUDAStream.h (at::cuda::getCurrentCUDAStream is that function),
// not ATen/cuda/CUDAContext.h, which would also need the cuBLAS/cuSPARSE/cuSOLVER headers that a
// minimal CUDA toolkit on a GPU-less builder may lack.
#include <ATen/ATen.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <torch/library.h>

#include <cmath>
#include <optional>
#include <vector>

#include "adam_common.h"
#include "common.h"
#include "common_cuda.h"
#include "mpext/adam_cuda.h"

namespace mpext {
namespace {

// Whether work enqueued on `stream` now would be captured into a CUDA graph. A failed query
// (e.g. the legacy default stream while another thread captures) counts as capturing; its
// error is cleared so that it cannot be mistaken for a failed launch later.
bool stream_is_capturing(cudaStream_t stream) {
  cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
  if (cudaStreamIsCapturing(stream, &status) != cudaSuccess) {
    (void)cudaGetLastError();
    return true;
  }
  return status != cudaStreamCaptureStatusNone;
}

void adam_step_cuda(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                    at::TensorList exp_avg_sqs, at::TensorList masters, at::TensorList steps,
                    const at::Tensor& lr, double beta1, double beta2, double eps,
                    double weight_decay, bool decoupled, bool maximize,
                    const std::optional<at::Tensor>& inv_scale,
                    const std::optional<at::Tensor>& found_inf) {
  const char* op = "adam_step_";
  // Every argument is checked before anything is launched: a bad call changes nothing.
  const std::vector<AdamTensor> plan =
      plan_adam(params, grads, exp_avgs, exp_avg_sqs, masters, steps, lr, beta1, beta2, eps,
                weight_decay, inv_scale, found_inf);
  if (plan.empty()) return;
  // plan_adam put every tensor on params[0]'s device, except lr, which may be on the CPU.
  const c10::Device device = params[0].device();
  TORCH_CHECK(device.is_cuda(), "mpext.", op, ": params[0] is on ", device,
              " but this implementation is for CUDA");
  const c10::cuda::CUDAGuard guard(device);
  const cudaStream_t stream = at::cuda::getCurrentCUDAStream();

  mp_adam_options_cuda opt{};
  opt.beta1 = beta1;
  opt.beta2 = beta2;
  opt.eps = eps;
  opt.weight_decay = weight_decay;
  opt.decoupled = decoupled ? 1 : 0;
  opt.maximize = maximize ? 1 : 0;
  if (lr.is_cuda()) {
    opt.lr = lr.const_data_ptr<float>();  // read by the kernel: no host synchronisation
  } else {
    // A host lr becomes a kernel argument. Inside a CUDA graph it would be frozen at its value
    // at capture time, silently ignoring later changes to the tensor: refuse that.
    TORCH_CHECK(!stream_is_capturing(stream), "mpext.", op,
                ": lr is on the CPU, so its value would be frozen into the CUDA graph being "
                "captured; put lr on ", device, " to capture this op");
    const float value = lr.const_data_ptr<float>()[0];  // a CPU read, no device involved
    TORCH_CHECK_VALUE(std::isfinite(value) && value >= 0.0f, "mpext.", op,
                      ": lr must be a finite number >= 0, got ", value);
    opt.lr = nullptr;
    opt.lr_value = value;
  }
  opt.inv_scale = inv_scale ? inv_scale->const_data_ptr<float>() : nullptr;
  opt.found_inf = found_inf ? found_inf->const_data_ptr<float>() : nullptr;

  std::vector<mp_adam_tensor_cuda> ts;
  ts.reserve(plan.size());
  for (const AdamTensor& a : plan) {
    // Zero-size params still take part: their step count advances like every other.
    ts.push_back({a.param, static_cast<int32_t>(a.param_dtype), a.grad,
                  static_cast<int32_t>(a.grad_dtype), a.master, a.exp_avg, a.exp_avg_sq, a.step,
                  a.numel});
  }
  check_cuda_status(
      mp_adam_step_multi_cuda(ts.data(), static_cast<int64_t>(ts.size()), &opt, stream), op);
}

}  // namespace

TORCH_LIBRARY_IMPL(mpext, CUDA, m) { m.impl("adam_step_", &adam_step_cuda); }

}  // namespace mpext
