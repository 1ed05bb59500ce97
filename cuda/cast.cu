// fp32 <-> bf16 / fp16 casts on CUDA devices: the kernels and launchers behind mpext/cast_cuda.h.
//
// Layout of the work. Every kernel runs the same per-thread routine, cast_range, over a flat
// range of elements with a thread index and a thread count:
//   - the single-segment kernel (mp_cast_cuda) gives it the whole segment, the global thread
//     index and the grid's thread count (a grid-stride loop);
//   - the multi-tensor kernel (cast_) gives each block one chunk of one segment (the
//     multi-tensor engine, multi_tensor.cuh), the block's thread index and the block size.
// cast_range moves 8 elements per step with 16-byte loads and stores when both pointers are
// 16-byte aligned, then finishes (or, unaligned, does everything) one element at a time; the
// launchers accept only pointers aligned to their element size. A cast is templated on its
// (source, destination) mp_dtype pair; a pair of one dtype is a copy.
//
// Numerics. Round to nearest even uses the CUDA conversion intrinsics, which is what torch's
// Tensor.to does on CUDA, so the bits match it for every non-NaN input (subnormals are rounded,
// not flushed: the intrinsics compile to cvt.rn without .ftz). Stochastic rounding uses the
// counter-based stream and the bit-level rounding of mpext/numerics.h, shared with the C core, so
// CUDA and CPU give the same bits: the element at stream position p uses mp_sr_bits(key, p).
#include <cuda_runtime.h>

#include "access.cuh"
#include "mpext/cast_cuda.h"
#include "mpext/mpext.h"
#include "mpext/numerics.h"
#include "multi_tensor.cuh"

namespace {

using namespace mp_cuda;  // the shared memory access and engine of access.cuh, multi_tensor.cuh

constexpr int kThreads = 256;    // threads per block, every kernel
constexpr int64_t kVec = 8;      // elements per vectorized step (16-byte loads/stores)
constexpr int kBlocksPerSm = 8;  // grid cap of the grid-stride kernel, per SM
constexpr int kMaxPieces = 96;   // segments (or pieces of one) per multi-tensor launch

static_assert(mp_cuda::kChunk % kVec == 0, "a chunk must start on a vector boundary");

// One element of an S -> D cast, round to nearest even (or exact), on raw bits: 16-bit values
// sit in the low half.
template <int S, int D>
MP_CUDA_HD uint32_t convert_rn(uint32_t u) {
  if constexpr (S == D) {
    return u;  // a copy
  } else if constexpr (S == MP_F32) {
    return narrow<D>(f32_from_bits(u));
  } else {
    return bits_from_f32(widen<S>(u));
  }
}

// Converts elements [0, n) of src into dst, this thread taking its share of a loop whose threads
// are numbered 0 .. nthreads - 1. Element i has stream position pos + i (stochastic rounding,
// which applies to fp32 -> bf16 only).
template <int S, int D, bool SR>
MP_CUDA_HD void cast_range(const void* src, void* dst, int64_t n, uint64_t pos, uint64_t key,
                           int64_t tid, int64_t nthreads) {
  constexpr int kSrc = MP_DTYPE_BYTES(S);
  constexpr int kDst = MP_DTYPE_BYTES(D);
  constexpr bool kStochastic = SR && S == MP_F32 && D == MP_BF16;
  int64_t done = 0;
  if (((reinterpret_cast<uintptr_t>(src) | reinterpret_cast<uintptr_t>(dst)) & 15u) == 0u) {
    const int64_t nvec = n / kVec;
    for (int64_t v = tid; v < nvec; v += nthreads) {
      uint32_t x[8], y[8];
      load8<kSrc>(src, v, x);
#pragma unroll
      for (int j = 0; j < 8; ++j) {
        if constexpr (kStochastic) {
          const uint64_t p = pos + static_cast<uint64_t>(v * kVec + j);
          y[j] = mp_bf16_sr_bits(x[j], mp_sr_bits(key, p));
        } else {
          y[j] = convert_rn<S, D>(x[j]);
        }
      }
      store8<kDst>(dst, v, y);
    }
    done = nvec * kVec;
  }
  for (int64_t i = done + tid; i < n; i += nthreads) {
    const uint32_t x = load1<kSrc>(src, i);
    if constexpr (kStochastic) {
      store1<kDst>(dst, i, mp_bf16_sr_bits(x, mp_sr_bits(key, pos + static_cast<uint64_t>(i))));
    } else {
      store1<kDst>(dst, i, convert_rn<S, D>(x));
    }
  }
}

// Calls f(Dtype<S>{}, Dtype<D>{}) for a segment's (source, destination) dtype pair: the one
// dispatch of this file over the seven pairs (four casts, three copies), constant inside f.
template <int V>
struct Dtype {
  static constexpr int value = V;
};

template <class F>
MP_CUDA_HD void for_pair(int src_dtype, int dst_dtype, F&& f) {
  if (src_dtype == dst_dtype) {
    if (src_dtype == MP_F32) {
      f(Dtype<MP_F32>{}, Dtype<MP_F32>{});
    } else if (src_dtype == MP_BF16) {
      f(Dtype<MP_BF16>{}, Dtype<MP_BF16>{});
    } else {
      f(Dtype<MP_F16>{}, Dtype<MP_F16>{});
    }
  } else if (src_dtype == MP_F32) {
    if (dst_dtype == MP_BF16) {
      f(Dtype<MP_F32>{}, Dtype<MP_BF16>{});
    } else {
      f(Dtype<MP_F32>{}, Dtype<MP_F16>{});
    }
  } else if (src_dtype == MP_BF16) {
    f(Dtype<MP_BF16>{}, Dtype<MP_F32>{});
  } else {
    f(Dtype<MP_F16>{}, Dtype<MP_F32>{});
  }
}

// Elements [start, start + count) of a segment (src and dst its arrays from element 0, pos the
// stream position of element 0, key the stream's), for thread tid of nthreads.
template <bool SR>
MP_CUDA_HD void cast_part(const void* src, int src_dtype, void* dst, int dst_dtype,
                          int64_t start, int64_t count, uint64_t pos, uint64_t key, int64_t tid,
                          int64_t nthreads) {
  for_pair(src_dtype, dst_dtype, [&](auto s, auto d) {
    constexpr int S = decltype(s)::value, D = decltype(d)::value;
    cast_range<S, D, SR>(static_cast<const char*>(src) + start * MP_DTYPE_BYTES(S),
                         static_cast<char*>(dst) + start * MP_DTYPE_BYTES(D), count,
                         pos + static_cast<uint64_t>(start), key, tid, nthreads);
  });
}

// The argument of one multi-tensor launch (passed by value, under the 4 KB parameter limit): per
// piece, the segment it belongs to, from the piece's first element.
struct MultiArgs {
  uint64_t key;  // the stream of the seed (mp_sr_key)
  mp_cuda::PieceTable<kMaxPieces> pieces;
  const void* src[kMaxPieces];
  void* dst[kMaxPieces];
  uint64_t pos[kMaxPieces];  // stream position of the piece's first element
  uint8_t src_dtype[kMaxPieces];
  uint8_t dst_dtype[kMaxPieces];
};

static_assert(sizeof(MultiArgs) <= 4096, "the multi-tensor argument must fit the 4 KB limit");

template <bool SR>
__global__ void __launch_bounds__(kThreads)
    cast_kernel(const __grid_constant__ mp_cast_segment seg, uint64_t key) {
  const int64_t tid = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t nthreads = static_cast<int64_t>(gridDim.x) * blockDim.x;
  cast_part<SR>(seg.src, seg.src_dtype, seg.dst, seg.dst_dtype, 0, seg.n, seg.sr_position, key,
                tid, nthreads);
}

template <bool SR>
__global__ void __launch_bounds__(kThreads) cast_multi_kernel(const __grid_constant__ MultiArgs a) {
  const mp_cuda::BlockRange r = mp_cuda::block_range(a.pieces, blockIdx.x);
  cast_part<SR>(a.src[r.k], a.src_dtype[r.k], a.dst[r.k], a.dst_dtype[r.k], r.start, r.count,
                a.pos[r.k], a.key, threadIdx.x, blockDim.x);
}

mp_status check_segments(const mp_cast_segment* segs, int64_t nsegs, int stochastic) {
  if (nsegs < 0 || (nsegs > 0 && segs == nullptr)) return MP_ERR_INVALID_ARGUMENT;
  for (int64_t k = 0; k < nsegs; ++k) {
    const mp_cast_segment& s = segs[k];
    if (!mp_cast_supported(s.src_dtype, s.dst_dtype, stochastic) ||
        !tensor_ok(s.src, s.src_dtype, s.n) || !tensor_ok(s.dst, s.dst_dtype, s.n)) {
      return MP_ERR_INVALID_ARGUMENT;
    }
  }
  return MP_OK;
}

}  // namespace

extern "C" {

mp_status mp_cast_cuda(const mp_cast_segment* seg, int stochastic, uint64_t seed,
                       cudaStream_t stream) {
  const mp_status checked = check_segments(seg, seg != nullptr ? 1 : -1, stochastic);
  if (checked != MP_OK || seg->n == 0) return checked;
  int device = 0, sms = 0;
  if (cudaGetDevice(&device) != cudaSuccess ||
      cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device) != cudaSuccess) {
    return MP_ERR_CUDA;
  }
  const int64_t per_block = kThreads * kVec;
  int64_t blocks = (seg->n + per_block - 1) / per_block;
  const int64_t cap = static_cast<int64_t>(sms > 0 ? sms : 1) * kBlocksPerSm;
  if (blocks > cap) blocks = cap;
  const unsigned grid = static_cast<unsigned>(blocks);
  if (stochastic) {
    mp_cuda::launch(cast_kernel<true>, grid, kThreads, 0, stream, *seg, mp_sr_key(seed, 0, 0));
  } else {
    mp_cuda::launch(cast_kernel<false>, grid, kThreads, 0, stream, *seg, uint64_t{0});
  }
  return mp_cuda::launch_status();
}

mp_status mp_cast_multi_cuda(const mp_cast_segment* segs, int64_t nsegs, int stochastic,
                             uint64_t seed, cudaStream_t stream) {
  const mp_status checked = check_segments(segs, nsegs, stochastic);
  if (checked != MP_OK) return checked;
  MultiArgs a{};
  a.key = mp_sr_key(seed, 0, 0);
  return mp_cuda::pack_launches(
      a.pieces, nsegs, [&](int64_t s) { return segs[s].n; },
      [&](int i, int64_t s, int64_t done) {
        const mp_cast_segment& g = segs[s];
        a.src[i] = static_cast<const char*>(g.src) + done * MP_DTYPE_BYTES(g.src_dtype);
        a.dst[i] = static_cast<char*>(g.dst) + done * MP_DTYPE_BYTES(g.dst_dtype);
        a.pos[i] = g.sr_position + static_cast<uint64_t>(done);
        a.src_dtype[i] = static_cast<uint8_t>(g.src_dtype);
        a.dst_dtype[i] = static_cast<uint8_t>(g.dst_dtype);
      },
      [&](int64_t blocks) {
        const unsigned grid = static_cast<unsigned>(blocks);
        if (stochastic) {
          mp_cuda::launch(cast_multi_kernel<true>, grid, kThreads, 0, stream, a);
        } else {
          mp_cuda::launch(cast_multi_kernel<false>, grid, kThreads, 0, stream, a);
        }
        return mp_cuda::launch_status();
      });
}

}  // extern "C"
