// CPU implementations of the loss-scaling ops: validate, then run the C core -- unscale_ over
// every grad's elements split across threads, update_scale_ on the scalars.

// No header may bring in every ATen operator: common.h says why.
#define AT_PER_OPERATOR_HEADERS
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <atomic>
#include <vector>

#include "common.h"
#include "mpext/scale.h"
#include "multi_tensor.h"
#include "scale_common.h"

namespace mpext {
namespace {

struct Cpu {
  static constexpr c10::DeviceType kDevice = c10::kCPU;

  static void unscale(const std::vector<mp_unscale_segment>& segs, at::Tensor& found_inf,
                      const at::Tensor& inv_scale) {
    const float inv = inv_scale.const_data_ptr<float>()[0];
    std::atomic<int32_t> any_found{0};
    parallel_segments(segs, kGrainSize, [&](size_t k, int64_t start, int64_t count) {
      const mp_unscale_segment& s = segs[k];
      int32_t found = 0;
      check_status(mp_unscale(static_cast<char*>(s.g) + start * MP_DTYPE_BYTES(s.dtype),
                              static_cast<mp_dtype>(s.dtype), count, inv, &found),
                   "unscale_");
      if (found) any_found.store(1, std::memory_order_relaxed);
    });
    if (any_found.load()) found_inf.data_ptr<float>()[0] = 1.0f;
  }

  static void update_scale(const mp_scale_update& u, const c10::Device&) {
    check_status(mp_update_scale(&u), "update_scale_");
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(mpext, CPU, m) {
  m.impl("unscale_", &unscale<Cpu>);
  m.impl("update_scale_", &update_scale<Cpu>);
}

}  // namespace mpext
