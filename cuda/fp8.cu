// FP8 block quantization on CUDA devices: the kernels and launchers behind mpext/fp8_cuda.h.
//
// One warp per quantization block (a row's `block` elements of the last dimension): its 32 lanes
// stride over the block for the finite amax, combine it with a butterfly of __shfl_xor_sync (an
// unsigned max over bits, so the order does not matter), each compute the one scale, then
// stride again to write the codes; lane 0 writes the scale. Warps walk the row-major list of
// blocks grid-stride, with 64-bit indices. Every element rule is mpext/fp8_rule.h's, shared with
// the C core, so the bits are the CPU's; stochastic rounding draws mp_sr_bits at the element's
// stream position, as there.
#include <cuda_runtime.h>

#include "access.cuh"
#include "mpext/fp8_cuda.h"
#include "mpext/fp8_rule.h"
#include "mpext/numerics.h"

namespace {

constexpr int kThreads = 256;  // 8 warps, 8 blocks of the tensor per CUDA block
constexpr int kWarps = kThreads / 32;
constexpr int64_t kMaxGrid = 1 << 16;

struct Geometry {
  int64_t rows, cols, block, nblocks;
};

// Calls f(w, start, n, lane) for every block w of the tensor this thread's warp takes (grid-stride
// over warps; all 32 lanes of a warp make the same calls): its first element and length.
template <class F>
__device__ __forceinline__ void for_each_block(const Geometry& g, F&& f) {
  const int lane = threadIdx.x % 32;
  const int64_t nwarps = static_cast<int64_t>(gridDim.x) * kWarps;
  for (int64_t w = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
       w < g.rows * g.nblocks; w += nwarps) {
    const int64_t r = w / g.nblocks, b = w % g.nblocks;
    f(w, r * g.cols + b * g.block, g.cols - b * g.block < g.block ? g.cols - b * g.block : g.block,
      lane);
  }
}

__global__ void __launch_bounds__(kThreads)
    quantize_kernel(const void* x, int dtype, uint8_t* q, float* scales, Geometry g, int fmt,
                    int pow2, int sr, uint64_t key, uint64_t position) {
  for_each_block(g, [&](int64_t w, int64_t start, int64_t n, int lane) {
    uint32_t amax = 0;
    for (int64_t i = lane; i < n; i += 32) {
      amax = mp_fp8_amax_bits(amax, mp_fp8_load_bits(x, start + i, dtype));
    }
#pragma unroll
    for (int m = 16; m >= 1; m /= 2) {
      const uint32_t other = __shfl_xor_sync(0xFFFFFFFFu, amax, m, 32);
      amax = other > amax ? other : amax;
    }
    const float s = mp_fp8_block_scale(amax, fmt, pow2);
    const float inv = 1.0f / s;
    if (lane == 0) scales[w] = s;
    for (int64_t i = lane; i < n; i += 32) {
      const uint32_t r = sr ? mp_sr_bits(key, position + static_cast<uint64_t>(start + i)) : 0u;
      q[start + i] = static_cast<uint8_t>(
          mp_fp8_quantize_bits(mp_fp8_load_bits(x, start + i, dtype), inv, fmt, sr, r));
    }
  });
}

__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const uint8_t* q, const float* scales, void* out, int dtype, Geometry g,
                      int fmt) {
  for_each_block(g, [&](int64_t w, int64_t start, int64_t n, int lane) {
    const float s = scales[w];
    for (int64_t i = lane; i < n; i += 32) {
      mp_fp8_store_bits(out, start + i, mp_fp8_dequantize_bits(q[start + i], s, fmt), dtype);
    }
  });
}

// The checks of the C core's entry points (mpext/fp8.h), plus alignment; the geometry.
bool args_ok(int dtype, int64_t rows, int64_t cols, int64_t block, int fmt, const void* a,
             const void* b, const void* c) {
  if (rows < 0 || cols < 0 || block < 1) return false;
  if (dtype != MP_F32 && dtype != MP_BF16 && dtype != MP_F16) return false;
  if (fmt != MP_FP8_E4M3 && fmt != MP_FP8_E5M2) return false;
  if (rows > 0 && cols > INT64_MAX / rows) return false;
  if (rows * cols == 0) return true;
  return a != nullptr && b != nullptr && c != nullptr;
}

unsigned grid_for(const Geometry& g) {
  const int64_t blocks = (g.rows * g.nblocks + kWarps - 1) / kWarps;
  const int64_t cap = mp_cuda::cap_blocks(kMaxGrid);
  return static_cast<unsigned>(blocks < cap ? blocks : cap);
}

}  // namespace

extern "C" {

mp_status mp_fp8_quantize_cuda(const void* x, mp_dtype dtype, uint8_t* q, float* scales,
                               int64_t rows, int64_t cols, int64_t block, int fmt, int pow2,
                               int stochastic, uint64_t seed, uint64_t position,
                               cudaStream_t stream) {
  if (!args_ok(dtype, rows, cols, block, fmt, x, q, scales)) return MP_ERR_INVALID_ARGUMENT;
  if (rows * cols == 0) return MP_OK;
  if (!mp_cuda::element_aligned(x, MP_DTYPE_BYTES(dtype)) || !mp_cuda::element_aligned(scales, 4))
    return MP_ERR_INVALID_ARGUMENT;
  const Geometry g{rows, cols, block, (cols + block - 1) / block};
  mp_cuda::launch(quantize_kernel, grid_for(g), kThreads, 0, stream, x, static_cast<int>(dtype),
                  q, scales, g, fmt, pow2 != 0 ? 1 : 0, stochastic != 0 ? 1 : 0,
                  mp_sr_key(seed, 0, 0), position);
  return mp_cuda::launch_status();
}

mp_status mp_fp8_dequantize_cuda(const uint8_t* q, const float* scales, void* out,
                                 mp_dtype out_dtype, int64_t rows, int64_t cols, int64_t block,
                                 int fmt, cudaStream_t stream) {
  if (!args_ok(out_dtype, rows, cols, block, fmt, q, scales, out)) return MP_ERR_INVALID_ARGUMENT;
  if (rows * cols == 0) return MP_OK;
  if (!mp_cuda::element_aligned(out, MP_DTYPE_BYTES(out_dtype)) ||
      !mp_cuda::element_aligned(scales, 4))
    return MP_ERR_INVALID_ARGUMENT;
  const Geometry g{rows, cols, block, (cols + block - 1) / block};
  mp_cuda::launch(dequantize_kernel, grid_for(g), kThreads, 0, stream, q, scales, out,
                  static_cast<int>(out_dtype), g, fmt);
  return mp_cuda::launch_status();
}

}  // extern "C"
