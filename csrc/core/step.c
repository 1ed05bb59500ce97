/* The optimizer step (mpext/step.h) over one range of one param: the CPU engine, whichever the
 * rule. Compiled once per ISA path (see isa.h). The range is cut into tiles (formats.h, MP_TILE
 * elements, or one block of 8-bit moments), and each tile runs through a pipeline of small
 * loops, one per stage:
 *   grad decode (unscale, optional write-back) -> param value decode -> moments decode
 *   -> the rule over fp32 arrays -> moments encode -> param encode -> ema
 * Each stage is one codec of formats.h, chosen by a switch per tile; the rule is the varying
 * stage: the rule's element function (mpext/rules/<name>.h) over the tile, one loop per rule
 * generated from the rows of mpext/rules/rules.h, so that every rule takes every storage format
 * without a loop body of its own per format. Where a storage format is fp32 (param, master,
 * moments, a grad written back) the rule works on the storage itself. The bits are those of the
 * per-element functions, in the same order, so every ISA path and the CUDA kernels agree. A
 * mode with a fast path (csrc/core/fast/: an optional cache, the same bits, proven by the C
 * tests) takes it instead of the pipeline. */
#include <string.h>

#include "formats/tiles.h"
#include "isa.h"
#include "mpext/numerics.h"
#include "mpext/step_storage.h"

#ifndef MP_ISA_SUFFIX
#error "step.c must be compiled with -DMP_ISA_SUFFIX=scalar|avx2|avx512"
#endif

/* ---- the rules: each over a tile of fp32 arrays, the stage the pipeline varies ---- */

/* A rule over a tile: unscaled gradients g, fp32 values p and the nmom moments m, v (those the
 * call keeps) updated in place by mp_<name>_element. One loop per moment count the rule's row
 * allows (the others are constant-folded away), the count a loop invariant. */
#define MP_RULE_TILE_(ID, name, MIN, MAX)                                                      \
  static void name##_tile(const float* restrict g, float* restrict p, float* restrict m,       \
                          float* restrict v, uint32_t n, int nmom,                             \
                          const mp_##name##_scalars* restrict hp) {                            \
    const mp_##name##_scalars s = *hp;                                                         \
    if ((MAX) >= 2 && nmom >= 2) {                                                             \
      _Pragma("GCC ivdep") for (uint32_t i = 0; i < n; ++i) {                                  \
        float mi = m[i], vi = v[i];                                                            \
        p[i] = mp_##name##_element(g[i], p[i], &mi, &vi, &s);                                  \
        m[i] = mi;                                                                             \
        v[i] = vi;                                                                             \
      }                                                                                        \
    } else if ((MAX) >= 1 && (MIN) <= 1 && nmom == 1) {                                        \
      _Pragma("GCC ivdep") for (uint32_t i = 0; i < n; ++i) {                                  \
        float mi = m[i], vi = 0.0f;                                                            \
        p[i] = mp_##name##_element(g[i], p[i], &mi, &vi, &s);                                  \
        m[i] = mi;                                                                             \
      }                                                                                        \
    } else if ((MIN) == 0) {                                                                   \
      _Pragma("GCC ivdep") for (uint32_t i = 0; i < n; ++i) {                                  \
        float mi = 0.0f, vi = 0.0f;                                                            \
        p[i] = mp_##name##_element(g[i], p[i], &mi, &vi, &s);                                  \
      }                                                                                        \
    }                                                                                          \
  }
MP_RULES(MP_RULE_TILE_)
#undef MP_RULE_TILE_

/* ---- the engine ---- */

/* What one piece of a param (positions sharing their high 32 bits) is stepped with. */
typedef struct step_piece {
  const mp_step_tensor* t;
  const mp_step_scalars* s; /* the storage's scalars */
  const mp_rule_scalars* r; /* the rule's */
  int nmom;     /* moments kept: exp_avg (1), and exp_avg_sq (2) */
  int64_t pos0; /* the position of element 0 (t->offset): random bits are drawn at i + pos0 */
  int kind;     /* MP_PV_* */
  mp_dtype pt, gt, md, vd;
} step_piece;

/* The rule's stage over a tile. */
static void rule_tile(const step_piece* a, const float* restrict g, float* restrict p,
                      float* restrict m, float* restrict v, uint32_t n) {
  switch (a->r->rule) {
#define MP_RULE_CASE_(ID, name, MIN, MAX) \
  case MP_RULE_##ID: name##_tile(g, p, m, v, n, a->nmom, &a->r->u.name); break;
    MP_RULES(MP_RULE_CASE_)
#undef MP_RULE_CASE_
    default: break;
  }
}

/* The param's arrays at element i. */
static mp_pv_tile pv_at(const step_piece* a, int64_t i) {
  const mp_step_tensor* t = a->t;
  mp_pv_tile at = {(char*)t->param + i * MP_DTYPE_BYTES(a->pt),
                   t->master != NULL ? t->master + i : NULL,
                   t->remainder != NULL ? t->remainder + i : NULL};
  return at;
}

/* Whether the tile loop asks for the next tile's storage ahead (mp_prefetch_span): where a
 * piece streams few arrays -- at most one moment and at most 12 bytes read per element (grad,
 * param, master or remainder, moments, ema) -- the stages alone keep too few misses in flight
 * and the prefetch won 4-19% a step (tools/rule_engine_ab.c, 16M elements, one core); with two
 * moments or more bytes (Adam's fp16 pipeline modes: 16 bytes) the extra requests crowd out
 * the demand loads and it lost up to 28% (tools/adam_engine_ab.c). A property of the mode,
 * never of the rule; the bits are the same either way. */
static int prefetch_ahead(const step_piece* a) {
  const mp_step_tensor* t = a->t;
  const int bytes = MP_DTYPE_BYTES(a->gt) + MP_DTYPE_BYTES(a->pt) +
                    (t->master != NULL ? 4 : 0) + (t->remainder != NULL ? 2 : 0) +
                    (a->nmom >= 1 ? MP_DTYPE_BYTES(a->md) : 0) +
                    (a->nmom >= 2 ? MP_DTYPE_BYTES(a->vd) : 0) + (t->ema != NULL ? 4 : 0);
  return a->nmom <= 1 && bytes <= 12;
}

/* The elements of one tile of step_tiles: MP_TILE, or MP_TILE_SHORT where a piece keeps one
 * moment or none (SGD, Lion). Streaming few arrays, the stages' loops over 512-element tiles
 * overlapped memory and computation worse: with 256 the same steps took 11-22% less time (Lion
 * and SGD, every format with fp32 or bf16 moments, 16M elements, one core,
 * tools/rule_engine_ab.c; docs/fast_paths.md, "Lion"); 128 was no better than 256, 64 worse.
 * 8-bit moments step a block at a time (step_q8_blocks) and are unchanged. Adam's two moments keep
 * MP_TILE (not measured with other lengths here). A property of the mode, never of the rule;
 * the bits are the same at any length (every stage is elementwise, random bits drawn at the
 * element's position). */
#ifndef MP_TILE_SHORT
#define MP_TILE_SHORT 256
#endif
_Static_assert(MP_TILE_SHORT <= MP_TILE, "the tile buffers hold MP_TILE elements");

static uint32_t tile_len(const step_piece* a) { return a->nmom <= 1 ? MP_TILE_SHORT : MP_TILE; }

/* Asks for the storage of the tile at element j (all of its len elements: past the piece's
 * end it is a hint that fetches nothing the step needs, never an access). */
static void prefetch_tile(const step_piece* a, int64_t j, uint32_t len) {
  const mp_step_tensor* t = a->t;
  mp_prefetch_span((const char*)t->grad + j * MP_DTYPE_BYTES(a->gt), len * MP_DTYPE_BYTES(a->gt));
  mp_prefetch_span((const char*)t->param + j * MP_DTYPE_BYTES(a->pt),
                   len * MP_DTYPE_BYTES(a->pt));
  if (t->master != NULL) mp_prefetch_span(t->master + j, len * 4);
  if (t->remainder != NULL) mp_prefetch_span(t->remainder + j, len * 2);
  if (a->nmom >= 1) {
    mp_prefetch_span((const char*)t->exp_avg + j * MP_DTYPE_BYTES(a->md),
                     len * MP_DTYPE_BYTES(a->md));
  }
  if (t->ema != NULL) mp_prefetch_span(t->ema + j, len * 4);
}

#if !defined(MP_STEP_STAGES_ONLY)
/* (telemetry.c includes this file for the stages and the tiling above, with
 * MP_STEP_STAGES_ONLY: its counted step has drivers of its own; step.c's object is the same
 * either way.) */

/* Elements [start, start + n) of one piece, fp32 or bf16 moments (or none), tile by tile. */
static void step_tiles(const step_piece* a, int64_t start, int64_t n) {
  _Alignas(64) float gbuf[MP_TILE];
  _Alignas(64) float pbuf[MP_TILE];
  _Alignas(64) float mbuf[MP_TILE];
  _Alignas(64) float vbuf[MP_TILE];
  _Alignas(64) uint32_t rbuf[MP_TILE];
  const mp_step_tensor* t = a->t;
  const mp_step_scalars* s = a->s;
  const uint32_t hi = (uint32_t)((uint64_t)(start + a->pos0) >> 32);
  const int bf16_moments = a->md == MP_BF16 || a->vd == MP_BF16;
  const int nearest = s->moments_nearest != 0;
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
 * into the block's fp32 buffers, then the block encoded: a pair of moments (signed and
 * non-negative), or one signed moment alone. */
static void step_q8_blocks(const step_piece* a, int64_t start, int64_t n) {
  _Alignas(64) float gbuf[MP_TILE];
  _Alignas(64) float pbuf[MP_TILE];
  _Alignas(64) float mblk[MP_Q8_BLOCK_MAX];
  _Alignas(64) float vblk[MP_Q8_BLOCK_MAX];
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
 * the fast path kept for its mode where there is one (fast != 0), else the pipeline. */
static void rule_step(const mp_step_tensor* t, int64_t start, int64_t n, const mp_step_scalars* s,
                      const mp_rule_scalars* r, int fast) {
  step_piece a;
  a.t = t;
  a.s = s;
  a.r = r;
  a.nmom = r->nmom;
  a.pos0 = t->offset;
  a.pt = (mp_dtype)t->param_dtype;
  a.gt = (mp_dtype)t->grad_dtype;
  /* the moments' formats as the dtypes their codecs load and store (formats/formats.h) */
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
    if (fast && MP_ISA_FN(mp_k_fast_step)(t, start, k, s, r, a.kind)) {
      /* done by a fast path */
    } else if (q8) {
      step_q8_blocks(&a, start, k);
    } else {
      step_tiles(&a, start, k);
    }
    start += k;
    n -= k;
  }
}

#if defined(MP_NO_FAST_PATHS)
/* A build without the fast paths (build_tools/core.py, MPEXT_FAST_PATHS=0): no mode has one,
 * every step runs the pipeline. */
int MP_ISA_FN(mp_k_fast_step)(const mp_step_tensor* t, int64_t start, int64_t n,
                              const mp_step_scalars* s, const mp_rule_scalars* r, int kind) {
  (void)t, (void)start, (void)n, (void)s, (void)r, (void)kind;
  return 0;
}

/* Nor a counted one (telemetry.c's counted step asks first, as this file asks above). */
int MP_ISA_FN(mp_k_fast_step_stats)(const mp_step_tensor* t, int64_t start, int64_t n,
                                    const mp_step_scalars* s, const mp_rule_scalars* r, int kind,
                                    double* row);
int MP_ISA_FN(mp_k_fast_step_stats)(const mp_step_tensor* t, int64_t start, int64_t n,
                                    const mp_step_scalars* s, const mp_rule_scalars* r, int kind,
                                    double* row) {
  (void)t, (void)start, (void)n, (void)s, (void)r, (void)kind, (void)row;
  return 0;
}
#endif

void MP_ISA_FN(mp_k_step)(const mp_step_tensor* t, int64_t start, int64_t n,
                          const mp_step_scalars* s, const mp_rule_scalars* r) {
  rule_step(t, start, n, s, r, 1);
}

void MP_ISA_FN(mp_k_step_generic)(const mp_step_tensor* t, int64_t start, int64_t n,
                                  const mp_step_scalars* s, const mp_rule_scalars* r) {
  rule_step(t, start, n, s, r, 0);
}
#endif /* !MP_STEP_STAGES_ONLY */
