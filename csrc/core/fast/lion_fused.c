/* Hand-fused Lion loops: fast paths for the Lion rule, an optional cache over the step
 * engine's tile pipeline (csrc/core/step.c; this folder's README.md). One loop body per
 * storage mode that loads, updates and stores every array of an element at once, where the
 * pipeline runs a loop per stage over a tile (with the stages' fp32 buffers between them).
 * Lion's update is a few multiplies and a sign, so with an fp32 moment the pipeline's passes
 * are what keep it from its bytes bound: one pass streams every array at once (and asks for
 * them ahead) and keeps the memory busy while it computes (docs/fast_paths.md, "Lion": the
 * gain of each row and the CPU it came from). A row computes the same bits as the pipeline, element by element, with the
 * same per-element functions in the same order (tests/c/test_fast_paths.c compares them on
 * every row and ISA path), and a build without this folder (MPEXT_FAST_PATHS=0) passes every
 * test.
 *
 * The rows are built on the AVX-512 path only (the CPU they were measured on; GCC vectorizes
 * the C loop): elsewhere mp_k_lion_fast_step finds none, and the other paths compile little
 * more than the headers. Reached through mp_k_fast_step (adam_fused.c), the engine's
 * only way into the fast paths. */
#include <string.h>

#include "formats/tiles.h"
#include "isa.h"
#include "lion_fused.h"
#include "mpext/numerics.h"

#ifndef MP_ISA_SUFFIX
#error "lion_fused.c must be compiled with -DMP_ISA_SUFFIX=scalar|avx2|avx512"
#endif

#if defined(__AVX512F__)

#define LION_AHEAD 512 /* elements prefetched ahead */
#define LION_CHUNK 32  /* elements per prefetch: one line of each 16-bit array */

/* Asks for the lines of elements [j, j + LION_CHUNK) of every array the loop streams (a hint:
 * past an array's end it fetches nothing the step needs, never an access). The hardware's own
 * prefetchers kept too few of the five streams' misses in flight on one core: the prefetch
 * took 14-16% off the master and remainder rows' step at 16M elements, 4% off SR's
 * (docs/fast_paths.md, "Lion"). */
static inline __attribute__((always_inline)) void lion_prefetch(
    const uint16_t* param, const uint16_t* grad, const float* master, const int16_t* remainder,
    const float* m, const int mk, uint32_t j) {
  mp_prefetch_span(grad + j, LION_CHUNK * 2);
  mp_prefetch_span(param + j, LION_CHUNK * 2);
  if (mk == MP_PV_MASTER) mp_prefetch_span(master + j, LION_CHUNK * 4);
  if (mk == MP_PV_REMAINDER) mp_prefetch_span(remainder + j, LION_CHUNK * 2);
  mp_prefetch_span(m + j, LION_CHUNK * 4);
}

/* The loop over elements [0, n) of a piece whose element 0 is at position (hi, lo0): a bf16
 * param and grad, an fp32 exp_avg, the param's value by kind mk (formats/tiles.h MP_PV_*),
 * LION_CHUNK elements per prefetch. Always inlined into a caller whose kind is a constant;
 * maximize too (0, or read from hl), so that the usual step leaves the negation out. The
 * arrays never overlap (mp_step's contract): ivdep. */
static inline __attribute__((always_inline)) void lion_loop(
    uint16_t* restrict param, const uint16_t* restrict grad, float* restrict master,
    int16_t* restrict remainder, float* restrict m, uint32_t n, uint32_t lo0, uint32_t hi,
    const mp_step_scalars* restrict hs, const mp_lion_scalars* restrict hl, const int mk,
    const int maybe_max) {
  mp_step_scalars u; /* what the loop reads of the storage's scalars */
  u.inv_scale = hs->inv_scale;
  const uint64_t key_p = hs->key_param;
  mp_lion_scalars L = *hl;
  if (!maybe_max) L.maximize = 0;
  for (uint32_t c = 0; c < n; c += LION_CHUNK) {
    const uint32_t e = n - c < LION_CHUNK ? n : c + LION_CHUNK;
    lion_prefetch(param, grad, master, remainder, m, mk, c + LION_AHEAD);
#pragma GCC ivdep
    for (uint32_t i = c; i < e; ++i) {
      const float g = mp_step_unscaled(mp_fmt_f32(mp_bf16_to_f32_bits(grad[i])), &u);
      float p;
      if (mk == MP_PV_MASTER) {
        p = master[i];
      } else if (mk == MP_PV_REMAINDER) {
        p = mp_fmt_f32(mp_bf16_join(param[i], (uint16_t)remainder[i]));
      } else {
        p = mp_fmt_f32(mp_bf16_to_f32_bits(param[i]));
      }
      float mi = m[i], vi = 0.0f;
      p = mp_lion_element(g, p, &mi, &vi, &L);
      m[i] = mi;
      if (mk == MP_PV_MASTER || mk == MP_PV_REMAINDER) {
        const uint32_t x = mp_bf16_master_bits(mp_fmt_bits(p));
        const uint16_t q = mp_bf16_rne_bits(x);
        param[i] = q;
        if (mk == MP_PV_MASTER) {
          master[i] = mp_fmt_f32(x);
        } else {
          remainder[i] = (int16_t)mp_bf16_remainder(x, q);
        }
      } else if (mk == MP_PV_NONE_RNE) {
        param[i] = mp_bf16_rne_bits(mp_fmt_bits(p));
      } else {
        param[i] = mp_bf16_sr_bits(mp_fmt_bits(p), mp_sr_bits_hl(key_p, lo0 + i, hi));
      }
    }
  }
}

/* The kept modes, one row each: the param's storage (bf16 params and grads, an fp32 exp_avg,
 * grads not written back, no ema). Why each is kept (its measured gain over the pipeline) is
 * in docs/fast_paths.md; a mode not listed runs the pipeline (bf16 moments: rows for them
 * measured 0.88-1.12x the pipeline's time, as the load on the machine changed; 8-bit: their
 * draws and codes cost as much fused as apart). */
#define MP_LION_FUSED_ROWS(X) \
  X(master, MP_PV_MASTER)     \
  X(remainder, MP_PV_REMAINDER) \
  X(sr, MP_PV_NONE_SR)        \
  X(rne, MP_PV_NONE_RNE)

/* One function per row over elements [start, start + n) of a piece. */
#define MP_LION_FN(name, MK)                                                                  \
  static void lion_##name(const mp_step_tensor* t, int64_t start, int64_t n,                  \
                          const mp_step_scalars* s, const mp_lion_scalars* l) {               \
    uint16_t* param = (uint16_t*)t->param + start;                                            \
    const uint16_t* grad = (const uint16_t*)t->grad + start;                                  \
    float* master = t->master != NULL ? t->master + start : NULL;                             \
    int16_t* remainder = t->remainder != NULL ? t->remainder + start : NULL;                  \
    float* m = (float*)t->exp_avg + start;                                                    \
    const uint64_t pos = (uint64_t)(start + t->offset);                                       \
    const uint32_t lo0 = (uint32_t)pos, hi = (uint32_t)(pos >> 32);                           \
    if (l->maximize) {                                                                        \
      lion_loop(param, grad, master, remainder, m, (uint32_t)n, lo0, hi, s, l, MK, 1);        \
    } else {                                                                                  \
      lion_loop(param, grad, master, remainder, m, (uint32_t)n, lo0, hi, s, l, MK, 0);        \
    }                                                                                         \
  }
MP_LION_FUSED_ROWS(MP_LION_FN)

typedef void (*lion_fn)(const mp_step_tensor*, int64_t, int64_t, const mp_step_scalars*,
                        const mp_lion_scalars*);

/* The rows selected by an index on their mode, the param's storage (MP_PV_*: 0..4); NULL
 * where none is kept. */
#define MP_LION_SLOT(name, MK) [MK] = lion_##name,
static const lion_fn LION[5] = {MP_LION_FUSED_ROWS(MP_LION_SLOT)};

int MP_ISA_FN(mp_k_lion_fast_step)(const mp_step_tensor* t, int64_t start, int64_t n,
                                   const mp_step_scalars* s, const mp_rule_scalars* r,
                                   int kind) {
  /* the rows' layout: bf16 param and grad, an fp32 moment, nothing else to store */
  if (r->rule != MP_RULE_LION || t->param_dtype != MP_BF16 || t->grad_dtype != MP_BF16 ||
      s->write_grad != 0 || t->ema != NULL || mp_format_dtype(t->exp_avg_format) != MP_F32 ||
      kind < 0 || kind > MP_PV_NONE_SR) {
    return 0;
  }
  const lion_fn f = LION[kind];
  if (f == NULL) return 0;
  f(t, start, n, s, &r->u.lion);
  return 1;
}

#else /* no rows on this ISA path */

int MP_ISA_FN(mp_k_lion_fast_step)(const mp_step_tensor* t, int64_t start, int64_t n,
                                   const mp_step_scalars* s, const mp_rule_scalars* r,
                                   int kind) {
  (void)t, (void)start, (void)n, (void)s, (void)r, (void)kind;
  return 0;
}

#endif
