// The CPU multi-tensor engine: one splitter for every op over a list of tensors.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <vector>

namespace mpext {

// Calls f(k, start, count) on ranges that together cover elements [0, segs[k].n) of every segment
// k (an op's segment struct of the C API) exactly once, split across threads by
// at::parallel_for over the segments' concatenated elements: a range never crosses a segment,
// and a task takes at least `grain` units. Ranges start and end on multiples of `unit` elements
// of their segment (or at its end), so that work cut into fixed blocks (grad_norm's) stays
// whole. Empty segments get no call.
template <class Seg, class F>
void parallel_segments(const std::vector<Seg>& segs, int64_t grain, F&& f, int64_t unit = 1) {
  // prefix[k]: the first unit of segment k in the concatenated list of units.
  std::vector<int64_t> prefix(segs.size() + 1, 0);
  for (size_t k = 0; k < segs.size(); ++k) {
    prefix[k + 1] = prefix[k] + (segs[k].n + unit - 1) / unit;
  }
  if (prefix.back() == 0) return;
  at::parallel_for(0, prefix.back(), grain, [&](int64_t begin, int64_t end) {
    size_t k = std::upper_bound(prefix.begin(), prefix.end(), begin) - prefix.begin() - 1;
    for (int64_t pos = begin; pos < end; ++k) {
      if (prefix[k + 1] == prefix[k]) continue;  // an empty segment
      const int64_t stop = std::min(end, prefix[k + 1]);  // units [pos, stop) of segment k
      const int64_t first = (pos - prefix[k]) * unit;
      const int64_t last = std::min((stop - prefix[k]) * unit, segs[k].n);
      f(k, first, last - first);
      pos = stop;
    }
  });
}

}  // namespace mpext
