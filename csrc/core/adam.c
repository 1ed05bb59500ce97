/* The fused Adam/AdamW step (mpext/adam.h) over one range of one param. Compiled once per ISA
 * path (see isa.h). The element update and the storage rules are mpext/adam_rule.h's, the ones
 * the CUDA kernels run; this file only loads, stores and instantiates. One loop body,
 * specialised by inlining for each combination of what the arrays hold (param and grad dtype,
 * where the master lives, the moments' dtypes, whether the gradient is written back), so that
 * every variant is a straight, vectorizable loop: bf16/fp16 loads and stores are the branch-free
 * bit conversions of numerics.h, the random bits of stochastic rounding are computed lane by lane
 * from the element's position, NaN/Inf follow IEEE arithmetic, and sqrtf vectorizes because the
 * core is built with -fno-math-errno. Adam/AdamW and maximize are selects inside the loop. */
#include <string.h>

#include "isa.h"
#include "mpext/adam_rule.h"
#include "mpext/numerics.h"

#ifndef MP_ISA_SUFFIX
#error "adam.c must be compiled with -DMP_ISA_SUFFIX=scalar|avx2|avx512"
#endif

/* Where a param's fp32 value lives. */
enum { MK_F32 = 0, MK_MASTER = 1, MK_REMAINDER = 2, MK_NONE_RNE = 3, MK_NONE_SR = 4 };

static inline float f32_of_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static inline uint32_t bits_of_f32(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

static inline float load_as_f32(const void* p, int64_t i, mp_dtype t) {
  uint32_t u;
  if (t == MP_F32) {
    memcpy(&u, (const float*)p + i, sizeof u);
  } else if (t == MP_BF16) {
    u = mp_bf16_to_f32_bits(((const uint16_t*)p)[i]);
  } else {
    u = mp_fp16_to_f32_bits(((const uint16_t*)p)[i]);
  }
  return f32_of_bits(u);
}

static inline void store_from_f32(void* p, int64_t i, mp_dtype t, float f) {
  const uint32_t u = bits_of_f32(f);
  if (t == MP_F32) {
    memcpy((float*)p + i, &u, sizeof u);
  } else if (t == MP_BF16) {
    ((uint16_t*)p)[i] = mp_bf16_rne_bits(u);
  } else {
    ((uint16_t*)p)[i] = mp_fp16_rne_bits(u);
  }
}

/* What the loop over one block of 8-bit moments needs beside the arrays: the block's
 * references (mp_q8_ref), the buffers its new fp32 moments and the random bits of their
 * rounding go to, and their absmax (as the max of their magnitudes' bits). */
typedef struct q8_sweep {
  float rm, rv;
  float* restrict mbuf;
  float* restrict vbuf;
  uint32_t* restrict rbuf;
  uint32_t am, av;
} q8_sweep;

/* The loop, always inlined into a caller with constant layout parameters. Elements [start,
 * start + n) must share the high 32 bits of their position (mp_k_adam_step splits a range that
 * does not), so that the positions the random bits are drawn at are 32-bit arithmetic. The
 * arrays never overlap (mp_adam_step's contract): ivdep spares the vectorized loop the runtime
 * alias checks GCC otherwise adds, and falls back from, once the loop is inlined. With 8-bit
 * moments (md == MP_I8) it is the first sweep over a block: the codes decoded, the new fp32
 * moments and the random bits of their rounding written to q's buffers. with_ema is a constant
 * too: a run-time test of the ema pointer inside the loop keeps it scalar. */
static inline __attribute__((always_inline)) void adam_loop(
    void* restrict param, const mp_dtype pt, void* restrict grad, const mp_dtype gt,
    float* restrict master, int16_t* restrict remainder, void* restrict m, const mp_dtype md,
    void* restrict v, const mp_dtype vd, float* restrict ema, int64_t start, uint32_t n,
    const mp_adam_scalars* restrict hp, const int mk, const int write_grad, const int near,
    const int with_ema, q8_sweep* restrict q) {
  mp_adam_scalars s = *hp;
  s.moments_nearest = near; /* the same value, as a constant: no choice left in the loop */
  const int sr_moments = (md == MP_BF16 || vd == MP_BF16) && !near;
  const int q8 = md == MP_I8;
  float rm = 0.0f, rv = 0.0f;
  float* restrict mbuf = NULL;
  float* restrict vbuf = NULL;
  uint32_t* restrict rbuf = NULL;
  if (q8) {
    rm = q->rm;
    rv = q->rv;
    mbuf = q->mbuf;
    vbuf = q->vbuf;
    rbuf = q->rbuf;
  }
  const uint32_t pos_lo = (uint32_t)start, pos_hi = (uint32_t)((uint64_t)start >> 32);
#pragma GCC ivdep
  for (uint32_t i = 0; i < n; ++i) {
    const uint32_t lo = pos_lo + i; /* the element's place in its param: pos_hi, lo */
    const float g = mp_adam_unscaled(load_as_f32(grad, i, gt), &s);
    if (write_grad) store_from_f32(grad, i, gt, g);
    float p0;
    if (mk == MK_MASTER) {
      p0 = master[i];
    } else if (mk == MK_REMAINDER) {
      p0 = f32_of_bits(mp_bf16_join(((const uint16_t*)param)[i], (uint16_t)remainder[i]));
    } else {
      p0 = load_as_f32(param, i, pt);
    }
    float mi, vi;
    if (q8) {
      mi = mp_q8_decode_m(((const uint8_t*)m)[i], rm);
      vi = mp_adam_q8_floor_v(mi, mp_q8_decode_v(((const uint8_t*)v)[i], rv), &s);
    } else {
      mi = load_as_f32(m, i, md);
      vi = load_as_f32(v, i, vd);
    }
    const float p = mp_adam_element(g, p0, &mi, &vi, &s);
    const uint32_t r_mv = sr_moments ? mp_sr_bits_hl(s.key_moments, lo, pos_hi) : 0u;
    if (q8) {
      mbuf[i] = mi;
      vbuf[i] = vi;
      /* drawn here rather than in q8_store: this loop has room for the generator's multiplies
       * (with a remainder, 10% off the step; with the param's own draw, 5%). Drawn, unused,
       * with moments_nearest too, which is for comparisons only. */
      rbuf[i] = mp_sr_bits_hl(s.key_q8, lo, pos_hi);
    } else if (md == MP_BF16) {
      ((uint16_t*)m)[i] = mp_adam_bf16_moment(mi, r_mv, &s);
    } else {
      ((float*)m)[i] = mi;
    }
    if (!q8 && vd == MP_BF16) {
      ((uint16_t*)v)[i] = mp_adam_bf16_moment(vi, r_mv >> 16, &s);
    } else if (!q8) {
      ((float*)v)[i] = vi;
    }
    if (with_ema && mk != MK_MASTER && mk != MK_REMAINDER) ema[i] = mp_adam_ema(ema[i], p, &s);
    if (mk == MK_F32) {
      ((float*)param)[i] = p;
    } else if (mk == MK_MASTER || mk == MK_REMAINDER) {
      const uint32_t x = pt == MP_BF16 ? mp_bf16_master_bits(bits_of_f32(p)) : bits_of_f32(p);
      if (with_ema) ema[i] = mp_adam_ema(ema[i], f32_of_bits(x), &s);
      const uint16_t qb = pt == MP_BF16 ? mp_bf16_rne_bits(x) : mp_fp16_rne_bits(x);
      ((uint16_t*)param)[i] = qb;
      if (mk == MK_MASTER) {
        master[i] = f32_of_bits(x);
      } else {
        remainder[i] = (int16_t)mp_bf16_remainder(x, qb);
      }
    } else if (mk == MK_NONE_RNE) {
      store_from_f32(param, i, pt, p);
    } else {
      const uint32_t r = mp_sr_bits_hl(s.key_param, lo, pos_hi);
      ((uint16_t*)param)[i] = pt == MP_BF16 ? mp_bf16_sr_bits(bits_of_f32(p), r)
                                            : mp_fp16_sr_bits(bits_of_f32(p), r);
    }
  }
  if (q8) {
    /* the block's absmax, from the buffers in L1: a loop of its own keeps the update's
     * registers free */
    uint32_t am = 0u, av = 0u;
    for (uint32_t i = 0; i < n; ++i) {
      const uint32_t ma = bits_of_f32(mbuf[i]) & 0x7FFFFFFFu;
      const uint32_t va = bits_of_f32(vbuf[i]) & 0x7FFFFFFFu;
      am = ma > am ? ma : am;
      av = va > av ? va : av;
    }
    q->am = am;
    q->av = av;
  }
}

/* The second sweep over a block of 8-bit moments: its new fp32 moments (still in L1) written as
 * codes relative to the block's new references, with the random bits the first sweep drew. */
static inline __attribute__((always_inline)) void q8_store(
    int8_t* restrict mc, uint8_t* restrict vc, const float* restrict mbuf,
    const float* restrict vbuf, const uint32_t* restrict rbuf, int64_t n, uint32_t em,
    uint32_t ev, int nearest) {
  for (int64_t i = 0; i < n; ++i) {
    const uint32_t r = nearest ? 0u : rbuf[i];
    mc[i] = (int8_t)mp_q8_encode_m(mbuf[i], em, r & 0xFFFFu, nearest);
    vc[i] = mp_q8_encode_v(vbuf[i], ev, r >> 16, nearest);
  }
}

/* 8-bit moments over elements [start, start + n) (start a multiple of the block size), block
 * by block: the first sweep updates everything and leaves the block's new fp32 moments and the
 * random bits of their rounding in buffers that stay in L1, the second writes their codes and
 * the block's scales. */
static inline __attribute__((always_inline)) void adam_q8(
    void* restrict param, const mp_dtype pt, void* restrict grad, const mp_dtype gt,
    float* restrict master, int16_t* restrict remainder, int8_t* restrict mc,
    uint8_t* restrict vc, float* restrict ms, float* restrict vs, float* restrict ema,
    int64_t start, int64_t n, const mp_adam_scalars* restrict hp, const int mk,
    const int write_grad, const int with_ema) {
  const int64_t b = hp->q8_block;
  _Alignas(64) float mbuf[MP_Q8_BLOCK_MAX];
  _Alignas(64) float vbuf[MP_Q8_BLOCK_MAX];
  _Alignas(64) uint32_t rbuf[MP_Q8_BLOCK_MAX];
  const int pb = MP_DTYPE_BYTES(pt), gb = MP_DTYPE_BYTES(gt);
  for (int64_t off = 0; off < n; off += b) {
    const int64_t len = n - off < b ? n - off : b;
    const int64_t k = (start + off) / b;
    q8_sweep q = {mp_q8_ref(mp_q8_ref_exp_m(bits_of_f32(ms[k]))),
                  mp_q8_ref(mp_q8_ref_exp_v(bits_of_f32(vs[k]))), mbuf, vbuf, rbuf, 0u, 0u};
    adam_loop((char*)param + off * pb, pt, (char*)grad + off * gb, gt,
              master != NULL ? master + off : NULL, remainder != NULL ? remainder + off : NULL,
              mc + off, MP_I8, vc + off, MP_U8, with_ema ? ema + off : NULL, start + off,
              (uint32_t)len, hp, mk, write_grad, 0, with_ema, &q);
    const uint32_t em = mp_q8_ref_exp_m(q.am), ev = mp_q8_ref_exp_v(q.av);
    if (hp->moments_nearest) { /* a constant in each loop: only its rounding is computed */
      q8_store(mc + off, vc + off, mbuf, vbuf, rbuf, len, em, ev, 1);
    } else {
      q8_store(mc + off, vc + off, mbuf, vbuf, rbuf, len, em, ev, 0);
    }
    ms[k] = f32_of_bits(q.am);
    vs[k] = f32_of_bits(q.av);
  }
}

/* The compile-time choices left once the arrays' types are fixed: the moments' dtypes, the
 * write-back of the gradient, with a bf16 moment how it is rounded (the per-element choice
 * between the two roundings costs the bf16-moment loops, which are bound by their instruction
 * count rather than by memory on a CPU with AVX-512, several percent), and the ema. */
#define MP_ADAM_MOMENTS(PT, GT, MK, EMA)                                                   \
  if (md == MP_I8) {                                                                     \
    if (hp->write_grad) {                                                                \
      MP_ADAM_Q8(PT, GT, MK, 1, EMA);                                                    \
    } else {                                                                             \
      MP_ADAM_Q8(PT, GT, MK, 0, EMA);                                                    \
    }                                                                                    \
    return;                                                                              \
  }                                                                                      \
  switch ((md == MP_BF16) << 3 | (vd == MP_BF16) << 2 |                                   \
          (hp->moments_nearest != 0 && (md == MP_BF16 || vd == MP_BF16)) << 1 |           \
          (hp->write_grad != 0)) {                                                        \
    case 0: MP_ADAM_CALL(PT, GT, MK, MP_F32, MP_F32, 0, 0, EMA); break;                   \
    case 1: MP_ADAM_CALL(PT, GT, MK, MP_F32, MP_F32, 1, 0, EMA); break;                   \
    case 4: MP_ADAM_CALL(PT, GT, MK, MP_F32, MP_BF16, 0, 0, EMA); break;                  \
    case 5: MP_ADAM_CALL(PT, GT, MK, MP_F32, MP_BF16, 1, 0, EMA); break;                  \
    case 6: MP_ADAM_CALL(PT, GT, MK, MP_F32, MP_BF16, 0, 1, EMA); break;                  \
    case 7: MP_ADAM_CALL(PT, GT, MK, MP_F32, MP_BF16, 1, 1, EMA); break;                  \
    case 8: MP_ADAM_CALL(PT, GT, MK, MP_BF16, MP_F32, 0, 0, EMA); break;                  \
    case 9: MP_ADAM_CALL(PT, GT, MK, MP_BF16, MP_F32, 1, 0, EMA); break;                  \
    case 10: MP_ADAM_CALL(PT, GT, MK, MP_BF16, MP_F32, 0, 1, EMA); break;                 \
    case 11: MP_ADAM_CALL(PT, GT, MK, MP_BF16, MP_F32, 1, 1, EMA); break;                 \
    case 12: MP_ADAM_CALL(PT, GT, MK, MP_BF16, MP_BF16, 0, 0, EMA); break;                \
    case 13: MP_ADAM_CALL(PT, GT, MK, MP_BF16, MP_BF16, 1, 0, EMA); break;                \
    case 14: MP_ADAM_CALL(PT, GT, MK, MP_BF16, MP_BF16, 0, 1, EMA); break;                \
    default: MP_ADAM_CALL(PT, GT, MK, MP_BF16, MP_BF16, 1, 1, EMA); break;                \
  }

#define MP_ADAM_CALL(PT, GT, MK, MD, VD, WG, NEAR, EMA)                                  \
  adam_loop(param, PT, grad, GT, master, remainder, m, MD, v, VD, ema, start, (uint32_t)n, \
            hp, MK, WG, NEAR, EMA, NULL)

#define MP_ADAM_Q8(PT, GT, MK, WG, EMA)                                                  \
  adam_q8(param, PT, grad, GT, master, remainder, (int8_t*)m, (uint8_t*)v, ms, vs, ema,   \
          start, n, hp, MK, WG, EMA)

/* One function per (param dtype, grad dtype, master kind): its loops, each twice (with and
 * without an ema). */
#define MP_ADAM_VARIANT(name, PT, GT, MK)                                                       \
  static void name(void* param, void* grad, float* master, int16_t* remainder, void* m,         \
                   mp_dtype md, void* v, mp_dtype vd, float* ms, float* vs, float* ema,         \
                   int64_t start, int64_t n, const mp_adam_scalars* hp) {                       \
    if (ema != NULL) {                                                                          \
      MP_ADAM_MOMENTS(PT, GT, MK, 1)                                                            \
    } else {                                                                                    \
      MP_ADAM_MOMENTS(PT, GT, MK, 0)                                                            \
    }                                                                                           \
  }

MP_ADAM_VARIANT(adam_f32, MP_F32, MP_F32, MK_F32)
MP_ADAM_VARIANT(adam_bf16_bf16_master, MP_BF16, MP_BF16, MK_MASTER)
MP_ADAM_VARIANT(adam_bf16_f32_master, MP_BF16, MP_F32, MK_MASTER)
MP_ADAM_VARIANT(adam_bf16_bf16_remainder, MP_BF16, MP_BF16, MK_REMAINDER)
MP_ADAM_VARIANT(adam_bf16_f32_remainder, MP_BF16, MP_F32, MK_REMAINDER)
MP_ADAM_VARIANT(adam_bf16_bf16_rne, MP_BF16, MP_BF16, MK_NONE_RNE)
MP_ADAM_VARIANT(adam_bf16_f32_rne, MP_BF16, MP_F32, MK_NONE_RNE)
MP_ADAM_VARIANT(adam_bf16_bf16_sr, MP_BF16, MP_BF16, MK_NONE_SR)
MP_ADAM_VARIANT(adam_bf16_f32_sr, MP_BF16, MP_F32, MK_NONE_SR)
MP_ADAM_VARIANT(adam_f16_f16_master, MP_F16, MP_F16, MK_MASTER)
MP_ADAM_VARIANT(adam_f16_f32_master, MP_F16, MP_F32, MK_MASTER)
MP_ADAM_VARIANT(adam_f16_f16_rne, MP_F16, MP_F16, MK_NONE_RNE)
MP_ADAM_VARIANT(adam_f16_f32_rne, MP_F16, MP_F32, MK_NONE_RNE)
MP_ADAM_VARIANT(adam_f16_f16_sr, MP_F16, MP_F16, MK_NONE_SR)
MP_ADAM_VARIANT(adam_f16_f32_sr, MP_F16, MP_F32, MK_NONE_SR)

typedef void (*adam_variant)(void*, void*, float*, int16_t*, void*, mp_dtype, void*, mp_dtype,
                             float*, float*, float*, int64_t, int64_t, const mp_adam_scalars*);

/* [param dtype][grad is fp32][master kind] */
static const adam_variant VARIANTS[3][2][5] = {
    {{adam_f32, 0, 0, 0, 0}, {adam_f32, 0, 0, 0, 0}},
    {{0, adam_bf16_bf16_master, adam_bf16_bf16_remainder, adam_bf16_bf16_rne, adam_bf16_bf16_sr},
     {0, adam_bf16_f32_master, adam_bf16_f32_remainder, adam_bf16_f32_rne, adam_bf16_f32_sr}},
    {{0, adam_f16_f16_master, 0, adam_f16_f16_rne, adam_f16_f16_sr},
     {0, adam_f16_f32_master, 0, adam_f16_f32_rne, adam_f16_f32_sr}},
};

void MP_ISA_FN(mp_k_adam_step)(const mp_adam_tensor* t, int64_t start, int64_t n,
                               const mp_adam_scalars* s) {
  const mp_dtype pt = (mp_dtype)t->param_dtype, gt = (mp_dtype)t->grad_dtype;
  const mp_dtype md = (mp_dtype)t->exp_avg_dtype, vd = (mp_dtype)t->exp_avg_sq_dtype;
  const int mk = pt == MP_F32                  ? MK_F32
                 : t->master != NULL           ? MK_MASTER
                 : t->remainder != NULL        ? MK_REMAINDER
                 : s->sr_params                ? MK_NONE_SR
                                               : MK_NONE_RNE;
  const adam_variant f = VARIANTS[pt][gt == MP_F32 && pt != MP_F32][mk];
  while (n > 0) { /* pieces whose positions share their high 32 bits (see adam_loop) */
    const int64_t k = mp_sr_piece((uint64_t)start, n);
    void* param = (char*)t->param + start * MP_DTYPE_BYTES(pt);
    void* grad = (char*)t->grad + start * MP_DTYPE_BYTES(gt);
    float* master = t->master != NULL ? t->master + start : NULL;
    int16_t* remainder = t->remainder != NULL ? t->remainder + start : NULL;
    void* m = (char*)t->exp_avg + start * MP_DTYPE_BYTES(md);
    void* v = (char*)t->exp_avg_sq + start * MP_DTYPE_BYTES(vd);
    float* ema = t->ema != NULL ? t->ema + start : NULL;
    f(param, grad, master, remainder, m, md, v, vd, t->exp_avg_scale, t->exp_avg_sq_scale, ema,
      start, k, s);
    start += k;
    n -= k;
  }
}
