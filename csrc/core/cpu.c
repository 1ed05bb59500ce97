/* CPU feature detection, ISA path selection and the public mp_* entry points. Compiled once,
 * with baseline flags: nothing here may use an instruction the oldest supported CPU lacks. */
#include <stdatomic.h>
#include <stddef.h>
#include <string.h>

#include "isa.h"
#include "mpext/adam.h" /* the mp_adam_* aliases, for one release */
#include "mpext/cast.h"
#include "mpext/fp8.h"
#include "mpext/norm.h"
#include "mpext/scale.h"
#include "mpext/scale_rule.h"
#include "mpext/step_storage.h"

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
#define MP_ISA_CASE_(ID, suffix) \
  case MP_ISA_##ID: return &mp_kernels__##suffix;
    MP_ISAS(MP_ISA_CASE_)
#undef MP_ISA_CASE_
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
  active()->to_bf16_f32(src, dst, n, 1);
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
  active()->to_fp16_f32(src, dst, n, 1);
  return MP_OK;
}

mp_status mp_to_fp32_bf16(const uint16_t* src, float* dst, int64_t n) {
  MP_CHECK_N(src, dst, n);
  active()->to_fp32_bf16(src, dst, n, 1);
  return MP_OK;
}

mp_status mp_to_fp32_fp16(const uint16_t* src, float* dst, int64_t n) {
  MP_CHECK_N(src, dst, n);
  active()->to_fp32_fp16(src, dst, n, 1);
  return MP_OK;
}

mp_status mp_cast(const void* src, mp_dtype src_dtype, void* dst, mp_dtype dst_dtype, int64_t n,
                  int stochastic, uint64_t seed, uint64_t position, int dst_fresh) {
  const int stream = !dst_fresh;
  if (!mp_cast_supported(src_dtype, dst_dtype, stochastic)) return MP_ERR_INVALID_ARGUMENT;
  MP_CHECK_N(src, dst, n);
  if (src_dtype == dst_dtype) {
    memcpy(dst, src, (size_t)n * (size_t)MP_DTYPE_BYTES(src_dtype));
  } else if (dst_dtype == MP_BF16) {
    if (stochastic) {
      active()->to_bf16_sr_f32((const float*)src, (uint16_t*)dst, n, seed, position);
    } else {
      active()->to_bf16_f32((const float*)src, (uint16_t*)dst, n, stream);
    }
  } else if (dst_dtype == MP_F16) {
    active()->to_fp16_f32((const float*)src, (uint16_t*)dst, n, stream);
  } else if (src_dtype == MP_BF16) {
    active()->to_fp32_bf16((const uint16_t*)src, (float*)dst, n, stream);
  } else {
    active()->to_fp32_fp16((const uint16_t*)src, (float*)dst, n, stream);
  }
  return MP_OK;
}

mp_status mp_unscale(void* g, mp_dtype dtype, int64_t n, float inv_scale, int32_t* found) {
  if (n < 0 || found == NULL || (n > 0 && g == NULL)) return MP_ERR_INVALID_ARGUMENT;
  if ((int)dtype < 0 || dtype >= MP_DTYPE_COUNT) return MP_ERR_INVALID_ARGUMENT;
  if (n == 0) return MP_OK;
  const mp_kernel_table* k = active();
  int bad = dtype == MP_F32    ? k->unscale_f32((float*)g, n, inv_scale)
            : dtype == MP_BF16 ? k->unscale_bf16((uint16_t*)g, n, inv_scale)
                               : k->unscale_fp16((uint16_t*)g, n, inv_scale);
  if (bad) *found = 1;
  return MP_OK;
}

mp_status mp_update_scale(const mp_scale_update* u) {
  if (!mp_scale_update_ok(u)) return MP_ERR_INVALID_ARGUMENT;
  mp_update_scale_rule(u);
  return MP_OK;
}

mp_status mp_step(const mp_step_tensor* t, int64_t start, int64_t count,
                  const mp_step_options* o) {
  if (t == NULL || o == NULL || !mp_step_options_ok(o) ||
      !mp_step_tensor_ok(t, mp_rule_moments(o)))
    return MP_ERR_INVALID_ARGUMENT;
  if (start < 0 || count < 0 || start > t->n || count > t->n - start)
    return MP_ERR_INVALID_ARGUMENT;
  if (mp_rule_moments(o) > 0 && mp_step_blocks(t) &&
      (!mp_q8_block_ok(o->q8_block) || start % o->q8_block != 0 ||
       t->offset % o->q8_block != 0 || (count % o->q8_block != 0 && start + count != t->n)))
    return MP_ERR_INVALID_ARGUMENT; /* a block is updated whole, by one call */
  if (count == 0 || mp_step_skip(o)) return MP_OK;
  const mp_step_scalars s = mp_step_scalars_now(o, t->step, t->sr_stream);
  const mp_rule_scalars r = mp_rule_scalars_now(o, t->step);
  active()->step(t, start, count, &s, &r);
  return MP_OK;
}

mp_status mp_step_advance_steps(const mp_step_tensor* ts, int64_t ntensors,
                                const mp_step_options* o) {
  if (ntensors < 0 || o == NULL || (ntensors > 0 && ts == NULL)) return MP_ERR_INVALID_ARGUMENT;
  for (int64_t k = 0; k < ntensors; ++k) {
    if (ts[k].step == NULL) return MP_ERR_INVALID_ARGUMENT;
  }
  if (mp_step_skip(o)) return MP_OK;
  for (int64_t k = 0; k < ntensors; ++k) *ts[k].step = *ts[k].step + 1.0f;
  return MP_OK;
}

mp_status mp_adam_step(const mp_adam_tensor* t, int64_t start, int64_t count,
                       const mp_adam_options* o) {
  return mp_step(t, start, count, o);
}

mp_status mp_adam_advance_steps(const mp_adam_tensor* ts, int64_t ntensors,
                                const mp_adam_options* o) {
  return mp_step_advance_steps(ts, ntensors, o);
}

mp_status mp_grad_norm_sumsq(const void* x, mp_dtype dtype, int64_t n, float inv_scale,
                             double* out) {
  if (n < 0 || out == NULL || (n > 0 && x == NULL)) return MP_ERR_INVALID_ARGUMENT;
  if ((int)dtype < 0 || dtype >= MP_DTYPE_COUNT) return MP_ERR_INVALID_ARGUMENT;
  const mp_kernel_table* k = active();
  *out = n == 0             ? 0.0
         : dtype == MP_F32  ? k->grad_norm_sumsq_f32((const float*)x, n, inv_scale)
         : dtype == MP_BF16 ? k->grad_norm_sumsq_bf16((const uint16_t*)x, n, inv_scale)
                            : k->grad_norm_sumsq_fp16((const uint16_t*)x, n, inv_scale);
  return MP_OK;
}

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

static int fp8_args_ok(int dtype, int64_t rows, int64_t cols, int64_t block, int fmt,
                       const void* a, const void* b, const void* c) {
  if (rows < 0 || cols < 0 || block < 1) return 0;
  if (dtype != MP_F32 && dtype != MP_BF16 && dtype != MP_F16) return 0;
  if (fmt != MP_FP8_E4M3 && fmt != MP_FP8_E5M2) return 0;
  if (rows > 0 && cols > INT64_MAX / rows) return 0;
  return rows * cols == 0 || (a != NULL && b != NULL && c != NULL);
}

mp_status mp_fp8_quantize(const void* x, mp_dtype dtype, uint8_t* q, float* scales, int64_t rows,
                          int64_t cols, int64_t block, int fmt, int pow2, int stochastic,
                          uint64_t seed, uint64_t position) {
  if (!fp8_args_ok((int)dtype, rows, cols, block, fmt, x, q, scales))
    return MP_ERR_INVALID_ARGUMENT;
  if (rows * cols == 0) return MP_OK;
  active()->fp8_quantize(x, (int)dtype, q, scales, rows, cols, block, fmt, pow2 != 0,
                         stochastic != 0, mp_sr_key(seed, 0, 0), position);
  return MP_OK;
}

mp_status mp_fp8_dequantize(const uint8_t* q, const float* scales, void* out, mp_dtype out_dtype,
                            int64_t rows, int64_t cols, int64_t block, int fmt) {
  if (!fp8_args_ok((int)out_dtype, rows, cols, block, fmt, q, scales, out))
    return MP_ERR_INVALID_ARGUMENT;
  if (rows * cols == 0) return MP_OK;
  active()->fp8_dequantize(q, scales, out, (int)out_dtype, rows, cols, block, fmt);
  return MP_OK;
}
