// CPU implementation of adam_step_, lion_step_ and sgd_step_: validate (plan_step), then the C
// core (mp_adam_step, which steps by the options' rule) over every param's elements, split
// across threads; the C core reads found_inf, the step counts, lr and inv_scale
// itself (the same rule as the CUDA kernels), and the step counts advance once every element
// is done.

// No header may bring in every ATen operator: common.h says why.
#define AT_PER_OPERATOR_HEADERS
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include "adam_common.h"
#include "common.h"
#include "multi_tensor.h"

namespace mpext {
namespace {

struct Cpu {
  static constexpr c10::DeviceType kDevice = c10::kCPU;

  static void step(const AdamPlan& plan, const c10::Device&, const char* op) {
    // Ranges of whole blocks (of 8-bit moments; the block size divides the grain), so that
    // one call sees each block's every element.
    const int64_t unit = plan.options.q8_block;
    parallel_segments(
        plan.tensors, kGrainSize / unit,
        [&](size_t k, int64_t start, int64_t count) {
          check_status(mp_adam_step(&plan.tensors[k], start, count, &plan.options), op);
        },
        unit);
    check_status(mp_adam_advance_steps(plan.tensors.data(),
                                       static_cast<int64_t>(plan.tensors.size()), &plan.options),
                 op);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(mpext, CPU, m) {
  m.impl("adam_step_", &adam_step<Cpu>);
  m.impl("lion_step_", &lion_step<Cpu>);
  m.impl("sgd_step_", &sgd_step<Cpu>);
  m.impl("muon_step_", &muon_step<Cpu>);  // muon
}

}  // namespace mpext
