/* fp32 <-> bf16 / fp16 casts. Compiled once per ISA path (see isa.h); the loops are written so
 * that the compiler vectorizes them for whichever ISA the build targets: the conversions in
 * numerics.h are branch-free integer code, and memcpy does the type punning (no aliasing
 * questions, no alignment assumptions). */
#include <string.h>

#include "half.h"
#include "isa.h"
#include "stream.h"
#include "mpext/numerics.h"

#ifndef MP_ISA_SUFFIX
#error "cast.c must be compiled with -DMP_ISA_SUFFIX=scalar|avx2|avx512"
#endif

static void to_bf16_f32_direct(const void* src_, void* dst_, int64_t n) {
  const float* restrict src = (const float*)src_;
  uint16_t* restrict dst = (uint16_t*)dst_;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    memcpy(&u, src + i, sizeof u);
    dst[i] = mp_bf16_rne_bits(u);
  }
}

void MP_ISA_FN(mp_k_to_bf16_f32)(const float* src, uint16_t* dst, int64_t n, int stream) {
  mp_convert_streamed(to_bf16_f32_direct, src, dst, n, 4, 2, stream);
}

static void to_fp16_f32_direct(const void* src, void* dst, int64_t n) {
  mp_f32_to_f16_n((const float*)src, (uint16_t*)dst, n);
}

void MP_ISA_FN(mp_k_to_fp16_f32)(const float* src, uint16_t* dst, int64_t n, int stream) {
  mp_convert_streamed(to_fp16_f32_direct, src, dst, n, 4, 2, stream);
}

static void to_fp32_bf16_direct(const void* src_, void* dst_, int64_t n) {
  const uint16_t* restrict src = (const uint16_t*)src_;
  float* restrict dst = (float*)dst_;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u = mp_bf16_to_f32_bits(src[i]);
    memcpy(dst + i, &u, sizeof u);
  }
}

void MP_ISA_FN(mp_k_to_fp32_bf16)(const uint16_t* src, float* dst, int64_t n, int stream) {
  mp_convert_streamed(to_fp32_bf16_direct, src, dst, n, 2, 4, stream);
}

static void to_fp32_fp16_direct(const void* src, void* dst, int64_t n) {
  mp_f16_to_f32_n((const uint16_t*)src, (float*)dst, n);
}

void MP_ISA_FN(mp_k_to_fp32_fp16)(const uint16_t* src, float* dst, int64_t n, int stream) {
  mp_convert_streamed(to_fp32_fp16_direct, src, dst, n, 2, 4, stream);
}

/* Stochastic rounding. Element i takes the random bits at position offset + i of the cast's
 * stream (mpext/numerics.h), computed lane by lane, so the loop vectorizes like the others. */
static void to_bf16_sr_direct(const float* restrict src, uint16_t* restrict dst, int64_t n,
                              uint64_t key, uint64_t offset) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    memcpy(&u, src + i, sizeof u);
    dst[i] = mp_bf16_sr_bits(u, mp_sr_bits(key, offset + (uint64_t)i));
  }
}

void MP_ISA_FN(mp_k_to_bf16_sr_f32)(const float* src, uint16_t* dst, int64_t n, uint64_t seed,
                                    uint64_t offset) {
  to_bf16_sr_direct(src, dst, n, mp_sr_key(seed, 0, 0), offset);
}
