// CPU implementation of adam_step_: validate (plan_adam), then the C core over every param's
// elements, split across threads; the C core reads found_inf, the step counts, lr and inv_scale
// itself (the same rule as the CUDA kernels), and the step counts advance once every element
// is done.
#include <ATen/ATen.h>
#include <torch/library.h>

#include "adam_common.h"
#include "common.h"
#include "multi_tensor.h"

namespace mpext {
namespace {

struct Cpu {
  static constexpr c10::DeviceType kDevice = c10::kCPU;

  static void adam_step(const AdamPlan& plan, const c10::Device&) {
    // Ranges of whole blocks (of 8-bit moments; the block size divides the grain), so that
    // one call sees each block's every element.
    const int64_t unit = plan.options.q8_block;
    parallel_segments(
        plan.tensors, kGrainSize / unit,
        [&](size_t k, int64_t start, int64_t count) {
          check_status(mp_adam_step(&plan.tensors[k], start, count, &plan.options), "adam_step_");
        },
        unit);
    check_status(mp_adam_advance_steps(plan.tensors.data(),
                                       static_cast<int64_t>(plan.tensors.size()), &plan.options),
                 "adam_step_");
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(mpext, CPU, m) { m.impl("adam_step_", &adam_step<Cpu>); }

}  // namespace mpext
