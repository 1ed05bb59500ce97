// No header may bring in every ATen operator: common.h says why.
#define AT_PER_OPERATOR_HEADERS
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include "common.h"

#include <algorithm>

namespace mpext {

void check_no_overlap(std::vector<ByteRange> ranges, const char* op, const char* dst_name,
                      const char* src_name) {
  ranges.erase(std::remove_if(ranges.begin(), ranges.end(),
                              [](const ByteRange& r) { return r.begin == r.end; }),
               ranges.end());
  std::stable_sort(ranges.begin(), ranges.end(),
                   [](const ByteRange& a, const ByteRange& b) { return a.begin < b.begin; });
  auto name = [&](const ByteRange& r) {
    return r.label.name != nullptr ? r.label : Arg(r.is_dst ? dst_name : src_name, r.index);
  };
  auto fail = [&](const ByteRange& a, const ByteRange& b) {
    TORCH_CHECK(false, "mpext.", op, ": ", name(a), " and ", name(b),
                " overlap in memory; a destination must not share memory with any other tensor "
                "of the call");
  };
  // Sweep in address order. An earlier range a overlaps b iff a.end > b.begin, so it suffices
  // to remember the furthest-reaching range so far, and the furthest-reaching destination.
  const ByteRange* far_any = nullptr;
  const ByteRange* far_dst = nullptr;
  for (const ByteRange& b : ranges) {
    if (far_dst && far_dst->end > b.begin) fail(*far_dst, b);
    if (b.is_dst && far_any && far_any->end > b.begin) fail(*far_any, b);
    if (!far_any || b.end > far_any->end) far_any = &b;
    if (b.is_dst && (!far_dst || b.end > far_dst->end)) far_dst = &b;
  }
}

}  // namespace mpext
