/* Internal to the C core (adam_fused.c): the AVX-512 loop of the fused Adam rows whose arrays
 * are all 16-bit -- a bf16 param and grad, a 16-bit remainder or none (stochastic rounding),
 * bf16 moments -- in AdamW's usual case (mp_adam_usual), 32 elements per iteration.
 *
 * Why by hand: GCC widens each 16-bit array with a zero-extension per 16 elements and narrows
 * it back with word permutes and shifts, and on cores that run 512-bit integer work on two
 * ports only (Intel's server cores) those shuffles, with the generator's shifts and multiplies,
 * are what the loop waits on. Here 32 words load as one vector and are never reordered: lane j
 * takes element 2j into its high half by one shift and element 2j + 1 by one mask, the update
 * runs on the even and the odd elements as two fp32 vectors, and each array is stored back
 * with one shift and one three-input logic op. The random bits are drawn at each element's own
 * position, so every element gets the same bits as in the scalar loop (tests/c/test_fast_paths.c
 * compares this row with the engine's pipeline on every ISA path). A block whose results hold a
 * NaN is left to the caller's loop (NaN payloads need their own rounding rule), so this loop
 * stays free of the NaN fix-ups. */
#ifndef MPEXT_CORE_ADAM_BF16X32_H
#define MPEXT_CORE_ADAM_BF16X32_H

#if defined(__AVX512F__) && defined(__AVX512BW__) && defined(__AVX512DQ__)
#include <immintrin.h>

#include "adam_fused.h"
#include "mpext/telemetry.h"
#include "telemetry_sums.h"

#define MP_BF16X32 1

#define X32_HI _mm512_set1_epi32((int)0xFFFF0000u)
#define X32_LO _mm512_set1_epi32(0xFFFF)
#define X32_OR_AND 0xF8 /* ternary logic: A | (B & C) */
#define X32_AHEAD 512   /* elements prefetched ahead (a prefetch past an array's end is harmless) */

/* x >> 16 in every lane, as a byte shuffle: 512-bit shifts issue on one port of Intel's server
 * cores, which the divider, the generator's shifts and its multiplies also need; the shuffle
 * goes to another. */
static inline __m512i x32_shr16(__m512i x) {
  /* each dword's bytes 2 and 3, then zeros (the indices count within a 128-bit lane) */
  const __m512i ctl = _mm512_set4_epi32((int)0x80800F0Eu, (int)0x80800B0Au, (int)0x80800706u,
                                        (int)0x80800302u);
  return _mm512_shuffle_epi8(x, ctl);
}

/* Prefetches the line X32_AHEAD 16-bit elements past p, as an address (no pointer past the
 * array is formed). Always inlined: as a call, GCC 12 took the function for one without side
 * effects and deleted every call to it (tests/test_build_tools.py checks that the prefetches
 * are in the object). */
static inline __attribute__((always_inline)) void x32_prefetch(const void* p) {
  _mm_prefetch((const char*)((uintptr_t)p + 2u * X32_AHEAD), _MM_HINT_T0);
}

/* Elements 2j and 2j + 1 of 32 words as fp32 bits in lane j (the word in the high half). */
static inline __m512i x32_even(__m512i w) { return _mm512_slli_epi32(w, 16); }
static inline __m512i x32_odd(__m512i w) { return _mm512_and_si512(w, X32_HI); }

/* 32 words from the high halves of the even and the odd elements' lanes. */
static inline __m512i x32_pack_hi(__m512i e, __m512i o) {
  return _mm512_ternarylogic_epi32(x32_shr16(e), o, X32_HI, X32_OR_AND);
}

/* 32 words from the low halves. */
static inline __m512i x32_pack_lo(__m512i e, __m512i o) {
  return _mm512_ternarylogic_epi32(_mm512_slli_epi32(o, 16), e, X32_LO, X32_OR_AND);
}

static inline __m512i x32_mix(__m512i x) { /* mp_mix32, lane by lane */
  x = _mm512_xor_si512(x, x32_shr16(x));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32(0x21F0AAAD));
  x = _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
  x = _mm512_mullo_epi32(x, _mm512_set1_epi32((int)0xD35A2D97u));
  return _mm512_xor_si512(x, _mm512_srli_epi32(x, 15));
}

/* mp_sr_bits_hl at positions lo (a vector) and hi: k the window key of x32_key. */
static inline __m512i x32_bits(__m512i lo, __m512i k) {
  return x32_mix(_mm512_xor_si512(lo, k));
}

/* x32_bits' vector of a stream's key for positions whose high half is hi. */
static inline __m512i x32_key(uint64_t key, uint32_t hi) {
  return _mm512_set1_epi32((int)mp_sr_window_key(key, hi));
}

/* mp_bf16_sr_bits of non-NaN fp32 bits u with the random bits r16 (in the low half), in the
 * high half; the low half is left as it is, since x32_pack_hi, which every result goes
 * through, ignores it (an and per vector saved: on AMD Zen 4 this loop is bound by its
 * count of vector instructions, not by the divider). */
static inline __m512i x32_sr_hi(__m512i u, __m512i r16) { return _mm512_add_epi32(u, r16); }

/* mp_bf16_rne_bits of non-NaN fp32 bits u, in the high half (the low half as x32_sr_hi's). */
static inline __m512i x32_rne_hi(__m512i u) {
  const __mmask16 odd = _mm512_test_epi32_mask(u, _mm512_set1_epi32(0x10000));
  const __m512i half = _mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF));
  return _mm512_mask_add_epi32(half, odd, half, _mm512_set1_epi32(1));
}

/* mp_bf16_master_bits of non-NaN fp32 bits x: a tie below an even bf16 moved one ulp down. */
static inline __m512i x32_master_bits(__m512i x) {
  const __mmask16 tie = _mm512_cmpeq_epi32_mask(_mm512_and_si512(x, _mm512_set1_epi32(0x1FFFF)),
                                                _mm512_set1_epi32(0x8000));
  return _mm512_mask_sub_epi32(x, tie, x, _mm512_set1_epi32(1));
}

/* The scalars of mp_adam_element in AdamW's usual case, as vectors. */
typedef struct x32_scalars {
  __m512 inv_scale, decay, lerp_weight, beta2, one_minus_beta2, bc2_sqrt, eps, neg_step_size;
} x32_scalars;

static inline x32_scalars x32_scalars_of(const mp_fused_scalars* s) {
  const x32_scalars c = {_mm512_set1_ps(s->st.inv_scale),       _mm512_set1_ps(s->a.decay),
                         _mm512_set1_ps(s->a.lerp_weight),     _mm512_set1_ps(s->a.beta2),
                         _mm512_set1_ps(s->a.one_minus_beta2), _mm512_set1_ps(s->a.bc2_sqrt),
                         _mm512_set1_ps(s->a.eps),             _mm512_set1_ps(s->a.neg_step_size)};
  return c;
}

/* mp_adam_element with decoupled decay, not maximized, lerp from the start (mp_adam_usual), on
 * 16 elements: the same fp32 operations in the same order. */
static inline __m512 x32_element(__m512* gp, __m512 p, __m512* m, __m512* v,
                                 const x32_scalars* c) {
  const __m512 g = _mm512_mul_ps(*gp, c->inv_scale);
  *gp = g;
  p = _mm512_mul_ps(p, c->decay);
  *m = _mm512_add_ps(*m, _mm512_mul_ps(c->lerp_weight, _mm512_sub_ps(g, *m)));
  *v = _mm512_add_ps(_mm512_mul_ps(*v, c->beta2),
                     _mm512_mul_ps(_mm512_mul_ps(c->one_minus_beta2, g), g));
  const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(*v), c->bc2_sqrt), c->eps);
  return _mm512_add_ps(p, _mm512_div_ps(_mm512_mul_ps(c->neg_step_size, *m), denom));
}

/* 32 fp32 values in element order (a, b) split into the even elements' vector and the odd
 * ones' (*e, *o), and back. */
static inline void x32_split(__m512i a, __m512i b, __m512i* e, __m512i* o) {
  const __m512i even = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28,
                                         30);
  *e = _mm512_permutex2var_epi32(a, even, b);
  *o = _mm512_permutex2var_epi32(a, _mm512_add_epi32(even, _mm512_set1_epi32(1)), b);
}

static inline void x32_join(__m512i e, __m512i o, __m512i* a, __m512i* b) {
  /* the even and odd elements interleaved back: the first 16, then the last 16 */
  const __m512i first = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7,
                                          23);
  *a = _mm512_permutex2var_epi32(e, first, o);
  *b = _mm512_permutex2var_epi32(e, _mm512_add_epi32(first, _mm512_set1_epi32(8)), o);
}

/* ---- the counted rows' tallies (adam_fused.c; the loops take them only where the caller
 * passes a row: NULL, folded away, in the uncounted rows) ----
 * Counted in registers while the values are live, lane by lane, and reduced once per call: the
 * counts exactly as telemetry_step.h's sts_param_ counts them (the same compares on the same
 * values); the error sums' terms as that epilogue forms them, added in fp32 runs of at most
 * MP_STS_RUN terms per lane, each run then into double lanes (telemetry_sums.h: why, and their
 * tolerance). */
typedef struct x32_tally {
  __m512i ch, un, sh;     /* changed, unmoved, below half an ulp: counts per lane */
  __m512d me, ma, ve, va; /* the bf16 moments' sums of |stored - fp32| and of |fp32| */
  __m512 fme, fma, fve, fva; /* their fp32 runs, 2 terms per lane and loop iteration */
  uint32_t run;              /* iterations in the runs */
} x32_tally;

static inline x32_tally x32_tally_zero(void) {
  const x32_tally z = {_mm512_setzero_si512(), _mm512_setzero_si512(), _mm512_setzero_si512(),
                       _mm512_setzero_pd(),    _mm512_setzero_pd(),    _mm512_setzero_pd(),
                       _mm512_setzero_pd(),    _mm512_setzero_ps(),    _mm512_setzero_ps(),
                       _mm512_setzero_ps(),    _mm512_setzero_ps(),    0u};
  return z;
}

/* The param's counts of 16 elements (one parity): x the new fp32 values (the master as stored,
 * or the master-free result), old the old ones, q / qold the stored bf16 params after and before
 * in the high halves (their low halves ignored); subhalf: master-free (sts_param_'s test of
 * |x - old| against half an ulp of the old param, here 2^(max(e, 1) - 135) for its exponent
 * field e: a power of two, exact as an fp32 product, subnormal included). */
static inline __attribute__((always_inline)) void x32_count_param(x32_tally* t, __m512 x,
                                                                  __m512 old, __m512i q,
                                                                  __m512i qold,
                                                                  const int subhalf) {
  const __m512i m1 = _mm512_set1_epi32(-1);
  const __mmask16 c = _mm512_cmp_ps_mask(x, old, _CMP_NEQ_UQ); /* x != old, as in C */
  t->ch = _mm512_mask_sub_epi32(t->ch, c, t->ch, m1);
  const __mmask16 u = _mm512_mask_testn_epi32_mask(c, _mm512_xor_si512(q, qold), X32_HI);
  t->un = _mm512_mask_sub_epi32(t->un, u, t->un, m1);
  if (subhalf) {
    const __m512i e = _mm512_max_epu32(
        _mm512_and_si512(_mm512_castps_si512(old), _mm512_set1_epi32(0x7F800000)),
        _mm512_set1_epi32(1 << 23));
    const __m512 half = _mm512_mul_ps(_mm512_castsi512_ps(e), _mm512_set1_ps(0x1p-8f));
    const __mmask16 h =
        _mm512_mask_cmp_ps_mask(c, _mm512_abs_ps(_mm512_sub_ps(x, old)), half, _CMP_LT_OQ);
    t->sh = _mm512_mask_sub_epi32(t->sh, h, t->sh, m1);
  }
}

/* The master-free SR store of 32 bf16 params (even and odd lanes xe, xo; lo_e / lo_o and kp
 * their random stream), and, where t is not NULL, its count: the fp32 result against the old
 * bf16 params pe / po (high halves). One copy for the bf16- and 8-bit-moment rows. */
static inline __attribute__((always_inline)) void x32_store_sr_param(
    uint16_t* param, __m512 xe, __m512 xo, __m512i lo_e, __m512i lo_o, __m512i kp, __m512i pe,
    __m512i po, x32_tally* t) {
  const __m512i re = x32_bits(lo_e, kp), ro = x32_bits(lo_o, kp);
  const __m512i qe = x32_sr_hi(_mm512_castps_si512(xe), _mm512_and_si512(re, X32_LO));
  const __m512i qo = x32_sr_hi(_mm512_castps_si512(xo), _mm512_and_si512(ro, X32_LO));
  _mm512_storeu_si512(param, x32_pack_hi(qe, qo));
  if (t != NULL) {
    x32_count_param(t, xe, _mm512_castsi512_ps(pe), qe, pe, 1);
    x32_count_param(t, xo, _mm512_castsi512_ps(po), qo, po, 1);
  }
}

/* |v| of 16 floats added to 8 double lanes (element k's low or high 8 alike on every call). */
static inline __m512d x32_add_pd(__m512d acc, __m512 v) {
  acc = _mm512_add_pd(acc, _mm512_cvtps_pd(_mm512_castps512_ps256(v)));
  return _mm512_add_pd(acc, _mm512_cvtps_pd(_mm512_extractf32x8_ps(v, 1)));
}

/* A bf16 moment's terms of 16 elements added to its fp32 runs: x the fp32 values, r the stored
 * bf16 in the high halves (low halves ignored). stored - x is exact in fp32 (a rounding's
 * difference has at most 17 significant bits at x's ulp): each term is the epilogue's. */
static inline __attribute__((always_inline)) void x32_count_bf16(__m512* err, __m512* mag,
                                                                 __m512 x, __m512i r) {
  const __m512 s = _mm512_castsi512_ps(_mm512_and_si512(r, X32_HI));
  *err = _mm512_add_ps(*err, _mm512_abs_ps(_mm512_sub_ps(s, x)));
  *mag = _mm512_add_ps(*mag, _mm512_abs_ps(x));
}

/* The bf16 moments' fp32 runs added into their double lanes, and restarted. */
static inline void x32_flush_bf16(x32_tally* t) {
  t->me = x32_add_pd(t->me, t->fme);
  t->ma = x32_add_pd(t->ma, t->fma);
  t->ve = x32_add_pd(t->ve, t->fve);
  t->va = x32_add_pd(t->va, t->fva);
  t->fme = t->fma = t->fve = t->fva = _mm512_setzero_ps();
  t->run = 0u;
}

static inline double x32_sum_pd(__m512d v) { return _mm512_reduce_add_pd(v); }
static inline double x32_sum_epi32(__m512i v) {
  return (double)(uint64_t)_mm512_reduce_add_epi64(_mm512_add_epi64(
      _mm512_cvtepu32_epi64(_mm512_castsi512_si256(v)),
      _mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64(v, 1))));
}

/* The tallies added into row (mpext/telemetry.h's columns). */
static inline void x32_tally_add(const x32_tally* t, double* restrict row) {
  row[MP_STS_CHANGED] += x32_sum_epi32(t->ch);
  row[MP_STS_UNMOVED] += x32_sum_epi32(t->un);
  row[MP_STS_SUBHALF] += x32_sum_epi32(t->sh);
  row[MP_STS_M_ERR] += x32_sum_pd(t->me);
  row[MP_STS_M_ABS] += x32_sum_pd(t->ma);
  row[MP_STS_V_ERR] += x32_sum_pd(t->ve);
  row[MP_STS_V_ABS] += x32_sum_pd(t->va);
}

/* mp_adam_ema past its first step with ema_weight < 0.5 (mp_adam_usual), on the 32 fp32 ema
 * values at e (elements in order) for the new values xe (even elements) and xo (odd): the pair
 * split by element parity, lerped, and put back in order. */
static inline void x32_ema(float* restrict e, __m512 xe, __m512 xo, __m512 w) {
  __m512i ee, eo, a, b;
  x32_split(_mm512_loadu_si512(e), _mm512_loadu_si512(e + 16), &ee, &eo);
  const __m512 le = _mm512_add_ps(_mm512_castsi512_ps(ee),
                                  _mm512_mul_ps(w, _mm512_sub_ps(xe, _mm512_castsi512_ps(ee))));
  const __m512 lo = _mm512_add_ps(_mm512_castsi512_ps(eo),
                                  _mm512_mul_ps(w, _mm512_sub_ps(xo, _mm512_castsi512_ps(eo))));
  x32_join(_mm512_castps_si512(le), _mm512_castps_si512(lo), &a, &b);
  _mm512_storeu_si512(e, a);
  _mm512_storeu_si512(e + 16, b);
}

/* The new fp32 param, m and v of 32 elements (even e, odd o): NaN anywhere? One unordered
 * compare tests two vectors. */
static inline int x32_nan(__m512 pe, __m512 me, __m512 ve, __m512 po, __m512 mo, __m512 vo) {
  return (_mm512_cmp_ps_mask(pe, me, _CMP_UNORD_Q) | _mm512_cmp_ps_mask(ve, po, _CMP_UNORD_Q) |
          _mm512_cmp_ps_mask(mo, vo, _CMP_UNORD_Q)) != 0;
}

/* Steps elements [i, n) of a row in 32-element blocks from i on, and returns the index where it
 * stopped: n rounded down to a block, or the first block whose results hold a NaN (nothing of
 * that block is written). param, grad, m, v: bf16; remainder: int16 (NULL for stochastic
 * rounding of the param); ema: fp32 (NULL for none); lo0: the position of element 0 in its
 * param (its low half), hi the high half; nearest: the moments rounded to nearest even;
 * write_grad: the unscaled grad stored back (to nearest even). */
static inline __attribute__((always_inline)) uint32_t x32_adam_bf16(
    uint16_t* restrict param, uint16_t* restrict grad, int16_t* restrict remainder,
    uint16_t* restrict m, uint16_t* restrict v, float* restrict ema, uint32_t i, uint32_t n,
    uint32_t lo0, uint32_t hi, const mp_fused_scalars* s, const int nearest,
    const int write_grad, double* restrict row) {
  const __m512 ema_w = _mm512_set1_ps(s->st.ema_weight);
  const x32_scalars c = x32_scalars_of(s);
  x32_tally t = x32_tally_zero();
  const __m512i km = x32_key(s->st.key_moments, hi), kp = x32_key(s->st.key_param, hi);
  /* the positions of the even elements of a block at lo0 + i: lo0 + i + 2j */
  const __m512i ramp = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28,
                                         30);
  const __m512i one = _mm512_set1_epi32(1);
  __m512i lo_e = _mm512_add_epi32(_mm512_set1_epi32((int)(lo0 + i)), ramp);
  for (; i + 32 <= n; i += 32, lo_e = _mm512_add_epi32(lo_e, _mm512_set1_epi32(32))) {
    /* a kilobyte ahead on every array: measurably faster on Intel's server cores
     * (docs/fast_paths.md) */
    x32_prefetch(param + i);
    x32_prefetch(grad + i);
    x32_prefetch(m + i);
    x32_prefetch(v + i);
    if (ema != NULL) { /* a kilobyte ahead of both its lines */
      x32_prefetch(ema + i);
      x32_prefetch(ema + i + 16);
    }
    if (remainder != NULL) x32_prefetch(remainder + i);
    const __m512i pw = _mm512_loadu_si512(param + i), gw = _mm512_loadu_si512(grad + i);
    const __m512i mw = _mm512_loadu_si512(m + i), vw = _mm512_loadu_si512(v + i);
    __m512i pe = x32_even(pw), po = x32_odd(pw);
    __m512i rw = _mm512_setzero_si512();
    if (remainder != NULL) { /* the fp32 master: the bf16 word above its signed remainder */
      rw = _mm512_loadu_si512(remainder + i);
      pe = _mm512_add_epi32(pe, _mm512_srai_epi32(_mm512_slli_epi32(rw, 16), 16));
      po = _mm512_add_epi32(po, _mm512_srai_epi32(rw, 16));
    }
    __m512 me = _mm512_castsi512_ps(x32_even(mw)), mo = _mm512_castsi512_ps(x32_odd(mw));
    __m512 ve = _mm512_castsi512_ps(x32_even(vw)), vo = _mm512_castsi512_ps(x32_odd(vw));
    __m512 ge = _mm512_castsi512_ps(x32_even(gw)), go = _mm512_castsi512_ps(x32_odd(gw));
    const __m512 xe = x32_element(&ge, _mm512_castsi512_ps(pe), &me, &ve, &c);
    const __m512 xo = x32_element(&go, _mm512_castsi512_ps(po), &mo, &vo, &c);
    /* a NaN grad makes the param NaN too */
    if (x32_nan(xe, me, ve, xo, mo, vo)) break;
    if (write_grad) {
      _mm512_storeu_si512(grad + i, x32_pack_hi(x32_rne_hi(_mm512_castps_si512(ge)),
                                                x32_rne_hi(_mm512_castps_si512(go))));
    }
    const __m512i lo_o = _mm512_add_epi32(lo_e, one);
    __m512i me16, mo16, ve16, vo16;
    if (nearest) {
      me16 = x32_rne_hi(_mm512_castps_si512(me));
      mo16 = x32_rne_hi(_mm512_castps_si512(mo));
      ve16 = x32_rne_hi(_mm512_castps_si512(ve));
      vo16 = x32_rne_hi(_mm512_castps_si512(vo));
    } else { /* one draw per element: m takes its low 16 bits, v its high 16 */
      const __m512i re = x32_bits(lo_e, km), ro = x32_bits(lo_o, km);
      me16 = x32_sr_hi(_mm512_castps_si512(me), _mm512_and_si512(re, X32_LO));
      mo16 = x32_sr_hi(_mm512_castps_si512(mo), _mm512_and_si512(ro, X32_LO));
      ve16 = x32_sr_hi(_mm512_castps_si512(ve), x32_shr16(re));
      vo16 = x32_sr_hi(_mm512_castps_si512(vo), x32_shr16(ro));
    }
    _mm512_storeu_si512(m + i, x32_pack_hi(me16, mo16));
    _mm512_storeu_si512(v + i, x32_pack_hi(ve16, vo16));
    if (row != NULL) { /* counting: the moments as stored against their fp32 values */
      x32_count_bf16(&t.fme, &t.fma, me, me16);
      x32_count_bf16(&t.fme, &t.fma, mo, mo16);
      x32_count_bf16(&t.fve, &t.fva, ve, ve16);
      x32_count_bf16(&t.fve, &t.fva, vo, vo16);
      if (++t.run == MP_STS_RUN / 2) x32_flush_bf16(&t); /* 2 terms a lane per iteration */
    }
    if (remainder != NULL) { /* round the master to nearest; the remainder is what is left */
      const __m512i ue = x32_master_bits(_mm512_castps_si512(xe));
      const __m512i uo = x32_master_bits(_mm512_castps_si512(xo));
      if (ema != NULL) x32_ema(ema + i, _mm512_castsi512_ps(ue), _mm512_castsi512_ps(uo), ema_w);
      const __m512i qe = x32_rne_hi(ue), qo = x32_rne_hi(uo);
      _mm512_storeu_si512(param + i, x32_pack_hi(qe, qo));
      /* u - round(u) has u's low half, the rounding's low half being zero */
      _mm512_storeu_si512(remainder + i, x32_pack_lo(ue, uo));
      if (row != NULL) { /* counting: the master as stored against the old one */
        x32_count_param(&t, _mm512_castsi512_ps(ue), _mm512_castsi512_ps(pe), qe, x32_even(pw), 0);
        x32_count_param(&t, _mm512_castsi512_ps(uo), _mm512_castsi512_ps(po), qo, x32_odd(pw), 0);
      }
    } else {
      if (ema != NULL) x32_ema(ema + i, xe, xo, ema_w);
      x32_store_sr_param(param + i, xe, xo, lo_e, lo_o, kp, pe, po, row != NULL ? &t : NULL);
    }
  }
  if (row != NULL) {
    x32_flush_bf16(&t);
    x32_tally_add(&t, row);
  }
  return i;
}

#endif /* AVX-512 F, BW, DQ */
#endif /* MPEXT_CORE_ADAM_BF16X32_H */
