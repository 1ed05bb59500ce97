// CPU implementations of the cast ops: validate, then the C core's mp_cast over every pair's
// elements, split across threads.

// No header may bring in every ATen operator: common.h says why.
#define AT_PER_OPERATOR_HEADERS
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <vector>

#include "cast_common.h"
#include "common.h"
#include "multi_tensor.h"

namespace mpext {
namespace {

struct Cpu {
  static constexpr c10::DeviceType kDevice = c10::kCPU;

  static void cast(const std::vector<mp_cast_segment>& segs, bool stochastic, int64_t seed,
                   const c10::Device&, bool dst_fresh, const char* op) {
    parallel_segments(segs, kGrainSize, [&](size_t k, int64_t start, int64_t count) {
      const mp_cast_segment& s = segs[k];
      check_status(
          mp_cast(static_cast<const char*>(s.src) + start * MP_DTYPE_BYTES(s.src_dtype),
                  static_cast<mp_dtype>(s.src_dtype),
                  static_cast<char*>(s.dst) + start * MP_DTYPE_BYTES(s.dst_dtype),
                  static_cast<mp_dtype>(s.dst_dtype), count, stochastic ? 1 : 0,
                  static_cast<uint64_t>(seed), s.sr_position + static_cast<uint64_t>(start), dst_fresh ? 1 : 0),
          op);
    });
  }
};

}  // namespace

TORCH_LIBRARY_IMPL(mpext, CPU, m) { CastOps<Cpu>::register_impls(m); }

}  // namespace mpext
