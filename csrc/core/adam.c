/* The fused Adam/AdamW step (mpext/adam.h) over one range of one param: the CPU engine.
 * Compiled once per ISA path (see isa.h). The range is cut into tiles (formats.h, MP_TILE
 * elements, or one block of 8-bit moments), and each tile runs through a pipeline of small
 * loops, one per stage:
 *   grad decode (unscale, optional write-back) -> param value decode -> moments decode
 *   -> the rule over fp32 arrays -> moments encode -> param encode -> ema
 * Each stage is one codec of formats.h, chosen by a switch per tile; the rule is the varying
 * stage: adam_rule.h's mp_adam_element, lion_rule.h's or sgd_rule.h's element over the tile,
 * so that every rule takes every storage format without a loop body of its own per format. Where a storage format is fp32 (param, master,
 * moments, a grad written back) the rule works on the storage itself. The bits are those of the
 * per-element functions, in the same order, so every ISA path and the CUDA kernels agree. */
#include <string.h>

#include "formats.h"
#include "isa.h"
#include "mpext/adam_rule.h"
#include "mpext/lion_rule.h"
#include "mpext/sgd_rule.h"
#include "mpext/muon_rule.h"
#include "mpext/numerics.h"

#ifndef MP_ISA_SUFFIX
#error "adam.c must be compiled with -DMP_ISA_SUFFIX=scalar|avx2|avx512"
#endif

/* ---- the rules: each over a tile of fp32 arrays, the stage the pipeline varies ---- */

/* Adam/AdamW over a tile: unscaled gradients g, fp32 values p and moments m, v updated in place
 * (mp_adam_element). Adam/AdamW and maximize are loop invariants, unswitched by the compiler. */
static void adam_rule_tile(const float* restrict g, float* restrict p, float* restrict m,
                           float* restrict v, uint32_t n, const mp_adam_scalars* restrict hp) {
  const mp_adam_scalars s = *hp;
#pragma GCC ivdep
  for (uint32_t i = 0; i < n; ++i) {
    float mi = m[i], vi = v[i];
    p[i] = mp_adam_element(g[i], p[i], &mi, &vi, &s);
    m[i] = mi;
    v[i] = vi;
  }
}

/* Lion over a tile (mp_lion_element): p and the moment m updated in place. */
static void lion_rule_tile(const float* restrict g, float* restrict p, float* restrict m,
                           uint32_t n, const mp_lion_scalars* restrict hp) {
  const mp_lion_scalars s = *hp;
#pragma GCC ivdep
  for (uint32_t i = 0; i < n; ++i) {
    float mi = m[i];
    p[i] = mp_lion_element(g[i], p[i], &mi, &s);
    m[i] = mi;
  }
}

/* SGD over a tile (mp_sgd_element): p and, with a momentum, the buffer b updated in place. */
static void sgd_rule_tile(const float* restrict g, float* restrict p, float* restrict b,
                          uint32_t n, const mp_sgd_scalars* restrict hp) {
  const mp_sgd_scalars s = *hp;
  if (!s.has_momentum) {
#pragma GCC ivdep
    for (uint32_t i = 0; i < n; ++i) {
      float unused = 0.0f;
      p[i] = mp_sgd_element(g[i], p[i], &unused, &s);
    }
    return;
  }
#pragma GCC ivdep
  for (uint32_t i = 0; i < n; ++i) {
    float bi = b[i];
    p[i] = mp_sgd_element(g[i], p[i], &bi, &s);
    b[i] = bi;
  }
}

/* Muon's elementwise phases over a tile (mp_muon_element): phase 1 writes the update into p
 * and updates the buffer b; phase 3 updates p from the orthogonalised update in g. */
static void muon_rule_tile(const float* restrict g, float* restrict p, float* restrict b,
                           uint32_t n, const mp_muon_scalars* restrict hp) {
  const mp_muon_scalars s = *hp;
  if (s.phase != 1) {
#pragma GCC ivdep
    for (uint32_t i = 0; i < n; ++i) p[i] = mp_muon_update_element(g[i], p[i], &s);
    return;
  }
#pragma GCC ivdep
  for (uint32_t i = 0; i < n; ++i) {
    float bi = b[i];
    p[i] = mp_muon_momentum_element(g[i], &bi, &s);
    b[i] = bi;
  }
}

/* ---- the engine ---- */

/* What one piece of a param (positions sharing their high 32 bits) is stepped with. */
typedef struct adam_piece {
  const mp_adam_tensor* t;
  const mp_adam_scalars* s; /* the storage's scalars (all rules), and Adam's */
  int rule;                 /* MP_RULE_* */
  const mp_lion_scalars* lion;
  const mp_sgd_scalars* sgd;
  const mp_muon_scalars* muon;
  int nmom;     /* moments kept: exp_avg (1), and exp_avg_sq (2) */
  int64_t pos0; /* the position of element 0 (t->offset): random bits are drawn at i + pos0 */
  int kind;     /* MP_PV_* */
  mp_dtype pt, gt, md, vd;
} adam_piece;

/* The rule's stage over a tile. */
static void rule_tile(const adam_piece* a, const float* restrict g, float* restrict p,
                      float* restrict m, float* restrict v, uint32_t n) {
  switch (a->rule) {
    case MP_RULE_LION: lion_rule_tile(g, p, m, n, a->lion); break;
    case MP_RULE_SGD: sgd_rule_tile(g, p, m, n, a->sgd); break;
    case MP_RULE_MUON_MOMENTUM:
    case MP_RULE_MUON_UPDATE: muon_rule_tile(g, p, m, n, a->muon); break;
    default: adam_rule_tile(g, p, m, v, n, a->s); break;
  }
}

/* The param's arrays at element i. */
static mp_pv_tile pv_at(const adam_piece* a, int64_t i) {
  const mp_adam_tensor* t = a->t;
  mp_pv_tile at = {(char*)t->param + i * MP_DTYPE_BYTES(a->pt),
                   t->master != NULL ? t->master + i : NULL,
                   t->remainder != NULL ? t->remainder + i : NULL};
  return at;
}

/* Elements [start, start + n) of one piece, fp32 or bf16 moments (or none), tile by tile. */
static void adam_tiles(const adam_piece* a, int64_t start, int64_t n) {
  _Alignas(64) float gbuf[MP_TILE];
  _Alignas(64) float pbuf[MP_TILE];
  _Alignas(64) float mbuf[MP_TILE];
  _Alignas(64) float vbuf[MP_TILE];
  _Alignas(64) uint32_t rbuf[MP_TILE];
  const mp_adam_tensor* t = a->t;
  const mp_adam_scalars* s = a->s;
  const uint32_t hi = (uint32_t)((uint64_t)(start + a->pos0) >> 32);
  const int bf16_moments = a->md == MP_BF16 || a->vd == MP_BF16;
  const int nearest = s->moments_nearest != 0;
  for (int64_t off = 0; off < n; off += MP_TILE) {
    const int64_t i = start + off;
    const uint32_t len = (uint32_t)(n - off < MP_TILE ? n - off : MP_TILE);
    const uint32_t lo = (uint32_t)(i + a->pos0);
    const mp_pv_tile at = pv_at(a, i);
    void* m_at = a->nmom >= 1 ? (char*)t->exp_avg + i * MP_DTYPE_BYTES(a->md) : NULL;
    void* v_at = a->nmom >= 2 ? (char*)t->exp_avg_sq + i * MP_DTYPE_BYTES(a->vd) : NULL;
    float* g = mp_grad_decode(gbuf, (char*)t->grad + i * MP_DTYPE_BYTES(a->gt), a->gt, len, s);
    float* p = mp_pv_decode(a->kind, a->pt, &at, pbuf, len);
    float* m = a->nmom >= 1 ? mp_mom_decode(a->md, m_at, mbuf, len) : NULL;
    float* v = a->nmom >= 2 ? mp_mom_decode(a->vd, v_at, vbuf, len) : NULL;
    rule_tile(a, g, p, m, v, len);
    if (bf16_moments) {
      if (!nearest) mp_mom_draw(rbuf, len, s->key_moments, lo, hi);
      if (a->md == MP_BF16) mp_mom_encode_bf16((uint16_t*)m_at, m, len, rbuf, 0, nearest);
      if (a->vd == MP_BF16) mp_mom_encode_bf16((uint16_t*)v_at, v, len, rbuf, 16, nearest);
    }
    mp_pv_encode(a->kind, a->pt, &at, p, len, s->key_param, lo, hi);
    if (t->ema != NULL) mp_ema_tile(t->ema + i, p, len, s);
  }
}

/* Elements [start, start + n) of one piece with 8-bit moments (start a multiple of the block
 * size), block by block: each part of a block (at most MP_TILE elements) decoded and updated
 * into the block's fp32 buffers, then the block encoded: the pair of Adam, or one signed
 * moment alone. */
static void adam_q8_blocks(const adam_piece* a, int64_t start, int64_t n) {
  _Alignas(64) float gbuf[MP_TILE];
  _Alignas(64) float pbuf[MP_TILE];
  _Alignas(64) float mblk[MP_Q8_BLOCK_MAX];
  _Alignas(64) float vblk[MP_Q8_BLOCK_MAX];
  const mp_adam_tensor* t = a->t;
  const mp_adam_scalars* s = a->s;
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
      rule_tile(a, g, p, mblk + off, vblk + off, len);
      mp_pv_encode(a->kind, a->pt, &at, p, len, s->key_param, (uint32_t)(i + a->pos0), hi);
      if (t->ema != NULL) mp_ema_tile(t->ema + i, p, len, s);
    }
    const uint32_t lo0 = (uint32_t)(i0 + a->pos0);
    if (pair) {
      mp_q8_encode_block(mc + i0, vc + i0, mblk, vblk, blen, t->exp_avg_scale + k,
                         t->exp_avg_sq_scale + k, s->key_q8, lo0, hi, s->moments_nearest != 0);
    } else {
      mp_q8_encode_block_m(mc + i0, mblk, blen, t->exp_avg_scale + k, s->key_q8, lo0, hi,
                           s->moments_nearest != 0);
    }
  }
}

/* The range in pieces whose positions share their high 32 bits (see formats.h), each through
 * a hand-fused loop where adam_fused.c keeps one for the mode (Adam, fused != 0, no offset),
 * else the pipeline with the piece's rule. */
static void rule_step(const mp_adam_tensor* t, int64_t start, int64_t n, const mp_adam_scalars* s,
                      int rule, const mp_lion_scalars* lion, const mp_sgd_scalars* sgd,
                      const mp_muon_scalars* muon, int fused) {
  adam_piece a;
  a.t = t;
  a.s = s;
  a.rule = rule;
  a.lion = lion;
  a.sgd = sgd;
  a.muon = muon;
  a.nmom = rule == MP_RULE_ADAM                                    ? 2
           : rule == MP_RULE_MUON_MOMENTUM                        ? 1
           : rule == MP_RULE_MUON_UPDATE                          ? 0
           : (rule == MP_RULE_LION || sgd->has_momentum) ? 1 : 0;
  a.pos0 = t->offset;
  a.pt = (mp_dtype)t->param_dtype;
  a.gt = (mp_dtype)t->grad_dtype;
  a.md = a.nmom >= 1 ? (mp_dtype)t->exp_avg_dtype : MP_F32;
  a.vd = a.nmom >= 2 ? (mp_dtype)t->exp_avg_sq_dtype : MP_F32;
  a.kind = a.pt == MP_F32          ? MP_PV_F32
           : t->master != NULL    ? MP_PV_MASTER
           : t->remainder != NULL ? MP_PV_REMAINDER
           : s->sr_params         ? MP_PV_NONE_SR
                                  : MP_PV_NONE_RNE;
  const int q8 = a.md == MP_I8;
  fused = fused && rule == MP_RULE_ADAM && t->offset == 0;
  while (n > 0) {
    const int64_t k = mp_sr_piece((uint64_t)(start + a.pos0), n);
    if (fused && MP_ISA_FN(mp_k_adam_fused)(t, start, k, s, a.kind)) {
      /* done by a kept specialisation */
    } else if (q8) {
      adam_q8_blocks(&a, start, k);
    } else {
      adam_tiles(&a, start, k);
    }
    start += k;
    n -= k;
  }
}

void MP_ISA_FN(mp_k_adam_step)(const mp_adam_tensor* t, int64_t start, int64_t n,
                               const mp_adam_scalars* s) {
  rule_step(t, start, n, s, MP_RULE_ADAM, NULL, NULL, NULL, 1);
}

void MP_ISA_FN(mp_k_adam_step_generic)(const mp_adam_tensor* t, int64_t start, int64_t n,
                                       const mp_adam_scalars* s) {
  rule_step(t, start, n, s, MP_RULE_ADAM, NULL, NULL, NULL, 0);
}

void MP_ISA_FN(mp_k_lion_step)(const mp_adam_tensor* t, int64_t start, int64_t n,
                               const mp_adam_scalars* s, const mp_lion_scalars* r) {
  rule_step(t, start, n, s, MP_RULE_LION, r, NULL, NULL, 0);
}

void MP_ISA_FN(mp_k_sgd_step)(const mp_adam_tensor* t, int64_t start, int64_t n,
                              const mp_adam_scalars* s, const mp_sgd_scalars* r) {
  rule_step(t, start, n, s, MP_RULE_SGD, NULL, r, NULL, 0);
}

void MP_ISA_FN(mp_k_muon_step)(const mp_adam_tensor* t, int64_t start, int64_t n,
                               const mp_adam_scalars* s, const mp_muon_scalars* r) {
  rule_step(t, start, n, s, r->phase == 1 ? MP_RULE_MUON_MOMENTUM : MP_RULE_MUON_UPDATE, NULL,
            NULL, r, 0);
}
