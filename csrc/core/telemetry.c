/* Fused unscale + non-finite check + gradient statistics (mpext/telemetry.h). Compiled once per
 * ISA path (see isa.h). The multiply and store are scale.c's loops, element for element (the
 * same fp32 product, the same conversion back: F16C blocks of 8 for fp16 where the build has
 * them, then the integer code), so the gradients and found_inf come out with mp_unscale's bits.
 * The statistics are integer tests on the stored bits, tallied in vector lanes over blocks of
 * 2^14 elements (so the loops vectorize) and added to the 64-bit totals per block: fp32 and bf16
 * in the unscale loop itself (one read per value), fp16 just before its F16C unscale.
 * The optimizer step's counters (mp_step_stats) are at the end: step.c's pipeline with a counting
 * epilogue, or, where a mode has a fast row, that row's counting variant. */
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

#define MP_STEP_STAGES_ONLY 1
#include "step.c" /* the pipeline's stages: rule tiles, step_piece, rule_tile, pv_at */

/* ---- the counted optimizer step (mpext/telemetry.h: mp_step_stats) ----
 * step.c's pipeline -- its stages, included from it -- with a rule-independent epilogue per
 * tile: the old fp32 values and 16-bit params saved before the rule, then read-only passes
 * after the stages have run (nothing they write is read by a stage), so the step writes the
 * same bits as without them. The drivers below are step.c's (step_tiles, step_q8_blocks,
 * rule_step) with those additions, in this file so that step.c's object, the uncounted step,
 * is the very one it was (counting drivers in its unit, or a "row == NULL" path inlined there,
 * moved its registers and inlining); the C tests step every mode both ways and compare every
 * byte. No fast path: they are a cache of the pipeline.
 * Counts are tallied in 32-bit lanes per tile; the sums of errors go through 8 double lanes
 * (element i in lane i % 8) and a fixed tree, so every ISA path adds the same numbers in the
 * same order. */

#include "telemetry_step.h" /* the epilogue's passes: sts_* */

/* step_tiles with each tile's counters added into row. */
static void step_tiles_counted(const step_piece* a, int64_t start, int64_t n,
                               double* restrict row) {
  _Alignas(64) float gbuf[MP_TILE];
  _Alignas(64) float pbuf[MP_TILE];
  _Alignas(64) float mbuf[MP_TILE];
  _Alignas(64) float vbuf[MP_TILE];
  _Alignas(64) uint32_t rbuf[MP_TILE];
  _Alignas(64) float old[MP_TILE];     /* counting: the old fp32 values, */
  _Alignas(64) uint16_t qold[MP_TILE]; /* and the old 16-bit params */
  const mp_step_tensor* t = a->t;
  const mp_step_scalars* s = a->s;
  const uint32_t hi = (uint32_t)((uint64_t)(start + a->pos0) >> 32);
  const int bf16_moments = a->md == MP_BF16 || a->vd == MP_BF16;
  const int nearest = s->moments_nearest != 0;
  /* step_tiles' tiling and prefetch (step.c: why), which the counted step waits on memory
   * without as the uncounted one did (SGD with momentum counted 1.85x the uncounted step
   * with 512-element tiles and no prefetch, tools/telemetry_step_ab.c) */
  const int ahead = prefetch_ahead(a);
  const uint32_t tile = tile_len(a);
  for (int64_t off = 0; off < n; off += tile) {
    const int64_t i = start + off;
    const uint32_t len = (uint32_t)(n - off < tile ? n - off : tile);
    const uint32_t lo = (uint32_t)(i + a->pos0);
    const mp_pv_tile at = pv_at(a, i);
    void* m_at = a->nmom >= 1 ? (char*)t->exp_avg + i * MP_DTYPE_BYTES(a->md) : NULL;
    void* v_at = a->nmom >= 2 ? (char*)t->exp_avg_sq + i * MP_DTYPE_BYTES(a->vd) : NULL;
    if (ahead && n - off > tile) prefetch_tile(a, i + tile, tile);
    float* g = mp_grad_decode(gbuf, (char*)t->grad + i * MP_DTYPE_BYTES(a->gt), a->gt, len, s);
    float* p = mp_pv_decode(a->kind, a->pt, &at, pbuf, len);
    float* m = a->nmom >= 1 ? mp_mom_decode(a->md, m_at, mbuf, len) : NULL;
    float* v = a->nmom >= 2 ? mp_mom_decode(a->vd, v_at, vbuf, len) : NULL;
    if (a->kind != MP_PV_F32) {
      memcpy(old, p, len * sizeof(float));
      memcpy(qold, at.param, len * sizeof(uint16_t));
    }
    rule_tile(a, g, p, m, v, len);
    if (bf16_moments) {
      if (!nearest) mp_mom_draw(rbuf, len, s->key_moments, lo, hi);
      if (a->md == MP_BF16) mp_mom_encode_bf16((uint16_t*)m_at, m, len, rbuf, 0, nearest);
      if (a->vd == MP_BF16) mp_mom_encode_bf16((uint16_t*)v_at, v, len, rbuf, 16, nearest);
    }
    mp_pv_encode(a->kind, a->pt, &at, p, len, s->key_param, lo, hi);
    if (t->ema != NULL) mp_ema_tile(t->ema + i, p, len, s);
    {
      /* gbuf is free again: the widened bf16 moments go there */
      row[MP_STS_ELEMS] += len;
      if (a->kind != MP_PV_F32) sts_param(a->kind, a->pt, p, old, at.param, qold, len, row);
      if (a->md == MP_BF16) {
        sts_bf16_moment(m_at, m, len, gbuf, &row[MP_STS_M_ERR], &row[MP_STS_M_ABS]);
      }
      if (a->vd == MP_BF16) {
        sts_bf16_moment(v_at, v, len, gbuf, &row[MP_STS_V_ERR], &row[MP_STS_V_ABS]);
      }
      if (t->ema != NULL) {
        sts_err_sums(t->ema + i, p, len, &row[MP_STS_EMA_LAG], &row[MP_STS_EMA_ABS]);
      }
    }
  }
}

/* step_q8_blocks with each tile's and block's counters added into row. */
static void step_q8_blocks_counted(const step_piece* a, int64_t start, int64_t n,
                                   double* restrict row) {
  _Alignas(64) float gbuf[MP_TILE];
  _Alignas(64) float pbuf[MP_TILE];
  _Alignas(64) float mblk[MP_Q8_BLOCK_MAX];
  _Alignas(64) float vblk[MP_Q8_BLOCK_MAX];
  _Alignas(64) float old[MP_TILE];     /* counting: the old fp32 values, */
  _Alignas(64) uint16_t qold[MP_TILE]; /* and the old 16-bit params */
  const mp_step_tensor* t = a->t;
  const mp_step_scalars* s = a->s;
  const int64_t b = s->q8_block;
  const int pair = a->nmom >= 2;
  const uint32_t hi = (uint32_t)((uint64_t)(start + a->pos0) >> 32);
  uint8_t* mc = (uint8_t*)t->exp_avg;
  uint8_t* vc = (uint8_t*)t->exp_avg_sq;
  for (int64_t boff = 0; boff < n; boff += b) {
    const int64_t i0 = start + boff, k = i0 / b;
    const uint32_t blen = (uint32_t)(n - boff < b ? n - boff : b);
    const float rm = mp_q8_ref_m_of(t->exp_avg_scale[k]);
    const float rv = pair ? mp_q8_ref_v_of(t->exp_avg_sq_scale[k]) : 0.0f;
    for (uint32_t off = 0; off < blen; off += MP_TILE) {
      const int64_t i = i0 + off;
      const uint32_t len = blen - off < MP_TILE ? blen - off : MP_TILE;
      const mp_pv_tile at = pv_at(a, i);
      float* g = mp_grad_decode(gbuf, (char*)t->grad + i * MP_DTYPE_BYTES(a->gt), a->gt, len, s);
      float* p = mp_pv_decode(a->kind, a->pt, &at, pbuf, len);
      if (pair) {
        mp_q8_decode_tile(mc + i, vc + i, mblk + off, vblk + off, len, rm, rv, s);
      } else {
        mp_q8_decode_tile_m(mc + i, mblk + off, len, rm);
      }
      if (a->kind != MP_PV_F32) {
        memcpy(old, p, len * sizeof(float));
        memcpy(qold, at.param, len * sizeof(uint16_t));
      }
      rule_tile(a, g, p, mblk + off, vblk + off, len);
      mp_pv_encode(a->kind, a->pt, &at, p, len, s->key_param, (uint32_t)(i + a->pos0), hi);
      if (t->ema != NULL) mp_ema_tile(t->ema + i, p, len, s);
      {
        row[MP_STS_ELEMS] += len;
        if (a->kind != MP_PV_F32) sts_param(a->kind, a->pt, p, old, at.param, qold, len, row);
        if (t->ema != NULL) {
          sts_err_sums(t->ema + i, p, len, &row[MP_STS_EMA_LAG], &row[MP_STS_EMA_ABS]);
        }
      }
    }
    const uint32_t lo0 = (uint32_t)(i0 + a->pos0);
    if (pair) {
      mp_q8_encode_block(mc + i0, vc + i0, mblk, vblk, blen, t->exp_avg_scale + k,
                         t->exp_avg_sq_scale + k, s->key_q8, lo0, hi, s->moments_nearest != 0);
    } else {
      mp_q8_encode_block_m(mc + i0, mblk, blen, t->exp_avg_scale + k, s->key_q8, lo0, hi,
                           s->moments_nearest != 0);
    }
    {
      sts_q8_block(mc + i0, pair ? vc + i0 : NULL, mblk, vblk, blen, t->exp_avg_scale[k],
                   pair ? t->exp_avg_sq_scale[k] : 0.0f, pair, gbuf, row);
    }
  }
}


/* A piece through the counted fast row kept for its mode (csrc/core/fast/adam_fused.c: the
 * same loops with captures and this file's epilogue); 0, having done nothing, where none is
 * kept or the build has none (step.c's MP_NO_FAST_PATHS stub). */
int MP_ISA_FN(mp_k_fast_step_stats)(const mp_step_tensor* t, int64_t start, int64_t n,
                                    const mp_step_scalars* s, const mp_rule_scalars* r, int kind,
                                    double* row);

/* rule_step's pieces through the counted fast row where one is kept (fast != 0), else the
 * counted drivers. */
static void rule_step_counted(const mp_step_tensor* t, int64_t start, int64_t n,
                              const mp_step_scalars* s, const mp_rule_scalars* r, double* row,
                              int fast) {
  step_piece a;
  a.t = t;
  a.s = s;
  a.r = r;
  a.nmom = r->nmom;
  a.pos0 = t->offset;
  a.pt = (mp_dtype)t->param_dtype;
  a.gt = (mp_dtype)t->grad_dtype;
  a.md = a.nmom >= 1 ? (mp_dtype)mp_format_dtype(t->exp_avg_format) : MP_F32;
  a.vd = a.nmom >= 2 ? (mp_dtype)mp_format_dtype(t->exp_avg_sq_format) : MP_F32;
  a.kind = a.pt == MP_F32          ? MP_PV_F32
           : t->master != NULL    ? MP_PV_MASTER
           : t->remainder != NULL ? MP_PV_REMAINDER
           : s->sr_params         ? MP_PV_NONE_SR
                                  : MP_PV_NONE_RNE;
  const int q8 = a.md == MP_I8;
  while (n > 0) {
    const int64_t k = mp_sr_piece((uint64_t)(start + a.pos0), n);
    if (fast && MP_ISA_FN(mp_k_fast_step_stats)(t, start, k, s, r, a.kind, row)) {
      /* done by a counted fast row */
    } else if (q8) {
      step_q8_blocks_counted(&a, start, k, row);
    } else {
      step_tiles_counted(&a, start, k, row);
    }
    start += k;
    n -= k;
  }
}

/* The step with its counters (mp_step_stats), added into row. Not a row of isa.h's table: the
 * telemetry keeps its own (telemetry_cpu.c). */
void MP_ISA_FN(mp_k_step_stats)(const mp_step_tensor* t, int64_t start, int64_t n,
                                const mp_step_scalars* s, const mp_rule_scalars* r, double* row);
void MP_ISA_FN(mp_k_step_stats)(const mp_step_tensor* t, int64_t start, int64_t n,
                                const mp_step_scalars* s, const mp_rule_scalars* r, double* row) {
  rule_step_counted(t, start, n, s, r, row, 1);
}

/* The counted pipeline alone (no fast row), for the tests that compare the two
 * (tests/c/test_step_telemetry.c). */
void MP_ISA_FN(mp_k_step_stats_generic)(const mp_step_tensor* t, int64_t start, int64_t n,
                                        const mp_step_scalars* s, const mp_rule_scalars* r,
                                        double* row);
void MP_ISA_FN(mp_k_step_stats_generic)(const mp_step_tensor* t, int64_t start, int64_t n,
                                        const mp_step_scalars* s, const mp_rule_scalars* r,
                                        double* row) {
  rule_step_counted(t, start, n, s, r, row, 0);
}
