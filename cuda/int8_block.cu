// The int8 block code of saved activations on CUDA devices: the kernels and launchers behind
// mpext/int8_block_cuda.h.
//
// One warp per block (a row's `block` elements of the last dimension), as cuda/fp8.cu: its 32
// lanes stride over the block for the absmax, combine it with a butterfly of __shfl_xor_sync (an
// unsigned max over bits, so the order does not matter and a NaN or Inf wins), each compute the
// one scale, then stride again to write the codes; lane 0 writes the scale. Warps walk the
// row-major list of blocks grid-stride, with 64-bit indices. Every element rule is
// mpext/int8_block_rule.h's, shared with the C core, so the bits are the CPU's (x / s is IEEE
// division: nvcc's default -prec-div=true, and the build does not pass --use_fast_math).
#include <cuda_runtime.h>

#include "access.cuh"
#include "mpext/int8_block_cuda.h"
#include "mpext/int8_block_rule.h"
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
    quantize_kernel(const void* x, int dtype, int8_t* q, float* scales, Geometry g, int pow2) {
  for_each_block(g, [&](int64_t w, int64_t start, int64_t n, int lane) {
    uint32_t amax = 0;
    for (int64_t i = lane; i < n; i += 32) {
      amax = mp_i8b_amax_bits(amax, __float_as_uint(mp_i8b_load(x, start + i, dtype)));
    }
#pragma unroll
    for (int m = 16; m >= 1; m /= 2) {
      const uint32_t other = __shfl_xor_sync(0xFFFFFFFFu, amax, m, 32);
      amax = other > amax ? other : amax;
    }
    const float s = mp_i8b_block_scale(amax, pow2);
    if (lane == 0) scales[w] = s;
    for (int64_t i = lane; i < n; i += 32) {
      q[start + i] = static_cast<int8_t>(mp_i8b_code(mp_i8b_load(x, start + i, dtype), s));
    }
  });
}

__global__ void __launch_bounds__(kThreads)
    dequantize_kernel(const int8_t* q, const float* scales, void* out, int dtype, Geometry g) {
  for_each_block(g, [&](int64_t w, int64_t start, int64_t n, int lane) {
    const float s = scales[w];
    for (int64_t i = lane; i < n; i += 32) {
      mp_i8b_store_bits(out, start + i, mp_i8b_restore_bits(q[start + i], s, dtype), dtype);
    }
  });
}

// The checks of the C core's entry points (mpext/int8_block.h), plus alignment.
bool args_ok(int dtype, int64_t rows, int64_t cols, int64_t block, const void* a, const void* b,
             const void* c) {
  if (rows < 0 || cols < 0 || block < 1) return false;
  if (dtype != MP_F32 && dtype != MP_BF16 && dtype != MP_F16) return false;
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

mp_status mp_int8_block_quantize_cuda(const void* x, mp_dtype dtype, int8_t* q, float* scales,
                                      int64_t rows, int64_t cols, int64_t block, int pow2,
                                      cudaStream_t stream) {
  if (!args_ok(dtype, rows, cols, block, x, q, scales)) return MP_ERR_INVALID_ARGUMENT;
  if (rows * cols == 0) return MP_OK;
  if (!mp_cuda::element_aligned(x, MP_DTYPE_BYTES(dtype)) || !mp_cuda::element_aligned(scales, 4))
    return MP_ERR_INVALID_ARGUMENT;
  const Geometry g{rows, cols, block, (cols + block - 1) / block};
  mp_cuda::launch(quantize_kernel, grid_for(g), kThreads, 0, stream, x, static_cast<int>(dtype),
                  q, scales, g, pow2 != 0 ? 1 : 0);
  return mp_cuda::launch_status();
}

mp_status mp_int8_block_dequantize_cuda(const int8_t* q, const float* scales, void* out,
                                        mp_dtype out_dtype, int64_t rows, int64_t cols,
                                        int64_t block, cudaStream_t stream) {
  if (!args_ok(out_dtype, rows, cols, block, q, scales, out)) return MP_ERR_INVALID_ARGUMENT;
  if (rows * cols == 0) return MP_OK;
  if (!mp_cuda::element_aligned(out, MP_DTYPE_BYTES(out_dtype)) ||
      !mp_cuda::element_aligned(scales, 4))
    return MP_ERR_INVALID_ARGUMENT;
  const Geometry g{rows, cols, block, (cols + block - 1) / block};
  mp_cuda::launch(dequantize_kernel, grid_for(g), kThreads, 0, stream, q, scales, out,
                  static_cast<int>(out_dtype), g);
  return mp_cuda::launch_status();
}

}  // extern "C"
