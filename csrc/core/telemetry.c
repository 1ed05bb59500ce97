/* Fused unscale + non-finite check + gradient statistics (mpext/telemetry.h). Compiled once per
 * ISA path (see isa.h). The multiply and store are scale.c's loops, element for element (the
 * same fp32 product, the same conversion back: F16C blocks of 8 for fp16 where the build has
 * them, then the integer code), so the gradients and found_inf come out with mp_unscale's bits.
 * The statistics are integer tests on the stored bits, tallied in vector lanes over blocks of
 * 2^14 elements (so the loops vectorize) and added to the 64-bit totals per block: fp32 and bf16
 * in the unscale loop itself (one read per value), fp16 just before its F16C unscale. */
#include <string.h>

#include "half.h"
#include "mpext/numerics.h"
#include "mpext/telemetry.h"

#ifndef MP_ISA_SUFFIX
#error "telemetry.c must be compiled with -DMP_ISA_SUFFIX=scalar|avx2|avx512"
#endif
#define MP_TCAT_(a, b) a##__##b
#define MP_TCAT(a, b) MP_TCAT_(a, b)
#define MP_TEL_FN(name) MP_TCAT(name, MP_ISA_SUFFIX)

/* Elements per block: the tallies of a block are 16- or 32-bit lanes, added to the 64-bit totals
 * per block; fp16's F16C unscale runs over the block after its tallies, from cache. */
enum { BLOCK = 1 << 14 };

/* Tallies of one block: [zeros, subnormal, headroom, nonfinite, max finite abs bits]. Range
 * tests are one unsigned compare each (a - lo < hi - lo), no && or branch, and the
 * tallies are locals, so that the loops vectorize. */
#define TALLY_FN(name, T, MASK, NORMAL, TOP, INF)                                   \
  static inline void name(const T* restrict g, int64_t n, uint32_t t[5]) {         \
    uint32_t zeros = 0, sub = 0, head = 0, bad = 0, amax = 0;                       \
    for (int64_t i = 0; i < n; ++i) {                                               \
      T raw;                                                                        \
      memcpy(&raw, g + i, sizeof raw);                                              \
      const uint32_t a = (uint32_t)raw & (MASK);                                    \
      zeros += (uint32_t)(a == 0u);                                                 \
      sub += (uint32_t)(a - 1u < (NORMAL) - 1u);                                    \
      head += (uint32_t)(a - (TOP) < (INF) - (TOP));                                \
      bad += (uint32_t)(a >= (INF));                                                \
      /* a mask, not a select: GCC 12 vectorizes this max only so */               \
      const uint32_t f = a & (0u - (uint32_t)(a < (INF)));                          \
      amax = f > amax ? f : amax;                                                   \
    }                                                                               \
    t[0] = zeros;                                                                   \
    t[1] = sub;                                                                     \
    t[2] = head;                                                                    \
    t[3] = bad;                                                                     \
    t[4] = amax;                                                                    \
  }
TALLY_FN(tally_f32, uint32_t, 0x7FFFFFFFu, 0x00800000u, 0x7F000000u, 0x7F800000u)

/* The 16-bit tallies in 16-bit lanes, twice as many per vector (a block's counts stay below
 * 2^16 since BLOCK <= 2^16): the check-only pass, a pure read, runs at the speed of memory. */
#define TALLY16_FN(name, NORMAL, TOP, INF)                                          \
  static inline void name(const uint16_t* restrict g, int64_t n, uint32_t t[5]) {  \
    uint16_t zeros = 0, sub = 0, head = 0, bad = 0, amax = 0;                       \
    for (int64_t i = 0; i < n; ++i) {                                               \
      const uint16_t a = (uint16_t)(g[i] & 0x7FFFu);                                \
      zeros += (uint16_t)(a == 0u);                                                 \
      sub += (uint16_t)((uint16_t)(a - 1u) < (uint16_t)((NORMAL) - 1u));            \
      head += (uint16_t)((uint16_t)(a - (TOP)) < (uint16_t)((INF) - (TOP)));        \
      bad += (uint16_t)(a >= (INF));                                                \
      const uint16_t f = a & (uint16_t)(0u - (uint16_t)(a < (INF)));                \
      amax = f > amax ? f : amax;                                                   \
    }                                                                               \
    t[0] = zeros;                                                                   \
    t[1] = sub;                                                                     \
    t[2] = head;                                                                    \
    t[3] = bad;                                                                     \
    t[4] = amax;                                                                    \
  }
TALLY16_FN(tally_bf16, 0x0080u, 0x7F00u, 0x7F80u)
TALLY16_FN(tally_fp16, 0x0400u, 0x7800u, 0x7C00u)
_Static_assert(BLOCK <= 65535, "16-bit tallies of a block must not wrap");

/* Tally and unscale in one loop (fp32, bf16: scale.c's arithmetic per element), so that the
 * unscale reads each value once. */
#define FUSED_FN(name, T, BT, MASK, NORMAL, TOP, INF, SCALE_ONE)                           \
  static inline void name(T* restrict g, int64_t n, float inv, uint32_t t[5]) {           \
    uint32_t zeros = 0, sub = 0, head = 0, bad = 0, amax = 0;                              \
    for (int64_t i = 0; i < n; ++i) {                                                      \
      BT raw; /* the element's bits (BT: an unsigned integer of its width) */               \
      memcpy(&raw, g + i, sizeof raw);                                                     \
      const uint32_t bits_ = (uint32_t)raw;                                                \
      const uint32_t a = bits_ & (MASK);                                                   \
      zeros += (uint32_t)(a == 0u);                                                        \
      sub += (uint32_t)(a - 1u < (NORMAL) - 1u);                                           \
      head += (uint32_t)(a - (TOP) < (INF) - (TOP));                                       \
      bad += (uint32_t)(a >= (INF));                                                       \
      const uint32_t f = a & (0u - (uint32_t)(a < (INF)));                                 \
      amax = f > amax ? f : amax;                                                          \
      SCALE_ONE                                                                            \
    }                                                                                      \
    t[0] = zeros;                                                                          \
    t[1] = sub;                                                                            \
    t[2] = head;                                                                           \
    t[3] = bad;                                                                            \
    t[4] = amax;                                                                           \
  }
FUSED_FN(fused_f32, float, uint32_t, 0x7FFFFFFFu, 0x00800000u, 0x7F000000u, 0x7F800000u,
         { g[i] = g[i] * inv; })
FUSED_FN(fused_bf16, uint16_t, uint16_t, 0x7FFFu, 0x0080u, 0x7F00u, 0x7F80u, {
  uint32_t u = mp_bf16_to_f32_bits((uint16_t)bits_);
  float x;
  memcpy(&x, &u, sizeof x);
  x *= inv;
  memcpy(&u, &x, sizeof u);
  g[i] = mp_bf16_rne_bits(u);
})

/* Adds a block's tallies to the totals; returns its non-finite tally. */
static inline uint32_t add_tally(const uint32_t t[5], int64_t* c, uint32_t* amax) {
  for (int j = 0; j < MP_TEL_NCOUNTS; ++j) c[j] += t[j];
  if (t[4] > *amax) *amax = t[4];
  return t[3];
}

/* A block starts at a multiple of 8 elements of the range, so its F16C groups of 8 are the
 * ones mp_unscale converts with F16C, and its integer tail is mp_unscale's tail. */
static inline void scale_fp16(uint16_t* restrict g, int64_t n, float inv) {
  int64_t i = 0;
#if defined(MP_HAVE_F16C)
  for (; n - i >= 8; i += 8) {
    float x[8];
    mp_f16_to_f32_x8(g + i, x);
    for (int j = 0; j < 8; ++j) x[j] *= inv;
    mp_f32_to_f16_x8(x, g + i);
  }
#endif
  for (; i < n; ++i) {
    uint32_t u = mp_fp16_to_f32_bits(g[i]);
    float x;
    memcpy(&x, &u, sizeof x);
    x *= inv;
    memcpy(&u, &x, sizeof u);
    g[i] = mp_fp16_rne_bits(u);
  }
}

/* Each returns 1 if an input was NaN/Inf, adds the counts to c and leaves the largest finite
 * abs bits (of the dtype) in *amax_out. When inv == 1 nothing is stored. */
#define TEL_FN(name, T, tally, SCALE_BLOCK)                                                 \
  int MP_TEL_FN(name)(T* restrict g, int64_t n, float inv, int64_t* c, uint32_t* amax_out) { \
    uint32_t amax = 0, any = 0, t[5];                                                       \
    for (int64_t b = 0; b < n; b += BLOCK) {                                                \
      const int64_t m = n - b < BLOCK ? n - b : BLOCK;                                      \
      if (inv == 1.0f) {                                                                    \
        tally((const void*)(g + b), m, t);                                                  \
      } else {                                                                              \
        SCALE_BLOCK                                                                         \
      }                                                                                     \
      any |= add_tally(t, c, &amax);                                                        \
    }                                                                                       \
    *amax_out = amax;                                                                       \
    return any != 0;                                                                        \
  }
TEL_FN(mp_k_tel_f32, float, tally_f32, { fused_f32(g + b, m, inv, t); })
TEL_FN(mp_k_tel_bf16, uint16_t, tally_bf16, { fused_bf16(g + b, m, inv, t); })
/* fp16: the tallies, then the F16C conversions of scale.c on the block while it is in cache */
TEL_FN(mp_k_tel_fp16, uint16_t, tally_fp16, {
  tally_fp16(g + b, m, t);
  scale_fp16(g + b, m, inv);
})
