/* Internal to the C core: the storage formats of the optimizer engine (step.c) over tiles, one
 * codec per format (the moment formats are the rows of mpext/formats/formats.h), each a decode
 * to fp32 and an encode from fp32 over one tile of elements (at most MP_TILE, or one block of
 * 8-bit moments). The per-element arithmetic is that of numerics.h, mpext/step_storage.h and
 * mpext/formats/ (the functions the CUDA kernels call), so a codec only loads, converts and
 * stores; it never changes a bit of what they compute.
 *
 * A decode returns the fp32 array the rule is to work on: the storage itself where a format is
 * already fp32 (an fp32 param, master, grad written back or moment: no copy), else the tile
 * buffer it filled. An encode reads that array back. Every loop is a straight, branch-free loop
 * over restrict arrays that vectorizes (the tiles never overlap their storage: mp_step's
 * contract); the choices (dtype, rounding) are made once per tile, outside the loops, so that
 * each codec is a handful of loop bodies and the engine's count of them is a sum over codecs.
 *
 * Random bits: a codec that rounds stochastically draws at the element's position (hi, lo + i),
 * hi the high 32 bits shared by the whole tile (the engine splits ranges by mp_sr_piece). */
#ifndef MPEXT_CORE_FORMATS_H
#define MPEXT_CORE_FORMATS_H

#include <stdint.h>
#include <string.h>

#include "half.h"
#include "mpext/step_storage.h"
#include "mpext/mpext.h"
#include "mpext/numerics.h"

/* Elements per tile: its fp32 buffers (grad, param, two moments, random bits: 10 KiB) stay in
 * L1 between the stages. (-DMP_TILE=N for experiments: 128 to 2048 measured no better.) */
#ifndef MP_TILE
#define MP_TILE 512
#endif

/* Always inlined into a caller whose dtype and rounding arguments are constants. */
#define MP_FMT_INLINE static inline __attribute__((always_inline))

MP_FMT_INLINE float mp_fmt_f32(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

MP_FMT_INLINE uint32_t mp_fmt_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

/* ---- fp32 / bf16 / fp16 elements: exact widening, round-to-nearest-even narrowing ---- */

MP_FMT_INLINE float mp_fmt_load(const void* p, uint32_t i, mp_dtype t) {
  if (t == MP_F32) return ((const float*)p)[i];
  const uint16_t h = ((const uint16_t*)p)[i];
  return mp_fmt_f32(t == MP_BF16 ? mp_bf16_to_f32_bits(h) : mp_fp16_to_f32_bits(h));
}

MP_FMT_INLINE void mp_fmt_store_rne(void* p, uint32_t i, mp_dtype t, float f) {
  const uint32_t u = mp_fmt_bits(f);
  if (t == MP_F32) {
    ((float*)p)[i] = f;
  } else {
    ((uint16_t*)p)[i] = t == MP_BF16 ? mp_bf16_rne_bits(u) : mp_fp16_rne_bits(u);
  }
}

/* x[i] = the value of src[i] (bf16 or fp16), exactly. */
MP_FMT_INLINE void mp_fmt_widen_(float* restrict x, const uint16_t* restrict src, uint32_t n,
                                 mp_dtype t) {
#pragma GCC ivdep
  for (uint32_t i = 0; i < n; ++i) x[i] = mp_fmt_load(src, i, t);
}

/* fp16 goes through half.h's blocks (F16C where the build has it): its integer widening and
 * narrowing cost an Adam step on fp16 params about as much as the update itself. */
static inline void mp_fmt_widen(float* restrict x, const uint16_t* restrict src, uint32_t n,
                                mp_dtype t) {
  if (t == MP_BF16) {
    mp_fmt_widen_(x, src, n, MP_BF16);
  } else {
    mp_f16_to_f32_n(src, x, n);
  }
}

/* ---- the gradient: fp32, bf16 or fp16; decoded with the unscale, optionally written back ---- */

MP_FMT_INLINE void mp_grad_tile_(float* restrict g, void* restrict grad, uint32_t n,
                                 const mp_step_scalars* restrict s, mp_dtype t, int write_back) {
  const float inv = s->inv_scale;
  mp_step_scalars u; /* only inv_scale is read: a constant of the loop */
  u.inv_scale = inv;
#pragma GCC ivdep
  for (uint32_t i = 0; i < n; ++i) {
    const float x = mp_step_unscaled(mp_fmt_load(grad, i, t), &u);
    g[i] = x;
    if (write_back) mp_fmt_store_rne(grad, i, t, x);
  }
}

/* g[i] = mp_step_unscaled(g[i]), in place. */
static inline void mp_grad_unscale(float* restrict g, uint32_t n, const mp_step_scalars* s) {
  mp_step_scalars u; /* only inv_scale is read: a constant of the loop */
  u.inv_scale = s->inv_scale;
#pragma GCC ivdep
  for (uint32_t i = 0; i < n; ++i) g[i] = mp_step_unscaled(g[i], &u);
}

/* The unscaled gradients of a tile (mp_step_unscaled), written back into grad (rounded to its
 * dtype) when s->write_grad. Returns the array: gbuf, or an fp32 grad itself when written back. */
static inline float* mp_grad_decode(float* restrict gbuf, void* restrict grad, mp_dtype t,
                                    uint32_t n, const mp_step_scalars* restrict s) {
  const int wb = s->write_grad != 0;
  if (t == MP_F32 && wb) {
    mp_grad_unscale((float*)grad, n, s);
    return (float*)grad;
  }
  if (t == MP_F16) { /* widened, unscaled and narrowed back by half.h's blocks */
    mp_f16_to_f32_n((const uint16_t*)grad, gbuf, n);
    mp_grad_unscale(gbuf, n, s);
    if (wb) mp_f32_to_f16_n(gbuf, (uint16_t*)grad, n);
    return gbuf;
  }
  switch ((int)t * 2 + wb) {
    case MP_F32 * 2: mp_grad_tile_(gbuf, grad, n, s, MP_F32, 0); break;
    case MP_BF16 * 2: mp_grad_tile_(gbuf, grad, n, s, MP_BF16, 0); break;
    default: mp_grad_tile_(gbuf, grad, n, s, MP_BF16, 1); break;
  }
  return gbuf;
}

/* ---- the param's fp32 value ----
 *   MP_PV_F32        an fp32 param: its own value, updated in place;
 *   MP_PV_MASTER     a bf16/fp16 param with an fp32 master: the master, updated in place; the
 *                    param written as its round to nearest even (a bf16 master after the tie
 *                    rule, mp_bf16_master_bits);
 *   MP_PV_REMAINDER  a bf16 param and its 16-bit remainder: joined, and split again after the
 *                    tie rule;
 *   MP_PV_NONE_RNE   a bf16/fp16 param alone, rounded to nearest even;
 *   MP_PV_NONE_SR    a bf16/fp16 param alone, rounded stochastically (the param's stream). */
enum {
  MP_PV_F32 = 0,
  MP_PV_MASTER = 1,
  MP_PV_REMAINDER = 2,
  MP_PV_NONE_RNE = 3,
  MP_PV_NONE_SR = 4
};

/* Where one tile of a param lives: pointers at the tile's first element. */
typedef struct mp_pv_tile {
  void* param;
  float* master;
  int16_t* remainder;
} mp_pv_tile;

/* The fp32 values of a tile: the fp32 param or master itself, or pbuf filled. */
static inline float* mp_pv_decode(int kind, mp_dtype pt, const mp_pv_tile* at,
                                  float* restrict pbuf, uint32_t n) {
  if (kind == MP_PV_F32) return (float*)at->param;
  if (kind == MP_PV_MASTER) return at->master;
  if (kind == MP_PV_REMAINDER) {
    const uint16_t* restrict q = (const uint16_t*)at->param;
    const int16_t* restrict r = at->remainder;
#pragma GCC ivdep
    for (uint32_t i = 0; i < n; ++i) pbuf[i] = mp_fmt_f32(mp_bf16_join(q[i], (uint16_t)r[i]));
    return pbuf;
  }
  mp_fmt_widen(pbuf, (const uint16_t*)at->param, n, pt);
  return pbuf;
}

MP_FMT_INLINE void mp_pv_master_bf16(uint16_t* restrict q, float* restrict p, uint32_t n) {
#pragma GCC ivdep
  for (uint32_t i = 0; i < n; ++i) {
    const uint32_t x = mp_bf16_master_bits(mp_fmt_bits(p[i]));
    q[i] = mp_bf16_rne_bits(x);
    p[i] = mp_fmt_f32(x);
  }
}

MP_FMT_INLINE void mp_pv_rne_bf16(uint16_t* restrict q, const float* restrict p, uint32_t n) {
#pragma GCC ivdep
  for (uint32_t i = 0; i < n; ++i) q[i] = mp_bf16_rne_bits(mp_fmt_bits(p[i]));
}

MP_FMT_INLINE void mp_pv_sr_(uint16_t* restrict q, const float* restrict p, uint32_t n,
                             mp_dtype pt, uint64_t key, uint32_t lo, uint32_t hi) {
#pragma GCC ivdep
  for (uint32_t i = 0; i < n; ++i) {
    const uint32_t r = mp_sr_bits_hl(key, lo + i, hi), u = mp_fmt_bits(p[i]);
    q[i] = pt == MP_BF16 ? mp_bf16_sr_bits(u, r) : mp_fp16_sr_bits(u, r);
  }
}

/* Stores the tile's new fp32 values p (what mp_pv_decode returned, updated) by the kind's
 * rounding. With a master or remainder, p becomes the master as stored (the ema's value).
 * key: the param's stream (MP_PV_NONE_SR); (hi, lo) the tile's first position. */
static inline void mp_pv_encode(int kind, mp_dtype pt, const mp_pv_tile* at, float* restrict p,
                                uint32_t n, uint64_t key, uint32_t lo, uint32_t hi) {
  uint16_t* restrict q = (uint16_t*)at->param;
  switch (kind * 4 + (pt == MP_BF16 ? 1 : 2)) {
    case MP_PV_MASTER * 4 + 1: mp_pv_master_bf16(q, p, n); break;
    case MP_PV_MASTER * 4 + 2: mp_f32_to_f16_n(p, q, n); break; /* stored as computed */
    case MP_PV_REMAINDER * 4 + 1: {
      int16_t* restrict r = at->remainder;
#pragma GCC ivdep
      for (uint32_t i = 0; i < n; ++i) {
        const uint32_t x = mp_bf16_master_bits(mp_fmt_bits(p[i]));
        const uint16_t qb = mp_bf16_rne_bits(x);
        q[i] = qb;
        r[i] = (int16_t)mp_bf16_remainder(x, qb);
        p[i] = mp_fmt_f32(x);
      }
      break;
    }
    case MP_PV_NONE_RNE * 4 + 1: mp_pv_rne_bf16(q, p, n); break;
    case MP_PV_NONE_RNE * 4 + 2: mp_f32_to_f16_n(p, q, n); break;
    case MP_PV_NONE_SR * 4 + 1: mp_pv_sr_(q, p, n, MP_BF16, key, lo, hi); break;
    case MP_PV_NONE_SR * 4 + 2: mp_pv_sr_(q, p, n, MP_F16, key, lo, hi); break;
    default: break; /* MP_PV_F32: updated in place */
  }
}

/* ---- moments: fp32 (in place) or bf16 (stochastic rounding, or to nearest) ---- */

/* The fp32 values of a tile of one moment (MP_F32 or MP_BF16): the storage, or buf filled. */
static inline float* mp_mom_decode(mp_dtype d, void* restrict m, float* restrict buf, uint32_t n) {
  if (d == MP_F32) return (float*)m;
  mp_fmt_widen(buf, (const uint16_t*)m, n, MP_BF16);
  return buf;
}

/* The random bits of a tile's bf16 moments, drawn once for both (the moments' stream): exp_avg
 * rounds with the low 16 bits, exp_avg_sq with the high 16. */
static inline void mp_mom_draw(uint32_t* restrict r, uint32_t n, uint64_t key, uint32_t lo,
                               uint32_t hi) {
#pragma GCC ivdep
  for (uint32_t i = 0; i < n; ++i) r[i] = mp_sr_bits_hl(key, lo + i, hi);
}

/* Stores a tile of one bf16 moment from x: stochastically with the bits r >> shift (shift 0 for
 * exp_avg, 16 for exp_avg_sq), or to nearest even (r unused). An fp32 moment needs nothing. */
static inline void mp_mom_encode_bf16(uint16_t* restrict dst, const float* restrict x, uint32_t n,
                                      const uint32_t* restrict r, uint32_t shift, int nearest) {
  if (nearest) {
#pragma GCC ivdep
    for (uint32_t i = 0; i < n; ++i) dst[i] = mp_bf16_rne_bits(mp_fmt_bits(x[i]));
  } else {
#pragma GCC ivdep
    for (uint32_t i = 0; i < n; ++i) dst[i] = mp_bf16_sr_bits(mp_fmt_bits(x[i]), r[i] >> shift);
  }
}

/* ---- 8-bit moments: the pair (int8 exp_avg, uint8 exp_avg_sq) of block codes and scales ----
 * (the codes: mpext/step.h, mpext/step_common.h's mp_q8_*). A tile is one block, or a part of one: the
 * block's references come from its scales before the step, and its new codes need the absmax
 * of all its new values, so the engine decodes and updates the block's parts into block-sized
 * buffers and encodes the block once. */

/* The references of a block whose scales (absmax before the step) are ms, vs. */
MP_FMT_INLINE float mp_q8_ref_m_of(float ms) { return mp_q8_ref(mp_q8_ref_exp_m(mp_fmt_bits(ms))); }
MP_FMT_INLINE float mp_q8_ref_v_of(float vs) { return mp_q8_ref(mp_q8_ref_exp_v(mp_fmt_bits(vs))); }

/* m[i], v[i] = the values of codes mc[i], vc[i] under the block references rm, rv, the second
 * raised to its floor (mp_step_q8_floor_v). */
static inline void mp_q8_decode_tile(const uint8_t* restrict mc, const uint8_t* restrict vc,
                                     float* restrict m, float* restrict v, uint32_t n, float rm,
                                     float rv, const mp_step_scalars* restrict s) {
  mp_step_scalars u; /* only q8_inv_k is read */
  u.q8_inv_k = s->q8_inv_k;
#pragma GCC ivdep
  for (uint32_t i = 0; i < n; ++i) {
    const float mi = mp_q8_decode_m(mc[i], rm);
    m[i] = mi;
    v[i] = mp_step_q8_floor_v(mi, mp_q8_decode_v(vc[i], rv), &u);
  }
}

MP_FMT_INLINE void mp_q8_codes_(uint8_t* restrict mc, uint8_t* restrict vc, const float* restrict m,
                                const float* restrict v, uint32_t n, uint32_t em, uint32_t ev,
                                uint64_t key, uint32_t lo, uint32_t hi, int nearest) {
#pragma GCC ivdep
  for (uint32_t i = 0; i < n; ++i) {
    const uint32_t r = nearest ? 0u : mp_sr_bits_hl(key, lo + i, hi);
    mc[i] = mp_q8_encode_m(m[i], em, r & 0xFFFFu, nearest);
    vc[i] = mp_q8_encode_v(v[i], ev, r >> 16, nearest);
  }
}

/* Encodes one whole block of n new values m, v: its absmax (as the max of the magnitudes'
 * bits) into *ms, *vs, its codes relative to the references of that absmax, rounded
 * stochastically (the 8-bit stream key at positions (hi, lo + i)) or to nearest. */
static inline void mp_q8_encode_block(uint8_t* restrict mc, uint8_t* restrict vc,
                                      const float* restrict m, const float* restrict v, uint32_t n,
                                      float* restrict ms, float* restrict vs, uint64_t key,
                                      uint32_t lo, uint32_t hi, int nearest) {
  uint32_t am = 0u, av = 0u;
  for (uint32_t i = 0; i < n; ++i) {
    const uint32_t ma = mp_fmt_bits(m[i]) & 0x7FFFFFFFu, va = mp_fmt_bits(v[i]) & 0x7FFFFFFFu;
    am = ma > am ? ma : am;
    av = va > av ? va : av;
  }
  const uint32_t em = mp_q8_ref_exp_m(am), ev = mp_q8_ref_exp_v(av);
  if (nearest) {
    mp_q8_codes_(mc, vc, m, v, n, em, ev, key, lo, hi, 1);
  } else {
    mp_q8_codes_(mc, vc, m, v, n, em, ev, key, lo, hi, 0);
  }
  *ms = mp_fmt_f32(am);
  *vs = mp_fmt_f32(av);
}

/* ---- one signed 8-bit moment alone (Lion's exp_avg, SGD's momentum buffer): the int8 codes
 * of exp_avg above, with one absmax per block; rounded with the low 16 bits of the same
 * stream as exp_avg of the pair. */

/* m[i] = the value of code mc[i] under the block reference rm. */
static inline void mp_q8_decode_tile_m(const uint8_t* restrict mc, float* restrict m, uint32_t n,
                                       float rm) {
#pragma GCC ivdep
  for (uint32_t i = 0; i < n; ++i) m[i] = mp_q8_decode_m(mc[i], rm);
}

MP_FMT_INLINE void mp_q8_codes_m_(uint8_t* restrict mc, const float* restrict m, uint32_t n,
                                  uint32_t em, uint64_t key, uint32_t lo, uint32_t hi,
                                  int nearest) {
#pragma GCC ivdep
  for (uint32_t i = 0; i < n; ++i) {
    const uint32_t r = nearest ? 0u : mp_sr_bits_hl(key, lo + i, hi);
    mc[i] = mp_q8_encode_m(m[i], em, r & 0xFFFFu, nearest);
  }
}

/* Encodes one whole block of n new values m as mp_q8_encode_block encodes exp_avg. */
static inline void mp_q8_encode_block_m(uint8_t* restrict mc, const float* restrict m, uint32_t n,
                                        float* restrict ms, uint64_t key, uint32_t lo,
                                        uint32_t hi, int nearest) {
  uint32_t am = 0u;
  for (uint32_t i = 0; i < n; ++i) {
    const uint32_t ma = mp_fmt_bits(m[i]) & 0x7FFFFFFFu;
    am = ma > am ? ma : am;
  }
  const uint32_t em = mp_q8_ref_exp_m(am);
  if (nearest) {
    mp_q8_codes_m_(mc, m, n, em, key, lo, hi, 1);
  } else {
    mp_q8_codes_m_(mc, m, n, em, key, lo, hi, 0);
  }
  *ms = mp_fmt_f32(am);
}

/* ---- software prefetch of a coming tile's storage ---- */

/* Asks for the cache lines of bytes [0, bytes) at p ahead of their use (a hint: nothing is
 * read, and the address is formed as an integer, so a span past an array's end is harmless).
 * The pipeline runs one stage at a time, so each stage's misses alone would be in flight; this
 * puts the next tile's on the way while the current one computes. */
MP_FMT_INLINE void mp_prefetch_span(const void* p, uint32_t bytes) {
  const uintptr_t a = (uintptr_t)p;
  for (uint32_t o = 0; o < bytes; o += 64u) __builtin_prefetch((const void*)(a + o), 1, 3);
}

/* ---- the ema of the fp32 value (an fp32 array, updated in place) ---- */

/* ema[i] moves towards x[i] (mp_step_ema). */
static inline void mp_ema_tile(float* restrict ema, const float* restrict x, uint32_t n,
                               const mp_step_scalars* restrict s) {
  const mp_step_scalars u = *s;
#pragma GCC ivdep
  for (uint32_t i = 0; i < n; ++i) ema[i] = mp_step_ema(ema[i], x[i], &u);
}

#endif /* MPEXT_CORE_FORMATS_H */
