/* CPU feature detection, ISA path selection and the public mp_* entry points. Compiled once,
 * with baseline flags: nothing here may use an instruction the oldest supported CPU lacks. */
#include <stdatomic.h>
#include <stddef.h>
#include <string.h>

#include "isa.h"
#include "mpext/adam.h"
#include "mpext/cast.h"
#include "mpext/norm.h"
#include "mpext/scale.h"
#include "mpext/scale_rule.h"

/* MP_X86_PATHS is defined by the build when the avx2/avx512 builds were compiled in. */

const char* mp_status_string(mp_status s) {
  switch (s) {
    case MP_OK: return "ok";
    case MP_ERR_INVALID_ARGUMENT: return "invalid argument";
    case MP_ERR_UNSUPPORTED_ISA: return "the CPU does not support the requested instruction set";
    case MP_ERR_CUDA: return "CUDA error";
  }
  return "unknown status";
}

static const char* const isa_names[MP_ISA_COUNT] = {"scalar", "avx2", "avx512"};

const char* mp_isa_name(mp_isa isa) {
  return ((int)isa >= 0 && isa < MP_ISA_COUNT) ? isa_names[isa] : NULL;
}

mp_status mp_isa_from_name(const char* name, mp_isa* out) {
  if (name == NULL || out == NULL) return MP_ERR_INVALID_ARGUMENT;
  for (int i = 0; i < MP_ISA_COUNT; ++i) {
    if (strcmp(name, isa_names[i]) == 0) {
      *out = (mp_isa)i;
      return MP_OK;
    }
  }
  return MP_ERR_INVALID_ARGUMENT;
}

int mp_cpu_isa_supported(mp_isa isa) {
  switch (isa) {
    case MP_ISA_SCALAR: return 1;
#if defined(MP_X86_PATHS)
    case MP_ISA_AVX2:
      return __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
             __builtin_cpu_supports("f16c");
    case MP_ISA_AVX512:
      return __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
             __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
             mp_cpu_isa_supported(MP_ISA_AVX2);
#endif
    default: return 0;
  }
}

mp_isa mp_cpu_isa_best(void) {
  for (int i = MP_ISA_COUNT - 1; i > 0; --i) {
    if (mp_cpu_isa_supported((mp_isa)i)) return (mp_isa)i;
  }
  return MP_ISA_SCALAR;
}

static const mp_kernel_table* table_for(mp_isa isa) {
  switch (isa) {
#if defined(MP_X86_PATHS)
    case MP_ISA_AVX2: return &mp_kernels__avx2;
    case MP_ISA_AVX512: return &mp_kernels__avx512;
#endif
    default: return &mp_kernels__scalar;
  }
}

/* -1 until first use; then the active mp_isa. */
static _Atomic int active_isa = -1;

mp_isa mp_cpu_isa_active(void) {
  int isa = atomic_load_explicit(&active_isa, memory_order_acquire);
  if (isa < 0) {
    int expected = -1;
    int best = (int)mp_cpu_isa_best();
    /* If another thread selected a path meanwhile, keep its choice. */
    if (!atomic_compare_exchange_strong(&active_isa, &expected, best)) return (mp_isa)expected;
    return (mp_isa)best;
  }
  return (mp_isa)isa;
}

mp_status mp_cpu_isa_select(mp_isa isa) {
  if ((int)isa < 0 || isa >= MP_ISA_COUNT) return MP_ERR_INVALID_ARGUMENT;
  if (!mp_cpu_isa_supported(isa)) return MP_ERR_UNSUPPORTED_ISA;
  atomic_store_explicit(&active_isa, (int)isa, memory_order_release);
  return MP_OK;
}

static const mp_kernel_table* active(void) { return table_for(mp_cpu_isa_active()); }

#define MP_CHECK_N(src, dst, n)                                         \
  do {                                                                  \
    if ((n) < 0 || ((n) > 0 && ((src) == NULL || (dst) == NULL)))       \
      return MP_ERR_INVALID_ARGUMENT;                                   \
    if ((n) == 0) return MP_OK;                                         \
  } while (0)

mp_status mp_to_bf16_f32(const float* src, uint16_t* dst, int64_t n) {
  MP_CHECK_N(src, dst, n);
  active()->to_bf16_f32(src, dst, n);
  return MP_OK;
}

mp_status mp_to_bf16_sr_f32(const float* src, uint16_t* dst, int64_t n, uint64_t seed,
                            uint64_t offset) {
  MP_CHECK_N(src, dst, n);
  active()->to_bf16_sr_f32(src, dst, n, seed, offset);
  return MP_OK;
}

mp_status mp_to_fp16_f32(const float* src, uint16_t* dst, int64_t n) {
  MP_CHECK_N(src, dst, n);
  active()->to_fp16_f32(src, dst, n);
  return MP_OK;
}

mp_status mp_to_fp32_bf16(const uint16_t* src, float* dst, int64_t n) {
  MP_CHECK_N(src, dst, n);
  active()->to_fp32_bf16(src, dst, n);
  return MP_OK;
}

mp_status mp_to_fp32_fp16(const uint16_t* src, float* dst, int64_t n) {
  MP_CHECK_N(src, dst, n);
  active()->to_fp32_fp16(src, dst, n);
  return MP_OK;
}

#define MP_UNSCALE_ENTRY(name, type)                                              \
  mp_status mp_##name(type* g, int64_t n, float inv_scale, int32_t* found) {      \
    if (n < 0 || found == NULL || (n > 0 && g == NULL)) return MP_ERR_INVALID_ARGUMENT; \
    if (n > 0 && active()->name(g, n, inv_scale)) *found = 1;                       \
    return MP_OK;                                                                 \
  }

MP_UNSCALE_ENTRY(unscale_f32, float)
MP_UNSCALE_ENTRY(unscale_bf16, uint16_t)
MP_UNSCALE_ENTRY(unscale_fp16, uint16_t)

mp_status mp_update_scale(float* scale, int32_t* growth_tracker, const float* found_inf,
                          double growth_factor, double backoff_factor, int64_t growth_interval,
                          int32_t* hysteresis_tracker, int32_t hysteresis, double min_scale,
                          double max_scale, int64_t* stats) {
  if (scale == NULL || growth_tracker == NULL || found_inf == NULL) return MP_ERR_INVALID_ARGUMENT;
  if (hysteresis > 1 && hysteresis_tracker == NULL) return MP_ERR_INVALID_ARGUMENT;
  mp_update_scale_rule(scale, growth_tracker, *found_inf, growth_factor, backoff_factor,
                       growth_interval, hysteresis_tracker, hysteresis, min_scale, max_scale,
                       stats);
  return MP_OK;
}

mp_status mp_adam_step(void* param, mp_dtype param_dtype, const void* grad, mp_dtype grad_dtype,
                       float* master, float* exp_avg, float* exp_avg_sq, int64_t n,
                       const mp_adam_params* p) {
  if (n < 0 || p == NULL) return MP_ERR_INVALID_ARGUMENT;
  if ((int)param_dtype < 0 || param_dtype > MP_F16 || (int)grad_dtype < 0 || grad_dtype > MP_F16)
    return MP_ERR_INVALID_ARGUMENT;
  if (grad_dtype != param_dtype && grad_dtype != MP_F32) return MP_ERR_INVALID_ARGUMENT;
  if ((param_dtype == MP_F32) != (master == NULL)) return MP_ERR_INVALID_ARGUMENT;
  if (n == 0) return MP_OK;
  if (param == NULL || grad == NULL || exp_avg == NULL || exp_avg_sq == NULL)
    return MP_ERR_INVALID_ARGUMENT;
  active()->adam_step(param, param_dtype, grad, grad_dtype, master, exp_avg, exp_avg_sq, n, p);
  return MP_OK;
}

#define MP_GRAD_NORM_ENTRY(name, type)                                                 \
  mp_status mp_##name(const type* x, int64_t n, float inv_scale, double* out) {       \
    if (n < 0 || out == NULL || (n > 0 && x == NULL)) return MP_ERR_INVALID_ARGUMENT; \
    *out = n > 0 ? active()->name(x, n, inv_scale) : 0.0;                             \
    return MP_OK;                                                                     \
  }

MP_GRAD_NORM_ENTRY(grad_norm_sumsq_f32, float)
MP_GRAD_NORM_ENTRY(grad_norm_sumsq_bf16, uint16_t)
MP_GRAD_NORM_ENTRY(grad_norm_sumsq_fp16, uint16_t)

static float canonical_nan_f32(void) {
  const uint32_t bits = 0x7FC00000u;
  float f;
  memcpy(&f, &bits, sizeof f);
  return f;
}

mp_status mp_grad_norm_finish(const double* partials, int64_t n, float* out) {
  if (n < 0 || out == NULL || (n > 0 && partials == NULL)) return MP_ERR_INVALID_ARGUMENT;
  double sum = 0.0;
  for (int64_t i = 0; i < n; ++i) sum += partials[i];
  /* sqrt of a sum of squares: >= 0, +Inf or NaN; the conversion rounds once to fp32. A NaN's
   * payload would depend on which NaN the vector sums met first (so on the ISA path): every NaN
   * result is the one canonical quiet NaN, as on CUDA. */
  *out = sum != sum ? canonical_nan_f32() : (float)__builtin_sqrt(sum);
  return MP_OK;
}
