/* Internal to the C core: the counting epilogue of the optimizer step's counters
 * (mpext/telemetry.h, mp_step_stats), read-only passes over a tile after it was stepped: the
 * counted pipeline's (telemetry.c). The counted fast rows (fast/adam_fused.c) count the same
 * things in their loops' registers (the same tests on the same values: the same counts; the
 * error sums' terms added in another order, in fp32 runs: telemetry_sums.h) and share only the
 * 8-bit blocks' pass for what their vector loops leave (sts_q8_block_from). Each includer is
 * compiled once per ISA path. */
#ifndef MPEXT_CORE_TELEMETRY_STEP_H
#define MPEXT_CORE_TELEMETRY_STEP_H

#include <string.h>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

#include "formats/tiles.h"
#include "mpext/telemetry.h"

#define STS_INLINE static inline __attribute__((always_inline))

/* *err += sum |a[i] - b[i]|, *abs += sum |b[i]|, each difference and magnitude in double.
 * Written with vector types (8 doubles: one AVX-512 register, two AVX2 or four SSE2 ones):
 * GCC does not vectorize a double reduction on its own (it would reassociate it), and the
 * scalar form made the counted step several times slower than the step. Four chains of 8
 * lanes (the group of 8 elements at i goes to chain (i / 8) % 4), added in a fixed tree: one
 * chain waited on each add's latency, and these sums were the larger part of a counted fast
 * row's cost (a counted sr_bf16m row 2.4x the uncounted one, its sums 0.9x of it, avx512, one
 * core: docs/telemetry.md). The same operations in the same order on every ISA path. */
typedef double sts_v8d __attribute__((vector_size(64)));
typedef float sts_v8f __attribute__((vector_size(32)));
typedef uint64_t sts_v8u __attribute__((vector_size(64)));

STS_INLINE void sts_acc8(const float* restrict a, const float* restrict b,
                         const sts_v8u* restrict mask, sts_v8d* restrict ev,
                         sts_v8d* restrict mv) {
#if defined(__AVX512F__)
  /* one widening per 8 (GCC's own code for the conversion below took four shuffles more, on
   * the port the conversions need) */
  const sts_v8d da = (sts_v8d)_mm512_cvtps_pd(_mm256_loadu_ps(a));
  const sts_v8d db = (sts_v8d)_mm512_cvtps_pd(_mm256_loadu_ps(b));
#else
  sts_v8f va, vb;
  memcpy(&va, a, sizeof va);
  memcpy(&vb, b, sizeof vb);
  const sts_v8d da = __builtin_convertvector(va, sts_v8d);
  const sts_v8d db = __builtin_convertvector(vb, sts_v8d);
#endif
  *ev += (sts_v8d)((sts_v8u)(da - db) & *mask);
  *mv += (sts_v8d)((sts_v8u)db & *mask);
}

static void sts_err_sums(const float* restrict a, const float* restrict b, uint32_t n,
                         double* restrict err, double* restrict abs) {
  const uint64_t no_sign = 0x7FFFFFFFFFFFFFFFull;
  const sts_v8u mask = {no_sign, no_sign, no_sign, no_sign, no_sign, no_sign, no_sign, no_sign};
  sts_v8d e0 = {0, 0, 0, 0, 0, 0, 0, 0}, m0 = e0, e1 = e0, m1 = e0, e2 = e0, m2 = e0, e3 = e0,
          m3 = e0;
  uint32_t i = 0;
  for (; i + 32u <= n; i += 32u) {
    sts_acc8(a + i, b + i, &mask, &e0, &m0);
    sts_acc8(a + i + 8, b + i + 8, &mask, &e1, &m1);
    sts_acc8(a + i + 16, b + i + 16, &mask, &e2, &m2);
    sts_acc8(a + i + 24, b + i + 24, &mask, &e3, &m3);
  }
  sts_v8d ev = (e0 + e1) + (e2 + e3), mv = (m0 + m1) + (m2 + m3);
  for (; i + 8u <= n; i += 8u) sts_acc8(a + i, b + i, &mask, &ev, &mv);
  double e[8], m[8];
  memcpy(e, &ev, sizeof e);
  memcpy(m, &mv, sizeof m);
  for (int j = 0; i < n; ++i, ++j) { /* the tail: element i in lane j, as the body's lanes */
    e[j] += __builtin_fabs((double)a[i] - (double)b[i]);
    m[j] += __builtin_fabs((double)b[i]);
  }
  *err += ((e[0] + e[1]) + (e[2] + e[3])) + ((e[4] + e[5]) + (e[6] + e[7]));
  *abs += ((m[0] + m[1]) + (m[2] + m[3])) + ((m[4] + m[5]) + (m[6] + m[7]));
}

/* Half an ulp of the 16-bit value h of dtype pt: the CUDA kernel's (mpext/telemetry.h). */
STS_INLINE float sts_half_ulp(uint16_t h, mp_dtype pt) { return mp_sts_half_ulp(h, (int)pt); }

/* A tile's param counts: x the new fp32 values, old the old ones, q / qold the stored 16-bit
 * params after and before; subhalf: master-free (the half-ulp test). */
STS_INLINE void sts_param_(const float* restrict x, const float* restrict old,
                           const uint16_t* restrict q, const uint16_t* restrict qold, uint32_t n,
                           mp_dtype pt, int subhalf, double* restrict row) {
  uint32_t ch = 0, un = 0, sh = 0;
  for (uint32_t i = 0; i < n; ++i) {
    const uint32_t c = (uint32_t)(x[i] != old[i]);
    ch += c;
    un += c & (uint32_t)(q[i] == qold[i]);
    if (subhalf) {
      /* |x - old| is exact in fp32 whenever it is below the half ulp (Sterbenz), and rounds
       * to at least it otherwise: the test is exact */
      sh += c & (uint32_t)(__builtin_fabsf(x[i] - old[i]) < sts_half_ulp(qold[i], pt));
    }
  }
  row[MP_STS_CHANGED] += ch;
  row[MP_STS_UNMOVED] += un;
  row[MP_STS_SUBHALF] += sh;
}

/* (unused in fast/adam_fused.c, which includes this header for sts_q8_block) */
__attribute__((unused)) static void sts_param(int kind, mp_dtype pt, const float* restrict x,
                                              const float* restrict old,
                                              const uint16_t* restrict q,
                                              const uint16_t* restrict qold, uint32_t n,
                                              double* restrict row) {
  const int free = kind == MP_PV_NONE_RNE || kind == MP_PV_NONE_SR;
  switch ((pt == MP_BF16 ? 0 : 2) + free) {
    case 0: sts_param_(x, old, q, qold, n, MP_BF16, 0, row); break;
    case 1: sts_param_(x, old, q, qold, n, MP_BF16, 1, row); break;
    case 2: sts_param_(x, old, q, qold, n, MP_F16, 0, row); break;
    default: sts_param_(x, old, q, qold, n, MP_F16, 1, row); break;
  }
}

/* Error sums of n bf16 moments as stored (dst) against their fp32 values x; tmp: n floats. */
__attribute__((unused)) static void sts_bf16_moment(const uint16_t* restrict dst,
                                                    const float* restrict x, uint32_t n,
                                                    float* restrict tmp, double* restrict err,
                                                    double* restrict abs) {
  mp_fmt_widen_(tmp, dst, n, MP_BF16);
  sts_err_sums(tmp, x, n, err, abs);
}

/* One encoded 8-bit block of one moment (signed: exp_avg's codes, else exp_avg_sq's) of n
 * values x, its new scale `scale`: the error sums (tile by tile, through tmp) and its flushed
 * values; returns whether any was flushed. */
static int sts_q8_moment(const uint8_t* restrict c, const float* restrict x, uint32_t n,
                         float scale, int is_signed, float* restrict tmp, double* restrict err,
                         double* restrict abs, double* restrict row) {
  const float ref = is_signed ? mp_q8_ref_m_of(scale) : mp_q8_ref_v_of(scale);
  const uint32_t mag = is_signed ? 0x7Fu : 0xFFu;
  uint32_t flushed = 0;
  for (uint32_t off = 0; off < n; off += MP_TILE) {
    const uint32_t len = n - off < MP_TILE ? n - off : MP_TILE;
    const uint8_t* restrict cc = c + off;
    if (is_signed) {
      for (uint32_t i = 0; i < len; ++i) tmp[i] = mp_q8_decode_m(cc[i], ref);
    } else {
      for (uint32_t i = 0; i < len; ++i) tmp[i] = mp_q8_decode_v(cc[i], ref);
    }
    for (uint32_t i = 0; i < len; ++i) {
      flushed += (uint32_t)(x[off + i] != 0.0f) & (uint32_t)((cc[i] & mag) == 0u);
    }
    sts_err_sums(tmp, x + off, len, err, abs);
  }
  row[MP_STS_Q8_FLUSHED] += flushed;
  return flushed != 0u;
}

/* A block of n 8-bit moments just encoded (codes mc, vc; new scales ms, vs; fp32 values m, v),
 * whose elements before `from` a counted row has counted already (their error sums added in
 * its registers, `flushed` of them flushed): the rest's counters, and the block's. */
static void sts_q8_block_from(const uint8_t* restrict mc, const uint8_t* restrict vc,
                              const float* restrict m, const float* restrict v, uint32_t n,
                              uint32_t from, uint32_t flushed, float ms, float vs, int pair,
                              float* restrict tmp, double* restrict row) {
  int sat = flushed != 0u;
  row[MP_STS_Q8_FLUSHED] += flushed;
  sat |= sts_q8_moment(mc + from, m + from, n - from, ms, 1, tmp, &row[MP_STS_M_ERR],
                       &row[MP_STS_M_ABS], row);
  sat |= (mp_fmt_bits(ms) & 0x7FFFFFFFu) >= 0x7F800000u;
  if (pair) {
    sat |= sts_q8_moment(vc + from, v + from, n - from, vs, 0, tmp, &row[MP_STS_V_ERR],
                         &row[MP_STS_V_ABS], row);
    sat |= (mp_fmt_bits(vs) & 0x7FFFFFFFu) >= 0x7F800000u;
  }
  row[MP_STS_Q8_BLOCKS] += 1.0;
  row[MP_STS_Q8_SATBLOCKS] += sat ? 1.0 : 0.0;
}

/* A block of 8-bit moments just encoded, every element counted here (the pipeline's). */
__attribute__((unused)) static void sts_q8_block(const uint8_t* restrict mc,
                                                 const uint8_t* restrict vc,
                                                 const float* restrict m,
                                                 const float* restrict v, uint32_t n, float ms,
                                                 float vs, int pair, float* restrict tmp,
                                                 double* restrict row) {
  sts_q8_block_from(mc, vc, m, v, n, 0u, 0u, ms, vs, pair, tmp, row);
}

#endif /* MPEXT_CORE_TELEMETRY_STEP_H */
