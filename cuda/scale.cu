// Loss scaling on CUDA devices: the kernels and launchers behind mpext/scale_cuda.h.
//
// unscale_. One multi-tensor kernel covers a list of grads of mixed dtypes (fp32, bf16, fp16):
// the launcher packs up to kMaxPieces tensors (or pieces of one) into a by-value kernel argument
// under the 4 KB limit, one chunk of kChunk elements per block, and launches again only when a
// launch is full. A block finds its piece by binary search over the pieces' first blocks. Every
// thread runs the same per-thread routine, unscale_range, over its block's chunk: it peels the
// elements before the first 16-byte boundary, then moves 8 elements per step with 16-byte loads
// and stores, then finishes the tail one element at a time. All indices and counts are int64_t.
//
// Numerics, as torch's CUDA _amp_foreach_non_finite_check_and_unscale_: each value is widened to
// fp32 (exact), tested for NaN/Inf on its exponent bits, multiplied by *inv_scale in fp32 and
// rounded back with __float2bfloat16_rn / __float2half_rn. When *inv_scale == 1.0f the values are
// only read (nothing is stored). inv_scale and found_inf are device pointers read and written in
// the kernel, so nothing here synchronises with the host and the launch can be captured in a CUDA
// graph. found_inf: each block ORs its threads' findings (__syncthreads_or) and thread 0 stores
// 1.0f if any was set. Every writer stores the same value and nobody clears it, so the plain
// stores need no atomics.
//
// update_scale_. A one-thread kernel runs mp_update_scale_rule (mpext/scale_rule.h), the code the
// CPU's mp_update_scale runs, so both make bit-identical decisions.
//
// The per-thread routines are __host__ __device__ so that a host-side test can drive them with
// emulated thread and block indices; only the __global__ wrappers and the launchers are
// device-specific.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "access.cuh"
#include "mpext/mpext.h"
#include "mpext/scale_cuda.h"
#include "mpext/scale_rule.h"

namespace {

using mp_cuda::bits_from_f32;
using mp_cuda::f32_from_bits;
using mp_cuda::load1;
using mp_cuda::load8;
using mp_cuda::store1;
using mp_cuda::store8;

#define MP_SCALE_HD __host__ __device__ __forceinline__

constexpr int kThreads = 256;            // threads per block
constexpr int64_t kVec = 8;              // elements per vectorized step (16-byte accesses)
constexpr int64_t kChunk = 65536;        // elements per block
constexpr int kMaxPieces = 192;          // tensors (or pieces of one) per launch
constexpr int64_t kMaxBlocks = 1 << 30;  // blocks per launch (grid.x < 2^31)

static_assert(kChunk % kVec == 0, "a chunk must keep its piece's alignment modulo 16 bytes");

template <int D>
struct DtypeTraits {
  static constexpr int kBytes = D == MP_UNSCALE_F32 ? 4 : 2;
};

int dtype_bytes(int dtype) { return dtype == MP_UNSCALE_F32 ? 4 : 2; }

// 1 if the element's exponent field is all ones (NaN or +-Inf), else 0. A bits-only test: the
// same as isfinite on the widened fp32 value, independent of fast-math flags.
template <int D>
MP_SCALE_HD uint32_t nonfinite(uint32_t x) {
  if constexpr (D == MP_UNSCALE_F32) {
    return (x & 0x7F800000u) == 0x7F800000u ? 1u : 0u;
  } else if constexpr (D == MP_UNSCALE_BF16) {
    return (x & 0x7F80u) == 0x7F80u ? 1u : 0u;
  } else {
    return (x & 0x7C00u) == 0x7C00u ? 1u : 0u;
  }
}

// One element, on raw bits (16-bit values in the low half): widen to fp32, multiply in fp32,
// round back to nearest even.
template <int D>
MP_SCALE_HD uint32_t scale_bits(uint32_t x, float inv) {
  if constexpr (D == MP_UNSCALE_F32) {
    return bits_from_f32(f32_from_bits(x) * inv);
  } else if constexpr (D == MP_UNSCALE_BF16) {
    const float v = __bfloat162float(__ushort_as_bfloat16(static_cast<unsigned short>(x)));
    return __bfloat16_as_ushort(__float2bfloat16_rn(v * inv));
  } else {
    const float v = __half2float(__ushort_as_half(static_cast<unsigned short>(x)));
    return __half_as_ushort(__float2half_rn(v * inv));
  }
}

// Elements [first, last) one at a time, this thread taking first + tid, first + tid + nthreads,
// ...; returns 1 if any of them was NaN/Inf.
template <int D, bool kCheckOnly>
MP_SCALE_HD uint32_t unscale_scalar(void* g, int64_t first, int64_t last, float inv,
                                    int64_t tid, int64_t nthreads) {
  constexpr int kBytes = DtypeTraits<D>::kBytes;
  uint32_t bad = 0;
  for (int64_t i = first + tid; i < last; i += nthreads) {
    const uint32_t x = load1<kBytes>(g, i);
    bad |= nonfinite<D>(x);
    if constexpr (!kCheckOnly) store1<kBytes>(g, i, scale_bits<D>(x, inv));
  }
  return bad;
}

// Unscales elements [0, n) at g (aligned to its element size) in place, or only checks them
// when kCheckOnly, this thread taking its share of a loop whose threads are numbered
// 0 .. nthreads - 1. Returns 1 if any element this thread read was NaN/Inf. The elements before
// g's first 16-byte boundary (the head) and after the last full vector (the tail) go one at a
// time.
template <int D, bool kCheckOnly>
MP_SCALE_HD uint32_t unscale_range(void* g, int64_t n, float inv, int64_t tid,
                                   int64_t nthreads) {
  constexpr int kBytes = DtypeTraits<D>::kBytes;
  const uintptr_t addr = reinterpret_cast<uintptr_t>(g);
  int64_t head = static_cast<int64_t>((16u - (addr & 15u)) & 15u) / kBytes;
  if (head > n) head = n;
  uint32_t bad = unscale_scalar<D, kCheckOnly>(g, 0, head, inv, tid, nthreads);
  void* body = static_cast<char*>(g) + head * kBytes;
  const int64_t nvec = (n - head) / kVec;
  for (int64_t v = tid; v < nvec; v += nthreads) {
    uint32_t x[8];
    load8<kBytes>(body, v, x);
#pragma unroll
    for (int j = 0; j < 8; ++j) bad |= nonfinite<D>(x[j]);
    if constexpr (!kCheckOnly) {
      uint32_t y[8];
#pragma unroll
      for (int j = 0; j < 8; ++j) y[j] = scale_bits<D>(x[j], inv);
      store8<kBytes>(body, v, y);
    }
  }
  return bad | unscale_scalar<D, kCheckOnly>(g, head + nvec * kVec, n, inv, tid, nthreads);
}

// The argument of one multi-tensor launch (passed by value, under the 4 KB parameter limit).
// Piece k is elements [0, n[k]) at g[k] (a tensor or a part of one), covered by blocks
// first_block[k] .. first_block[k + 1] - 1 (the last piece's blocks run to the grid's end), one
// chunk of kChunk elements each. first_block is strictly increasing and starts at 0.
struct UnscaleArgs {
  const float* inv_scale;
  float* found_inf;
  void* g[kMaxPieces];
  int64_t n[kMaxPieces];
  uint32_t first_block[kMaxPieces];
  uint8_t dtype[kMaxPieces];
  int32_t npieces;
};

static_assert(sizeof(UnscaleArgs) <= 4096, "the multi-tensor argument must fit the 4 KB limit");

template <int D, bool kCheckOnly>
MP_SCALE_HD uint32_t unscale_chunk(const UnscaleArgs& a, int k, int64_t start, int64_t count,
                                   float inv, int64_t tid, int64_t nthreads) {
  void* g = static_cast<char*>(a.g[k]) + start * DtypeTraits<D>::kBytes;
  return unscale_range<D, kCheckOnly>(g, count, inv, tid, nthreads);
}

// The work of block `block` of a multi-tensor launch, for thread tid of nthreads, with
// inv = *a.inv_scale. Returns 1 if this thread saw a NaN/Inf.
template <bool kCheckOnly>
MP_SCALE_HD uint32_t unscale_block(const UnscaleArgs& a, uint32_t block, float inv, int64_t tid,
                                   int64_t nthreads) {
  const int lo = mp_cuda::piece_of_block(a.first_block, a.npieces, block);
  const int64_t start = static_cast<int64_t>(block - a.first_block[lo]) * kChunk;
  const int64_t rest = a.n[lo] - start;
  const int64_t count = rest < kChunk ? rest : kChunk;
  switch (a.dtype[lo]) {
    case MP_UNSCALE_F32:
      return unscale_chunk<MP_UNSCALE_F32, kCheckOnly>(a, lo, start, count, inv, tid, nthreads);
    case MP_UNSCALE_BF16:
      return unscale_chunk<MP_UNSCALE_BF16, kCheckOnly>(a, lo, start, count, inv, tid, nthreads);
    default:
      return unscale_chunk<MP_UNSCALE_FP16, kCheckOnly>(a, lo, start, count, inv, tid, nthreads);
  }
}

// Everything one thread does: reads *inv_scale and picks the read-only check or the unscale.
MP_SCALE_HD uint32_t unscale_thread(const UnscaleArgs& a, uint32_t block, int64_t tid,
                                    int64_t nthreads) {
  const float inv = *a.inv_scale;
  return inv == 1.0f ? unscale_block<true>(a, block, inv, tid, nthreads)
                     : unscale_block<false>(a, block, inv, tid, nthreads);
}

__global__ void __launch_bounds__(kThreads)
    unscale_multi_kernel(const __grid_constant__ UnscaleArgs a) {
  const uint32_t bad = unscale_thread(a, blockIdx.x, threadIdx.x, blockDim.x);
  // Every thread reaches the barrier (no early return above).
  if (__syncthreads_or(static_cast<int>(bad)) && threadIdx.x == 0) *a.found_inf = 1.0f;
}

__global__ void update_scale_kernel(float* scale, int32_t* growth_tracker, const float* found_inf,
                                    double growth_factor, double backoff_factor,
                                    int64_t growth_interval, int32_t* hysteresis_tracker,
                                    int32_t hysteresis, double min_scale, double max_scale,
                                    int64_t* stats) {
  mp_update_scale_rule(scale, growth_tracker, *found_inf, growth_factor, backoff_factor,
                       growth_interval, hysteresis_tracker, hysteresis, min_scale, max_scale,
                       stats);
}

// A launch failed iff the runtime has a pending error; it is left for the caller to read.
mp_status launch_status() { return cudaPeekAtLastError() == cudaSuccess ? MP_OK : MP_ERR_CUDA; }

mp_status check_segments(const mp_unscale_segment* segs, int64_t nsegs, const float* found_inf,
                         const float* inv_scale) {
  if (nsegs < 0 || (nsegs > 0 && segs == nullptr)) return MP_ERR_INVALID_ARGUMENT;
  if (found_inf == nullptr || inv_scale == nullptr) return MP_ERR_INVALID_ARGUMENT;
  for (int64_t k = 0; k < nsegs; ++k) {
    const mp_unscale_segment& s = segs[k];
    if (s.dtype < 0 || s.dtype >= MP_UNSCALE_DTYPE_COUNT || s.n < 0) {
      return MP_ERR_INVALID_ARGUMENT;
    }
    if (s.n > 0 && (s.g == nullptr || !mp_cuda::element_aligned(s.g, dtype_bytes(s.dtype)))) {
      return MP_ERR_INVALID_ARGUMENT;
    }
  }
  return MP_OK;
}

// Packs the (checked) segments into UnscaleArgs, one chunk per block, and calls
// launch(args, blocks) whenever max_pieces pieces (at most kMaxPieces) or max_blocks blocks are
// packed, and once at the end if anything is left. A segment that does not fit the blocks left
// is split across launches at a chunk boundary (which keeps its alignment modulo 16 bytes).
template <class Launch>
mp_status for_each_launch(const mp_unscale_segment* segs, int64_t nsegs, float* found_inf,
                          const float* inv_scale, int64_t max_blocks, int max_pieces,
                          Launch&& launch) {
  if (max_pieces > kMaxPieces || max_pieces < 1) max_pieces = kMaxPieces;
  UnscaleArgs a{};
  a.inv_scale = inv_scale;
  a.found_inf = found_inf;
  a.npieces = 0;
  int64_t blocks = 0;
  for (int64_t k = 0; k < nsegs; ++k) {
    const mp_unscale_segment& s = segs[k];
    int64_t done = 0;
    while (done < s.n) {
      const int64_t chunks = (s.n - done + kChunk - 1) / kChunk;
      const int64_t take = chunks < max_blocks - blocks ? chunks : max_blocks - blocks;
      const int64_t count = s.n - done < take * kChunk ? s.n - done : take * kChunk;
      const int i = a.npieces++;
      a.g[i] = static_cast<char*>(s.g) + done * dtype_bytes(s.dtype);
      a.n[i] = count;
      a.first_block[i] = static_cast<uint32_t>(blocks);
      a.dtype[i] = static_cast<uint8_t>(s.dtype);
      blocks += take;
      done += count;
      if (a.npieces == max_pieces || blocks == max_blocks) {
        const mp_status st = launch(static_cast<const UnscaleArgs&>(a), blocks);
        if (st != MP_OK) return st;
        a.npieces = 0;
        blocks = 0;
      }
    }
  }
  if (a.npieces > 0) return launch(static_cast<const UnscaleArgs&>(a), blocks);
  return MP_OK;
}

mp_status unscale_one(int dtype, void* g, int64_t n, float* found_inf, const float* inv_scale,
                      cudaStream_t stream) {
  const mp_unscale_segment seg = {dtype, g, n};
  return mp_unscale_multi_cuda(&seg, 1, found_inf, inv_scale, stream);
}

}  // namespace

extern "C" {

mp_status mp_unscale_multi_cuda(const mp_unscale_segment* segs, int64_t nsegs, float* found_inf,
                                const float* inv_scale, cudaStream_t stream) {
  const mp_status checked = check_segments(segs, nsegs, found_inf, inv_scale);
  if (checked != MP_OK) return checked;
  return for_each_launch(segs, nsegs, found_inf, inv_scale, mp_cuda::cap_blocks(kMaxBlocks),
                         mp_cuda::cap_pieces(kMaxPieces),
                         [&](const UnscaleArgs& a, int64_t blocks) -> mp_status {
                           mp_cuda::launch(unscale_multi_kernel, static_cast<unsigned>(blocks),
                                           kThreads, 0, stream, a);
                           return launch_status();
                         });
}

mp_status mp_unscale_f32_cuda(float* g, int64_t n, float* found_inf, const float* inv_scale,
                              cudaStream_t stream) {
  return unscale_one(MP_UNSCALE_F32, g, n, found_inf, inv_scale, stream);
}

mp_status mp_unscale_bf16_cuda(uint16_t* g, int64_t n, float* found_inf, const float* inv_scale,
                               cudaStream_t stream) {
  return unscale_one(MP_UNSCALE_BF16, g, n, found_inf, inv_scale, stream);
}

mp_status mp_unscale_fp16_cuda(uint16_t* g, int64_t n, float* found_inf, const float* inv_scale,
                               cudaStream_t stream) {
  return unscale_one(MP_UNSCALE_FP16, g, n, found_inf, inv_scale, stream);
}

mp_status mp_update_scale_cuda(float* scale, int32_t* growth_tracker, const float* found_inf,
                               double growth_factor, double backoff_factor,
                               int64_t growth_interval, int32_t* hysteresis_tracker,
                               int32_t hysteresis, double min_scale, double max_scale,
                               int64_t* stats, cudaStream_t stream) {
  if (scale == nullptr || growth_tracker == nullptr || found_inf == nullptr) {
    return MP_ERR_INVALID_ARGUMENT;
  }
  if (hysteresis > 1 && hysteresis_tracker == nullptr) return MP_ERR_INVALID_ARGUMENT;
  mp_cuda::launch(update_scale_kernel, 1, 1, 0, stream, scale, growth_tracker, found_inf,
                  growth_factor, backoff_factor, growth_interval, hysteresis_tracker, hysteresis,
                  min_scale, max_scale, stats);
  return launch_status();
}

}  // extern "C"
