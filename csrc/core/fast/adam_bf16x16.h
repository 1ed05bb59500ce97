/* Internal to the C core (adam_fused.c): the AVX2 loop of the fused Adam rows whose arrays are
 * all 16-bit -- the rows adam_bf16x32.h steps on AVX-512, in the same layout, 16 elements per
 * iteration -- for the cores the avx2 build runs on (AMD Zen 2 and 3, Intel cores without
 * AVX-512).
 *
 * Why by hand: GCC's AVX2 code for these rows widens every 16-bit array with a zero-extension
 * per 8 elements and narrows it back with an and, a pack and a lane permute, and selects the
 * NaN cases of each rounding with compares and blends: about 15 instructions per element on a
 * core that retires 2.5 of them per cycle, so the loop, not memory, was what a step waited on
 * (docs/fast_paths.md). As in adam_bf16x32.h, 16 words
 * load as one vector and are never reordered: lane j takes element 2j into its high half by
 * one shift and element 2j + 1 by one mask, the update runs on the even and the odd elements
 * as two fp32 vectors, and each array is stored back with a shift, a mask and an or. The
 * random bits are drawn at each element's own position, so every element gets the bits of the
 * scalar loop (tests/c/test_fast_paths.c compares these rows with the engine's pipeline on every
 * ISA path), and a block whose results hold a NaN is left to the caller's loop. AVX2 has no
 * ternary logic, no mask registers and no fp classes: the packing takes two logic ops where
 * AVX-512 takes one, a rounding's carry is added as a shifted bit, a tie found by a compare is
 * added as its all-ones lane, and NaNs are found by unordered compares. No software prefetch:
 * it changed nothing measurable on the cores this path is for (docs/fast_paths.md).
 *
 * The rows with fp32 moments and a bf16 param (a master, a remainder, none) have a loop here
 * too, x16_adam_f32m: their fp32 arrays load in element order, so the 16-bit ones are widened
 * in order as well (a zero-extension and a shift per 8) and narrowed with one pack and one
 * permute per 16 -- GCC's code for these rows, with a blend per rounding case, was slower on
 * Zen 2 than the engine's pipeline. */
#ifndef MPEXT_CORE_ADAM_BF16X16_H
#define MPEXT_CORE_ADAM_BF16X16_H

#if defined(__AVX2__) && defined(__FMA__) && !defined(MP_BF16X32)
#include <immintrin.h>

#include "formats/tiles.h"
#include "adam_fused.h"
#include "mpext/telemetry.h"
#include "telemetry_sums.h"

#define MP_BF16X16 1

#define X16_HI _mm256_set1_epi32((int)0xFFFF0000u)
#define X16_LO _mm256_set1_epi32(0xFFFF)

/* Elements 2j and 2j + 1 of 16 words as fp32 bits in lane j (the word in the high half). */
static inline __m256i x16_even(__m256i w) { return _mm256_slli_epi32(w, 16); }
static inline __m256i x16_odd(__m256i w) { return _mm256_and_si256(w, X16_HI); }

/* 16 words from the high halves of the even lanes e and the odd lanes o; o's low halves must
 * be zero (the roundings below leave them so), e's may hold anything. */
static inline __m256i x16_pack_hi(__m256i e, __m256i o) {
  return _mm256_or_si256(_mm256_srli_epi32(e, 16), o);
}

/* 16 words from the low halves. */
static inline __m256i x16_pack_lo(__m256i e, __m256i o) {
  return _mm256_or_si256(_mm256_slli_epi32(o, 16), _mm256_and_si256(e, X16_LO));
}

static inline __m256i x16_mix(__m256i x) { /* mp_mix32, lane by lane */
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x21F0AAAD));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32((int)0xD35A2D97u));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
}

/* mp_sr_bits_hl at positions lo (a vector) and hi: k the window key of x16_key. */
static inline __m256i x16_bits(__m256i lo, __m256i k) {
  return x16_mix(_mm256_xor_si256(lo, k));
}

/* x16_bits' vector of a stream's key for positions whose high half is hi. */
static inline __m256i x16_key(uint64_t key, uint32_t hi) {
  return _mm256_set1_epi32((int)mp_sr_window_key(key, hi));
}

/* mp_bf16_sr_bits of non-NaN fp32 bits u with the random bits r16 (in the low half), in the
 * high half: masked (an odd lane of x16_pack_hi) or with the low half left as it comes (an
 * even lane). */
static inline __m256i x16_sr_hi(__m256i u, __m256i r16) {
  return _mm256_and_si256(_mm256_add_epi32(u, r16), X16_HI);
}
static inline __m256i x16_sr_even(__m256i u, __m256i r16) { return _mm256_add_epi32(u, r16); }

/* mp_bf16_rne_bits of non-NaN fp32 bits u, in the high half (masked, and as it comes). */
static inline __m256i x16_rne_even(__m256i u) {
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
  return _mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), odd);
}
static inline __m256i x16_rne_hi(__m256i u) { return _mm256_and_si256(x16_rne_even(u), X16_HI); }

/* mp_bf16_master_bits of non-NaN fp32 bits x: a tie below an even bf16 moved one ulp down. */
static inline __m256i x16_master_bits(__m256i x) {
  const __m256i tie = _mm256_cmpeq_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x1FFFF)),
                                         _mm256_set1_epi32(0x8000));
  return _mm256_add_epi32(x, tie); /* tie is -1 where x is one */
}

/* The scalars of mp_adam_element in AdamW's usual case, as vectors. */
typedef struct x16_scalars {
  __m256 inv_scale, decay, lerp_weight, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size;
} x16_scalars;

static inline x16_scalars x16_scalars_of(const mp_fused_scalars* s) {
  const x16_scalars c = {_mm256_set1_ps(s->st.inv_scale),       _mm256_set1_ps(s->a.decay),
                         _mm256_set1_ps(s->a.lerp_weight),     _mm256_set1_ps(s->a.beta2),
                         _mm256_set1_ps(s->a.one_minus_beta2), _mm256_set1_ps(s->a.bc2_sqrt),
                         _mm256_set1_ps(s->a.eps),             _mm256_set1_ps(s->a.neg_step_size)};
  return c;
}

/* mp_adam_element with decoupled decay, not maximized, lerp from the start (mp_adam_usual), on
 * 8 elements: the same fp32 operations in the same order. */
static inline __m256 x16_element(__m256* gp, __m256 p, __m256* m, __m256* v,
                                 const x16_scalars* c) {
  const __m256 g = _mm256_mul_ps(*gp, c->inv_scale);
  *gp = g;
  p = _mm256_mul_ps(p, c->decay);
  *m = _mm256_add_ps(*m, _mm256_mul_ps(c->lerp_weight, _mm256_sub_ps(g, *m)));
  *v = _mm256_add_ps(_mm256_mul_ps(*v, c->beta2),
                     _mm256_mul_ps(_mm256_mul_ps(c->one_minus_beta2, g), g));
  const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(*v), c->bc2_sqrt), c->eps);
  return _mm256_add_ps(p, _mm256_div_ps(_mm256_mul_ps(c->neg_step_size, *m), denom));
}

/* mp_adam_ema past its first step with ema_weight < 0.5 (mp_adam_usual), on the 16 fp32 ema
 * values at e (elements in order) for the new values xe (even elements) and xo (odd): the pair
 * split by element parity, lerped, and put back in order. */
static inline void x16_ema(float* restrict e, __m256 xe, __m256 xo, __m256 w) {
  const __m256 a = _mm256_loadu_ps(e), b = _mm256_loadu_ps(e + 8);
  /* (e0 e2 e8 e10 | e4 e6 e12 e14), its 64-bit pairs reordered 0 2 1 3; the odd ones alike */
  const __m256 ee = _mm256_castpd_ps(
      _mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0x88)), 0xD8));
  const __m256 eo = _mm256_castpd_ps(
      _mm256_permute4x64_pd(_mm256_castps_pd(_mm256_shuffle_ps(a, b, 0xDD)), 0xD8));
  const __m256 le = _mm256_add_ps(ee, _mm256_mul_ps(w, _mm256_sub_ps(xe, ee)));
  const __m256 lo = _mm256_add_ps(eo, _mm256_mul_ps(w, _mm256_sub_ps(xo, eo)));
  /* interleaved within each 128-bit half: (e0..e3 | e8..e11) and (e4..e7 | e12..e15) */
  const __m256 u = _mm256_unpacklo_ps(le, lo), h = _mm256_unpackhi_ps(le, lo);
  _mm256_storeu_ps(e, _mm256_permute2f128_ps(u, h, 0x20));
  _mm256_storeu_ps(e + 8, _mm256_permute2f128_ps(u, h, 0x31));
}

/* ---- the counted rows' tallies: adam_bf16x32.h's x32_tally on 8 lanes (AVX2 has no mask
 * registers: a compare's all-ones lane is subtracted as -1) ---- */
typedef struct x16_tally {
  __m256i ch, un, sh;     /* changed, unmoved, below half an ulp: counts per lane */
  __m256d me, ma, ve, va; /* the bf16 moments' sums of |stored - fp32| and of |fp32| */
  __m256 fme, fma, fve, fva; /* their fp32 runs (x32_tally's), 2 terms per lane and iteration */
  uint32_t run;              /* iterations in the runs */
} x16_tally;

static inline x16_tally x16_tally_zero(void) {
  const x16_tally z = {_mm256_setzero_si256(), _mm256_setzero_si256(), _mm256_setzero_si256(),
                       _mm256_setzero_pd(),    _mm256_setzero_pd(),    _mm256_setzero_pd(),
                       _mm256_setzero_pd(),    _mm256_setzero_ps(),    _mm256_setzero_ps(),
                       _mm256_setzero_ps(),    _mm256_setzero_ps(),    0u};
  return z;
}

static inline __m256 x16_abs(__m256 x) {
  return _mm256_castsi256_ps(
      _mm256_and_si256(_mm256_castps_si256(x), _mm256_set1_epi32(0x7FFFFFFF)));
}

/* The param's counts of 8 elements: x the new fp32 values, old the old ones, q / qold the stored
 * bf16 params after and before in the high halves (low halves ignored); subhalf: master-free
 * (x32_count_param's half-ulp test). */
static inline __attribute__((always_inline)) void x16_count_param(x16_tally* t, __m256 x,
                                                                  __m256 old, __m256i q,
                                                                  __m256i qold,
                                                                  const int subhalf) {
  const __m256i c = _mm256_castps_si256(_mm256_cmp_ps(x, old, _CMP_NEQ_UQ)); /* x != old */
  t->ch = _mm256_sub_epi32(t->ch, c);
  const __m256i same = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_xor_si256(q, qold), X16_HI),
                                          _mm256_setzero_si256());
  t->un = _mm256_sub_epi32(t->un, _mm256_and_si256(c, same));
  if (subhalf) {
    const __m256i e = _mm256_max_epu32(
        _mm256_and_si256(_mm256_castps_si256(old), _mm256_set1_epi32(0x7F800000)),
        _mm256_set1_epi32(1 << 23));
    const __m256 half = _mm256_mul_ps(_mm256_castsi256_ps(e), _mm256_set1_ps(0x1p-8f));
    const __m256 h = _mm256_cmp_ps(x16_abs(_mm256_sub_ps(x, old)), half, _CMP_LT_OQ);
    t->sh = _mm256_sub_epi32(t->sh, _mm256_and_si256(c, _mm256_castps_si256(h)));
  }
}

static inline __m256d x16_add_pd(__m256d acc, __m256 v) {
  acc = _mm256_add_pd(acc, _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
  return _mm256_add_pd(acc, _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1)));
}

/* A bf16 moment's terms of 8 elements added to its fp32 runs (x32_count_bf16): x the fp32
 * values, r the stored bf16 in the high halves (low halves ignored). */
static inline __attribute__((always_inline)) void x16_count_bf16(__m256* err, __m256* mag,
                                                                 __m256 x, __m256i r) {
  const __m256 s = _mm256_castsi256_ps(_mm256_and_si256(r, X16_HI));
  *err = _mm256_add_ps(*err, x16_abs(_mm256_sub_ps(s, x)));
  *mag = _mm256_add_ps(*mag, x16_abs(x));
}

/* The bf16 moments' fp32 runs added into their double lanes, and restarted (x32_flush_bf16). */
static inline void x16_flush_bf16(x16_tally* t) {
  t->me = x16_add_pd(t->me, t->fme);
  t->ma = x16_add_pd(t->ma, t->fma);
  t->ve = x16_add_pd(t->ve, t->fve);
  t->va = x16_add_pd(t->va, t->fva);
  t->fme = t->fma = t->fve = t->fva = _mm256_setzero_ps();
  t->run = 0u;
}

static inline double x16_sum_pd(__m256d v) {
  double a[4];
  _mm256_storeu_pd(a, v);
  return (a[0] + a[1]) + (a[2] + a[3]);
}
static inline double x16_sum_epi32(__m256i v) {
  uint32_t a[8];
  _mm256_storeu_si256((__m256i*)a, v);
  uint64_t t = 0;
  for (int k = 0; k < 8; ++k) t += a[k];
  return (double)t;
}

/* The tallies added into row (mpext/telemetry.h's columns). */
static inline void x16_tally_add(const x16_tally* t, double* restrict row) {
  row[MP_STS_CHANGED] += x16_sum_epi32(t->ch);
  row[MP_STS_UNMOVED] += x16_sum_epi32(t->un);
  row[MP_STS_SUBHALF] += x16_sum_epi32(t->sh);
  row[MP_STS_M_ERR] += x16_sum_pd(t->me);
  row[MP_STS_M_ABS] += x16_sum_pd(t->ma);
  row[MP_STS_V_ERR] += x16_sum_pd(t->ve);
  row[MP_STS_V_ABS] += x16_sum_pd(t->va);
}

/* The lanes of x that hold a NaN, all ones. */
static inline __m256 x16_nan(__m256 x) { return _mm256_cmp_ps(x, x, _CMP_UNORD_Q); }

/* Steps elements [i, n) of a row in 16-element blocks from i on, and returns the index where it
 * stopped: n rounded down to a block, or the first block whose results hold a NaN (nothing of
 * that block is written). The arguments are x32_adam_bf16's (adam_bf16x32.h). */
static inline __attribute__((always_inline)) uint32_t x16_adam_bf16(
    uint16_t* restrict param, uint16_t* restrict grad, int16_t* restrict remainder,
    uint16_t* restrict m, uint16_t* restrict v, float* restrict ema, uint32_t i, uint32_t n,
    uint32_t lo0, uint32_t hi, const mp_fused_scalars* s, const int nearest,
    const int write_grad, double* restrict row) {
  const __m256 ema_w = _mm256_set1_ps(s->st.ema_weight);
  const x16_scalars c = x16_scalars_of(s);
  x16_tally t = x16_tally_zero();
  const __m256i km = x16_key(s->st.key_moments, hi), kp = x16_key(s->st.key_param, hi);
  /* the positions of the even elements of a block at lo0 + i: lo0 + i + 2j */
  const __m256i ramp = _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14);
  const __m256i one = _mm256_set1_epi32(1);
  for (; i + 16 <= n; i += 16) {
    const __m256i pw = _mm256_loadu_si256((const __m256i*)(param + i));
    const __m256i gw = _mm256_loadu_si256((const __m256i*)(grad + i));
    const __m256i mw = _mm256_loadu_si256((const __m256i*)(m + i));
    const __m256i vw = _mm256_loadu_si256((const __m256i*)(v + i));
    __m256i pe = x16_even(pw), po = x16_odd(pw);
    if (remainder != NULL) { /* the fp32 master: the bf16 word above its signed remainder */
      const __m256i rw = _mm256_loadu_si256((const __m256i*)(remainder + i));
      pe = _mm256_add_epi32(pe, _mm256_srai_epi32(_mm256_slli_epi32(rw, 16), 16));
      po = _mm256_add_epi32(po, _mm256_srai_epi32(rw, 16));
    }
    __m256 me = _mm256_castsi256_ps(x16_even(mw)), mo = _mm256_castsi256_ps(x16_odd(mw));
    __m256 ve = _mm256_castsi256_ps(x16_even(vw)), vo = _mm256_castsi256_ps(x16_odd(vw));
    __m256 ge = _mm256_castsi256_ps(x16_even(gw)), go = _mm256_castsi256_ps(x16_odd(gw));
    const __m256 xe = x16_element(&ge, _mm256_castsi256_ps(pe), &me, &ve, &c);
    const __m256 xo = x16_element(&go, _mm256_castsi256_ps(po), &mo, &vo, &c);
    /* the new param alone: a NaN moment makes it NaN too (a NaN v through the denominator, a
     * NaN m through the numerator), and so does a NaN grad */
    const __m256 nan = _mm256_or_ps(x16_nan(xe), x16_nan(xo));
    if (!_mm256_testz_ps(nan, nan)) break;
    if (write_grad) {
      _mm256_storeu_si256((__m256i*)(grad + i),
                          x16_pack_hi(x16_rne_even(_mm256_castps_si256(ge)),
                                      x16_rne_hi(_mm256_castps_si256(go))));
    }
    const __m256i lo_e = _mm256_add_epi32(_mm256_set1_epi32((int)(lo0 + i)), ramp);
    const __m256i lo_o = _mm256_add_epi32(lo_e, one);
    __m256i m16, v16;
    if (nearest) {
      m16 = x16_pack_hi(x16_rne_even(_mm256_castps_si256(me)), x16_rne_hi(_mm256_castps_si256(mo)));
      v16 = x16_pack_hi(x16_rne_even(_mm256_castps_si256(ve)), x16_rne_hi(_mm256_castps_si256(vo)));
    } else { /* one draw per element: m takes its low 16 bits, v its high 16 */
      const __m256i re = x16_bits(lo_e, km), ro = x16_bits(lo_o, km);
      m16 = x16_pack_hi(x16_sr_even(_mm256_castps_si256(me), _mm256_and_si256(re, X16_LO)),
                        x16_sr_hi(_mm256_castps_si256(mo), _mm256_and_si256(ro, X16_LO)));
      v16 = x16_pack_hi(x16_sr_even(_mm256_castps_si256(ve), _mm256_srli_epi32(re, 16)),
                        x16_sr_hi(_mm256_castps_si256(vo), _mm256_srli_epi32(ro, 16)));
    }
    _mm256_storeu_si256((__m256i*)(m + i), m16);
    _mm256_storeu_si256((__m256i*)(v + i), v16);
    if (row != NULL) { /* counting: the moments as stored against their fp32 values */
      x16_count_bf16(&t.fme, &t.fma, me, x16_even(m16));
      x16_count_bf16(&t.fme, &t.fma, mo, m16);
      x16_count_bf16(&t.fve, &t.fva, ve, x16_even(v16));
      x16_count_bf16(&t.fve, &t.fva, vo, v16);
      if (++t.run == MP_STS_RUN / 2) x16_flush_bf16(&t); /* 2 terms a lane per iteration */
    }
    __m256i qw;
    if (remainder != NULL) { /* round the master to nearest; the remainder is what is left */
      const __m256i ue = x16_master_bits(_mm256_castps_si256(xe));
      const __m256i uo = x16_master_bits(_mm256_castps_si256(xo));
      if (ema != NULL) x16_ema(ema + i, _mm256_castsi256_ps(ue), _mm256_castsi256_ps(uo), ema_w);
      qw = x16_pack_hi(x16_rne_even(ue), x16_rne_hi(uo));
      _mm256_storeu_si256((__m256i*)(param + i), qw);
      /* u - round(u) has u's low half, the rounding's low half being zero */
      _mm256_storeu_si256((__m256i*)(remainder + i), x16_pack_lo(ue, uo));
      if (row != NULL) { /* counting: the master as stored against the old one */
        x16_count_param(&t, _mm256_castsi256_ps(ue), _mm256_castsi256_ps(pe), x16_even(qw),
                        x16_even(pw), 0);
        x16_count_param(&t, _mm256_castsi256_ps(uo), _mm256_castsi256_ps(po), qw, pw, 0);
      }
    } else {
      if (ema != NULL) x16_ema(ema + i, xe, xo, ema_w);
      const __m256i re = x16_bits(lo_e, kp), ro = x16_bits(lo_o, kp);
      qw = x16_pack_hi(x16_sr_even(_mm256_castps_si256(xe), _mm256_and_si256(re, X16_LO)),
                       x16_sr_hi(_mm256_castps_si256(xo), _mm256_and_si256(ro, X16_LO)));
      _mm256_storeu_si256((__m256i*)(param + i), qw);
      if (row != NULL) { /* counting: the fp32 result against the old bf16 param */
        x16_count_param(&t, xe, _mm256_castsi256_ps(pe), x16_even(qw), pe, 1);
        x16_count_param(&t, xo, _mm256_castsi256_ps(po), qw, po, 1);
      }
    }
  }
  if (row != NULL) {
    x16_flush_bf16(&t);
    x16_tally_add(&t, row);
  }
  return i;
}

/* x16_adam_f32m's block: 4 vectors of 8 elements. Its loop waits on the divider's latency
 * more than on its width (two square roots and four divisions per 16 elements, then the
 * roundings that need them): four independent vectors per block, their NaN test done once, let
 * the next block's divisions start while this one's roundings run (docs/fast_paths.md has the
 * measured choice of 4). */
#define X16_F32M_V 4
#define X16_F32M_W (8 * X16_F32M_V)

/* 8 bf16 words at p as fp32 bits, in order. */
static inline __m256i x16_widen(const uint16_t* p) {
  return _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16);
}

/* 16 words in order from the high halves of a (elements 0-7) and b (8-15); the pack works
 * within 128-bit halves, the permute puts its 64-bit quarters back in order. */
static inline __m256i x16_narrow_hi(__m256i a, __m256i b) {
  return _mm256_permute4x64_epi64(
      _mm256_packus_epi32(_mm256_srli_epi32(a, 16), _mm256_srli_epi32(b, 16)), 0xD8);
}

/* 16 int16 in order from int32 lanes already in [-0x8000, 0x7FFF] (no saturation occurs). */
static inline __m256i x16_narrow_s16(__m256i a, __m256i b) {
  return _mm256_permute4x64_epi64(_mm256_packs_epi32(a, b), 0xD8);
}

/* 8 fp32 ema values at e moved towards x (mp_adam_ema in the usual case). */
static inline void x16_ema_in_order(float* restrict e, __m256 x, __m256 w) {
  const __m256 a = _mm256_loadu_ps(e);
  _mm256_storeu_ps(e, _mm256_add_ps(a, _mm256_mul_ps(w, _mm256_sub_ps(x, a))));
}

/* Steps elements [i, n) of a row with a bf16 param and fp32 moments in blocks of X16_F32M_W
 * elements from i on; returns where it stopped, as x16_adam_bf16. grad: bf16, or fp32 when
 * g32; kind: the param's storage (formats.h MP_PV_MASTER, _REMAINDER, _NONE_RNE or _NONE_SR),
 * master and remainder its arrays (NULL where the kind has none). */
static inline __attribute__((always_inline)) uint32_t x16_adam_f32m(
    uint16_t* restrict param, void* restrict grad, const int g32, float* restrict master,
    int16_t* restrict remainder, float* restrict m, float* restrict v, float* restrict ema,
    uint32_t i, uint32_t n, uint32_t lo0, uint32_t hi, const mp_fused_scalars* s, const int kind,
    const int write_grad, double* restrict row) {
  const __m256 ema_w = _mm256_set1_ps(s->st.ema_weight);
  const x16_scalars c = x16_scalars_of(s);
  x16_tally t = x16_tally_zero();
  const __m256i kp = x16_key(s->st.key_param, hi);
  const __m256i ramp = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const int rounded_master = kind == MP_PV_MASTER || kind == MP_PV_REMAINDER;
  uint16_t* restrict gw = (uint16_t*)grad;
  float* restrict gf = (float*)grad;
  for (; i + X16_F32M_W <= n; i += X16_F32M_W) {
    __m256 g[X16_F32M_V], x[X16_F32M_V], mk[X16_F32M_V], vk[X16_F32M_V];
    __m256 p0[X16_F32M_V];  /* counting: the old fp32 values */
    __m256i q0[X16_F32M_V]; /* and the old params' bits */
    __m256 nan = _mm256_setzero_ps();
    for (int k = 0; k < X16_F32M_V; ++k) {
      const uint32_t j = i + 8u * (uint32_t)k;
      __m256 p;
      g[k] = g32 ? _mm256_loadu_ps(gf + j) : _mm256_castsi256_ps(x16_widen(gw + j));
      if (row != NULL || kind != MP_PV_MASTER) q0[k] = x16_widen(param + j);
      if (kind == MP_PV_MASTER) {
        p = _mm256_loadu_ps(master + j);
      } else if (kind == MP_PV_REMAINDER) { /* the bf16 word above its signed remainder */
        p = _mm256_castsi256_ps(_mm256_add_epi32(
            q0[k], _mm256_cvtepi16_epi32(_mm_loadu_si128((const __m128i*)(remainder + j)))));
      } else {
        p = _mm256_castsi256_ps(q0[k]);
      }
      p0[k] = p;
      mk[k] = _mm256_loadu_ps(m + j);
      vk[k] = _mm256_loadu_ps(v + j);
      x[k] = x16_element(&g[k], p, &mk[k], &vk[k], &c);
      nan = _mm256_or_ps(nan, x16_nan(x[k])); /* as in x16_adam_bf16 */
    }
    if (!_mm256_testz_ps(nan, nan)) break;
    for (int k = 0; k < X16_F32M_V; k += 2) {
      const uint32_t j = i + 8u * (uint32_t)k;
      if (write_grad && g32) {
        _mm256_storeu_ps(gf + j, g[k]);
        _mm256_storeu_ps(gf + j + 8, g[k + 1]);
      } else if (write_grad) {
        _mm256_storeu_si256((__m256i*)(gw + j),
                            x16_narrow_hi(x16_rne_even(_mm256_castps_si256(g[k])),
                                          x16_rne_even(_mm256_castps_si256(g[k + 1]))));
      }
      _mm256_storeu_ps(m + j, mk[k]);
      _mm256_storeu_ps(m + j + 8, mk[k + 1]);
      _mm256_storeu_ps(v + j, vk[k]);
      _mm256_storeu_ps(v + j + 8, vk[k + 1]);
      __m256i qa, qb;
      if (rounded_master) { /* the master rounded to nearest even, kept as stored */
        const __m256i ua = x16_master_bits(_mm256_castps_si256(x[k]));
        const __m256i ub = x16_master_bits(_mm256_castps_si256(x[k + 1]));
        qa = x16_rne_hi(ua);
        qb = x16_rne_hi(ub);
        if (row != NULL) { /* counting: the master as stored against the old one */
          x16_count_param(&t, _mm256_castsi256_ps(ua), p0[k], qa, q0[k], 0);
          x16_count_param(&t, _mm256_castsi256_ps(ub), p0[k + 1], qb, q0[k + 1], 0);
        }
        if (kind == MP_PV_MASTER) {
          _mm256_storeu_si256((__m256i*)(master + j), ua);
          _mm256_storeu_si256((__m256i*)(master + j + 8), ub);
        } else {
          _mm256_storeu_si256((__m256i*)(remainder + j),
                              x16_narrow_s16(_mm256_sub_epi32(ua, qa), _mm256_sub_epi32(ub, qb)));
        }
        if (ema != NULL) {
          x16_ema_in_order(ema + j, _mm256_castsi256_ps(ua), ema_w);
          x16_ema_in_order(ema + j + 8, _mm256_castsi256_ps(ub), ema_w);
        }
      } else {
        if (kind == MP_PV_NONE_SR) {
          const __m256i la = _mm256_add_epi32(_mm256_set1_epi32((int)(lo0 + j)), ramp);
          const __m256i lb = _mm256_add_epi32(la, _mm256_set1_epi32(8));
          const __m256i ra = x16_bits(la, kp), rb = x16_bits(lb, kp);
          qa = x16_sr_even(_mm256_castps_si256(x[k]), _mm256_and_si256(ra, X16_LO));
          qb = x16_sr_even(_mm256_castps_si256(x[k + 1]), _mm256_and_si256(rb, X16_LO));
        } else {
          qa = x16_rne_even(_mm256_castps_si256(x[k]));
          qb = x16_rne_even(_mm256_castps_si256(x[k + 1]));
        }
        if (row != NULL) { /* counting: the fp32 result against the old bf16 param */
          x16_count_param(&t, x[k], p0[k], qa, q0[k], 1);
          x16_count_param(&t, x[k + 1], p0[k + 1], qb, q0[k + 1], 1);
        }
        if (ema != NULL) {
          x16_ema_in_order(ema + j, x[k], ema_w);
          x16_ema_in_order(ema + j + 8, x[k + 1], ema_w);
        }
      }
      _mm256_storeu_si256((__m256i*)(param + j), x16_narrow_hi(qa, qb));
    }
  }
  if (row != NULL) x16_tally_add(&t, row);
  return i;
}

#endif /* AVX2 and FMA, not AVX-512 */
#endif /* MPEXT_CORE_ADAM_BF16X16_H */
