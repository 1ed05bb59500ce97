/* Internal to the C core (adam_fused.c): the AVX-512 loops of the fused Adam rows with 8-bit
 * moments -- a bf16 param (with an fp32 master, a 16-bit remainder or stochastic rounding) and
 * a bf16 grad -- in AdamW's usual case (mp_adam_usual), 32 elements per iteration, in the
 * layout of adam_bf16x32.h (lane j of a vector holds element 2j in one vector and 2j + 1 in
 * the other: one shift or mask per 16-bit array, no shuffles).
 *
 * Why by hand: on AMD Zen 4 the 8-bit step is bound by its count of vector instructions (each
 * 512-bit op holds a 256-bit pipe for two cycles), and GCC's code for the C loops took about
 * 9 per element: 64 elements per iteration, so that it spills and rebroadcasts its constants,
 * the codes decoded with integer selects, a loop of its own for the block's absmax, and an
 * encode with a clamp, a bound and a double multiply that a finite block does not need. Here:
 *  - the decode of a code is its bits shifted under the block's exponent (the product with the
 *    power-of-two reference R, exact, as an integer add); a subnormal code (exponent field 0)
 *    is then 2x - 2^(E - T + 1 - 127), one masked fused multiply-subtract (exact: 2x is, and
 *    the difference lies within a factor of two of both operands);
 *  - the block's absmax is taken while the first sweep stores its values;
 *  - the encode of a block whose new reference is finite (every value finite, so none above the
 *    top code: no clamp) scales by one power of two where one fp32 holds it, takes the
 *    subnormal codes' 2^-16 units and the normal codes' rebiased bits into one vector by a
 *    masked conversion, adds the random bits once and shifts once; the sign goes in as bit 26
 *    before the shift, and the even and odd codes meet in one three-input logic op.
 * Every element gets the bits of the C loop (the same operations on the same values, or
 * provably exact ones giving the same result; tests/c/test_fast_paths.c compares the rows with the
 * engine's pipeline on every ISA path). A block whose reference is not finite, a 32-element
 * chunk whose new param holds a NaN and the tail of a block under 32 elements are left to the
 * C loop. The first sweep's buffers hold each 32-element chunk as its 16 even elements, then
 * its 16 odd ones; x32_q8_unsplit puts them back in element order for the C encode. */
#ifndef MPEXT_CORE_ADAM_Q8X32_H
#define MPEXT_CORE_ADAM_Q8X32_H

#include "adam_bf16x32.h"

#if defined(MP_BF16X32)
#include "formats/tiles.h"
#include "telemetry_sums.h"

#define MP_Q8X32 1

/* The decode of one moment's codes in a block of reference exponent e (< 255): a code's bits
 * at 19 plus b are its value's fp32 bits; c2 is 2^(e - t + 1 - 127), t the code's bias. */
typedef struct x32_q8_dec {
  __m512i b;
  __m512 c2;
} x32_q8_dec;

static inline x32_q8_dec x32_q8_dec_of(uint32_t e, uint32_t t) {
  const x32_q8_dec d = {_mm512_set1_epi32((int)((e - t) << 23)),
                        _mm512_castsi512_ps(_mm512_set1_epi32((int)((e - t + 1u) << 23)))};
  return d;
}

/* mp_q8_decode_m/v without the sign: the magnitude code at bits 19 and up of c19 (nothing
 * else set), sub the lanes whose code's exponent field is 0. */
static inline __m512 x32_q8_value(__m512i c19, __mmask16 sub, const x32_q8_dec* d) {
  const __m512 x = _mm512_castsi512_ps(_mm512_add_epi32(c19, d->b));
  return _mm512_mask_fmsub_ps(x, sub, _mm512_set1_ps(2.0f), d->c2);
}

/* Elements [0, n) (n a multiple of 32 from here on) of one block of 8-bit moments: the first
 * sweep of adam_fused.c's adam_loop (grad, param, codes decoded under the block's old
 * reference exponents em, ev (< 255), the update, the param stored), the new fp32 moments and
 * the 8-bit stream's random bits in mbuf, vbuf, rbuf (each 32-element chunk split: even
 * elements, then odd), and the maxima of the moments' magnitude bits folded into *am, *av
 * (exp_avg_sq's bits taken as they are: no value it stores is NaN, since a NaN moment makes the
 * param NaN, and none other has its sign set, the decode, the update and the floor giving +0
 * where they give a zero). Returns where
 * it stopped: n rounded down to 32, or the first chunk whose new param holds a NaN (nothing of
 * it written). mk: MP_PV_MASTER, MP_PV_REMAINDER or MP_PV_NONE_SR. */
static inline __attribute__((always_inline)) uint32_t x32_q8_sweep(
    uint16_t* restrict param, uint16_t* restrict grad, float* restrict master,
    int16_t* restrict remainder, const uint8_t* restrict mc, const uint8_t* restrict vc,
    uint32_t n, uint32_t lo0, uint32_t hi, const mp_fused_scalars* s, uint32_t em, uint32_t ev,
    float* restrict mbuf, float* restrict vbuf, uint32_t* restrict rbuf, uint32_t* am,
    uint32_t* av, const int mk, const int write_grad, double* restrict row) {
  const x32_scalars c = x32_scalars_of(s);
  const __m512 inv_k = _mm512_set1_ps(s->st.q8_inv_k);
  const x32_q8_dec dm = x32_q8_dec_of(em, 7u), dv = x32_q8_dec_of(ev, 15u);
  const __m512i kq = x32_key(s->st.key_q8, hi), kp = x32_key(s->st.key_param, hi);
  const __m512i ramp = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28,
                                         30);
  const __m512i mag_m = _mm512_set1_epi32(0x03F80000), mag_v = _mm512_set1_epi32(0x07F80000);
  const __m512i sign = _mm512_set1_epi32((int)0x80000000u), abs = _mm512_set1_epi32(0x7FFFFFFF);
  __m512i lo_e = _mm512_add_epi32(_mm512_set1_epi32((int)lo0), ramp);
  __m512i amx = _mm512_setzero_si512(), avx = _mm512_setzero_si512();
  x32_tally t = x32_tally_zero(); /* counting: the param's counts (x32_count_param) */
  uint32_t i = 0;
  for (; i + 32 <= n; i += 32, lo_e = _mm512_add_epi32(lo_e, _mm512_set1_epi32(32))) {
    x32_prefetch(param + i);
    x32_prefetch(grad + i);
    x32_prefetch(mc + i);
    x32_prefetch(vc + i);
    if (mk == MP_PV_REMAINDER) x32_prefetch(remainder + i);
    if (mk == MP_PV_MASTER) {
      x32_prefetch(master + i);
      x32_prefetch(master + i + 16);
    }
    const __m512i gw = _mm512_loadu_si512(grad + i);
    __m512 ge = _mm512_castsi512_ps(x32_even(gw)), go = _mm512_castsi512_ps(x32_odd(gw));
    __m512i pe, po;
    /* the old params, read for counting only where the loop has no other use for them */
    const __m512i pw = mk != MP_PV_MASTER || row != NULL ? _mm512_loadu_si512(param + i)
                                                         : _mm512_setzero_si512();
    if (mk == MP_PV_MASTER) {
      x32_split(_mm512_loadu_si512(master + i), _mm512_loadu_si512(master + i + 16), &pe, &po);
    } else {
      pe = x32_even(pw);
      po = x32_odd(pw);
      if (mk == MP_PV_REMAINDER) {
        const __m512i rw = _mm512_loadu_si512(remainder + i);
        pe = _mm512_add_epi32(pe, _mm512_srai_epi32(_mm512_slli_epi32(rw, 16), 16));
        po = _mm512_add_epi32(po, _mm512_srai_epi32(rw, 16));
      }
    }
    /* the codes of elements 2j and 2j + 1 in the low and high half of lane j */
    const __m512i mw = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(mc + i)));
    const __m512i vw = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i*)(vc + i)));
    __m512 me = x32_q8_value(_mm512_and_si512(_mm512_slli_epi32(mw, 19), mag_m),
                             _mm512_testn_epi32_mask(mw, _mm512_set1_epi32(0x70)), &dm);
    __m512 mo = x32_q8_value(_mm512_and_si512(_mm512_slli_epi32(mw, 3), mag_m),
                             _mm512_testn_epi32_mask(mw, _mm512_set1_epi32(0x700000)), &dm);
    me = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(
        _mm512_castps_si512(me), _mm512_slli_epi32(mw, 24), sign, X32_OR_AND));
    mo = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(
        _mm512_castps_si512(mo), _mm512_slli_epi32(mw, 8), sign, X32_OR_AND));
    __m512 ve = x32_q8_value(_mm512_slli_epi32(vw, 19),
                             _mm512_testn_epi32_mask(vw, _mm512_set1_epi32(0xF0)), &dv);
    __m512 vo = x32_q8_value(_mm512_and_si512(_mm512_slli_epi32(vw, 3), mag_v),
                             _mm512_testn_epi32_mask(vw, _mm512_set1_epi32(0xF00000)), &dv);
    /* mp_adam_q8_floor_v: w > v ? w : v, which is maxps(w, v) (v where either is NaN) */
    ve = _mm512_max_ps(_mm512_mul_ps(_mm512_mul_ps(me, me), inv_k), ve);
    vo = _mm512_max_ps(_mm512_mul_ps(_mm512_mul_ps(mo, mo), inv_k), vo);
    const __m512 xe = x32_element(&ge, _mm512_castsi512_ps(pe), &me, &ve, &c);
    const __m512 xo = x32_element(&go, _mm512_castsi512_ps(po), &mo, &vo, &c);
    /* a NaN anywhere makes the param NaN (its rounding has a rule of its own) */
    if (_mm512_cmp_ps_mask(xe, xo, _CMP_UNORD_Q) != 0) break;
    if (write_grad) {
      _mm512_storeu_si512(grad + i, x32_pack_hi(x32_rne_hi(_mm512_castps_si512(ge)),
                                                x32_rne_hi(_mm512_castps_si512(go))));
    }
    _mm512_store_ps(mbuf + i, me);
    _mm512_store_ps(mbuf + i + 16, mo);
    _mm512_store_ps(vbuf + i, ve);
    _mm512_store_ps(vbuf + i + 16, vo);
    amx = _mm512_max_epu32(amx, _mm512_and_si512(_mm512_castps_si512(me), abs));
    amx = _mm512_max_epu32(amx, _mm512_and_si512(_mm512_castps_si512(mo), abs));
    avx = _mm512_max_epu32(avx, _mm512_max_epu32(_mm512_castps_si512(ve), _mm512_castps_si512(vo)));
    const __m512i lo_o = _mm512_add_epi32(lo_e, _mm512_set1_epi32(1));
    _mm512_store_si512(rbuf + i, x32_bits(lo_e, kq));
    _mm512_store_si512(rbuf + i + 16, x32_bits(lo_o, kq));
    if (mk == MP_PV_NONE_SR) {
      x32_store_sr_param(param + i, xe, xo, lo_e, lo_o, kp, pe, po, row != NULL ? &t : NULL);
    } else {
      const __m512i ue = x32_master_bits(_mm512_castps_si512(xe));
      const __m512i uo = x32_master_bits(_mm512_castps_si512(xo));
      const __m512i qe = x32_rne_hi(ue), qo = x32_rne_hi(uo);
      _mm512_storeu_si512(param + i, x32_pack_hi(qe, qo));
      if (row != NULL) { /* counting: the master as stored against the old one */
        x32_count_param(&t, _mm512_castsi512_ps(ue), _mm512_castsi512_ps(pe), qe, x32_even(pw), 0);
        x32_count_param(&t, _mm512_castsi512_ps(uo), _mm512_castsi512_ps(po), qo, x32_odd(pw), 0);
      }
      if (mk == MP_PV_REMAINDER) {
        _mm512_storeu_si512(remainder + i, x32_pack_lo(ue, uo));
      } else {
        __m512i a, b;
        x32_join(ue, uo, &a, &b);
        _mm512_storeu_si512(master + i, a);
        _mm512_storeu_si512(master + i + 16, b);
      }
    }
  }
  if (row != NULL) x32_tally_add(&t, row);
  const uint32_t a = (uint32_t)_mm512_reduce_max_epu32(amx);
  const uint32_t b = (uint32_t)_mm512_reduce_max_epu32(avx);
  *am = a > *am ? a : *am;
  *av = b > *av ? b : *av;
  return i;
}

/* Codes of one moment of a 32-element chunk (split): the magnitudes' bits ae, ao (the signs
 * in neg_e, neg_o where with_sign), the 16 random bits of each at bit 3 (rn_e, rn_o), rebias
 * (mp_q8_encode's (ea - T) << 23) and the scale of the subnormal codes' units s1 (times s2
 * where two) = 2^(k + 3), k as mp_q8_encode's. Returns each element's code in the byte of its
 * place: 32 bytes in order, in the low halves of 16 dwords (for a vpmovdw). */
static inline __m512i x32_q8_codes(__m512i ae, __m512i ao, __m512i rn_e, __m512i rn_o,
                                   __mmask16 neg_e, __mmask16 neg_o, __m512i rebias, __m512 s1,
                                   __m512 s2, const int two, const int with_sign) {
  const __m512i one23 = _mm512_set1_epi32(1 << 23), bit26 = _mm512_set1_epi32(1 << 26);
  const __m512i de = _mm512_sub_epi32(ae, rebias), d_o = _mm512_sub_epi32(ao, rebias);
  /* below 2^(1 - T) R: a subnormal code, the value in units of 2^-19 code steps, truncated
   * (the C loop's units of 2^-16, truncated, give the same code once the random bits are
   * added and the sum shifted: the three bits below add less than one unit) */
  __m512 ye = _mm512_mul_ps(_mm512_castsi512_ps(ae), s1);
  __m512 yo = _mm512_mul_ps(_mm512_castsi512_ps(ao), s1);
  if (two) {
    ye = _mm512_mul_ps(ye, s2);
    yo = _mm512_mul_ps(yo, s2);
  }
  __m512i te = _mm512_mask_cvttps_epi32(de, _mm512_cmplt_epi32_mask(de, one23), ye);
  __m512i to = _mm512_mask_cvttps_epi32(d_o, _mm512_cmplt_epi32_mask(d_o, one23), yo);
  te = _mm512_add_epi32(te, rn_e);
  to = _mm512_add_epi32(to, rn_o);
  /* a code is below 2^7 for exp_avg: its sign, bit 7, at 26 before the shift */
  if (with_sign) {
    te = _mm512_mask_add_epi32(te, neg_e, te, bit26);
    to = _mm512_mask_add_epi32(to, neg_o, to, bit26);
  }
  /* the even code in byte 0 of its lane, the odd one in byte 1 */
  return _mm512_ternarylogic_epi32(_mm512_srli_epi32(te, 19), _mm512_srli_epi32(to, 11),
                                   _mm512_set1_epi32(0xFF00), 0xD8 /* C ? B : A */);
}

/* Counting the 8-bit moments in the second sweep (the counted rows; telemetry_step.h's
 * sts_q8_block counts the same things in the pipeline): the moments' error sums in double lanes
 * over a call, fed by fp32 runs (telemetry_sums.h). */
typedef struct x32_q8_count {
  __m512d me, ma, ve, va;
} x32_q8_count;

/* One moment's counting on the codes of a 32-element chunk: c the codes as x32_q8_codes
 * returns them (the even element's in bits 0-7 of its lane, the odd one's in bits 8-15), x the
 * values they code (even e, odd o), d the block's new decode. Each code decoded as x32_q8_sweep
 * decodes (to mp_q8_decode's value); |decoded - x| and |x| added to the runs *err, *mag; the
 * lanes whose value != 0 has a magnitude code 0 (flushed) counted in *fl. */
static inline __attribute__((always_inline)) void x32_q8_count_moment(
    __m512i c, __m512 xe, __m512 xo, const x32_q8_dec* d, __m512* err, __m512* mag,
    __m512i* fl, const int with_sign) {
  const __m512i mag_bits = _mm512_set1_epi32(with_sign ? 0x03F80000 : 0x07F80000);
  const __m512i zmag = _mm512_set1_epi32(with_sign ? 0x7F : 0xFF); /* the magnitude's bits */
  const __m512i sube = _mm512_set1_epi32(with_sign ? 0x70 : 0xF0); /* its exponent's */
  const __m512i abs = _mm512_set1_epi32(0x7FFFFFFF), m1 = _mm512_set1_epi32(-1);
  __m512 de = x32_q8_value(_mm512_and_si512(_mm512_slli_epi32(c, 19), mag_bits),
                           _mm512_testn_epi32_mask(c, sube), d);
  __m512 dodd = x32_q8_value(_mm512_and_si512(_mm512_slli_epi32(c, 11), mag_bits),
                             _mm512_testn_epi32_mask(c, _mm512_slli_epi32(sube, 8)), d);
  if (with_sign) {
    const __m512i sign = _mm512_set1_epi32((int)0x80000000u);
    de = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(
        _mm512_castps_si512(de), _mm512_slli_epi32(c, 24), sign, X32_OR_AND));
    dodd = _mm512_castsi512_ps(_mm512_ternarylogic_epi32(
        _mm512_castps_si512(dodd), _mm512_slli_epi32(c, 16), sign, X32_OR_AND));
  }
  *err = _mm512_add_ps(*err, _mm512_abs_ps(_mm512_sub_ps(de, xe)));
  *err = _mm512_add_ps(*err, _mm512_abs_ps(_mm512_sub_ps(dodd, xo)));
  *mag = _mm512_add_ps(*mag, _mm512_abs_ps(xe));
  *mag = _mm512_add_ps(*mag, _mm512_abs_ps(xo));
  /* flushed: a zero magnitude code under a value whose bits (less the sign) are not zero */
  const __mmask16 fe = _mm512_mask_test_epi32_mask(_mm512_testn_epi32_mask(c, zmag),
                                                   _mm512_castps_si512(xe), abs);
  const __mmask16 fo = _mm512_mask_test_epi32_mask(
      _mm512_testn_epi32_mask(c, _mm512_slli_epi32(zmag, 8)), _mm512_castps_si512(xo), abs);
  *fl = _mm512_mask_sub_epi32(*fl, fe, *fl, m1);
  *fl = _mm512_mask_sub_epi32(*fl, fo, *fl, m1);
}

/* The second sweep over elements [0, n) (n a multiple of 32) of a block whose new reference
 * exponents em, ev are below 255 (every value finite): their codes from x32_q8_sweep's split
 * buffers, with the random bits it drew (mp_q8_encode_m/v, stochastic). With cnt (the counted
 * rows; NULL, folded away, in the uncounted ones) the codes are counted while in registers:
 * the error sums added into cnt's double lanes, the flushed values returned (else 0). */
static inline __attribute__((always_inline)) uint32_t x32_q8_encode_(
    int8_t* restrict mc, uint8_t* restrict vc, const float* restrict mbuf,
    const float* restrict vbuf, const uint32_t* restrict rbuf, uint32_t n, uint32_t em,
    uint32_t ev, const int two, x32_q8_count* restrict cnt) {
  /* mp_q8_encode: k = 142 + T + mbits - ea, split in two factors where 2^(k + 3) is not an
   * fp32 (only for blocks whose values are all below about 2^-98 or above 2^90) */
  const int32_t km = 142 + 7 + 4 - (int32_t)em, kv = 142 + 15 + 4 - (int32_t)ev;
  const int32_t km1 = two ? ((km + 256) >> 1) - 128 : km + 3;
  const int32_t kv1 = two ? ((kv + 256) >> 1) - 128 : kv + 3;
  const __m512 sm1 = _mm512_castsi512_ps(_mm512_set1_epi32((km1 + 127) << 23));
  const __m512 sv1 = _mm512_castsi512_ps(_mm512_set1_epi32((kv1 + 127) << 23));
  const __m512 sm2 = _mm512_castsi512_ps(_mm512_set1_epi32((km - km1 + 3 + 127) << 23));
  const __m512 sv2 = _mm512_castsi512_ps(_mm512_set1_epi32((kv - kv1 + 3 + 127) << 23));
  const __m512i rbm = _mm512_set1_epi32((int)((em - 7u) << 23));
  const __m512i rbv = _mm512_set1_epi32((int)((ev - 15u) << 23));
  const __m512i abs = _mm512_set1_epi32(0x7FFFFFFF), low = _mm512_set1_epi32(0x7FFF8);
  /* counting: the decode under the new references, the fp32 runs (2 terms a lane per
   * iteration), the flushed values per lane */
  const x32_q8_dec dm = x32_q8_dec_of(em, 7u), dv = x32_q8_dec_of(ev, 15u);
  __m512 fme = _mm512_setzero_ps(), fma = fme, fve = fme, fva = fme;
  __m512i fl = _mm512_setzero_si512();
  uint32_t run = 0u;
  for (uint32_t i = 0; i < n; i += 32) {
    const __m512i ume = _mm512_load_si512(mbuf + i), umo = _mm512_load_si512(mbuf + i + 16);
    const __m512i re = _mm512_load_si512(rbuf + i), ro = _mm512_load_si512(rbuf + i + 16);
    /* exp_avg rounds with the low 16 random bits, exp_avg_sq with the high 16 */
    const __m512i m = x32_q8_codes(
        _mm512_and_si512(ume, abs), _mm512_and_si512(umo, abs),
        _mm512_and_si512(_mm512_slli_epi32(re, 3), low),
        _mm512_and_si512(_mm512_slli_epi32(ro, 3), low), _mm512_movepi32_mask(ume),
        _mm512_movepi32_mask(umo), rbm, sm1, sm2, two, 1);
    /* exp_avg_sq: no finite value has its sign set (x32_q8_sweep) */
    const __m512i v = x32_q8_codes(
        _mm512_load_si512(vbuf + i), _mm512_load_si512(vbuf + i + 16),
        _mm512_and_si512(_mm512_srli_epi32(re, 13), low),
        _mm512_and_si512(_mm512_srli_epi32(ro, 13), low), 0, 0, rbv, sv1, sv2, two, 0);
    _mm256_storeu_si256((__m256i*)(mc + i), _mm512_cvtepi32_epi16(m));
    _mm256_storeu_si256((__m256i*)(vc + i), _mm512_cvtepi32_epi16(v));
    if (cnt != NULL) {
      x32_q8_count_moment(m, _mm512_castsi512_ps(ume), _mm512_castsi512_ps(umo), &dm, &fme,
                          &fma, &fl, 1);
      x32_q8_count_moment(v, _mm512_load_ps(vbuf + i), _mm512_load_ps(vbuf + i + 16), &dv,
                          &fve, &fva, &fl, 0);
      if (++run == MP_STS_RUN / 2 || i + 32 >= n) { /* the runs into double */
        cnt->me = x32_add_pd(cnt->me, fme);
        cnt->ma = x32_add_pd(cnt->ma, fma);
        cnt->ve = x32_add_pd(cnt->ve, fve);
        cnt->va = x32_add_pd(cnt->va, fva);
        fme = fma = fve = fva = _mm512_setzero_ps();
        run = 0u;
      }
    }
  }
  return cnt != NULL ? (uint32_t)_mm512_reduce_add_epi32(fl) : 0u;
}

static inline void x32_q8_encode(int8_t* restrict mc, uint8_t* restrict vc,
                                 const float* restrict mbuf, const float* restrict vbuf,
                                 const uint32_t* restrict rbuf, uint32_t n, uint32_t em,
                                 uint32_t ev) {
  /* 2^(k + 3) an fp32 normal: k + 3 in [-126, 127] */
  if (em >= 29u && em <= 254u && ev >= 37u && ev <= 254u) {
    x32_q8_encode_(mc, vc, mbuf, vbuf, rbuf, n, em, ev, 0, NULL);
  } else {
    x32_q8_encode_(mc, vc, mbuf, vbuf, rbuf, n, em, ev, 1, NULL);
  }
}

/* x32_q8_encode counting as it goes (x32_q8_encode_ with cnt): returns the flushed values. */
static inline uint32_t x32_q8_encode_counted(int8_t* restrict mc, uint8_t* restrict vc,
                                             const float* restrict mbuf,
                                             const float* restrict vbuf,
                                             const uint32_t* restrict rbuf, uint32_t n,
                                             uint32_t em, uint32_t ev, x32_q8_count* cnt) {
  if (em >= 29u && em <= 254u && ev >= 37u && ev <= 254u) {
    return x32_q8_encode_(mc, vc, mbuf, vbuf, rbuf, n, em, ev, 0, cnt);
  }
  return x32_q8_encode_(mc, vc, mbuf, vbuf, rbuf, n, em, ev, 1, cnt);
}

/* The first n (a multiple of 32) elements of x32_q8_sweep's buffers back in element order. */
static inline void x32_q8_unsplit(float* restrict mbuf, float* restrict vbuf,
                                  uint32_t* restrict rbuf, uint32_t n) {
  for (uint32_t i = 0; i < n; i += 32) {
    uint32_t* const bufs[3] = {(uint32_t*)mbuf, (uint32_t*)vbuf, rbuf};
    for (int k = 0; k < 3; ++k) {
      __m512i a, b;
      x32_join(_mm512_load_si512(bufs[k] + i), _mm512_load_si512(bufs[k] + i + 16), &a, &b);
      _mm512_store_si512(bufs[k] + i, a);
      _mm512_store_si512(bufs[k] + i + 16, b);
    }
  }
}

#endif /* MP_BF16X32 */
#endif /* MPEXT_CORE_ADAM_Q8X32_H */
