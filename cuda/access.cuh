// What the CUDA kernels and launchers (cast.cu, scale.cu, adam.cu, norm.cu) share, beside the
// multi-tensor engine (multi_tensor.cuh): raw-bit loads and stores of one or eight 32- or 16-bit
// elements (eight through 16-byte accesses), the conversions between an element's bits and fp32,
// the packers' per-launch caps and the one kernel-launch call with its status. No torch headers.
//
// The CPU emulation harness (tests/cuda_emu) compiles these files with the host C++ compiler
// against a shim of the CUDA built-ins that defines MP_CUDA_EMULATION; launch() is the only place
// that tells the two apart.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stddef.h>
#include <stdint.h>

#include "mpext/mpext.h"

#define MP_CUDA_HD __host__ __device__ __forceinline__

namespace mp_cuda {

// Launches kernel<<<grid, block, shared_bytes, stream>>>(args...); in the emulation harness the
// emulator runs the grid on the host instead. Every launch in cuda/*.cu goes through here.
template <class... Params, class... Args>
inline void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes,
                   cudaStream_t stream, Args&&... args) {
#if defined(MP_CUDA_EMULATION)
  mp_emu::launch(kernel, grid, block, shared_bytes, stream, static_cast<Args&&>(args)...);
#else
  kernel<<<grid, block, shared_bytes, stream>>>(static_cast<Args&&>(args)...);
#endif
}

// A launch failed iff the runtime has a pending error; it is left for the caller to read.
inline mp_status launch_status() {
  return cudaPeekAtLastError() == cudaSuccess ? MP_OK : MP_ERR_CUDA;
}

// The caps of one multi-tensor launch: blocks, and entries (pieces, step counters) of its
// by-value argument. On the device they are each op's own limits. The emulation harness lowers
// them through test_caps (0: the op's limit) so that lists split across launches and tensors
// across launches with a few thousand elements instead of gigabytes.
struct LaunchCaps {
  int64_t max_blocks;
  int max_pieces;
};

#if defined(MP_CUDA_EMULATION)
inline LaunchCaps test_caps = {0, 0};
#endif

inline int64_t cap_blocks(int64_t limit) {
#if defined(MP_CUDA_EMULATION)
  if (test_caps.max_blocks > 0 && test_caps.max_blocks < limit) return test_caps.max_blocks;
#endif
  return limit;
}

inline int cap_pieces(int limit) {
#if defined(MP_CUDA_EMULATION)
  if (test_caps.max_pieces > 0 && test_caps.max_pieces < limit) return test_caps.max_pieces;
#endif
  return limit;
}

// Whether p is aligned to its element size: the launchers reject pointers that are not, since a
// GPU faults on an access that is not aligned to its size.
inline bool element_aligned(const void* p, int bytes) {
  return reinterpret_cast<uintptr_t>(p) % static_cast<uintptr_t>(bytes) == 0u;
}

// Whether n elements of mp_dtype dtype at p make a tensor a launcher can take: a known dtype,
// n >= 0, and (when n > 0) p non-null and aligned to its element size.
inline bool tensor_ok(const void* p, int32_t dtype, int64_t n) {
  if (dtype < 0 || dtype >= MP_DTYPE_COUNT || n < 0) return false;
  return n == 0 || (p != nullptr && element_aligned(p, MP_DTYPE_BYTES(dtype)));
}

MP_CUDA_HD float f32_from_bits(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float f;
  __builtin_memcpy(&f, &u, sizeof f);
  return f;
#endif
}

MP_CUDA_HD uint32_t bits_from_f32(float f) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(f);
#else
  uint32_t u;
  __builtin_memcpy(&u, &f, sizeof u);
  return u;
#endif
}

// An element of mp_dtype D (raw bits, 16-bit values in the low half) widened to fp32 (exact).
template <int D>
MP_CUDA_HD float widen(uint32_t x) {
  if constexpr (D == MP_F32) {
    return f32_from_bits(x);
  } else if constexpr (D == MP_BF16) {
    return __bfloat162float(__ushort_as_bfloat16(static_cast<unsigned short>(x)));
  } else {
    return __half2float(__ushort_as_half(static_cast<unsigned short>(x)));
  }
}

// An fp32 value as the bits of mp_dtype D, rounded to nearest even (subnormals kept: the
// intrinsics compile to cvt.rn without .ftz).
template <int D>
MP_CUDA_HD uint32_t narrow(float f) {
  if constexpr (D == MP_F32) {
    return bits_from_f32(f);
  } else if constexpr (D == MP_BF16) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(f));
  } else {
    return __half_as_ushort(__float2half_rn(f));
  }
}

// Eight consecutive elements starting at element 8 * v of a 16-byte aligned pointer (8-byte for
// 1-byte elements), as raw bits (8- and 16-bit ones zero-extended; little endian: element 2k is
// the low half of word k), and back.
template <int Bytes>
MP_CUDA_HD void load8(const void* p, int64_t v, uint32_t x[8]) {
  const uint4* s = static_cast<const uint4*>(p);
  if constexpr (Bytes == 1) {  // eight bytes, one 8-byte access (p 8-byte aligned)
    const uint2 a = static_cast<const uint2*>(p)[v];
    for (int j = 0; j < 4; ++j) {
      x[j] = (a.x >> (8 * j)) & 0xFFu;
      x[j + 4] = (a.y >> (8 * j)) & 0xFFu;
    }
  } else if constexpr (Bytes == 4) {
    const uint4 a = s[2 * v];
    const uint4 b = s[2 * v + 1];
    x[0] = a.x; x[1] = a.y; x[2] = a.z; x[3] = a.w;
    x[4] = b.x; x[5] = b.y; x[6] = b.z; x[7] = b.w;
  } else {
    const uint4 a = s[v];
    x[0] = a.x & 0xFFFFu; x[1] = a.x >> 16;
    x[2] = a.y & 0xFFFFu; x[3] = a.y >> 16;
    x[4] = a.z & 0xFFFFu; x[5] = a.z >> 16;
    x[6] = a.w & 0xFFFFu; x[7] = a.w >> 16;
  }
}

template <int Bytes>
MP_CUDA_HD void store8(void* p, int64_t v, const uint32_t y[8]) {
  uint4* d = static_cast<uint4*>(p);
  if constexpr (Bytes == 1) {
    uint2 a = make_uint2(0u, 0u);
    for (int j = 0; j < 4; ++j) {
      a.x |= (y[j] & 0xFFu) << (8 * j);
      a.y |= (y[j + 4] & 0xFFu) << (8 * j);
    }
    static_cast<uint2*>(p)[v] = a;
  } else if constexpr (Bytes == 4) {
    d[2 * v] = make_uint4(y[0], y[1], y[2], y[3]);
    d[2 * v + 1] = make_uint4(y[4], y[5], y[6], y[7]);
  } else {
    d[v] = make_uint4((y[0] & 0xFFFFu) | (y[1] << 16), (y[2] & 0xFFFFu) | (y[3] << 16),
                      (y[4] & 0xFFFFu) | (y[5] << 16), (y[6] & 0xFFFFu) | (y[7] << 16));
  }
}

// Element i, as raw bits (an 8- or 16-bit one zero-extended), and back.
template <int Bytes>
MP_CUDA_HD uint32_t load1(const void* p, int64_t i) {
  if constexpr (Bytes == 4) {
    return static_cast<const uint32_t*>(p)[i];
  } else if constexpr (Bytes == 2) {
    return static_cast<const uint16_t*>(p)[i];
  } else {
    return static_cast<const uint8_t*>(p)[i];
  }
}

template <int Bytes>
MP_CUDA_HD void store1(void* p, int64_t i, uint32_t y) {
  if constexpr (Bytes == 4) {
    static_cast<uint32_t*>(p)[i] = y;
  } else if constexpr (Bytes == 2) {
    static_cast<uint16_t*>(p)[i] = static_cast<uint16_t>(y);
  } else {
    static_cast<uint8_t*>(p)[i] = static_cast<uint8_t>(y);
  }
}

// Elements i0 .. i0 + 7 (i0 a multiple of 8), the first nv of them present: with one 8- or
// 16-byte access per array slice when `vec` (p aligned to 8 elements) and all eight are there,
// else one element at a time; absent ones read as 0 and are not written.
template <int Bytes>
MP_CUDA_HD void load_group(const void* p, int64_t i0, int nv, bool vec, uint32_t x[8]) {
  if (vec && nv == 8) {
    load8<Bytes>(p, i0 / 8, x);
  } else {
#pragma unroll
    for (int j = 0; j < 8; ++j) x[j] = j < nv ? load1<Bytes>(p, i0 + j) : 0u;
  }
}

template <int Bytes>
MP_CUDA_HD void store_group(void* p, int64_t i0, int nv, bool vec, const uint32_t y[8]) {
  if (vec && nv == 8) {
    store8<Bytes>(p, i0 / 8, y);
  } else {
    // a constant trip count: y stays in registers (a loop to nv would index it dynamically)
#pragma unroll
    for (int j = 0; j < 8; ++j) {
      if (j < nv) store1<Bytes>(p, i0 + j, y[j]);
    }
  }
}

}  // namespace mp_cuda
