/* fp32 <-> bf16 / fp16 casts. Compiled once per ISA path (see isa.h); the loops are written so
 * that the compiler vectorizes them for whichever ISA the build targets: the conversions in
 * numerics.h are branch-free integer code, and memcpy does the type punning (no aliasing
 * questions, no alignment assumptions). */
#include <string.h>

#include "half.h"
#include "isa.h"
#include "mpext/numerics.h"

#ifndef MP_ISA_SUFFIX
#error "cast.c must be compiled with -DMP_ISA_SUFFIX=scalar|avx2|avx512"
#endif

void MP_ISA_FN(mp_k_to_bf16_f32)(const float* restrict src, uint16_t* restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u;
    memcpy(&u, src + i, sizeof u);
    dst[i] = mp_bf16_rne_bits(u);
  }
}

void MP_ISA_FN(mp_k_to_fp16_f32)(const float* restrict src, uint16_t* restrict dst, int64_t n) {
  int64_t i = 0;
#if defined(MP_HAVE_F16C)
  for (; i + 8 <= n; i += 8) mp_f32_to_f16_x8(src + i, dst + i);
#endif
  for (; i < n; ++i) {
    uint32_t u;
    memcpy(&u, src + i, sizeof u);
    dst[i] = mp_fp16_rne_bits(u);
  }
}

void MP_ISA_FN(mp_k_to_fp32_bf16)(const uint16_t* restrict src, float* restrict dst, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    uint32_t u = mp_bf16_to_f32_bits(src[i]);
    memcpy(dst + i, &u, sizeof u);
  }
}

void MP_ISA_FN(mp_k_to_fp32_fp16)(const uint16_t* restrict src, float* restrict dst, int64_t n) {
  int64_t i = 0;
#if defined(MP_HAVE_F16C)
  for (; i + 8 <= n; i += 8) mp_f16_to_f32_x8(src + i, dst + i);
#endif
  for (; i < n; ++i) {
    uint32_t u = mp_fp16_to_f32_bits(src[i]);
    memcpy(dst + i, &u, sizeof u);
  }
}

/* Stochastic rounding. Element i uses random word (offset + i) % 4 of Philox block
 * (offset + i) / 4, so one Philox evaluation serves four elements. Blocks are processed
 * MP_SR_BLOCKS at a time: first all their random words (a loop over independent blocks, which
 * vectorizes), then the roundings. */
#define MP_SR_BLOCKS 64

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
    uint64_t first_block = (offset + (uint64_t)i) >> 2;
    int64_t count = n - i < MP_SR_BLOCKS * 4 ? n - i : MP_SR_BLOCKS * 4;
    int64_t blocks = (count + 3) / 4;
    for (int64_t b = 0; b < blocks; ++b) {
      mp_sr_random_block(seed, first_block + (uint64_t)b, rnd + 4 * b); /* wraps mod 2^62 */
    }
    for (int64_t j = 0; j < count; ++j) {
      uint32_t u;
      memcpy(&u, src + i + j, sizeof u);
      dst[i + j] = mp_bf16_sr_bits(u, rnd[j]);
    }
    i += count;
  }
}
