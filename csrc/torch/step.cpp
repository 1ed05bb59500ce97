// CPU implementation of the step ops (one per rule: adam_step_, lion_step_, sgd_step_, ...):
// validate (plan_step), then the C core (mp_step, which steps by the options' rule) over every
// param's elements, split
// across threads; the C core reads found_inf, the step counts, lr and inv_scale
// itself (the same rule as the CUDA kernels), and the step counts advance once every element
// is done.

// No header may bring in every ATen operator: common.h says why.
#define AT_PER_OPERATOR_HEADERS
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <mutex>
#include <vector>

#include "mpext/telemetry.h"
#include "rules/rules.h"
#include "step_common.h"
#include "common.h"
#include "multi_tensor.h"

namespace mpext {
namespace {

struct Cpu {
  static constexpr c10::DeviceType kDevice = c10::kCPU;

  static void step(const StepPlan& plan, const c10::Device&, const char* op) {
    // Ranges of whole blocks (of 8-bit moments; the block size divides the grain), so that
    // one call sees each block's every element.
    const int64_t unit = plan.options.q8_block;
    if (plan.stats != nullptr) {
      // Telemetry: each range counts into a row of its own, added to its param's row under one
      // lock (a merge per range of >= kGrainSize elements costs nothing). The counts are exact
      // whatever the split; the sums of errors are added in the order the ranges finish.
      std::mutex merge;
      parallel_segments(
          plan.tensors, kGrainSize / unit,
          [&](size_t k, int64_t start, int64_t count) {
            double row[MP_STS_NCOLS] = {};
            check_status(mp_step_stats(&plan.tensors[k], start, count, &plan.options, row), op);
            std::lock_guard<std::mutex> lock(merge);
            double* dst = plan.stats + static_cast<int64_t>(k) * MP_STS_NCOLS;
            for (int j = 0; j < MP_STS_NCOLS; ++j) dst[j] += row[j];
          },
          unit);
    } else {
      parallel_segments(
          plan.tensors, kGrainSize / unit,
          [&](size_t k, int64_t start, int64_t count) {
            check_status(mp_step(&plan.tensors[k], start, count, &plan.options), op);
          },
          unit);
    }
    check_status(mp_step_advance_steps(plan.tensors.data(),
                                       static_cast<int64_t>(plan.tensors.size()), &plan.options),
                 op);
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(mpext, CPU, m) {
// One registration per row of mpext/rules/rules.h: "<name>_step_" is <name>_step<Cpu>.
#define MP_RULE_IMPL_(ID, name, MIN, MAX) m.impl(#name "_step_", &name##_step<Cpu>);
  MP_RULES(MP_RULE_IMPL_)
#undef MP_RULE_IMPL_
}

}  // namespace mpext
