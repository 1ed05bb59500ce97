// NVIDIA's own host implementations of the conversions the shim models (cuda_bf16.hpp and
// cuda_fp16.hpp compiled for the host), in a translation unit of their own because their names
// clash with the shim's. test_emu.cpp compares the shim with them.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

extern "C" unsigned short mp_nv_float2bfloat16_rn(float f) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
}

extern "C" unsigned short mp_nv_float2half_rn(float f) {
  return __half_as_ushort(__float2half_rn(f));
}

extern "C" float mp_nv_bfloat162float(unsigned short h) {
  return __bfloat162float(__ushort_as_bfloat16(h));
}

extern "C" float mp_nv_half2float(unsigned short h) { return __half2float(__ushort_as_half(h)); }
