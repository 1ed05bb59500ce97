// fp32 <-> bf16 / fp16 casts on CUDA devices: the kernels and launchers behind mpext/cast_cuda.h.
//
// Layout of the work. Every kernel runs the same per-thread routine, cast_range, over a flat
// range of elements with a thread index and a thread count:
//   - the single-tensor kernels give it the whole tensor, the global thread index and the grid's
//     thread count (a grid-stride loop);
//   - the multi-tensor kernel (cast_) gives each block one chunk of kChunk elements of one
//     segment, the block's thread index and the block size.
// cast_range moves 8 elements per step with 16-byte loads and stores when both pointers are
// 16-byte aligned, then finishes (or, unaligned, does everything) one element at a time; the
// launchers accept only pointers aligned to their element size. All indices and counts are
// int64_t, so a tensor may exceed 2^31 elements.
//
// Numerics. Round to nearest even uses the CUDA conversion intrinsics, which is what torch's
// Tensor.to does on CUDA, so the bits match it for every non-NaN input (subnormals are rounded,
// not flushed: the intrinsics compile to cvt.rn without .ftz). Stochastic rounding uses the
// Philox stream and the bit-level rounding of mpext/numerics.h, shared with the C core, so CUDA
// and CPU give the same bits: the element at stream position p uses word p % 4 of Philox block
// p / 4, and one Philox evaluation serves four consecutive positions.
//
// The per-thread routines are __host__ __device__ so that a host-side test can drive them with
// emulated thread indices; only the __global__ wrappers and the launchers are device-specific.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "access.cuh"
#include "mpext/cast_cuda.h"
#include "mpext/mpext.h"
#include "mpext/numerics.h"

namespace {

using mp_cuda::bits_from_f32;
using mp_cuda::f32_from_bits;
using mp_cuda::load1;
using mp_cuda::load8;
using mp_cuda::store1;
using mp_cuda::store8;

#define MP_CAST_HD __host__ __device__ __forceinline__

constexpr int kThreads = 256;             // threads per block, every kernel
constexpr int64_t kVec = 8;               // elements per vectorized step (16-byte loads/stores)
constexpr int64_t kChunk = 65536;         // elements per block in the multi-tensor kernel
constexpr int kBlocksPerSm = 8;           // grid cap of the grid-stride kernels, per SM
constexpr int kMaxPieces = 96;            // segments (or pieces of one) per multi-tensor launch
constexpr int64_t kMaxBlocks = 1 << 30;   // blocks per multi-tensor launch (grid.x < 2^31)

static_assert(kChunk % kVec == 0, "a chunk must start on a vector boundary");

// Element sizes of each kind, in bytes.
template <int K>
struct KindTraits {
  static constexpr int kSrc =
      (K == MP_CAST_F32_TO_BF16 || K == MP_CAST_F32_TO_F16 || K == MP_CAST_COPY32) ? 4 : 2;
  static constexpr int kDst =
      (K == MP_CAST_BF16_TO_F32 || K == MP_CAST_F16_TO_F32 || K == MP_CAST_COPY32) ? 4 : 2;
};

// One element, round to nearest even (or exact), on raw bits: 16-bit values sit in the low half.
template <int K>
MP_CAST_HD uint32_t convert_rn(uint32_t u) {
  if constexpr (K == MP_CAST_F32_TO_BF16) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(f32_from_bits(u)));
  } else if constexpr (K == MP_CAST_F32_TO_F16) {
    return __half_as_ushort(__float2half_rn(f32_from_bits(u)));
  } else if constexpr (K == MP_CAST_BF16_TO_F32) {
    return bits_from_f32(__bfloat162float(__ushort_as_bfloat16(static_cast<unsigned short>(u))));
  } else if constexpr (K == MP_CAST_F16_TO_F32) {
    return bits_from_f32(__half2float(__ushort_as_half(static_cast<unsigned short>(u))));
  } else {
    return u;  // copies
  }
}

template <int S>
MP_CAST_HD void pick8(const uint32_t w[12], uint32_t r[8]) {
#pragma unroll
  for (int j = 0; j < 8; ++j) r[j] = w[S + j];
}

// The random words of the eight stream positions p .. p + 7: words p % 4 .. p % 4 + 7 of the
// Philox blocks p / 4, p / 4 + 1 (and p / 4 + 2 when p % 4 != 0). Every index is a compile-time
// constant after unrolling, so w and r stay in registers.
MP_CAST_HD void sr_words8(uint64_t seed, uint64_t p, uint32_t r[8]) {
  uint32_t w[12];
  const uint64_t b = p >> 2;
  mp_sr_random_block(seed, b, w);
  mp_sr_random_block(seed, b + 1u, w + 4);
  const unsigned s = static_cast<unsigned>(p & 3u);
  if (s == 0u) {
    pick8<0>(w, r);
    return;
  }
  mp_sr_random_block(seed, b + 2u, w + 8);
  if (s == 1u) {
    pick8<1>(w, r);
  } else if (s == 2u) {
    pick8<2>(w, r);
  } else {
    pick8<3>(w, r);
  }
}

// Stochastic rounding of elements [begin, n) of a range whose element 0 has stream position pos,
// one element at a time but one Philox evaluation per block of four positions: thread tid takes
// the tid-th, (tid + nthreads)-th, ... Philox block touching the elements, and the elements
// inside [begin, n) that the block covers. Positions (and so blocks) wrap like the CPU's.
MP_CAST_HD void sr_scalar(const void* src, void* dst, int64_t begin, int64_t n, uint64_t pos,
                          uint64_t seed, int64_t tid, int64_t nthreads) {
  if (begin >= n) return;
  const uint64_t p0 = pos + static_cast<uint64_t>(begin);
  const int64_t lead = static_cast<int64_t>(p0 & 3u);   // elements of the first block before begin
  const int64_t groups = (n - begin + lead + 3) / 4;    // Philox blocks touching [begin, n)
  for (int64_t j = tid; j < groups; j += nthreads) {
    uint32_t r[4];
    mp_sr_random_block(seed, (p0 >> 2) + static_cast<uint64_t>(j), r);
    const int64_t base = begin - lead + 4 * j;          // element of the block's word 0
#pragma unroll
    for (int q = 0; q < 4; ++q) {
      const int64_t i = base + q;
      if (i >= begin && i < n) store1<2>(dst, i, mp_bf16_sr_bits(load1<4>(src, i), r[q]));
    }
  }
}

// Converts elements [0, n) of src into dst, this thread taking its share of a loop whose threads
// are numbered 0 .. nthreads - 1. Element i has stream position pos + i (stochastic rounding,
// which applies to MP_CAST_F32_TO_BF16 only).
template <int K, bool SR>
MP_CAST_HD void cast_range(const void* src, void* dst, int64_t n, uint64_t pos, uint64_t seed,
                           int64_t tid, int64_t nthreads) {
  constexpr int kSrc = KindTraits<K>::kSrc;
  constexpr int kDst = KindTraits<K>::kDst;
  constexpr bool kStochastic = SR && K == MP_CAST_F32_TO_BF16;
  int64_t done = 0;
  if (((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) & 15u) == 0u) {
    const int64_t nvec = n / kVec;
    for (int64_t v = tid; v < nvec; v += nthreads) {
      uint32_t x[8], y[8];
      load8<kSrc>(src, v, x);
      if constexpr (kStochastic) {
        uint32_t r[8];
        sr_words8(seed, pos + static_cast<uint64_t>(v * kVec), r);
#pragma unroll
        for (int j = 0; j < 8; ++j) y[j] = mp_bf16_sr_bits(x[j], r[j]);
      } else {
#pragma unroll
        for (int j = 0; j < 8; ++j) y[j] = convert_rn<K>(x[j]);
      }
      store8<kDst>(dst, v, y);
    }
    done = nvec * kVec;
  }
  if constexpr (kStochastic) {
    sr_scalar(src, dst, done, n, pos, seed, tid, nthreads);
  } else {
    for (int64_t i = done + tid; i < n; i += nthreads) {
      store1<kDst>(dst, i, convert_rn<K>(load1<kSrc>(src, i)));
    }
  }
}

// The argument of one multi-tensor launch (passed by value, under the 4 KB parameter limit).
// Piece k is elements [0, n[k]) of a segment (or a part of one), covered by blocks
// first_block[k] .. first_block[k + 1] - 1 (the last piece's blocks run to the grid's end), one
// chunk of kChunk elements each. first_block is strictly increasing and starts at 0.
struct MultiArgs {
  uint64_t seed;
  const void* src[kMaxPieces];
  void* dst[kMaxPieces];
  int64_t n[kMaxPieces];
  uint64_t pos[kMaxPieces];  // stream position of element 0
  uint32_t first_block[kMaxPieces];
  uint8_t kind[kMaxPieces];
  int32_t npieces;
};

static_assert(sizeof(MultiArgs) <= 4096, "the multi-tensor argument must fit the 4 KB limit");

template <int K, bool SR>
MP_CAST_HD void multi_chunk(const MultiArgs& a, int k, int64_t start, int64_t count,
                            int64_t tid, int64_t nthreads) {
  const char* src = static_cast<const char*>(a.src[k]) + start * KindTraits<K>::kSrc;
  char* dst = static_cast<char*>(a.dst[k]) + start * KindTraits<K>::kDst;
  cast_range<K, SR>(src, dst, count, a.pos[k] + static_cast<uint64_t>(start), a.seed, tid,
                    nthreads);
}

// The work of block `block` of a multi-tensor launch, for thread tid of nthreads.
template <bool SR>
MP_CAST_HD void multi_block(const MultiArgs& a, uint32_t block, int64_t tid, int64_t nthreads) {
  const int lo = mp_cuda::piece_of_block(a.first_block, a.npieces, block);
  const int64_t start = static_cast<int64_t>(block - a.first_block[lo]) * kChunk;
  const int64_t rest = a.n[lo] - start;
  const int64_t count = rest < kChunk ? rest : kChunk;
  switch (a.kind[lo]) {
    case MP_CAST_F32_TO_BF16:
      multi_chunk<MP_CAST_F32_TO_BF16, SR>(a, lo, start, count, tid, nthreads);
      break;
    case MP_CAST_F32_TO_F16:
      multi_chunk<MP_CAST_F32_TO_F16, SR>(a, lo, start, count, tid, nthreads);
      break;
    case MP_CAST_BF16_TO_F32:
      multi_chunk<MP_CAST_BF16_TO_F32, SR>(a, lo, start, count, tid, nthreads);
      break;
    case MP_CAST_F16_TO_F32:
      multi_chunk<MP_CAST_F16_TO_F32, SR>(a, lo, start, count, tid, nthreads);
      break;
    case MP_CAST_COPY32:
      multi_chunk<MP_CAST_COPY32, SR>(a, lo, start, count, tid, nthreads);
      break;
    default:
      multi_chunk<MP_CAST_COPY16, SR>(a, lo, start, count, tid, nthreads);
      break;
  }
}

template <int K, bool SR>
__global__ void __launch_bounds__(kThreads)
    cast_kernel(const void* src, void* dst, int64_t n, uint64_t pos, uint64_t seed) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nthreads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  cast_range<K, SR>(src, dst, n, pos, seed, tid, nthreads);
}

template <bool SR>
__global__ void __launch_bounds__(kThreads) cast_multi_kernel(const __grid_constant__ MultiArgs a) {
  multi_block<SR>(a, blockIdx.x, threadIdx.x, blockDim.x);
}

// A launch failed iff the runtime has a pending error; it is left for the caller to read.
mp_status launch_status() { return cudaPeekAtLastError() == cudaSuccess ? MP_OK : MP_ERR_CUDA; }

template <int K, bool SR>
mp_status launch_single(const void* src, void* dst, int64_t n, uint64_t pos, uint64_t seed,
                        cudaStream_t stream) {
  if (n < 0 || (n > 0 && (src == nullptr || dst == nullptr))) return MP_ERR_INVALID_ARGUMENT;
  if (n == 0) return MP_OK;
  if (!mp_cuda::element_aligned(src, KindTraits<K>::kSrc) ||
      !mp_cuda::element_aligned(dst, KindTraits<K>::kDst)) {
    return MP_ERR_INVALID_ARGUMENT;
  }
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    return MP_ERR_CUDA;
  }
  const int64_t per_block = kThreads * kVec;
  int64_t blocks = (n + per_block - 1) / per_block;
  const int64_t cap = static_cast<int64_t>(sms > 0 ? sms : 1) * kBlocksPerSm;
  if (blocks > cap) blocks = cap;
  mp_cuda::launch(cast_kernel<K, SR>, static_cast<unsigned>(blocks), kThreads, 0, stream, src,
                  dst, n, pos, seed);
  return launch_status();
}

int src_bytes(int kind) {
  return (kind == MP_CAST_F32_TO_BF16 || kind == MP_CAST_F32_TO_F16 || kind == MP_CAST_COPY32)
             ? 4
             : 2;
}

int dst_bytes(int kind) {
  return (kind == MP_CAST_BF16_TO_F32 || kind == MP_CAST_F16_TO_F32 || kind == MP_CAST_COPY32)
             ? 4
             : 2;
}

mp_status check_segments(const mp_cast_segment* segs, int64_t nsegs, int stochastic) {
  if (nsegs < 0 || (nsegs > 0 && segs == nullptr)) return MP_ERR_INVALID_ARGUMENT;
  for (int64_t k = 0; k < nsegs; ++k) {
    const mp_cast_segment& s = segs[k];
    if (s.kind < 0 || s.kind >= MP_CAST_KIND_COUNT || s.n < 0) return MP_ERR_INVALID_ARGUMENT;
    if (s.n > 0 && (s.src == nullptr || s.dst == nullptr ||
                    !mp_cuda::element_aligned(s.src, src_bytes(s.kind)) ||
                    !mp_cuda::element_aligned(s.dst, dst_bytes(s.kind)))) {
      return MP_ERR_INVALID_ARGUMENT;
    }
    if (stochastic && s.kind == MP_CAST_F32_TO_F16) return MP_ERR_INVALID_ARGUMENT;
  }
  return MP_OK;
}

// Packs the (checked) segments into MultiArgs, one chunk per block, and calls
// launch(args, blocks) whenever max_pieces pieces (at most kMaxPieces) or max_blocks blocks are
// packed, and once at the end. A segment that does not fit the blocks left is split across
// launches.
template <class Launch>
mp_status for_each_launch(const mp_cast_segment* segs, int64_t nsegs, uint64_t seed,
                          int64_t max_blocks, int max_pieces, Launch&& launch) {
  if (max_pieces > kMaxPieces || max_pieces < 1) max_pieces = kMaxPieces;
  MultiArgs a{};
  a.seed = seed;
  a.npieces = 0;
  int64_t blocks = 0;
  for (int64_t k = 0; k < nsegs; ++k) {
    const mp_cast_segment& s = segs[k];
    int64_t done = 0;
    while (done < s.n) {
      const int64_t chunks = (s.n - done + kChunk - 1) / kChunk;
      const int64_t take = chunks < max_blocks - blocks ? chunks : max_blocks - blocks;
      const int64_t count = s.n - done < take * kChunk ? s.n - done : take * kChunk;
      const int i = a.npieces++;
      a.src[i] = static_cast<const char*>(s.src) + done * src_bytes(s.kind);
      a.dst[i] = static_cast<char*>(s.dst) + done * dst_bytes(s.kind);
      a.n[i] = count;
      a.pos[i] = s.sr_position + static_cast<uint64_t>(done);
      a.first_block[i] = static_cast<uint32_t>(blocks);
      a.kind[i] = static_cast<uint8_t>(s.kind);
      blocks += take;
      done += count;
      if (a.npieces == max_pieces || blocks == max_blocks) {
        const mp_status st = launch(static_cast<const MultiArgs&>(a), blocks);
        if (st != MP_OK) return st;
        a.npieces = 0;
        blocks = 0;
      }
    }
  }
  if (a.npieces > 0) return launch(static_cast<const MultiArgs&>(a), blocks);
  return MP_OK;
}

}  // namespace

extern "C" {

mp_status mp_to_bf16_f32_cuda(const float* src, uint16_t* dst, int64_t n, cudaStream_t stream) {
  return launch_single<MP_CAST_F32_TO_BF16, false>(src, dst, n, 0, 0, stream);
}

mp_status mp_to_bf16_sr_f32_cuda(const float* src, uint16_t* dst, int64_t n, uint64_t seed,
                                 uint64_t offset, cudaStream_t stream) {
  return launch_single<MP_CAST_F32_TO_BF16, true>(src, dst, n, offset, seed, stream);
}

mp_status mp_to_fp16_f32_cuda(const float* src, uint16_t* dst, int64_t n, cudaStream_t stream) {
  return launch_single<MP_CAST_F32_TO_F16, false>(src, dst, n, 0, 0, stream);
}

mp_status mp_to_fp32_bf16_cuda(const uint16_t* src, float* dst, int64_t n, cudaStream_t stream) {
  return launch_single<MP_CAST_BF16_TO_F32, false>(src, dst, n, 0, 0, stream);
}

mp_status mp_to_fp32_fp16_cuda(const uint16_t* src, float* dst, int64_t n, cudaStream_t stream) {
  return launch_single<MP_CAST_F16_TO_F32, false>(src, dst, n, 0, 0, stream);
}

mp_status mp_cast_multi_cuda(const mp_cast_segment* segs, int64_t nsegs, int stochastic,
                             uint64_t seed, cudaStream_t stream) {
  const mp_status checked = check_segments(segs, nsegs, stochastic);
  if (checked != MP_OK) return checked;
  return for_each_launch(segs, nsegs, seed, mp_cuda::cap_blocks(kMaxBlocks),
                         mp_cuda::cap_pieces(kMaxPieces),
                         [&](const MultiArgs& a, int64_t blocks) -> mp_status {
                           const unsigned grid = static_cast<unsigned>(blocks);
                           if (stochastic) {
                             mp_cuda::launch(cast_multi_kernel<true>, grid, kThreads, 0, stream,
                                             a);
                           } else {
                             mp_cuda::launch(cast_multi_kernel<false>, grid, kThreads, 0, stream,
                                             a);
                           }
                           return launch_status();
                         });
}

}  // extern "C"
