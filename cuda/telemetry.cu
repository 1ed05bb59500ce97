// Gradient telemetry on CUDA devices (mpext/telemetry_cuda.h): scale.cu's unscale-and-check
// with per-gradient counts taken in the same pass.
//
// The multi-tensor engine (multi_tensor.cuh) packs the gradients into launches, one chunk of
// 64K elements per block. Each thread runs tel_range over its share of the chunk: the values as
// unscale_range in scale.cu computes them (widen, multiply by *inv_scale in fp32, round back to
// nearest even; nothing stored when *inv_scale == 1), and 32-bit tallies of the stored bits
// (mpext/telemetry.h: zeros, subnormal, headroom, non-finite, the largest finite abs bits).
// The block sums its threads' tallies in shared memory, then thread 0 adds them to the
// gradient's row with one 64-bit atomicAdd per non-zero count, merges max_abs with an integer
// atomicMax on the fp32 bits of fp32(amax * stat_inv) (non-negative: bit order is value
// order), and lowers first_nonfinite with atomicMin. Sums of integers, a max and a min do not
// depend on the order the blocks run in: the totals are the C core's, bit for bit.
#include <cuda_runtime.h>

#include "access.cuh"
#include "mpext/mpext.h"
#include "mpext/telemetry.h"
#include "mpext/telemetry_cuda.h"
#include "multi_tensor.cuh"

namespace {

using namespace mp_cuda;

constexpr int kThreads = 256;
constexpr int64_t kVec = 8;
constexpr int kMaxPieces = 128;  // g, dtype, row per piece: under the 4 KB argument limit

// The 64-bit add, integer max and 64-bit min of thread 0 of each block. The emulation harness
// (tests/cuda_emu) does not model atomics; there a block's threads switch only at barriers and
// blocks run one at a time, so a plain read-modify-write is what the atomic does.
__device__ __forceinline__ void add_u64(int64_t* p, uint32_t v) {
#if defined(MP_CUDA_EMULATION)
  *p += v;
#else
  atomicAdd(reinterpret_cast<unsigned long long*>(p), static_cast<unsigned long long>(v));
#endif
}

__device__ __forceinline__ void max_bits(float* p, float v) {
#if defined(MP_CUDA_EMULATION)
  *p = mp_tel_max_bits(*p, v);
#else
  atomicMax(reinterpret_cast<int*>(p), __float_as_int(v));
#endif
}

__device__ __forceinline__ void min_i64(int64_t* p, int64_t v) {
#if defined(MP_CUDA_EMULATION)
  if (v < *p) *p = v;
#else
  atomicMin(reinterpret_cast<long long*>(p), static_cast<long long>(v));
#endif
}

// A thread's tallies: [zeros, subnormal, headroom, non-finite, max finite abs bits].
struct Tally {
  uint32_t t[5];
};

template <int D>
MP_CUDA_HD void tally(uint32_t x, Tally& s) {
  const uint32_t a = x & (D == MP_F32 ? 0x7FFFFFFFu : 0x7FFFu);
  const uint32_t normal = mp_tel_normal(D), top = mp_tel_top(D), inf = mp_tel_inf(D);
  s.t[0] += a == 0u ? 1u : 0u;
  s.t[1] += a - 1u < normal - 1u ? 1u : 0u;
  s.t[2] += a - top < inf - top ? 1u : 0u;
  s.t[3] += a >= inf ? 1u : 0u;
  const uint32_t f = a < inf ? a : 0u;
  s.t[4] = f > s.t[4] ? f : s.t[4];
}

template <int D>
MP_CUDA_HD uint32_t scale_bits(uint32_t x, float inv) {
  return narrow<D>(widen<D>(x) * inv);
}

template <int D, bool kCheckOnly>
MP_CUDA_HD void tel_scalar(void* g, int64_t first, int64_t last, float inv, int64_t tid,
                           int64_t nthreads, Tally& s) {
  constexpr int kBytes = MP_DTYPE_BYTES(D);
  for (int64_t i = first + tid; i < last; i += nthreads) {
    const uint32_t x = load1<kBytes>(g, i);
    tally<D>(x, s);
    if constexpr (!kCheckOnly) store1<kBytes>(g, i, scale_bits<D>(x, inv));
  }
}

// Elements [0, n) at g: a scalar head up to the first 16-byte boundary, 16-byte vectors, a
// scalar tail (scale.cu's unscale_range, with the tallies).
template <int D, bool kCheckOnly>
MP_CUDA_HD void tel_range(void* g, int64_t n, float inv, int64_t tid, int64_t nthreads,
                          Tally& s) {
  constexpr int kBytes = MP_DTYPE_BYTES(D);
  const uintptr_t addr = reinterpret_cast<uintptr_t>(g);
  int64_t head = static_cast<int64_t>((16u - (addr & 15u)) & 15u) / kBytes;
  if (head > n) head = n;
  tel_scalar<D, kCheckOnly>(g, 0, head, inv, tid, nthreads, s);
  void* body = static_cast<char*>(g) + head * kBytes;
  const int64_t nvec = (n - head) / kVec;
  for (int64_t v = tid; v < nvec; v += nthreads) {
    uint32_t x[8];
    load8<kBytes>(body, v, x);
#pragma unroll
    for (int j = 0; j < 8; ++j) tally<D>(x[j], s);
    if constexpr (!kCheckOnly) {
      uint32_t y[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) y[j] = scale_bits<D>(x[j], inv);
      store8<kBytes>(body, v, y);
    }
  }
  tel_scalar<D, kCheckOnly>(g, head + nvec * kVec, n, inv, tid, nthreads, s);
}

struct StatsArgs {
  const float* inv_scale;
  const float* stat_inv_scale;  // never null here: the launcher puts inv_scale in its place
  float* found_inf;
  int64_t* counts;
  float* max_abs;
  int64_t* first_nonfinite;
  mp_cuda::PieceTable<kMaxPieces> pieces;
  void* g[kMaxPieces];
  int32_t row[kMaxPieces];
  uint8_t dtype[kMaxPieces];
};

static_assert(sizeof(StatsArgs) <= 4096, "the multi-tensor argument must fit the 4 KB limit");

template <bool kCheckOnly>
MP_CUDA_HD void tel_block(const StatsArgs& a, const mp_cuda::BlockRange& r, float inv,
                          int64_t tid, int64_t nthreads, Tally& s) {
  void* g = static_cast<char*>(a.g[r.k]) + r.start * MP_DTYPE_BYTES(a.dtype[r.k]);
  switch (a.dtype[r.k]) {
    case MP_F32: return tel_range<MP_F32, kCheckOnly>(g, r.count, inv, tid, nthreads, s);
    case MP_BF16: return tel_range<MP_BF16, kCheckOnly>(g, r.count, inv, tid, nthreads, s);
    default: return tel_range<MP_F16, kCheckOnly>(g, r.count, inv, tid, nthreads, s);
  }
}

// fp32 value of the largest finite abs bits of a dtype.
MP_CUDA_HD float widen_any(int dtype, uint32_t a) {
  return dtype == MP_F32 ? widen<MP_F32>(a) : dtype == MP_BF16 ? widen<MP_BF16>(a)
                                                               : widen<MP_F16>(a);
}

__global__ void __launch_bounds__(kThreads)
    unscale_stats_kernel(const __grid_constant__ StatsArgs a) {
  __shared__ uint32_t sh[5][kThreads];
  const mp_cuda::BlockRange r = mp_cuda::block_range(a.pieces, blockIdx.x);
  const float inv = *a.inv_scale;
  Tally s = {{0u, 0u, 0u, 0u, 0u}};
  if (inv == 1.0f) {
    tel_block<true>(a, r, inv, threadIdx.x, blockDim.x, s);
  } else {
    tel_block<false>(a, r, inv, threadIdx.x, blockDim.x, s);
  }
  for (int j = 0; j < 5; ++j) sh[j][threadIdx.x] = s.t[j];
  __syncthreads();
  for (unsigned half = kThreads / 2; half > 0; half /= 2) {
    if (threadIdx.x < half) {
      for (int j = 0; j < 4; ++j) sh[j][threadIdx.x] += sh[j][threadIdx.x + half];
      const uint32_t o = sh[4][threadIdx.x + half];
      if (o > sh[4][threadIdx.x]) sh[4][threadIdx.x] = o;
    }
    __syncthreads();
  }
  if (threadIdx.x == 0) {
    const int64_t row = a.row[r.k];
    int64_t* c = a.counts + row * MP_TEL_NCOUNTS;
    for (int j = 0; j < MP_TEL_NCOUNTS; ++j) {
      if (sh[j][0] != 0u) add_u64(c + j, sh[j][0]);
    }
    max_bits(a.max_abs + row, widen_any(a.dtype[r.k], sh[4][0]) * *a.stat_inv_scale);
    if (sh[3][0] != 0u) {
      min_i64(a.first_nonfinite, row);
      *a.found_inf = 1.0f;
    }
  }
}

}  // namespace

extern "C" {

mp_status mp_unscale_stats_multi_cuda(const mp_stats_segment* segs, int64_t nsegs,
                                      float* found_inf, const float* inv_scale,
                                      const float* stat_inv_scale, int64_t* counts,
                                      float* max_abs, int64_t* first_nonfinite,
                                      cudaStream_t stream) {
  if (nsegs < 0 || (nsegs > 0 && segs == nullptr)) return MP_ERR_INVALID_ARGUMENT;
  if (found_inf == nullptr || inv_scale == nullptr) return MP_ERR_INVALID_ARGUMENT;
  if (nsegs > 0 && (counts == nullptr || max_abs == nullptr || first_nonfinite == nullptr))
    return MP_ERR_INVALID_ARGUMENT;
  for (int64_t k = 0; k < nsegs; ++k) {
    if (!tensor_ok(segs[k].g, segs[k].dtype, segs[k].n) || segs[k].row < 0 ||
        segs[k].row > INT32_MAX)
      return MP_ERR_INVALID_ARGUMENT;
  }
  StatsArgs a{};
  a.inv_scale = inv_scale;
  a.stat_inv_scale = stat_inv_scale != nullptr ? stat_inv_scale : inv_scale;
  a.found_inf = found_inf;
  a.counts = counts;
  a.max_abs = max_abs;
  a.first_nonfinite = first_nonfinite;
  return mp_cuda::pack_launches(
      a.pieces, nsegs, [&](int64_t s) { return segs[s].n; },
      [&](int i, int64_t s, int64_t done) {
        a.g[i] = static_cast<char*>(segs[s].g) + done * MP_DTYPE_BYTES(segs[s].dtype);
        a.dtype[i] = static_cast<uint8_t>(segs[s].dtype);
        a.row[i] = static_cast<int32_t>(segs[s].row);
      },
      [&](int64_t blocks) {
        mp_cuda::launch(unscale_stats_kernel, static_cast<unsigned>(blocks), kThreads, 0,
                        stream, a);
        return mp_cuda::launch_status();
      });
}

}  // extern "C"
