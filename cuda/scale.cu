// Loss scaling on CUDA devices: the kernels and launchers behind mpext/scale_cuda.h.
//
// unscale_. The multi-tensor engine (multi_tensor.cuh) packs a list of grads of mixed dtypes
// into launches, one chunk per block. Every thread runs unscale_range over its block's chunk: it
// peels the elements before the first 16-byte boundary, then moves 8 elements per step with
// 16-byte loads and stores, then finishes the tail one element at a time.
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
#include <cuda_runtime.h>

#include "access.cuh"
#include "mpext/mpext.h"
#include "mpext/scale_cuda.h"
#include "mpext/scale_rule.h"
#include "multi_tensor.cuh"

namespace {

using namespace mp_cuda;  // the shared memory access and engine of access.cuh, multi_tensor.cuh

constexpr int kThreads = 256;    // threads per block
constexpr int64_t kVec = 8;      // elements per vectorized step (16-byte accesses)
constexpr int kMaxPieces = 192;  // tensors (or pieces of one) per launch

static_assert(mp_cuda::kChunk % kVec == 0, "a chunk must keep its piece's alignment modulo 16");

// 1 if the element's exponent field is all ones (NaN or +-Inf), else 0. A bits-only test: the
// same as isfinite on the widened fp32 value, independent of fast-math flags.
template <int D>
MP_CUDA_HD uint32_t nonfinite(uint32_t x) {
  if constexpr (D == MP_F32) {
    return (x & 0x7F800000u) == 0x7F800000u ? 1u : 0u;
  } else if constexpr (D == MP_BF16) {
    return (x & 0x7F80u) == 0x7F80u ? 1u : 0u;
  } else {
    return (x & 0x7C00u) == 0x7C00u ? 1u : 0u;
  }
}

// One element, on raw bits (16-bit values in the low half): widen to fp32, multiply in fp32 (one
// operation: nothing to contract), round back to nearest even.
template <int D>
MP_CUDA_HD uint32_t scale_bits(uint32_t x, float inv) {
  return narrow<D>(widen<D>(x) * inv);
}

// Elements [first, last) one at a time, this thread taking first + tid, first + tid + nthreads,
// ...; returns 1 if any of them was NaN/Inf.
template <int D, bool kCheckOnly>
MP_CUDA_HD uint32_t unscale_scalar(void* g, int64_t first, int64_t last, float inv,
                                   int64_t tid, int64_t nthreads) {
  constexpr int kBytes = MP_DTYPE_BYTES(D);
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
MP_CUDA_HD uint32_t unscale_range(void* g, int64_t n, float inv, int64_t tid,
                                  int64_t nthreads) {
  constexpr int kBytes = MP_DTYPE_BYTES(D);
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

// The argument of one multi-tensor launch (passed by value, under the 4 KB parameter limit): per
// piece, the grad it belongs to, from the piece's first element.
struct UnscaleArgs {
  const float* inv_scale;
  float* found_inf;
  mp_cuda::PieceTable<kMaxPieces> pieces;
  void* g[kMaxPieces];
  uint8_t dtype[kMaxPieces];
};

static_assert(sizeof(UnscaleArgs) <= 4096, "the multi-tensor argument must fit the 4 KB limit");

// The work of block `block` of a multi-tensor launch, for thread tid of nthreads, with
// inv = *a.inv_scale. Returns 1 if this thread saw a NaN/Inf.
template <bool kCheckOnly>
MP_CUDA_HD uint32_t unscale_block(const UnscaleArgs& a, uint32_t block, float inv, int64_t tid,
                                  int64_t nthreads) {
  const mp_cuda::BlockRange r = mp_cuda::block_range(a.pieces, block);
  void* g = static_cast<char*>(a.g[r.k]) + r.start * MP_DTYPE_BYTES(a.dtype[r.k]);
  switch (a.dtype[r.k]) {
    case MP_F32: return unscale_range<MP_F32, kCheckOnly>(g, r.count, inv, tid, nthreads);
    case MP_BF16: return unscale_range<MP_BF16, kCheckOnly>(g, r.count, inv, tid, nthreads);
    default: return unscale_range<MP_F16, kCheckOnly>(g, r.count, inv, tid, nthreads);
  }
}

// Everything one thread does: reads *inv_scale and picks the read-only check or the unscale.
MP_CUDA_HD uint32_t unscale_thread(const UnscaleArgs& a, uint32_t block, int64_t tid,
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

__global__ void update_scale_kernel(const mp_scale_update u) { mp_update_scale_rule(&u); }

mp_status check_segments(const mp_unscale_segment* segs, int64_t nsegs, const float* found_inf,
                         const float* inv_scale) {
  if (nsegs < 0 || (nsegs > 0 && segs == nullptr)) return MP_ERR_INVALID_ARGUMENT;
  if (found_inf == nullptr || inv_scale == nullptr) return MP_ERR_INVALID_ARGUMENT;
  for (int64_t k = 0; k < nsegs; ++k) {
    if (!tensor_ok(segs[k].g, segs[k].dtype, segs[k].n)) return MP_ERR_INVALID_ARGUMENT;
  }
  return MP_OK;
}

}  // namespace

extern "C" {

mp_status mp_unscale_multi_cuda(const mp_unscale_segment* segs, int64_t nsegs, float* found_inf,
                                const float* inv_scale, cudaStream_t stream) {
  const mp_status checked = check_segments(segs, nsegs, found_inf, inv_scale);
  if (checked != MP_OK) return checked;
  UnscaleArgs a{};
  a.inv_scale = inv_scale;
  a.found_inf = found_inf;
  return mp_cuda::pack_launches(
      a.pieces, nsegs, [&](int64_t s) { return segs[s].n; },
      [&](int i, int64_t s, int64_t done) {
        a.g[i] = static_cast<char*>(segs[s].g) + done * MP_DTYPE_BYTES(segs[s].dtype);
        a.dtype[i] = static_cast<uint8_t>(segs[s].dtype);
      },
      [&](int64_t blocks) {
        mp_cuda::launch(unscale_multi_kernel, static_cast<unsigned>(blocks), kThreads, 0, stream,
                        a);
        return mp_cuda::launch_status();
      });
}

mp_status mp_update_scale_cuda(const mp_scale_update* u, cudaStream_t stream) {
  if (!mp_scale_update_ok(u)) return MP_ERR_INVALID_ARGUMENT;
  mp_cuda::launch(update_scale_kernel, 1, 1, 0, stream, *u);
  return mp_cuda::launch_status();
}

}  // extern "C"
