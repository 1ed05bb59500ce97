/* The public entry point of the gradient telemetry (mpext/telemetry.h): argument checks and the
 * choice of the ISA build of telemetry.c, by the path the rest of the core uses
 * (mp_cpu_isa_active). Compiled once, with baseline flags. telemetry.c keeps its own small table
 * rather than a row in isa.h's, so that the feature is one pair of files. */
#include <stddef.h>
#include <string.h>

#include "mpext/step_storage.h"
#include "mpext/telemetry.h"

typedef int (*tel_fn)(void* g, int64_t n, float inv, int64_t* c, uint32_t* amax);

#define MP_TEL_DECL(isa)                                                                      \
  int mp_k_tel_f32__##isa(float* g, int64_t n, float inv, int64_t* c, uint32_t* amax);       \
  int mp_k_tel_bf16__##isa(uint16_t* g, int64_t n, float inv, int64_t* c, uint32_t* amax);   \
  int mp_k_tel_fp16__##isa(uint16_t* g, int64_t n, float inv, int64_t* c, uint32_t* amax);
MP_TEL_DECL(scalar)
#if defined(MP_X86_PATHS)
MP_TEL_DECL(avx2)
MP_TEL_DECL(avx512)
#endif

/* [isa][dtype] */
static const tel_fn tel_kernels[MP_ISA_COUNT][MP_DTYPE_COUNT] = {
    {(tel_fn)mp_k_tel_f32__scalar, (tel_fn)mp_k_tel_bf16__scalar, (tel_fn)mp_k_tel_fp16__scalar},
#if defined(MP_X86_PATHS)
    {(tel_fn)mp_k_tel_f32__avx2, (tel_fn)mp_k_tel_bf16__avx2, (tel_fn)mp_k_tel_fp16__avx2},
    {(tel_fn)mp_k_tel_f32__avx512, (tel_fn)mp_k_tel_bf16__avx512, (tel_fn)mp_k_tel_fp16__avx512},
#endif
};

static float widen_bits(mp_dtype dtype, uint32_t a) {
  uint32_t u = dtype == MP_F32 ? a
               : dtype == MP_BF16 ? mp_bf16_to_f32_bits((uint16_t)a)
                                  : mp_fp16_to_f32_bits((uint16_t)a);
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

mp_status mp_unscale_stats(void* g, mp_dtype dtype, int64_t n, float inv_scale,
                           float stat_inv_scale, int32_t* found, mp_grad_stats* stats) {
  if (n < 0 || found == NULL || stats == NULL || (n > 0 && g == NULL))
    return MP_ERR_INVALID_ARGUMENT;
  if ((int)dtype < 0 || dtype >= MP_DTYPE_COUNT) return MP_ERR_INVALID_ARGUMENT;
  if (n == 0) return MP_OK;
  int isa = (int)mp_cpu_isa_active();
  if (tel_kernels[isa][0] == NULL) isa = MP_ISA_SCALAR; /* a path not compiled in */
  uint32_t amax = 0;
  const int bad = tel_kernels[isa][dtype](g, n, inv_scale, stats->count, &amax);
  /* One correctly rounded product of the largest magnitude: the max of the products. */
  stats->max_abs = mp_tel_max_bits(stats->max_abs, widen_bits(dtype, amax) * stat_inv_scale);
  if (bad) *found = 1;
  return MP_OK;
}

/* ---- the optimizer step's counters: step.c's mp_k_step_stats of each ISA build ---- */

typedef void (*step_stats_fn)(const mp_step_tensor* t, int64_t start, int64_t n,
                              const mp_step_scalars* s, const mp_rule_scalars* r, double* row);

#define MP_STS_DECL(isa)                                                                      \
  void mp_k_step_stats__##isa(const mp_step_tensor* t, int64_t start, int64_t n,              \
                              const mp_step_scalars* s, const mp_rule_scalars* r, double* row);
MP_STS_DECL(scalar)
#if defined(MP_X86_PATHS)
MP_STS_DECL(avx2)
MP_STS_DECL(avx512)
#endif

static const step_stats_fn sts_kernels[MP_ISA_COUNT] = {
    mp_k_step_stats__scalar,
#if defined(MP_X86_PATHS)
    mp_k_step_stats__avx2,
    mp_k_step_stats__avx512,
#endif
};

mp_status mp_step_stats(const mp_step_tensor* t, int64_t start, int64_t count,
                        const mp_step_options* o, double* row) {
  if (row == NULL || !mp_step_call_ok(t, start, count, o)) return MP_ERR_INVALID_ARGUMENT;
  if (count == 0 || mp_step_skip(o)) return MP_OK;
  int isa = (int)mp_cpu_isa_active();
  if (sts_kernels[isa] == NULL) isa = MP_ISA_SCALAR; /* a path not compiled in */
  const mp_step_scalars s = mp_step_scalars_now(o, t->step, t->sr_stream);
  const mp_rule_scalars r = mp_rule_scalars_now(o, t->step);
  sts_kernels[isa](t, start, count, &s, &r, row);
  return MP_OK;
}
