// CUDA implementation of the step ops (one per rule: adam_step_, lion_step_, sgd_step_, ...):
// validate (plan_step, shared with the CPU ops), then hand raw
// device pointers to the multi-tensor launcher of mpext/step_cuda.h on the current stream of the
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

#include <optional>
#include <vector>

#include "rules/rules.h"
#include "step_common.h"
#include "common.h"
#include "common_cuda.h"
#include "mpext/step_cuda.h"

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

struct Cuda {
  static constexpr c10::DeviceType kDevice = c10::kCUDA;

  static void step(const StepPlan& plan, const c10::Device& device, const char* op) {
    const c10::cuda::CUDAGuard guard(device);
    const cudaStream_t stream = at::cuda::getCurrentCUDAStream();
    // A host lr becomes a kernel argument. Inside a CUDA graph it would be frozen at its value
    // at capture time, silently ignoring later changes to the tensor: refuse that.
    TORCH_CHECK(plan.options.lr != nullptr || !stream_is_capturing(stream),
                "mpext.", op, ": lr is on the CPU, so its value would be frozen into the CUDA "
                "graph being captured; put lr on ", device, " to capture this op");
    const int64_t n = static_cast<int64_t>(plan.tensors.size());
    // with stats (telemetry), the counting variant of the kernel; plan_step checked the rows
    check_cuda_status(plan.stats != nullptr
                          ? mp_step_multi_stats_cuda(plan.tensors.data(), n, &plan.options,
                                                     plan.stats, stream)
                          : mp_step_multi_cuda(plan.tensors.data(), n, &plan.options, stream),
                      op);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(mpext, CUDA, m) {
// One registration per row of mpext/rules/rules.h: "<name>_step_" is <name>_step<Cuda>.
#define MP_RULE_IMPL_(ID, name, MIN, MAX) m.impl(#name "_step_", &name##_step<Cuda>);
  MP_RULES(MP_RULE_IMPL_)
#undef MP_RULE_IMPL_
}

}  // namespace mpext
