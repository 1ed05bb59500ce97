/* Hand-fused Adam/AdamW loops: the fast paths, an optional cache over the step engine's tile
 * pipeline (csrc/core/step.c; this folder's README.md). One loop body per storage mode that
 * loads, updates and stores every array of an element at once. The engine's stages each run a
 * loop of their own, and on a CPU whose Adam loop waits on its divider (two divisions and a
 * square root per element) the fused loop hides the conversions, roundings and random draws
 * under that wait, where the pipeline adds them. A row is kept only where it measurably beat
 * the pipeline (docs/fast_paths.md has each row's measured gain and the CPU it came from).
 * Every row computes the same bits as the pipeline: tests/c/test_fast_paths.c compares the two on
 * every row and ISA path, and a build without this folder (MPEXT_FAST_PATHS=0) passes every
 * test. Compiled once per ISA path (see isa.h). Each row is built twice (mp_adam_usual). The
 * rows whose arrays are all 16-bit step 32 elements at a time by hand on AVX-512
 * (adam_bf16x32.h) and 16 on AVX2 (adam_bf16x16.h, which also steps BF16 params with FP32
 * moments, where GCC's own vectorisation of the C loop is slowest); the 8-bit rows with a bf16
 * param and grad step each block's 32-element chunks by hand on AVX-512, both sweeps
 * (adam_q8x32.h). */
#include <string.h>

#include "isa.h"
#include "adam_bf16x32.h"
#include "adam_bf16x16.h"
#include "adam_q8x32.h"
#include "formats/tiles.h"
#include "adam_fused.h"
#include "lion_fused.h"
#include "mpext/numerics.h"
#include "telemetry_step.h"

#ifndef MP_ISA_SUFFIX
#error "adam_fused.c must be compiled with -DMP_ISA_SUFFIX=scalar|avx2|avx512"
#endif

/* Where a param's fp32 value lives: formats.h's MP_PV_* kinds. */
enum {
  MK_F32 = MP_PV_F32,
  MK_MASTER = MP_PV_MASTER,
  MK_REMAINDER = MP_PV_REMAINDER,
  MK_NONE_RNE = MP_PV_NONE_RNE,
  MK_NONE_SR = MP_PV_NONE_SR
};

#define f32_of_bits mp_fmt_f32
#define bits_of_f32 mp_fmt_bits

static inline float load_as_f32(const void* p, int64_t i, mp_dtype t) {
  return mp_fmt_load(p, (uint32_t)i, t);
}

static inline void store_from_f32(void* p, int64_t i, mp_dtype t, float f) {
  mp_fmt_store_rne(p, (uint32_t)i, t, f);
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
 * start + n) must share the high 32 bits of their position (mp_k_step splits a range that
 * does not), so that the positions the random bits are drawn at are 32-bit arithmetic. The
 * arrays never overlap (mp_step's contract): ivdep spares the vectorized loop the runtime
 * alias checks GCC otherwise adds, and falls back from, once the loop is inlined. With 8-bit
 * moments (md == MP_I8) it is the first sweep over a block: the codes decoded, the new fp32
 * moments and the random bits of their rounding written to q's buffers. with_ema is a constant
 * too: a run-time test of the ema pointer inside the loop keeps it scalar. */
static inline __attribute__((always_inline)) void adam_loop(
    void* restrict param, const mp_dtype pt, void* restrict grad, const mp_dtype gt,
    float* restrict master, int16_t* restrict remainder, void* restrict m, const mp_dtype md,
    void* restrict v, const mp_dtype vd, float* restrict ema, int64_t start, uint32_t n,
    const mp_fused_scalars* restrict hp, const int mk, const int write_grad, const int near,
    const int with_ema, const int usual, q8_sweep* restrict q, double* restrict row) {
  mp_fused_scalars s = *hp;
  s.st.moments_nearest = near; /* the same value, as a constant: no choice left in the loop */
  if (usual) { /* the same values too (see mp_adam_usual), as constants */
    s.a.decoupled = 1;
    s.a.maximize = 0;
    s.a.lerp_from_start = 1;
    if (with_ema) {
      s.st.ema_copy = 0;
      s.st.ema_from_start = 1;
    }
  }
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
  /* counting (row: NULL, folded away, in the uncounted rows): the counters of the elements this
   * C loop steps, as telemetry_step.h's epilogue counts them, per element; the vector loops
   * count theirs in their own registers */
  const int free = mk == MK_NONE_RNE || mk == MK_NONE_SR;
  uint32_t n_ch = 0, n_un = 0, n_sh = 0;
  double s_me = 0.0, s_ma = 0.0, s_ve = 0.0, s_va = 0.0;
  uint32_t i = 0;
  while (i < n) {
    uint32_t stop = n;
#if defined(MP_BF16X32) || defined(MP_BF16X16)
    /* the rows adam_bf16x32.h (AVX-512) and adam_bf16x16.h (AVX2) step a block of elements at
     * a time: the loop below takes the tail and any block with a NaN */
    if (usual && pt == MP_BF16 && gt == MP_BF16 && md == MP_BF16 && vd == MP_BF16 &&
        (mk == MK_REMAINDER || mk == MK_NONE_SR)) {
#if defined(MP_BF16X32)
      const uint32_t w = 32u;
      i = x32_adam_bf16((uint16_t*)param, (uint16_t*)grad, remainder, (uint16_t*)m,
                        (uint16_t*)v, with_ema ? ema : NULL, i, n, pos_lo, pos_hi, &s, near,
                        write_grad, row);
#else
      const uint32_t w = 16u;
      i = x16_adam_bf16((uint16_t*)param, (uint16_t*)grad, remainder, (uint16_t*)m,
                        (uint16_t*)v, with_ema ? ema : NULL, i, n, pos_lo, pos_hi, &s, near,
                        write_grad, row);
#endif
      stop = n - i < w ? n : i + w;
    }
#endif
#if defined(MP_BF16X16)
    if (usual && pt == MP_BF16 && md == MP_F32 && vd == MP_F32 && mk != MK_F32) {
      i = x16_adam_f32m((uint16_t*)param, grad, gt == MP_F32, master, remainder, (float*)m,
                        (float*)v, with_ema ? ema : NULL, i, n, pos_lo, pos_hi, &s, mk,
                        write_grad, row);
      stop = n - i < X16_F32M_W ? n : i + X16_F32M_W;
    }
#endif
#pragma GCC ivdep
    for (; i < stop; ++i) {
      const uint32_t lo = pos_lo + i; /* the element's place in its param: pos_hi, lo */
      const float g = mp_step_unscaled(load_as_f32(grad, i, gt), &s.st);
      if (write_grad) store_from_f32(grad, i, gt, g);
      float p0;
      /* counting: the old 16-bit param */
      const uint16_t q0 = row != NULL && mk != MK_F32 ? ((const uint16_t*)param)[i] : 0u;
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
        vi = mp_step_q8_floor_v(mi, mp_q8_decode_v(((const uint8_t*)v)[i], rv), &s.st);
      } else {
        mi = load_as_f32(m, i, md);
        vi = load_as_f32(v, i, vd);
      }
      const float p = mp_adam_element(g, p0, &mi, &vi, &s.a);
      float xc = p; /* counting: the new fp32 value (the master as stored, where one is) */
      const uint32_t r_mv = sr_moments ? mp_sr_bits_hl(s.st.key_moments, lo, pos_hi) : 0u;
      if (q8) {
        mbuf[i] = mi;
        vbuf[i] = vi;
        /* drawn here rather than in q8_store: this loop has room for the generator's multiplies
         * (docs/fast_paths.md). Drawn, unused, with moments_nearest too, which is for
         * comparisons only. */
        rbuf[i] = mp_sr_bits_hl(s.st.key_q8, lo, pos_hi);
      } else if (md == MP_BF16) {
        const uint16_t h = mp_step_bf16_moment(mi, r_mv, &s.st);
        ((uint16_t*)m)[i] = h;
        if (row != NULL) {
          s_me += __builtin_fabs((double)f32_of_bits((uint32_t)h << 16) - (double)mi);
          s_ma += __builtin_fabs((double)mi);
        }
      } else {
        ((float*)m)[i] = mi;
      }
      if (!q8 && vd == MP_BF16) {
        const uint16_t h = mp_step_bf16_moment(vi, r_mv >> 16, &s.st);
        ((uint16_t*)v)[i] = h;
        if (row != NULL) {
          s_ve += __builtin_fabs((double)f32_of_bits((uint32_t)h << 16) - (double)vi);
          s_va += __builtin_fabs((double)vi);
        }
      } else if (!q8) {
        ((float*)v)[i] = vi;
      }
      if (with_ema && mk != MK_MASTER && mk != MK_REMAINDER) ema[i] = mp_step_ema(ema[i], p, &s.st);
      if (mk == MK_F32) {
        ((float*)param)[i] = p;
      } else if (mk == MK_MASTER || mk == MK_REMAINDER) {
        const uint32_t x = pt == MP_BF16 ? mp_bf16_master_bits(bits_of_f32(p)) : bits_of_f32(p);
        if (with_ema) ema[i] = mp_step_ema(ema[i], f32_of_bits(x), &s.st);
        const uint16_t qb = pt == MP_BF16 ? mp_bf16_rne_bits(x) : mp_fp16_rne_bits(x);
        ((uint16_t*)param)[i] = qb;
        if (mk == MK_MASTER) {
          master[i] = f32_of_bits(x);
        } else {
          remainder[i] = (int16_t)mp_bf16_remainder(x, qb);
        }
        xc = f32_of_bits(x);
      } else if (mk == MK_NONE_RNE) {
        store_from_f32(param, i, pt, p);
      } else {
        const uint32_t r = mp_sr_bits_hl(s.st.key_param, lo, pos_hi);
        ((uint16_t*)param)[i] = pt == MP_BF16 ? mp_bf16_sr_bits(bits_of_f32(p), r)
                                              : mp_fp16_sr_bits(bits_of_f32(p), r);
      }
      if (row != NULL && mk != MK_F32) { /* sts_param_'s tests, on this element */
        const uint32_t c = (uint32_t)(xc != p0);
        n_ch += c;
        n_un += c & (uint32_t)(((const uint16_t*)param)[i] == q0);
        /* half an ulp of a bf16 as x32_count_param takes it (2^(max(e, 1) - 135), a product
         * GCC vectorizes without the selects of sts_half_ulp's two cases; the same value) */
        const float half =
            pt == MP_BF16
                ? f32_of_bits(((uint32_t)q0 << 16 & 0x7F800000u) > 0x00800000u
                                  ? ((uint32_t)q0 << 16 & 0x7F800000u)
                                  : 0x00800000u) * 0x1p-8f
                : sts_half_ulp(q0, pt);
        if (free) n_sh += c & (uint32_t)(__builtin_fabsf(xc - p0) < half);
      }
    }
  }
  if (row != NULL) {
    row[MP_STS_CHANGED] += n_ch;
    row[MP_STS_UNMOVED] += n_un;
    row[MP_STS_SUBHALF] += n_sh;
    if (md == MP_BF16) {
      row[MP_STS_M_ERR] += s_me;
      row[MP_STS_M_ABS] += s_ma;
    }
    if (vd == MP_BF16) {
      row[MP_STS_V_ERR] += s_ve;
      row[MP_STS_V_ABS] += s_va;
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

/* Counting 8-bit moments (adam_q8 with a row): the scratch of the block epilogue's decode
 * (sts_q8_block_from, for the elements the vector sweeps leave), and the vector sweeps' error
 * sums (adam_q8x32.h). */
typedef struct q8_count_bufs {
  _Alignas(64) float tmp[MP_TILE];
#if defined(MP_Q8X32)
  x32_q8_count x;
#endif
} q8_count_bufs;

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
 * the block's scales. With row (the counted step, mp_step_stats; NULL, folded away, in the
 * uncounted rows) the sweeps count in their registers: the param's counters in the first, the
 * moments' (decoded under the block's new scale, against their fp32 values) in the second's
 * vector loop (adam_q8x32.h); the elements it leaves are counted from the buffers by
 * telemetry_step.h's block epilogue (sts_q8_block_from), which also counts the block. No
 * counted row has an ema. */
static inline __attribute__((always_inline)) void adam_q8(
    void* restrict param, const mp_dtype pt, void* restrict grad, const mp_dtype gt,
    float* restrict master, int16_t* restrict remainder, int8_t* restrict mc,
    uint8_t* restrict vc, float* restrict ms, float* restrict vs, float* restrict ema,
    int64_t start, int64_t n, const mp_fused_scalars* restrict hp, const int mk,
    const int write_grad, const int with_ema, const int usual, double* restrict row,
    q8_count_bufs* restrict cb) {
  const int64_t b = hp->st.q8_block;
  _Alignas(64) float mbuf[MP_Q8_BLOCK_MAX];
  _Alignas(64) float vbuf[MP_Q8_BLOCK_MAX];
  _Alignas(64) uint32_t rbuf[MP_Q8_BLOCK_MAX];
  const int pb = MP_DTYPE_BYTES(pt), gb = MP_DTYPE_BYTES(gt);
#if defined(MP_Q8X32)
  /* the rows adam_q8x32.h steps by hand: each block's whole 32-element chunks, where its
   * reference is finite */
  const int hand = usual && !with_ema && pt == MP_BF16 && gt == MP_BF16 &&
                   (mk == MK_MASTER || mk == MK_REMAINDER || mk == MK_NONE_SR) &&
                   !hp->st.moments_nearest;
  if (row != NULL) {
    cb->x.me = cb->x.ma = cb->x.ve = cb->x.va = _mm512_setzero_pd();
  }
#endif
  for (int64_t off = 0; off < n; off += b) {
    const int64_t len = n - off < b ? n - off : b;
    const int64_t k = (start + off) / b;
    const uint32_t em0 = mp_q8_ref_exp_m(bits_of_f32(ms[k]));
    const uint32_t ev0 = mp_q8_ref_exp_v(bits_of_f32(vs[k]));
    uint32_t h = 0u, am = 0u, av = 0u;
#if defined(MP_Q8X32)
    if (hand && em0 < 255u && ev0 < 255u) {
      const int64_t pos = start + off;
      h = x32_q8_sweep((uint16_t*)param + off, (uint16_t*)grad + off,
                       master != NULL ? master + off : NULL,
                       remainder != NULL ? remainder + off : NULL, (const uint8_t*)mc + off,
                       vc + off, (uint32_t)len, (uint32_t)pos, (uint32_t)((uint64_t)pos >> 32),
                       hp, em0, ev0, mbuf, vbuf, rbuf, &am, &av, mk, write_grad, row);
    }
#endif
    if (h < (uint64_t)len) { /* the rest of the block: the C loop */
      q8_sweep q = {mp_q8_ref(em0), mp_q8_ref(ev0), mbuf + h, vbuf + h, rbuf + h, 0u, 0u};
      adam_loop((char*)param + (off + h) * pb, pt, (char*)grad + (off + h) * gb, gt,
                master != NULL ? master + off + h : NULL,
                remainder != NULL ? remainder + off + h : NULL, mc + off + h, MP_I8,
                vc + off + h, MP_U8, with_ema ? ema + off + h : NULL, start + off + h,
                (uint32_t)(len - h), hp, mk, write_grad, 0, with_ema, usual, &q, row);
      am = q.am > am ? q.am : am;
      av = q.av > av ? q.av : av;
    }
    const uint32_t em = mp_q8_ref_exp_m(am), ev = mp_q8_ref_exp_v(av);
    int64_t from = 0;
    uint32_t flushed = 0u; /* counting: of the elements before from */
#if defined(MP_Q8X32)
    if (h > 0u) {
      if (em < 255u && ev < 255u) {
        if (row != NULL) {
          flushed = x32_q8_encode_counted(mc + off, vc + off, mbuf, vbuf, rbuf, h, em, ev, &cb->x);
        } else {
          x32_q8_encode(mc + off, vc + off, mbuf, vbuf, rbuf, h, em, ev);
        }
        from = h;
      } else {
        x32_q8_unsplit(mbuf, vbuf, rbuf, h);
      }
    }
#endif
    if (hp->st.moments_nearest) { /* a constant in each loop: only its rounding is computed */
      q8_store(mc + off + from, vc + off + from, mbuf + from, vbuf + from, rbuf + from,
               len - from, em, ev, 1);
    } else {
      q8_store(mc + off + from, vc + off + from, mbuf + from, vbuf + from, rbuf + from,
               len - from, em, ev, 0);
    }
    ms[k] = f32_of_bits(am);
    vs[k] = f32_of_bits(av);
    if (row != NULL) { /* the rest of the block's moment counters, and the block's */
      sts_q8_block_from((const uint8_t*)mc + off, vc + off, mbuf, vbuf, (uint32_t)len,
                        (uint32_t)from, flushed, ms[k], vs[k], 1, cb->tmp, row);
    }
  }
#if defined(MP_Q8X32)
  if (row != NULL) {
    row[MP_STS_M_ERR] += x32_sum_pd(cb->x.me);
    row[MP_STS_M_ABS] += x32_sum_pd(cb->x.ma);
    row[MP_STS_V_ERR] += x32_sum_pd(cb->x.ve);
    row[MP_STS_V_ABS] += x32_sum_pd(cb->x.va);
  }
#endif
}

/* The kept modes, one row each, named as docs/fast_paths.md names them: param dtype, grad
 * dtype, param storage, exp_avg and exp_avg_sq dtypes (MP_I8, MP_U8: the 8-bit pair),
 * write_grad, bf16 moments to nearest, ema. Why each is kept (its measured gain over the
 * pipeline) is in docs/fast_paths.md; a mode not listed runs the pipeline. */
#define MP_ADAM_FUSED_ROWS(X)                                                                      \
  X(fp32, MP_F32, MP_F32, MK_F32, MP_F32, MP_F32, 0, 0, 0)                                         \
  X(fp32_wb, MP_F32, MP_F32, MK_F32, MP_F32, MP_F32, 1, 0, 0)                                      \
  X(fp32_bf16m, MP_F32, MP_F32, MK_F32, MP_BF16, MP_BF16, 0, 0, 0)                                 \
  X(fp32_ema, MP_F32, MP_F32, MK_F32, MP_F32, MP_F32, 0, 0, 1)                                     \
  X(master, MP_BF16, MP_BF16, MK_MASTER, MP_F32, MP_F32, 0, 0, 0)                                  \
  X(master_wb, MP_BF16, MP_BF16, MK_MASTER, MP_F32, MP_F32, 1, 0, 0)                               \
  X(master_g32, MP_BF16, MP_F32, MK_MASTER, MP_F32, MP_F32, 0, 0, 0)                               \
  X(master_g32_wb, MP_BF16, MP_F32, MK_MASTER, MP_F32, MP_F32, 1, 0, 0)                            \
  X(master_bf16m, MP_BF16, MP_BF16, MK_MASTER, MP_BF16, MP_BF16, 0, 0, 0)                          \
  X(master_bf16m_wb, MP_BF16, MP_BF16, MK_MASTER, MP_BF16, MP_BF16, 1, 0, 0)                       \
  X(master_ema, MP_BF16, MP_BF16, MK_MASTER, MP_F32, MP_F32, 0, 0, 1)                              \
  X(remainder, MP_BF16, MP_BF16, MK_REMAINDER, MP_F32, MP_F32, 0, 0, 0)                            \
  X(remainder_wb, MP_BF16, MP_BF16, MK_REMAINDER, MP_F32, MP_F32, 1, 0, 0)                         \
  X(remainder_g32, MP_BF16, MP_F32, MK_REMAINDER, MP_F32, MP_F32, 0, 0, 0)                         \
  X(remainder_bf16m, MP_BF16, MP_BF16, MK_REMAINDER, MP_BF16, MP_BF16, 0, 0, 0)                    \
  X(bf16m_nearest, MP_BF16, MP_BF16, MK_REMAINDER, MP_BF16, MP_BF16, 0, 1, 0)                      \
  X(remainder_bf16m_g32, MP_BF16, MP_F32, MK_REMAINDER, MP_BF16, MP_BF16, 0, 0, 0)                 \
  X(remainder_bf16m_ema, MP_BF16, MP_BF16, MK_REMAINDER, MP_BF16, MP_BF16, 0, 0, 1)                \
  X(remainder_bf16m_wb, MP_BF16, MP_BF16, MK_REMAINDER, MP_BF16, MP_BF16, 1, 0, 0)                 \
  X(sr, MP_BF16, MP_BF16, MK_NONE_SR, MP_F32, MP_F32, 0, 0, 0)                                     \
  X(sr_wb, MP_BF16, MP_BF16, MK_NONE_SR, MP_F32, MP_F32, 1, 0, 0)                                  \
  X(sr_g32, MP_BF16, MP_F32, MK_NONE_SR, MP_F32, MP_F32, 0, 0, 0)                                  \
  X(sr_ema, MP_BF16, MP_BF16, MK_NONE_SR, MP_F32, MP_F32, 0, 0, 1)                                 \
  X(sr_bf16m, MP_BF16, MP_BF16, MK_NONE_SR, MP_BF16, MP_BF16, 0, 0, 0)                             \
  X(sr_bf16m_ema, MP_BF16, MP_BF16, MK_NONE_SR, MP_BF16, MP_BF16, 0, 0, 1)                         \
  X(sr_bf16m_wb, MP_BF16, MP_BF16, MK_NONE_SR, MP_BF16, MP_BF16, 1, 0, 0)                          \
  X(rne, MP_BF16, MP_BF16, MK_NONE_RNE, MP_F32, MP_F32, 0, 0, 0)                                   \
  X(rne_wb, MP_BF16, MP_BF16, MK_NONE_RNE, MP_F32, MP_F32, 1, 0, 0)                                \
  X(q8_remainder, MP_BF16, MP_BF16, MK_REMAINDER, MP_I8, MP_U8, 0, 0, 0)                           \
  X(q8_remainder_wb, MP_BF16, MP_BF16, MK_REMAINDER, MP_I8, MP_U8, 1, 0, 0)                        \
  X(q8_master, MP_BF16, MP_BF16, MK_MASTER, MP_I8, MP_U8, 0, 0, 0)                                 \
  X(q8_sr, MP_BF16, MP_BF16, MK_NONE_SR, MP_I8, MP_U8, 0, 0, 0)                                    \
  X(q8_sr_wb, MP_BF16, MP_BF16, MK_NONE_SR, MP_I8, MP_U8, 1, 0, 0)

/* 1 if a step's runtime choices are AdamW's usual ones (decoupled weight decay, not maximized,
 * beta1 > 0.5 and, for a row with an ema, past its first step with an ema_decay > 0.5). The
 * loop is built twice per row: once with these as constants, which leaves out the other side
 * of each choice and the masks that select it (on a core that issues 512-bit integer and blend
 * work on two ports only, that work is what the loop waits on), and once for any choice. A row
 * without an ema never reads the ema's fields (a group without one has ema_decay 0). */
static inline int mp_adam_usual(const mp_fused_scalars* s, int with_ema) {
  return s->a.decoupled && !s->a.maximize && s->a.lerp_from_start &&
         (!with_ema || (!s->st.ema_copy && s->st.ema_from_start));
}

/* One function per row over a piece (positions sharing their high 32 bits). */
#define MP_FUSED_LOOP(PT, GT, MK, MD, VD, WG, NEAR, EMA, USUAL)                           \
  if (MD == MP_I8) {                                                                      \
    adam_q8(param, PT, grad, GT, master, remainder, (int8_t*)m, (uint8_t*)v,             \
            t->exp_avg_scale, t->exp_avg_sq_scale, ema, start, n, s, MK, WG, EMA, USUAL,  \
            NULL, NULL);                                                                  \
  } else {                                                                                \
    adam_loop(param, PT, grad, GT, master, remainder, m, MD, v, VD, ema, start,           \
              (uint32_t)n, s, MK, WG, NEAR, EMA, USUAL, NULL, NULL);                      \
  }
#define MP_FUSED_FN(name, PT, GT, MK, MD, VD, WG, NEAR, EMA)                                \
  static void fused_##name(const mp_step_tensor* t, int64_t start, int64_t n,               \
                           const mp_fused_scalars* s) {                                     \
    void* param = (char*)t->param + start * MP_DTYPE_BYTES(PT);                             \
    void* grad = (char*)t->grad + start * MP_DTYPE_BYTES(GT);                               \
    float* master = t->master != NULL ? t->master + start : NULL;                           \
    int16_t* remainder = t->remainder != NULL ? t->remainder + start : NULL;                \
    void* m = (char*)t->exp_avg + start * MP_DTYPE_BYTES(MD);                               \
    void* v = (char*)t->exp_avg_sq + start * MP_DTYPE_BYTES(VD);                            \
    float* ema = t->ema != NULL ? t->ema + start : NULL;                                    \
    if (mp_adam_usual(s, EMA)) {                                                            \
      MP_FUSED_LOOP(PT, GT, MK, MD, VD, WG, NEAR, EMA, 1)                                   \
    } else {                                                                                \
      MP_FUSED_LOOP(PT, GT, MK, MD, VD, WG, NEAR, EMA, 0)                                   \
    }                                                                                       \
  }
MP_ADAM_FUSED_ROWS(MP_FUSED_FN)

typedef void (*fused_fn)(const mp_step_tensor*, int64_t, int64_t, const mp_fused_scalars*);

/* The rows selected by an index on their mode: param dtype (MP_F32, MP_BF16, MP_F16: the
 * values 0..2), grad dtype (the param's, or fp32: 0/1), param storage (MP_PV_*), moments
 * (fp32 pair, bf16 pair, 8-bit pair, or another mix: 0..3), write_grad, nearest, ema: one array
 * slot per mode, built at compile time from the rows, NULL where no row is kept. */
#define FUSED_MOMENTS(MD, VD)                          \
  ((MD) == MP_F32 && (VD) == MP_F32     ? 0            \
   : (MD) == MP_BF16 && (VD) == MP_BF16 ? 1            \
   : (MD) == MP_I8 && (VD) == MP_U8     ? 2            \
                                        : 3)
#define FUSED_INDEX(PT, G32, MK, MOM, WG, NEAR, EMA) \
  ((((((((PT) * 2 + (G32)) * 5 + (MK)) * 4 + (MOM)) * 2 + (WG)) * 2 + (NEAR)) * 2) + (EMA))
enum { FUSED_SLOTS = 3 * 2 * 5 * 4 * 2 * 2 * 2 };
#define MP_FUSED_SLOT(name, PT, GT, MK, MD, VD, WG, NEAR, EMA) \
  [FUSED_INDEX(PT, (GT) != (PT), MK, FUSED_MOMENTS(MD, VD), WG, NEAR, EMA)] = fused_##name,
static const fused_fn FUSED[FUSED_SLOTS] = {MP_ADAM_FUSED_ROWS(MP_FUSED_SLOT)};

int MP_ISA_FN(mp_k_fast_step)(const mp_step_tensor* t, int64_t start, int64_t n,
                              const mp_step_scalars* s, const mp_rule_scalars* r, int kind) {
  if (r->rule == MP_RULE_LION) { /* Lion's rows: lion_fused.c (declared in lion_fused.h) */
    return MP_ISA_FN(mp_k_lion_fast_step)(t, start, n, s, r, kind);
  }
  if (r->rule != MP_RULE_ADAM || t->offset != 0) return 0; /* the rows are Adam's, unsharded */
  const int32_t md = mp_format_dtype(t->exp_avg_format);
  const int32_t vd = mp_format_dtype(t->exp_avg_sq_format);
  /* the rounding of bf16 moments is a choice only where there are some (8-bit codes choose
   * theirs outside the loop) */
  const int32_t near = s->moments_nearest != 0 && (md == MP_BF16 || vd == MP_BF16);
  const int32_t wg = s->write_grad != 0, ema = t->ema != NULL;
  const fused_fn f = FUSED[FUSED_INDEX(t->param_dtype, t->grad_dtype != t->param_dtype, kind,
                                       FUSED_MOMENTS(md, vd), wg, near, ema)];
  if (f == NULL) return 0;
  const mp_fused_scalars fs = {*s, r->u.adam};
  f(t, start, n, &fs);
  return 1;
}

/* ---- the counted rows (mp_step_stats: telemetry.c takes them where a row is kept) ----
 * The same loops given a row (NULL, and folded away, in the uncounted rows above, whose machine
 * code this leaves as it was): each loop counts what the counted pipeline's epilogue
 * (telemetry_step.h) counts, in its own registers while the values are live -- vector lanes in
 * the SIMD loops, scalars in the C loop -- and adds its tallies into the row once per call. The
 * counts are the epilogue's exactly; the error sums add the same terms in another order
 * (docs/telemetry.md: within 2 (n + 1) 2^-53 of their size; tests/c/test_fast_paths.c).
 * Counted variants are built for the modes AdamW commonly runs, in its usual case only
 * (mp_adam_usual): a bf16 param with a master, a remainder or none, fp32, bf16 or 8-bit
 * moments, with and without the unscaled grad's write-back; no ema, no fp32 grad, no nearest
 * moments. Every other mode, and Adam's or a maximized step, counts through the pipeline: the
 * same counts (each counted variant is a whole copy of its loop, and the build compiles this
 * file once per ISA path, in three flag sets). The scalar path has none: its rows are GCC's
 * vectorization of the C loop at SSE2's width, for CPUs without AVX2, where the pipeline counts
 * at about the speed of a counted copy of them (the pipeline's own vectorized passes). */
#if defined(MP_BF16X32) || defined(MP_BF16X16)
#define MP_ADAM_COUNTED_ROWS(X)                                                           \
  X(master, MP_BF16, MP_BF16, MK_MASTER, MP_F32, MP_F32, 0)                               \
  X(master_wb, MP_BF16, MP_BF16, MK_MASTER, MP_F32, MP_F32, 1)                            \
  X(remainder, MP_BF16, MP_BF16, MK_REMAINDER, MP_F32, MP_F32, 0)                         \
  X(remainder_wb, MP_BF16, MP_BF16, MK_REMAINDER, MP_F32, MP_F32, 1)                      \
  X(remainder_bf16m, MP_BF16, MP_BF16, MK_REMAINDER, MP_BF16, MP_BF16, 0)                 \
  X(remainder_bf16m_wb, MP_BF16, MP_BF16, MK_REMAINDER, MP_BF16, MP_BF16, 1)              \
  X(sr, MP_BF16, MP_BF16, MK_NONE_SR, MP_F32, MP_F32, 0)                                  \
  X(sr_wb, MP_BF16, MP_BF16, MK_NONE_SR, MP_F32, MP_F32, 1)                               \
  X(sr_bf16m, MP_BF16, MP_BF16, MK_NONE_SR, MP_BF16, MP_BF16, 0)                          \
  X(sr_bf16m_wb, MP_BF16, MP_BF16, MK_NONE_SR, MP_BF16, MP_BF16, 1)                       \
  X(rne, MP_BF16, MP_BF16, MK_NONE_RNE, MP_F32, MP_F32, 0)                                \
  X(rne_wb, MP_BF16, MP_BF16, MK_NONE_RNE, MP_F32, MP_F32, 1)                             \
  X(q8_remainder, MP_BF16, MP_BF16, MK_REMAINDER, MP_I8, MP_U8, 0)                        \
  X(q8_remainder_wb, MP_BF16, MP_BF16, MK_REMAINDER, MP_I8, MP_U8, 1)                     \
  X(q8_master, MP_BF16, MP_BF16, MK_MASTER, MP_I8, MP_U8, 0)                              \
  X(q8_sr, MP_BF16, MP_BF16, MK_NONE_SR, MP_I8, MP_U8, 0)                                 \
  X(q8_sr_wb, MP_BF16, MP_BF16, MK_NONE_SR, MP_I8, MP_U8, 1)
#else
#define MP_ADAM_COUNTED_ROWS(X)
#endif

#define MP_FUSED_STATS_FN(name, PT, GT, MK, MD, VD, WG)                                      \
  static void fused_stats_##name(const mp_step_tensor* t, int64_t start, int64_t n,         \
                                 const mp_fused_scalars* s, double* row) {                  \
    void* param = (char*)t->param + start * MP_DTYPE_BYTES(PT);                             \
    void* grad = (char*)t->grad + start * MP_DTYPE_BYTES(GT);                               \
    float* master = t->master != NULL ? t->master + start : NULL;                           \
    int16_t* remainder = t->remainder != NULL ? t->remainder + start : NULL;                \
    void* m = (char*)t->exp_avg + start * MP_DTYPE_BYTES(MD);                               \
    void* v = (char*)t->exp_avg_sq + start * MP_DTYPE_BYTES(VD);                            \
    row[MP_STS_ELEMS] += (double)n;                                                         \
    if (MD == MP_I8) {                                                                      \
      _Alignas(64) q8_count_bufs cb;                                                        \
      adam_q8(param, PT, grad, GT, master, remainder, (int8_t*)m, (uint8_t*)v,             \
              t->exp_avg_scale, t->exp_avg_sq_scale, NULL, start, n, s, MK, WG, 0, 1, row,  \
              &cb);                                                                         \
    } else {                                                                                \
      adam_loop(param, PT, grad, GT, master, remainder, m, MD, v, VD, NULL, start,          \
                (uint32_t)n, s, MK, WG, 0, 0, 1, NULL, row);                                \
    }                                                                                       \
  }
MP_ADAM_COUNTED_ROWS(MP_FUSED_STATS_FN)

typedef void (*fused_stats_fn)(const mp_step_tensor*, int64_t, int64_t, const mp_fused_scalars*,
                               double*);
#define MP_FUSED_STATS_SLOT(name, PT, GT, MK, MD, VD, WG) \
  [FUSED_INDEX(PT, (GT) != (PT), MK, FUSED_MOMENTS(MD, VD), WG, 0, 0)] = fused_stats_##name,
/* (slot 0, an fp32 param with fp32 moments, never has a counted row: the designator keeps the
 * initializer non-empty where the list is) */
static const fused_stats_fn FUSED_STATS[FUSED_SLOTS] = {
    [0] = NULL, MP_ADAM_COUNTED_ROWS(MP_FUSED_STATS_SLOT)};

/* mp_k_fast_step with the step's counters added into row (telemetry.c's counted step takes it
 * first, as step.c takes mp_k_fast_step); 0, having done nothing, where no counted row is kept.
 * A mode whose row has nothing to count (an fp32 param with fp32 moments, no ema) runs its
 * uncounted row and counts its elements. */
int MP_ISA_FN(mp_k_fast_step_stats)(const mp_step_tensor* t, int64_t start, int64_t n,
                                    const mp_step_scalars* s, const mp_rule_scalars* r, int kind,
                                    double* row);
int MP_ISA_FN(mp_k_fast_step_stats)(const mp_step_tensor* t, int64_t start, int64_t n,
                                    const mp_step_scalars* s, const mp_rule_scalars* r, int kind,
                                    double* row) {
  if (r->rule != MP_RULE_ADAM || t->offset != 0) return 0;
  const int32_t md = mp_format_dtype(t->exp_avg_format);
  const int32_t vd = mp_format_dtype(t->exp_avg_sq_format);
  const int32_t near = s->moments_nearest != 0 && (md == MP_BF16 || vd == MP_BF16);
  const int32_t wg = s->write_grad != 0, ema = t->ema != NULL;
  const int32_t slot = FUSED_INDEX(t->param_dtype, t->grad_dtype != t->param_dtype, kind,
                                   FUSED_MOMENTS(md, vd), wg, near, ema);
  const mp_fused_scalars fs = {*s, r->u.adam};
  if (kind == MK_F32 && md == MP_F32 && vd == MP_F32 && !ema) {
    if (FUSED[slot] == NULL) return 0;
    FUSED[slot](t, start, n, &fs);
    row[MP_STS_ELEMS] += (double)n;
    return 1;
  }
  const fused_stats_fn f = FUSED_STATS[slot];
  if (f == NULL || !mp_adam_usual(&fs, 0)) return 0;
  f(t, start, n, &fs, row);
  return 1;
}
