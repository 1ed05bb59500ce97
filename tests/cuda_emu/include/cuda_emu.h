// The CUDA built-ins that cuda/*.cu use, for compiling those files with the host C++ compiler and
// running their kernels on the CPU (see ../README.md). cuda_runtime.h, cuda_bf16.h and
// cuda_fp16.h in this folder include this file, so the CUDA sources compile unchanged.
//
// Device semantics modelled here (what sm_80+ does, not what the host toolchain would do):
//   - fp32 _rn intrinsics and __double2float_rn round to nearest even with subnormals kept (no
//     FTZ: the kernels are built without fast-math), and a NaN result is the GPU's single
//     canonical NaN 0x7FFFFFFF (no payload propagation, unlike x86).
//   - __float2bfloat16_rn / __float2half_rn (cvt.rn.bf16.f32 / cvt.rn.f16.f32): round to nearest
//     even, subnormal results rounded (not flushed), overflow to +-Inf; every NaN becomes 0x7FFF,
//     as NVIDIA's own host emulation in cuda_bf16.hpp / cuda_fp16.hpp.
//   - __half2float (cvt.f32.f16): exact; a NaN becomes 0x7FFFFFFF (cuda_fp16.hpp's host emulation
//     also drops the sign). __bfloat162float: a 16-bit shift (the sm_80 code path, mov.b32), so a
//     NaN keeps its payload.
//   - double intrinsics (__dadd_rn, __dsub_rn, __dmul_rn, __ddiv_rn, __dsqrt_rn, __fma_rn) and
//     device pow/sqrt: the host's IEEE double operations and libm (fma is exact on both). CUDA's double pow has up to 2 ulp of error, which
//     this cannot reproduce (see the README).
// Plain C++ float operators in device code (a * b) run as host IEEE operations (the harness
// compiles with -ffp-contract=off); on the GPU their NaN results are canonical too.
#pragma once

#ifndef __cplusplus
#error "the CUDA emulation shim is C++ only"
#endif

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include <tuple>
#include <utility>

// Device code is compiled as such: the device branches of __host__ __device__ code run.
#define __CUDA_ARCH__ 800
#define MP_CUDA_EMULATION 1

#define __host__
#define __device__
#define __global__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __grid_constant__
// One copy of each __shared__ variable, collected in one section: the emulator runs one block at
// a time and fills the whole section with random bytes before each block, so shared memory is
// shared by a block's threads, starts undefined, and carries nothing from one block to the next.
// Kernels with __shared__ variables must have internal linkage (an anonymous namespace, as in
// cuda/*.cu): GCC cannot put those of inline or template functions with external linkage into
// the same section as the others.
#define __shared__ static __attribute__((section("mp_emu_shared"), aligned(16)))

// ---- vector types ----

struct uint3 {
  unsigned int x, y, z;
};

struct dim3 {
  unsigned int x, y, z;
  constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1)
      : x(vx), y(vy), z(vz) {}
};

struct alignas(8) uint2 {
  unsigned int x, y;
};

inline uint2 make_uint2(unsigned int x, unsigned int y) {
  uint2 r;
  r.x = x;
  r.y = y;
  return r;
}

struct alignas(16) uint4 {
  unsigned int x, y, z, w;
};

inline uint4 make_uint4(unsigned int x, unsigned int y, unsigned int z, unsigned int w) {
  uint4 r;
  r.x = x;
  r.y = y;
  r.z = z;
  r.w = w;
  return r;
}

// ---- built-in variables (set by the scheduler before it resumes a thread) ----

namespace mp_emu {
struct ThreadCoords {
  uint3 thread, block;
  dim3 block_dim, grid_dim;
};
extern ThreadCoords g_coords;
int barrier(int predicate);  // __syncthreads_or; in emu.cpp
// __shfl_xor_sync over the 32 threads of the calling thread's warp; in emu.cpp
unsigned int shfl_xor(unsigned int mask, unsigned int value, int lane_mask, int width);
}  // namespace mp_emu

#define threadIdx (static_cast<const uint3&>(::mp_emu::g_coords.thread))
#define blockIdx (static_cast<const uint3&>(::mp_emu::g_coords.block))
#define blockDim (static_cast<const dim3&>(::mp_emu::g_coords.block_dim))
#define gridDim (static_cast<const dim3&>(::mp_emu::g_coords.grid_dim))

inline void __syncthreads() { (void)::mp_emu::barrier(0); }
inline int __syncthreads_or(int predicate) { return ::mp_emu::barrier(predicate != 0); }

// A warp collective: every thread of the warp (threads 32w .. 32w + 31 of the block, all of
// them present) must call it, with the full mask and width 32 (the only form the kernels use);
// the scheduler opens it once all have arrived, like a barrier of the warp.
inline unsigned int __shfl_xor_sync(unsigned int mask, unsigned int var, int lane_mask,
                                    int width = 32) {
  return ::mp_emu::shfl_xor(mask, var, lane_mask, width);
}

// ---- bit casts ----

inline float __uint_as_float(unsigned int u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}
inline float __int_as_float(int i) {
  float f;
  memcpy(&f, &i, sizeof f);
  return f;
}
inline unsigned int __float_as_uint(float f) {
  unsigned int u;
  memcpy(&u, &f, sizeof u);
  return u;
}

// ---- fp32 and fp64 arithmetic intrinsics ----

namespace mp_emu {
// A NaN result of an fp32 instruction is the canonical NaN on NVIDIA GPUs.
inline float canonical(float r) { return r != r ? __uint_as_float(0x7FFFFFFFu) : r; }
}  // namespace mp_emu

inline float __fadd_rn(float a, float b) { return mp_emu::canonical(a + b); }
inline float __fsub_rn(float a, float b) { return mp_emu::canonical(a - b); }
inline float __fmul_rn(float a, float b) { return mp_emu::canonical(a * b); }
inline float __fdiv_rn(float a, float b) { return mp_emu::canonical(a / b); }
inline float __fsqrt_rn(float a) { return mp_emu::canonical(sqrtf(a)); }
inline float __fmaf_rn(float a, float b, float c) { return mp_emu::canonical(fmaf(a, b, c)); }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline double __dsqrt_rn(double a) { return sqrt(a); }
inline double __fma_rn(double a, double b, double c) { return fma(a, b, c); }
inline float __double2float_rn(double a) { return mp_emu::canonical(static_cast<float>(a)); }

// ---- bf16 and fp16 ----

struct __nv_bfloat16 {
  unsigned short __x;
};
struct __half {
  unsigned short __x;
};
typedef __nv_bfloat16 nv_bfloat16;
typedef __half half;

inline __nv_bfloat16 __ushort_as_bfloat16(unsigned short u) { return __nv_bfloat16{u}; }
inline unsigned short __bfloat16_as_ushort(__nv_bfloat16 h) { return h.__x; }
inline __half __ushort_as_half(unsigned short u) { return __half{u}; }
inline unsigned short __half_as_ushort(__half h) { return h.__x; }

inline float __bfloat162float(__nv_bfloat16 h) {
  return __uint_as_float(static_cast<unsigned int>(h.__x) << 16);
}

// Round to nearest even on the bits: add half an ulp of the result (minus one when the kept
// part is even, so that a tie goes to even). Carries into the exponent are the correct rounding
// up, up to Inf.
inline __nv_bfloat16 __float2bfloat16_rn(float f) {
  const unsigned int u = __float_as_uint(f);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return __nv_bfloat16{0x7FFFu};
  return __nv_bfloat16{static_cast<unsigned short>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16)};
}

inline __half __float2half_rn(float f) {
  const unsigned int u = __float_as_uint(f);
  const unsigned int sign = (u >> 16) & 0x8000u;
  const unsigned int a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return __half{0x7FFFu};
  if (a >= 0x477FF000u) return __half{static_cast<unsigned short>(sign | 0x7C00u)};  // >= 65520
  unsigned int mant, shift;
  if (a >= 0x38800000u) {  // normal fp16: drop 13 bits of the rebased value
    mant = a - 0x38000000u;
    shift = 13;
  } else {  // subnormal fp16 (or zero): the value in units of 2^-24, with the implicit bit
    const unsigned int e = a >> 23;
    if (e < 102) return __half{static_cast<unsigned short>(sign)};  // below 2^-25: to zero
    mant = (a & 0x7FFFFFu) | 0x800000u;
    shift = 126 - e;  // 14 .. 24
  }
  const unsigned int kept = mant >> shift;
  const unsigned int rest = mant & ((1u << shift) - 1u);
  const unsigned int halfway = 1u << (shift - 1);
  const unsigned int up = rest > halfway || (rest == halfway && (kept & 1u));
  return __half{static_cast<unsigned short>(sign | (kept + up))};
}

inline float __half2float(__half h) {
  const unsigned int sign = (static_cast<unsigned int>(h.__x) & 0x8000u) << 16;
  const unsigned int e = (h.__x >> 10) & 0x1Fu;
  const unsigned int m = h.__x & 0x3FFu;
  if (e == 0x1Fu) return __uint_as_float(m ? 0x7FFFFFFFu : (sign | 0x7F800000u));
  if (e != 0) return __uint_as_float(sign | ((e + 112u) << 23) | (m << 13));
  // Zero or subnormal: m * 2^-24, exact in fp32.
  const float mag = static_cast<float>(m) * 5.9604644775390625e-8f;
  return __uint_as_float(sign | __float_as_uint(mag));
}

// ---- runtime API ----

enum cudaError_t {
  cudaSuccess = 0,
  cudaErrorInvalidValue = 1,
  cudaErrorInvalidConfiguration = 9,
  cudaErrorLaunchFailure = 719,
};

enum cudaDeviceAttr { cudaDevAttrMultiProcessorCount = 16 };

typedef struct CUstream_st* cudaStream_t;

cudaError_t cudaGetLastError();
cudaError_t cudaPeekAtLastError();
cudaError_t cudaGetDevice(int* device);
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device);

// ---- kernel launch (what mp_cuda::launch in cuda/access.cuh calls instead of <<< >>>) ----

namespace mp_emu {

// Runs every block of a grid, blocks in a random order, the threads of each block as fibers
// that switch only at barriers, in a random order between barriers. body(arg) is one thread's
// run of the kernel. Checks the launch configuration first: a bad one sets the runtime's error
// (as a failed launch does) and runs nothing. In emu.cpp.
void run_grid(dim3 grid, dim3 block, size_t shared_bytes, cudaStream_t stream,
              size_t param_bytes, void (*body)(void*), void* arg);

template <class... Params>
struct KernelCall {
  void (*kernel)(Params...);
  std::tuple<Params...> params;  // the launch's copy of the arguments
  static void run(void* self) {
    KernelCall* c = static_cast<KernelCall*>(self);
    std::apply(c->kernel, c->params);  // each thread gets its own by-value copy
  }
};

template <class... Params, class... Args>
void launch(void (*kernel)(Params...), dim3 grid, dim3 block, size_t shared_bytes,
            cudaStream_t stream, Args&&... args) {
  static_assert(sizeof...(Params) == sizeof...(Args), "kernel argument count");
  KernelCall<Params...> call{kernel, std::tuple<Params...>(std::forward<Args>(args)...)};
  run_grid(grid, block, shared_bytes, stream, (size_t{0} + ... + sizeof(Params)),
           &KernelCall<Params...>::run, &call);
}

// ---- controls for the tests ----

// Seeds the block and thread orders (each launch derives its own stream from it).
void set_seed(uint64_t seed);
// What cudaDeviceGetAttribute(cudaDevAttrMultiProcessorCount) reports (default 132).
void set_sm_count(int sms);
// The launch `countdown` launches from now (0: the next one) fails with cudaErrorLaunchFailure
// and runs nothing; a negative countdown turns this off.
void fail_launch_in(int64_t countdown);
// Launches attempted so far (failed ones included), and the blocks they ran.
int64_t launch_count();
int64_t blocks_run();

}  // namespace mp_emu
