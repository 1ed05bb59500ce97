/* mpext C API: the fused optimizer step -- one engine for every rule (Adam/AdamW, Lion, SGD:
 * the rows of mpext/rules/rules.h) and every storage format -- with optional FP32 master weights
 * and a fused unscale of the gradient. The structs are shared by the CPU entry points here and
 * the CUDA launcher of mpext/step_cuda.h; the numerics are the rule headers' (mpext/rules/) and
 * the storage's (mpext/step_storage.h), which both tiers call.
 *
 * Per element, in fp32, g, p and the moments read from their storage (bf16 moments widened, a
 * remainder joined to its param, 8-bit codes decoded):
 *   g = grad * inv_scale;  (unscale_grads: grad = g, rounded to its dtype)
 *   p, moments = the options' rule (g, p, moments)   (e.g. mpext/rules/adam.h: torch's AdamW)
 * then the moments and p stored back (see mp_step_tensor for the storage of each). */
#ifndef MPEXT_STEP_H
#define MPEXT_STEP_H

#include <stdint.h>

#include "mpext/formats/formats.h" /* the moment formats, MP_FMT_* */
#include "mpext/mpext.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One param of a step: n elements of each array, all in one memory layout.
 *   param:      n values of param_dtype, updated in place;
 *   grad:       n values of grad_dtype (param_dtype or MP_F32), read (and, with the options'
 *               unscale_grads, overwritten with the unscaled gradient);
 *   exp_avg, exp_avg_sq: the rule's moments (mp_rule_moments: 2, 1 or 0 of them; the
 *               others NULL): n values each in the format exp_avg_format / exp_avg_sq_format (an
 *               MP_FMT_* of mpext/formats/formats.h: MP_FMT_F32, or MP_FMT_BF16: stored with
 *               stochastic rounding), read and written; or a block format, MP_FMT_Q8S for
 *               the first moment (with MP_FMT_Q8U for a second): 8-bit codes of blocks of the
 *               options' q8_block elements, each block
 *               with its fp32 absmax in exp_avg_scale / exp_avg_sq_scale (ceil(n / q8_block)
 *               floats each, read and written): see "8-bit moments" below;
 *   step:       one float, the param's step count before this step; never NULL.
 * An fp32 param is its own value (master and remainder NULL). A bf16/fp16 param's fp32 value
 * (the master) is kept in one of three ways:
 *   master:     n floats, read and written; the param is written as its round to nearest even;
 *   remainder:  (bf16 params only) n int16, the master's bits less the param's: the master is
 *               (param << 16) + remainder, exactly, so a bf16 param with its remainder holds the
 *               fp32 master in 4 bytes instead of 6 (see mpext/step_common.h, mp_bf16_join);
 *   neither:    no master: the update is computed from the param's value and written back
 *               rounded to nearest even, or stochastically with the options' sr_params.
 * A bf16 param's fp32 master that lands exactly halfway between two bf16 values above an even
 * one (low half 0x8000, param bit 0 clear: 1 of 2^17 values) is stored one fp32 ulp below, with
 * a master as with a remainder, which 16 bits could not tell from the same point above an odd
 * one: so the two modes compute the same bits, and the param is always the master's round to
 * nearest even.
 * sr_stream (< 2^32) numbers the param's stochastic-rounding streams (its position in the
 * optimizer).
 * ema, when not NULL, is moved towards the param's new fp32 value in the same pass:
 *   ema = lerp(ema, value, 1 - ema_decay)   (torch.lerp's two forms, each operation rounded)
 * with a weight of 1 (a copy) on the param's first step, as torch.optim.swa_utils.AveragedModel
 * starts; the value is the master as stored (a bf16 master after the tie rule below), or, with
 * no master, the fp32 update before the param is rounded.
 * When n == 0 only step is used (the others may be NULL).
 *
 * 8-bit moments. Element i belongs to block i / q8_block; the block's codes are relative to a
 * power of two R = 2^(E - 127), E the fp32 exponent field of its scale (the absmax of the
 * block's values) rounded up to 5 significant bits, at least 2^ebits (so that no value of the
 * block exceeds the largest code, and R is a normal float); a block whose scale is NaN or Inf
 * reads as NaN. exp_avg (int8): bit 7 the sign, bits 6..0 an E3M4 magnitude; exp_avg_sq
 * (uint8): an E4M4 magnitude. A magnitude code c = (e << 4) | f is worth
 * R * 2^(e - T) * (1 + f / 16) for e >= 1 and R * 2^(1 - T) * f / 16 for e = 0, T = 7 (E3M4)
 * or 15 (E4M4): a 5-significant-bit float whose top binade is the block's, decoded exactly (see
 * mpext/step_common.h, mp_q8_decode_m/v; docs/moments_8bit.md says why these codes). A step decodes
 * the old values, updates them in fp32 (the param's update uses these fp32 moments), takes each
 * block's new absmax and writes the block's codes -- stochastically rounded (unbiased), or to
 * nearest with the options' moments_nearest -- and its scale, all in one pass over memory. A
 * second moment that decoded below m^2 * (1 - beta2) (1 - beta1^2 / beta2) / (1 - beta1)^2 is
 * raised to it before the update: an exponential average of the same gradients never is
 * (Cauchy-Schwarz), so only a v lost to the code (a small v beside a large one in its block)
 * is, and m / sqrt(v) stays bounded. */
typedef struct mp_step_tensor {
  void* param;
  int32_t param_dtype; /* an mp_dtype */
  void* grad;
  int32_t grad_dtype; /* an mp_dtype */
  float* master;
  void* exp_avg;
  void* exp_avg_sq;
  float* step;
  int64_t n;
  int16_t* remainder;
  int32_t exp_avg_format;    /* an MP_FMT_*: F32, BF16, or Q8S (with Q8U below, if kept) */
  int32_t exp_avg_sq_format; /* an MP_FMT_*: F32, BF16, or Q8U (with Q8S above); not read by
                                a rule keeping one moment or none */
  uint64_t sr_stream;
  float* exp_avg_scale;     /* 8-bit moments: one absmax per block, else NULL */
  float* exp_avg_sq_scale;
  float* ema; /* n floats, an exponential moving average of the fp32 value, or NULL for none */
  int64_t offset; /* >= 0: the position of element 0 in the whole param (a shard's start), added
                     to the element positions of the random bits so that a shard rounds as the
                     unsharded param would; with 8-bit moments a multiple of q8_block */
} mp_step_tensor;

/* The settings of one call, shared by its params. The hyperparameter fields (beta1 .. decoupled,
 * maximize, dampening, nesterov) are read by the rule as its header says (e.g. SGD's momentum is
 * beta1); the rest are the storage's. lr, inv_scale and found_inf point at memory
 * of the tier that runs the call (host memory for the CPU entry points, device memory for CUDA),
 * so that a step needs no host synchronisation. */
typedef struct mp_step_options {
  double beta1, beta2;    /* the rule's */
  double eps;
  double weight_decay;    /* >= 0, finite (every rule) */
  int32_t decoupled;
  int32_t maximize;       /* 1: ascend */
  const float* lr;        /* the learning rate, or NULL to use lr_value */
  float lr_value;
  const float* inv_scale; /* multiplies every grad, or NULL for 1 */
  const float* found_inf; /* when non-NULL and *found_inf != 0 the step writes nothing */
  int32_t unscale_grads;  /* 1: write grad * inv_scale (rounded to the grad's dtype) back into
                             grad in the same pass, as torch's fused optimizers leave it; nothing
                             is written when inv_scale is NULL or 1 (the values would not change) */
  int32_t sr_params;      /* 1: a param without master or remainder is written with stochastic
                             rounding (bf16 or fp16), else to nearest even */
  int32_t moments_nearest; /* 1: bf16 moments rounded to nearest even instead of stochastically
                              (biased: for comparisons only) */
  uint64_t seed;          /* stochastic rounding draws from the streams mp_sr_key(seed, t, 2k)
                             (bf16 moments), (seed, t, 2k + 1) (param) and (seed, t, 2^33 + k)
                             (8-bit moments: 16 bits for exp_avg, 16 for exp_avg_sq), t the step
                             count after this step, k the tensor's sr_stream, at the element's
                             position */
  int64_t q8_block;       /* elements per block of 8-bit moments: a power of two in
                             [MP_Q8_BLOCK_MIN, MP_Q8_BLOCK_MAX]; read only for tensors that
                             have them */
  double ema_decay;       /* in [0, 1]: the decay of the tensors' ema arrays (if any) */
  /* The update rule, an MP_RULE_* of mpext/rules/rules.h (0, Adam/AdamW, when
   * zero-initialized); its header says which of the hyperparameter fields above and below it
   * reads, their ranges and the moments it keeps. */
  int32_t rule;
  double dampening;
  int32_t nesterov;
} mp_step_options;

/* The range of q8_block: below 32 the scales cost more than 0.25 bytes per element, above 2048
 * a block no longer fits the 2048 elements a CUDA block holds in registers at once (nor its
 * fp32 values half of a 32 KiB L1 cache on the CPU), for a saving under 0.004 bytes. */
#define MP_Q8_BLOCK_MIN 32
#define MP_Q8_BLOCK_MAX 2048

/* Elements [start, start + count) of t's arrays, stepped by the options' rule (the moments it
 * keeps: mp_rule_moments), on the calling thread and the active ISA path:
 * unless *o->found_inf != 0, reads the grads, updates master (or the fp32 param), exp_avg and
 * exp_avg_sq, and writes the param, from the step count *t->step + 1 (t->step is only read: see
 * mp_step_advance_steps). Every ISA path gives the same bits. Returns MP_ERR_INVALID_ARGUMENT
 * (writing nothing) for a NULL t or o, a bad dtype or master (as described above), a range
 * outside [0, t->n), a NULL array with count > 0, or options out of range; with 8-bit moments
 * also for a bad q8_block, or a range or t->offset that does not start on a block boundary, or
 * a range that does not end on one (or at n). Arrays of one tensor must not overlap each other or the options' scalars. */
mp_status mp_step(const mp_step_tensor* t, int64_t start, int64_t count, const mp_step_options* o);

/* Adds 1 to *ts[k].step for every k < ntensors, unless *o->found_inf != 0: the end of a step
 * whose elements mp_step has updated. Returns MP_ERR_INVALID_ARGUMENT (writing nothing)
 * for ntensors < 0, or NULL ts, o or step pointer. */
mp_status mp_step_advance_steps(const mp_step_tensor* ts, int64_t ntensors,
                                const mp_step_options* o);

#ifdef __cplusplus
}
#endif

/* The rules (their enum MP_RULE_*, their headers and what is generated from their rows): after
 * the structs, which the rule headers take. */
#include "mpext/rules/rules.h"

#endif /* MPEXT_STEP_H */
