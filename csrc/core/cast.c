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

void MP_ISA_FN(mp_k_to_bf16_f32)(const float* src, uint16_t* dst, int64_t n) {
  mp_convert_streamed(to_bf16_f32_direct, src, dst, n, 4, 2);
}

static void to_fp16_f32_direct(const void* src_, void* dst_, int64_t n) {
  const float* restrict src = (const float*)src_;
  uint16_t* restrict dst = (uint16_t*)dst_;
  int64_t i = 0;
#if defined(MP_HAVE_F16C)
  for (; n - i >= 8; i += 8) mp_f32_to_f16_x8(src + i, dst + i);
#endif
  for (; i < n; ++i) {
    uint32_t u;
    memcpy(&u, src + i, sizeof u);
    dst[i] = mp_fp16_rne_bits(u);
  }
}

void MP_ISA_FN(mp_k_to_fp16_f32)(const float* src, uint16_t* dst, int64_t n) {
  mp_convert_streamed(to_fp16_f32_direct, src, dst, n, 4, 2);
}

static void to_fp32_bf16_direct(const void* src_, void* dst_, int64_t n) {
  const uint16_t* restrict src = (const uint16_t*)src_;
  float* restrict dst = (float*)dst_;
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u = mp_bf16_to_f32_bits(src[i]);
    memcpy(dst + i, &u, sizeof u);
  }
}

void MP_ISA_FN(mp_k_to_fp32_bf16)(const uint16_t* src, float* dst, int64_t n) {
  mp_convert_streamed(to_fp32_bf16_direct, src, dst, n, 2, 4);
}

static void to_fp32_fp16_direct(const void* src_, void* dst_, int64_t n) {
  const uint16_t* restrict src = (const uint16_t*)src_;
  float* restrict dst = (float*)dst_;
  int64_t i = 0;
#if defined(MP_HAVE_F16C)
  for (; n - i >= 8; i += 8) mp_f16_to_f32_x8(src + i, dst + i);
#endif
  for (; i < n; ++i) {
    uint32_t u = mp_fp16_to_f32_bits(src[i]);
    memcpy(dst + i, &u, sizeof u);
  }
}

void MP_ISA_FN(mp_k_to_fp32_fp16)(const uint16_t* src, float* dst, int64_t n) {
  mp_convert_streamed(to_fp32_fp16_direct, src, dst, n, 2, 4);
}

/* Stochastic rounding. Element i uses random word (offset + i) % 4 of Philox block
 * (offset + i) / 4 (numerics.h), so one Philox evaluation serves four elements. Blocks are made
 * MP_SR_BLOCKS at a time with the counters held as four arrays (structure of arrays), so that
 * each Philox round is a loop over independent lanes that the compiler vectorizes (32x32->64
 * multiplies are vpmuludq on x86); then the roundings use them. This computes exactly
 * mp_sr_random_block, lane by lane. */
#define MP_SR_BLOCKS 64

static inline void sr_random_blocks(uint64_t seed, uint64_t first_block,
                                    uint32_t out[MP_SR_BLOCKS * 4]) {
  uint32_t c0[MP_SR_BLOCKS], c1[MP_SR_BLOCKS], c2[MP_SR_BLOCKS], c3[MP_SR_BLOCKS];
  for (int b = 0; b < MP_SR_BLOCKS; ++b) {
    uint64_t block = (first_block + (uint64_t)b) & 0x3FFFFFFFFFFFFFFFull; /* wraps mod 2^62 */
    c0[b] = (uint32_t)block;
    c1[b] = (uint32_t)(block >> 32);
    c2[b] = 0u;
    c3[b] = 0u;
  }
  uint32_t k0 = (uint32_t)seed, k1 = (uint32_t)(seed >> 32);
  for (int round = 0; round < 10; ++round) {
    for (int b = 0; b < MP_SR_BLOCKS; ++b) {
      uint64_t p0 = (uint64_t)MP_PHILOX_M0 * c0[b];
      uint64_t p1 = (uint64_t)MP_PHILOX_M1 * c2[b];
      uint32_t n0 = (uint32_t)(p1 >> 32) ^ c1[b] ^ k0;
      uint32_t n2 = (uint32_t)(p0 >> 32) ^ c3[b] ^ k1;
      c1[b] = (uint32_t)p1;
      c3[b] = (uint32_t)p0;
      c0[b] = n0;
      c2[b] = n2;
    }
    k0 += MP_PHILOX_W0;
    k1 += MP_PHILOX_W1;
  }
  for (int b = 0; b < MP_SR_BLOCKS; ++b) {
    out[4 * b + 0] = c0[b];
    out[4 * b + 1] = c1[b];
    out[4 * b + 2] = c2[b];
    out[4 * b + 3] = c3[b];
  }
}

void MP_ISA_FN(mp_k_to_bf16_sr_f32)(const float* restrict src, uint16_t* restrict dst,
                                    int64_t n, uint64_t seed, uint64_t offset) {
  uint32_t rnd[MP_SR_BLOCKS * 4];
  int64_t i = 0;
  /* Head: elements before the first index that starts a Philox block. */
  while (i < n && ((offset + (uint64_t)i) & 3u) != 0u) {
    uint32_t u;
    memcpy(&u, src + i, sizeof u);
    dst[i] = mp_bf16_sr_bits(u, mp_sr_random_bits(seed, offset + (uint64_t)i));
    ++i;
  }
  while (i < n) {
    int64_t count = n - i < MP_SR_BLOCKS * 4 ? n - i : MP_SR_BLOCKS * 4;
    sr_random_blocks(seed, (offset + (uint64_t)i) >> 2, rnd);
    for (int64_t j = 0; j < count; ++j) {
      uint32_t u;
      memcpy(&u, src + i + j, sizeof u);
      dst[i + j] = mp_bf16_sr_bits(u, rnd[j]);
    }
    i += count;
  }
}
