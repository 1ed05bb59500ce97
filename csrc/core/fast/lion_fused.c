/* Hand-fused Lion loops: fast paths for the Lion rule, an optional cache over the step
 * engine's tile pipeline (csrc/core/step.c; this folder's README.md). One loop body per
 * storage mode that loads, updates and stores every array of an element at once, where the
 * pipeline runs a loop per stage over a tile (with the stages' fp32 buffers between them).
 * Lion's update is a few multiplies and a sign, so with fp32 moments the pipeline's passes
 * are what keep it from its bytes bound: one pass streams every array at once and keeps the
 * memory busy while it computes (docs/fast_paths.md, "Lion": the gain of each row and the CPU
 * it came from). A row computes the same bits as the pipeline, element by element, with the
 * same per-element functions in the same order (tests/c/test_fast_paths.c compares them on
 * every row and ISA path), and a build without this folder (MPEXT_FAST_PATHS=0) passes every
 * test.
 *
 * The rows are built on the AVX-512 path only (the CPU they were measured on; GCC vectorizes
 * the C loop): elsewhere mp_k_lion_fast_step finds none, and the compile time the other paths
 * add is that of an empty file. Reached through mp_k_fast_step (adam_fused.c), the engine's
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

/* The loop over elements [0, n) of a piece whose element 0 is at position (hi, lo0): a bf16
 * param and grad, exp_avg fp32 (md MP_F32) or bf16 (stochastically rounded, or to nearest with
 * near), the param's value by kind mk (formats/tiles.h MP_PV_*). Always inlined into a caller
 * whose layout arguments are constants; maximize too (0, or read from hl), so that the usual
 * step leaves the negation out. The arrays never overlap (mp_step's contract): ivdep. */
static inline __attribute__((always_inline)) void lion_loop(
    uint16_t* restrict param, const uint16_t* restrict grad, float* restrict master,
    int16_t* restrict remainder, void* restrict m, const mp_dtype md, uint32_t n, uint32_t lo0,
    uint32_t hi, const mp_step_scalars* restrict hs, const mp_lion_scalars* restrict hl,
    const int mk, const int near, const int maybe_max) {
  mp_step_scalars u; /* what the loop reads of the storage's scalars */
  u.inv_scale = hs->inv_scale;
  const uint64_t key_p = hs->key_param, key_m = hs->key_moments;
  mp_lion_scalars L = *hl;
  if (!maybe_max) L.maximize = 0;
#pragma GCC ivdep
  for (uint32_t i = 0; i < n; ++i) {
    const uint32_t lo = lo0 + i;
    const float g = mp_step_unscaled(mp_fmt_f32(mp_bf16_to_f32_bits(grad[i])), &u);
    float p;
    if (mk == MP_PV_MASTER) {
      p = master[i];
    } else if (mk == MP_PV_REMAINDER) {
      p = mp_fmt_f32(mp_bf16_join(param[i], (uint16_t)remainder[i]));
    } else {
      p = mp_fmt_f32(mp_bf16_to_f32_bits(param[i]));
    }
    float mi = md == MP_F32 ? ((float*)m)[i] : mp_fmt_f32(mp_bf16_to_f32_bits(((uint16_t*)m)[i]));
    float vi = 0.0f;
    p = mp_lion_element(g, p, &mi, &vi, &L);
    if (md == MP_F32) {
      ((float*)m)[i] = mi;
    } else if (near) {
      ((uint16_t*)m)[i] = mp_bf16_rne_bits(mp_fmt_bits(mi));
    } else { /* exp_avg rounds with the low 16 bits of the moments' draw (mp_mom_draw) */
      ((uint16_t*)m)[i] = mp_bf16_sr_bits(mp_fmt_bits(mi), mp_sr_bits_hl(key_m, lo, hi));
    }
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
      param[i] = mp_bf16_sr_bits(mp_fmt_bits(p), mp_sr_bits_hl(key_p, lo, hi));
    }
  }
}

/* The kept modes, one row each (bf16 params and grads, grads not written back, no ema): the
 * param's storage, exp_avg's dtype, bf16 exp_avg to nearest. Why each is kept (its measured
 * gain over the pipeline) is in docs/fast_paths.md; a mode not listed runs the pipeline. */
#define MP_LION_FUSED_ROWS(X)                   \
  X(master, MP_PV_MASTER, MP_F32, 0)            \
  X(remainder, MP_PV_REMAINDER, MP_F32, 0)      \
  X(sr, MP_PV_NONE_SR, MP_F32, 0)               \
  X(rne, MP_PV_NONE_RNE, MP_F32, 0)             \
  X(remainder_bf16m, MP_PV_REMAINDER, MP_BF16, 0) \
  X(sr_bf16m, MP_PV_NONE_SR, MP_BF16, 0)

/* One function per row over elements [start, start + n) of a piece. */
#define MP_LION_FN(name, MK, MD, NEAR)                                                       \
  static void lion_##name(const mp_step_tensor* t, int64_t start, int64_t n,                 \
                          const mp_step_scalars* s, const mp_lion_scalars* l) {              \
    uint16_t* param = (uint16_t*)t->param + start;                                           \
    const uint16_t* grad = (const uint16_t*)t->grad + start;                                 \
    float* master = t->master != NULL ? t->master + start : NULL;                            \
    int16_t* remainder = t->remainder != NULL ? t->remainder + start : NULL;                 \
    void* m = (char*)t->exp_avg + start * MP_DTYPE_BYTES(MD);                                \
    const uint64_t pos = (uint64_t)(start + t->offset);                                      \
    const uint32_t lo0 = (uint32_t)pos, hi = (uint32_t)(pos >> 32);                          \
    if (l->maximize) {                                                                       \
      lion_loop(param, grad, master, remainder, m, MD, (uint32_t)n, lo0, hi, s, l, MK, NEAR, \
                1);                                                                          \
    } else {                                                                                 \
      lion_loop(param, grad, master, remainder, m, MD, (uint32_t)n, lo0, hi, s, l, MK, NEAR, \
                0);                                                                          \
    }                                                                                        \
  }
MP_LION_FUSED_ROWS(MP_LION_FN)

typedef void (*lion_fn)(const mp_step_tensor*, int64_t, int64_t, const mp_step_scalars*,
                        const mp_lion_scalars*);

/* The rows selected by an index on their mode: param storage (MP_PV_*: 0..4), exp_avg (fp32,
 * bf16 stochastic, bf16 to nearest: 0..2); one array slot per mode, NULL where none is kept. */
#define LION_INDEX(MK, MOM) ((MK) * 3 + (MOM))
#define LION_MOM(MD, NEAR) ((MD) == MP_F32 ? 0 : (NEAR) ? 2 : 1)
#define MP_LION_SLOT(name, MK, MD, NEAR) [LION_INDEX(MK, LION_MOM(MD, NEAR))] = lion_##name,
static const lion_fn LION[5 * 3] = {MP_LION_FUSED_ROWS(MP_LION_SLOT)};

int MP_ISA_FN(mp_k_lion_fast_step)(const mp_step_tensor* t, int64_t start, int64_t n,
                                   const mp_step_scalars* s, const mp_rule_scalars* r,
                                   int kind) {
  /* the rows' layout: bf16 param and grad, one fp32 or bf16 moment, nothing else to store */
  if (r->rule != MP_RULE_LION || t->param_dtype != MP_BF16 || t->grad_dtype != MP_BF16 ||
      s->write_grad != 0 || t->ema != NULL || kind < 0 || kind > MP_PV_NONE_SR) {
    return 0;
  }
  const int32_t md = mp_format_dtype(t->exp_avg_format);
  if (md != MP_F32 && md != MP_BF16) return 0;
  const lion_fn f = LION[LION_INDEX(kind, LION_MOM(md, s->moments_nearest != 0))];
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
