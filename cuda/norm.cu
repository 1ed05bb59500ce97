// The multi-tensor L2 norm on CUDA devices: the kernels and the launcher behind
// mpext/norm_cuda.h.
//
// Pass 1 (norm_partials_kernel): the multi-tensor engine (multi_tensor.cuh) packs a list of
// tensors of mixed dtypes into launches, one chunk per block. Each thread sums
// (float(x) * inv)^2 in double over a fixed set of its block's elements (the head before the
// first 16-byte boundary and the tail one at a time, the body 8 elements per 16-byte load), then
// the block adds its threads' sums as a fixed tree in shared memory and thread 0 writes the
// block's sum to its own workspace entry (launch after launch, the entries follow the blocks).
// Pass 2 (norm_finish_kernel): one block adds the workspace entries (thread t takes entries t,
// t + kFinishThreads, ... in order, then a fixed tree) and writes sqrt(total), rounded once to
// fp32, to *out. No atomics anywhere: the same inputs give the same bits on every run.
//
// Numerics: y = float(x) * inv in fp32 (__fmul_rn, the value an unscale pass would store), then
// y * y in double, which is exact, so squares that overflow fp32 still count; a NaN makes the
// sum NaN and an Inf (without NaN) makes it +Inf. Everything is read-only but the workspace and
// *out; nothing waits for the host.
#include <cuda_runtime.h>

#include "access.cuh"
#include "mpext/mpext.h"
#include "mpext/norm_cuda.h"
#include "multi_tensor.cuh"

namespace {

using namespace mp_cuda;  // the shared memory access and engine of access.cuh, multi_tensor.cuh

constexpr int kThreads = 256;        // threads per block of pass 1 (a power of two)
constexpr int kFinishThreads = 512;  // threads of the one block of pass 2 (a power of two)
constexpr int64_t kVec = 8;          // elements per 16-byte load
constexpr int kMaxPieces = 192;      // tensors (or pieces of one) per launch

static_assert(mp_cuda::kChunk % kVec == 0, "a chunk must keep its piece's alignment modulo 16");
static_assert(mp_cuda::kChunk == MP_GRAD_NORM_CUDA_CHUNK, "one workspace entry per block");

// An element of dtype D (raw bits, 16-bit values in the low half) times inv, in fp32 (one
// operation: nothing to contract), squared in double (exact).
template <int D>
MP_CUDA_HD double square(uint32_t x, float inv) {
  const double y = static_cast<double>(widen<D>(x) * inv);
  return y * y;
}

// Elements [first, last) one at a time, this thread taking first + tid, first + tid + nthreads...
template <int D>
MP_CUDA_HD double sumsq_scalar(const void* x, int64_t first, int64_t last, float inv,
                               int64_t tid, int64_t nthreads) {
  constexpr int kBytes = MP_DTYPE_BYTES(D);
  double acc = 0.0;
  for (int64_t i = first + tid; i < last; i += nthreads) acc += square<D>(load1<kBytes>(x, i), inv);
  return acc;
}

// This thread's share of elements [0, n) at x: the head up to the first 16-byte boundary and the
// tail one at a time, the body 8 at a time with 16-byte loads.
template <int D>
MP_CUDA_HD double sumsq_range(const void* x, int64_t n, float inv, int64_t tid,
                              int64_t nthreads) {
  constexpr int kBytes = MP_DTYPE_BYTES(D);
  const uintptr_t addr = reinterpret_cast<uintptr_t>(x);
  int64_t head = static_cast<int64_t>((16u - (addr & 15u)) & 15u) / kBytes;
  if (head > n) head = n;
  double acc = sumsq_scalar<D>(x, 0, head, inv, tid, nthreads);
  const void* body = static_cast<const char*>(x) + head * kBytes;
  const int64_t nvec = (n - head) / kVec;
  for (int64_t v = tid; v < nvec; v += nthreads) {
    uint32_t e[8];
    load8<kBytes>(body, v, e);
    double s = 0.0;
#pragma unroll
    for (int j = 0; j < 8; ++j) s += square<D>(e[j], inv);
    acc += s;
  }
  return acc + sumsq_scalar<D>(x, head + nvec * kVec, n, inv, tid, nthreads);
}

// The argument of one pass-1 launch (by value, under the 4 KB parameter limit): per piece, the
// tensor it belongs to from the piece's first element; block b writes partials[b].
struct NormArgs {
  const float* inv_scale;  // NULL: 1
  double* partials;
  mp_cuda::PieceTable<kMaxPieces> pieces;
  const void* x[kMaxPieces];
  uint8_t dtype[kMaxPieces];
};

static_assert(sizeof(NormArgs) <= 4096, "the multi-tensor argument must fit the 4 KB limit");

// The sum of squares of thread tid's share of block `block`.
MP_CUDA_HD double block_share(const NormArgs& a, uint32_t block, int64_t tid, int64_t nthreads) {
  const mp_cuda::BlockRange r = mp_cuda::block_range(a.pieces, block);
  const float inv = a.inv_scale != nullptr ? *a.inv_scale : 1.0f;
  const char* x = static_cast<const char*>(a.x[r.k]) + r.start * MP_DTYPE_BYTES(a.dtype[r.k]);
  switch (a.dtype[r.k]) {
    case MP_F32: return sumsq_range<MP_F32>(x, r.count, inv, tid, nthreads);
    case MP_BF16: return sumsq_range<MP_BF16>(x, r.count, inv, tid, nthreads);
    default: return sumsq_range<MP_F16>(x, r.count, inv, tid, nthreads);
  }
}

// Adds s[0 .. kN) into s[0] as a fixed tree; every thread of the block must call it.
template <int kN>
__device__ __forceinline__ void tree_sum(double* s) {
#pragma unroll
  for (int stride = kN / 2; stride > 0; stride >>= 1) {
    if (static_cast<int>(threadIdx.x) < stride) s[threadIdx.x] += s[threadIdx.x + stride];
    __syncthreads();
  }
}

__global__ void __launch_bounds__(kThreads) norm_partials_kernel(const __grid_constant__ NormArgs a) {
  __shared__ double s[kThreads];
  s[threadIdx.x] = block_share(a, blockIdx.x, threadIdx.x, blockDim.x);
  __syncthreads();
  tree_sum<kThreads>(s);
  if (threadIdx.x == 0) a.partials[blockIdx.x] = s[0];
}

__global__ void __launch_bounds__(kFinishThreads)
    norm_finish_kernel(const double* partials, int64_t n, float* out) {
  __shared__ double s[kFinishThreads];
  double acc = 0.0;
  for (int64_t i = threadIdx.x; i < n; i += kFinishThreads) acc += partials[i];
  s[threadIdx.x] = acc;
  __syncthreads();
  tree_sum<kFinishThreads>(s);
  // Every NaN result is the canonical quiet NaN, whatever the inputs' payloads (as on the CPU).
  if (threadIdx.x == 0)
    *out = s[0] != s[0] ? __int_as_float(0x7FC00000) : __double2float_rn(__dsqrt_rn(s[0]));
}

bool segments_ok(const mp_norm_segment* segs, int64_t nsegs) {
  if (nsegs < 0 || (nsegs > 0 && segs == nullptr)) return false;
  for (int64_t k = 0; k < nsegs; ++k) {
    if (!tensor_ok(segs[k].x, segs[k].dtype, segs[k].n)) return false;
  }
  return true;
}

}  // namespace

extern "C" {

int64_t mp_grad_norm_workspace_cuda(const mp_norm_segment* segs, int64_t nsegs) {
  if (!segments_ok(segs, nsegs)) return -1;
  int64_t blocks = 0;
  for (int64_t k = 0; k < nsegs; ++k) {
    blocks += (segs[k].n + mp_cuda::kChunk - 1) / mp_cuda::kChunk;
  }
  return blocks;
}

mp_status mp_grad_norm_multi_cuda(const mp_norm_segment* segs, int64_t nsegs,
                                  const float* inv_scale, double* workspace,
                                  int64_t workspace_len, float* out, cudaStream_t stream) {
  const int64_t need = mp_grad_norm_workspace_cuda(segs, nsegs);
  if (need < 0 || out == nullptr || workspace_len < need || (need > 0 && workspace == nullptr)) {
    return MP_ERR_INVALID_ARGUMENT;
  }
  NormArgs a{};
  a.inv_scale = inv_scale;
  int64_t written = 0;
  const mp_status st = mp_cuda::pack_launches(
      a.pieces, nsegs, [&](int64_t s) { return segs[s].n; },
      [&](int i, int64_t s, int64_t done) {
        a.x[i] = static_cast<const char*>(segs[s].x) + done * MP_DTYPE_BYTES(segs[s].dtype);
        a.dtype[i] = static_cast<uint8_t>(segs[s].dtype);
      },
      [&](int64_t blocks) {
        a.partials = workspace + written;
        mp_cuda::launch(norm_partials_kernel, static_cast<unsigned>(blocks), kThreads, 0, stream,
                        a);
        written += blocks;
        return mp_cuda::launch_status();
      });
  if (st != MP_OK) return st;
  mp_cuda::launch(norm_finish_kernel, 1, kFinishThreads, 0, stream, workspace, written, out);
  return mp_cuda::launch_status();
}

}  // extern "C"
