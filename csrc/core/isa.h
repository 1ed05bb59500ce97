/* Internal to the C core: the per-ISA kernel table and name mangling.
 *
 * Each kernel source (cast.c, ...) is compiled once per ISA path with MP_ISA_SUFFIX set to
 * scalar, avx2 or avx512 and that path's compiler flags; MP_ISA_FN(name) gives every build its
 * own symbol names, and table.c gathers each build's kernels into one table, mp_kernels__<suffix>. cpu.c holds the
 * public mp_* entry points, which call through the active table. */
#ifndef MPEXT_CORE_ISA_H
#define MPEXT_CORE_ISA_H

#include <stdint.h>

#include "mpext/adam_rule.h"
#include "mpext/lion_rule.h"
#include "mpext/muon_rule.h"
#include "mpext/sgd_rule.h"
#include "mpext/mpext.h"

#define MP_CAT_(a, b) a##__##b
#define MP_CAT(a, b) MP_CAT_(a, b)
#ifdef MP_ISA_SUFFIX
#define MP_ISA_FN(name) MP_CAT(name, MP_ISA_SUFFIX)
#endif

/* The operations every ISA build provides. Counts are already validated by cpu.c. The four
 * round-to-nearest casts take stream: nonzero lets a large output go past the cache
 * (stream.h). */
typedef struct mp_kernel_table {
  void (*to_bf16_f32)(const float* src, uint16_t* dst, int64_t n, int stream);
  void (*to_bf16_sr_f32)(const float* src, uint16_t* dst, int64_t n, uint64_t seed,
                         uint64_t offset);
  void (*to_fp16_f32)(const float* src, uint16_t* dst, int64_t n, int stream);
  void (*to_fp32_bf16)(const uint16_t* src, float* dst, int64_t n, int stream);
  void (*to_fp32_fp16)(const uint16_t* src, float* dst, int64_t n, int stream);
  /* In-place g *= inv_scale; returns 1 if any input was NaN/Inf (scale.c). */
  int (*unscale_f32)(float* g, int64_t n, float inv_scale);
  int (*unscale_bf16)(uint16_t* g, int64_t n, float inv_scale);
  int (*unscale_fp16)(uint16_t* g, int64_t n, float inv_scale);
  /* One fused Adam/AdamW step over elements [start, start + n) of t, arguments already
   * checked (adam.c). */
  void (*adam_step)(const mp_adam_tensor* t, int64_t start, int64_t n, const mp_adam_scalars* s);
  /* The same step through the engine's tile pipeline alone, never a hand-fused loop: the same
   * bits (the C tests compare the two on every mode). */
  void (*adam_step_generic)(const mp_adam_tensor* t, int64_t start, int64_t n,
                            const mp_adam_scalars* s);
  /* One Lion / SGD step over elements [start, start + n) of t through the same pipeline, the
   * rule's scalars beside the storage's s (adam.c). */
  void (*lion_step)(const mp_adam_tensor* t, int64_t start, int64_t n, const mp_adam_scalars* s,
                    const mp_lion_scalars* r);
  void (*sgd_step)(const mp_adam_tensor* t, int64_t start, int64_t n, const mp_adam_scalars* s,
                   const mp_sgd_scalars* r);
  void (*muon_step)(const mp_adam_tensor* t, int64_t start, int64_t n, const mp_adam_scalars* s,
                    const mp_muon_scalars* r); /* muon: either elementwise phase */
  /* Sum over n elements of (x * inv_scale)^2 in double, in a fixed order (norm.c). */
  double (*grad_norm_sumsq_f32)(const float* x, int64_t n, float inv_scale);
  double (*grad_norm_sumsq_bf16)(const uint16_t* x, int64_t n, float inv_scale);
  double (*grad_norm_sumsq_fp16)(const uint16_t* x, int64_t n, float inv_scale);
  /* FP8 block quantization of rows x cols elements, arguments already checked (fp8.c); key is
   * the stochastic-rounding stream's (mp_sr_key), position element (0, 0)'s. */
  void (*fp8_quantize)(const void* x, int dtype, uint8_t* q, float* scales, int64_t rows,
                       int64_t cols, int64_t block, int fmt, int pow2, int sr, uint64_t key,
                       uint64_t position);
  void (*fp8_dequantize)(const uint8_t* q, const float* scales, void* out, int dtype,
                         int64_t rows, int64_t cols, int64_t block, int fmt);
} mp_kernel_table;

extern const mp_kernel_table mp_kernels__scalar;
extern const mp_kernel_table mp_kernels__avx2;
extern const mp_kernel_table mp_kernels__avx512;

#ifdef MP_ISA_SUFFIX
/* This build's kernels (defined in cast.c, scale.c, adam.c, norm.c, ...; gathered into a table by table.c). */
void MP_ISA_FN(mp_k_to_bf16_f32)(const float* src, uint16_t* dst, int64_t n, int stream);
void MP_ISA_FN(mp_k_to_bf16_sr_f32)(const float* src, uint16_t* dst, int64_t n, uint64_t seed,
                                    uint64_t offset);
void MP_ISA_FN(mp_k_to_fp16_f32)(const float* src, uint16_t* dst, int64_t n, int stream);
void MP_ISA_FN(mp_k_to_fp32_bf16)(const uint16_t* src, float* dst, int64_t n, int stream);
void MP_ISA_FN(mp_k_to_fp32_fp16)(const uint16_t* src, float* dst, int64_t n, int stream);
int MP_ISA_FN(mp_k_unscale_f32)(float* g, int64_t n, float inv_scale);
int MP_ISA_FN(mp_k_unscale_bf16)(uint16_t* g, int64_t n, float inv_scale);
int MP_ISA_FN(mp_k_unscale_fp16)(uint16_t* g, int64_t n, float inv_scale);
void MP_ISA_FN(mp_k_adam_step)(const mp_adam_tensor* t, int64_t start, int64_t n,
                               const mp_adam_scalars* s);
void MP_ISA_FN(mp_k_adam_step_generic)(const mp_adam_tensor* t, int64_t start, int64_t n,
                                       const mp_adam_scalars* s);
void MP_ISA_FN(mp_k_lion_step)(const mp_adam_tensor* t, int64_t start, int64_t n,
                               const mp_adam_scalars* s, const mp_lion_scalars* r);
void MP_ISA_FN(mp_k_sgd_step)(const mp_adam_tensor* t, int64_t start, int64_t n,
                              const mp_adam_scalars* s, const mp_sgd_scalars* r);
void MP_ISA_FN(mp_k_muon_step)(const mp_adam_tensor* t, int64_t start, int64_t n,
                               const mp_adam_scalars* s, const mp_muon_scalars* r);
/* Steps a piece (positions sharing their high 32 bits) of t through the hand-fused loop kept
 * for its mode (adam_fused.c), kind its param storage (formats.h MP_PV_*); returns 0, having
 * done nothing, when the mode has none. */
int MP_ISA_FN(mp_k_adam_fused)(const mp_adam_tensor* t, int64_t start, int64_t n,
                               const mp_adam_scalars* s, int kind);
double MP_ISA_FN(mp_k_grad_norm_sumsq_f32)(const float* x, int64_t n, float inv_scale);
double MP_ISA_FN(mp_k_grad_norm_sumsq_bf16)(const uint16_t* x, int64_t n, float inv_scale);
double MP_ISA_FN(mp_k_grad_norm_sumsq_fp16)(const uint16_t* x, int64_t n, float inv_scale);
void MP_ISA_FN(mp_k_fp8_quantize)(const void* x, int dtype, uint8_t* q, float* scales,
                                  int64_t rows, int64_t cols, int64_t block, int fmt, int pow2,
                                  int sr, uint64_t key, uint64_t position);
void MP_ISA_FN(mp_k_fp8_dequantize)(const uint8_t* q, const float* scales, void* out, int dtype,
                                    int64_t rows, int64_t cols, int64_t block, int fmt);
#endif

#endif /* MPEXT_CORE_ISA_H */
