/* Internal to the C core: the per-ISA kernel table and name mangling.
 *
 * Each kernel source (cast.c, ...) is compiled once per ISA path with MP_ISA_SUFFIX set to
 * scalar, avx2 or avx512 and that path's compiler flags; MP_ISA_FN(name) gives every build its
 * own symbol names. The kernels are listed once, as the rows of MP_KERNELS below, from which come
 * the table's fields (mp_kernel_table), each build's declarations (mp_k_<name>__<suffix>) and its
 * table (table.c, mp_kernels__<suffix>); the ISA builds are the rows of MP_ISAS, from which come
 * the tables' declarations and cpu.c's choice of table. cpu.c holds the public mp_* entry
 * points, which call through the active table. */
#ifndef MPEXT_CORE_ISA_H
#define MPEXT_CORE_ISA_H

#include <stdint.h>

#include "mpext/mpext.h"
#include "mpext/step_storage.h" /* mp_step_tensor, mp_step_scalars, mp_rule_scalars */

#define MP_CAT_(a, b) a##__##b
#define MP_CAT(a, b) MP_CAT_(a, b)
#ifdef MP_ISA_SUFFIX
#define MP_ISA_FN(name) MP_CAT(name, MP_ISA_SUFFIX)
#endif

/* The ISA builds: X(MP_ISA_* suffix, the build's MP_ISA_SUFFIX). The x86 paths exist where the
 * build defines MP_X86_PATHS (build_tools/core.py). */
#if defined(MP_X86_PATHS)
#define MP_ISAS(X) X(SCALAR, scalar) X(AVX2, avx2) X(AVX512, avx512)
#else
#define MP_ISAS(X) X(SCALAR, scalar)
#endif

/* The operations every ISA build provides, one row each: X(return type, name, (parameters)).
 * Counts are already validated by cpu.c.
 *   to_*: the casts; the four round-to-nearest ones take stream: nonzero lets a large output go
 *     past the cache (stream.h) (cast.c);
 *   unscale_*: in-place g *= inv_scale; returns 1 if any input was NaN/Inf (scale.c);
 *   step: one optimizer step over elements [start, start + n) of t, arguments already checked,
 *     the storage's scalars s and the rule's r (step.c), through a fast path where one is kept
 *     for the mode (csrc/core/fast/), else the tile pipeline;
 *   step_generic: the same step through the tile pipeline alone: the same bits (the C tests
 *     compare the two on every mode);
 *   grad_norm_sumsq_*: the sum over n elements of (x * inv_scale)^2 in double, in a fixed order
 *     (norm.c);
 *   fp8_*: FP8 block quantization of rows x cols elements (fp8.c); key is the
 *     stochastic-rounding stream's (mp_sr_key), position element (0, 0)'s. */
#define MP_KERNELS(X)                                                                             \
  X(void, to_bf16_f32, (const float* src, uint16_t* dst, int64_t n, int stream))                  \
  X(void, to_bf16_sr_f32, (const float* src, uint16_t* dst, int64_t n, uint64_t seed,             \
                           uint64_t offset))                                                      \
  X(void, to_fp16_f32, (const float* src, uint16_t* dst, int64_t n, int stream))                  \
  X(void, to_fp32_bf16, (const uint16_t* src, float* dst, int64_t n, int stream))                 \
  X(void, to_fp32_fp16, (const uint16_t* src, float* dst, int64_t n, int stream))                 \
  X(int, unscale_f32, (float* g, int64_t n, float inv_scale))                                     \
  X(int, unscale_bf16, (uint16_t* g, int64_t n, float inv_scale))                                 \
  X(int, unscale_fp16, (uint16_t* g, int64_t n, float inv_scale))                                 \
  X(void, step, (const mp_step_tensor* t, int64_t start, int64_t n, const mp_step_scalars* s,     \
                 const mp_rule_scalars* r))                                                       \
  X(void, step_generic, (const mp_step_tensor* t, int64_t start, int64_t n,                       \
                         const mp_step_scalars* s, const mp_rule_scalars* r))                     \
  X(double, grad_norm_sumsq_f32, (const float* x, int64_t n, float inv_scale))                    \
  X(double, grad_norm_sumsq_bf16, (const uint16_t* x, int64_t n, float inv_scale))                \
  X(double, grad_norm_sumsq_fp16, (const uint16_t* x, int64_t n, float inv_scale))                \
  X(void, fp8_quantize, (const void* x, int dtype, uint8_t* q, float* scales, int64_t rows,       \
                         int64_t cols, int64_t block, int fmt, int pow2, int sr, uint64_t key,    \
                         uint64_t position))                                                      \
  X(void, fp8_dequantize, (const uint8_t* q, const float* scales, void* out, int dtype,           \
                           int64_t rows, int64_t cols, int64_t block, int fmt))

#define MP_KERNEL_FIELD_(ret, name, params) ret(*name) params;
typedef struct mp_kernel_table {
  MP_KERNELS(MP_KERNEL_FIELD_)
} mp_kernel_table;
#undef MP_KERNEL_FIELD_

#define MP_KERNEL_TABLE_DECL_(ID, suffix) extern const mp_kernel_table mp_kernels__##suffix;
MP_ISAS(MP_KERNEL_TABLE_DECL_)
#undef MP_KERNEL_TABLE_DECL_

#ifdef MP_ISA_SUFFIX
/* This build's kernels (defined in cast.c, scale.c, step.c, norm.c, ...; gathered into a table
 * by table.c). */
#define MP_KERNEL_DECL_(ret, name, params) ret MP_ISA_FN(mp_k_##name) params;
MP_KERNELS(MP_KERNEL_DECL_)
#undef MP_KERNEL_DECL_

/* Steps a piece (positions sharing their high 32 bits) of t through the fast path kept for its
 * mode (csrc/core/fast/), kind its param storage (formats.h MP_PV_*); returns 0, having done
 * nothing, when the mode has none (always, in a build without fast paths: MP_NO_FAST_PATHS). */
int MP_ISA_FN(mp_k_fast_step)(const mp_step_tensor* t, int64_t start, int64_t n,
                              const mp_step_scalars* s, const mp_rule_scalars* r, int kind);
#endif

#endif /* MPEXT_CORE_ISA_H */
