/* mpext C API: the fused Adam/AdamW step, with optional FP32 master weights and a fused unscale
 * of the gradient. The structs are shared by the CPU entry points here and the CUDA launcher of
 * mpext/adam_cuda.h; the numerics, per-step scalars included, are mpext/adam_rule.h's, which
 * both tiers call.
 *
 * Per element, in fp32 (adam_rule.h has the exact order of operations), m, v and p read from
 * their storage (bf16 moments widened, a remainder joined to its param):
 *   g = grad * inv_scale;  (unscale_grads: grad = g, rounded to its dtype);  if maximize: g = -g
 *   Adam (L2):      g = g + weight_decay * p
 *   AdamW:          p = p * (1 - lr * weight_decay)
 *   m = lerp(m, g, 1 - beta1);  v = v * beta2 + ((1 - beta2) * g) * g
 *   p = p - (lr / (1 - beta1^t)) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
 * which is torch.optim.Adam / AdamW's single-tensor path, with t the param's step count plus one,
 * then m, v and p stored back (see mp_adam_tensor for the storage of each). */
#ifndef MPEXT_ADAM_H
#define MPEXT_ADAM_H

#include <stdint.h>

#include "mpext/mpext.h"

#ifdef __cplusplus
extern "C" {
#endif

/* One param of an Adam step: n elements of each array, all in one memory layout.
 *   param:      n values of param_dtype, updated in place;
 *   grad:       n values of grad_dtype (param_dtype or MP_F32), read (and, with the options'
 *               unscale_grads, overwritten with the unscaled gradient);
 *   exp_avg, exp_avg_sq: n values each of exp_avg_dtype / exp_avg_sq_dtype (MP_F32, or MP_BF16:
 *               stored with stochastic rounding), read and written; or, as a pair, MP_I8 and
 *               MP_U8: 8-bit codes of blocks of the options' q8_block elements, each block
 *               with its fp32 absmax in exp_avg_scale / exp_avg_sq_scale (ceil(n / q8_block)
 *               floats each, read and written): see "8-bit moments" below;
 *   step:       one float, the param's step count before this step; never NULL.
 * An fp32 param is its own value (master and remainder NULL). A bf16/fp16 param's fp32 value
 * (the master) is kept in one of three ways:
 *   master:     n floats, read and written; the param is written as its round to nearest even;
 *   remainder:  (bf16 params only) n int16, the master's bits less the param's: the master is
 *               (param << 16) + remainder, exactly, so a bf16 param with its remainder holds the
 *               fp32 master in 4 bytes instead of 6 (see adam_rule.h, mp_bf16_split);
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
 * adam_rule.h, mp_q8_decode_m/v; docs/moments_8bit.md says why these codes). A step decodes
 * the old values, updates them in fp32 (the param's update uses these fp32 moments), takes each
 * block's new absmax and writes the block's codes -- stochastically rounded (unbiased), or to
 * nearest with the options' moments_nearest -- and its scale, all in one pass over memory. A
 * second moment that decoded below m^2 * (1 - beta2) (1 - beta1^2 / beta2) / (1 - beta1)^2 is
 * raised to it before the update: an exponential average of the same gradients never is
 * (Cauchy-Schwarz), so only a v lost to the code (a small v beside a large one in its block)
 * is, and m / sqrt(v) stays bounded. */
typedef struct mp_adam_tensor {
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
  int32_t exp_avg_dtype;    /* an mp_dtype: MP_F32, MP_BF16, or MP_I8 (with MP_U8 below) */
  int32_t exp_avg_sq_dtype; /* an mp_dtype: MP_F32, MP_BF16, or MP_U8 (with MP_I8 above) */
  uint64_t sr_stream;
  float* exp_avg_scale;     /* 8-bit moments: one absmax per block, else NULL */
  float* exp_avg_sq_scale;
  float* ema; /* n floats, an exponential moving average of the fp32 value, or NULL for none */
  int64_t offset; /* >= 0: the position of element 0 in the whole param (a shard's start), added
                     to the element positions of the random bits so that a shard rounds as the
                     unsharded param would; with 8-bit moments a multiple of q8_block */
} mp_adam_tensor;

/* The settings of one call, shared by its params. lr, inv_scale and found_inf point at memory
 * of the tier that runs the call (host memory for the CPU entry points, device memory for CUDA),
 * so that a step needs no host synchronisation. */
typedef struct mp_adam_options {
  double beta1, beta2;    /* in [0, 1) */
  double eps;             /* >= 0, finite */
  double weight_decay;    /* >= 0, finite: L2 for Adam, decoupled for AdamW */
  int32_t decoupled;      /* 1: AdamW, 0: Adam */
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
  /* The update rule (0, Adam/AdamW, when zero-initialized) and what its hyperparameters are:
   *   MP_RULE_ADAM: the above;
   *   MP_RULE_LION: beta1, beta2 in [0, 1], weight_decay (decoupled), maximize (mpext/lion_rule.h);
   *     one moment, exp_avg (exp_avg_sq NULL; 8-bit: MP_I8 codes with exp_avg_scale);
   *   MP_RULE_SGD: beta1 the momentum (>= 0), dampening, nesterov, weight_decay (L2), maximize
   *     (mpext/sgd_rule.h); the moment exp_avg is the momentum buffer, none (NULL) when the
   *     momentum is 0; eps is not read;
   *   MP_RULE_MUON_MOMENTUM / MP_RULE_MUON_UPDATE (muon: Muon's elementwise phases,
   *     mpext/muon_rule.h): phase 1 beta1 the momentum (>= 0, finite), nesterov; the param is
   *     the update it writes, exp_avg the momentum buffer; the step counts do not advance.
   *     Phase 3 beta1 the lr ratio (> 0, finite), weight_decay (decoupled); no moment, the
   *     grad is the orthogonalised update. */
  int32_t rule;
  double dampening;
  int32_t nesterov;
} mp_adam_options;

/* The rules of mp_adam_options.rule. */
enum {
  MP_RULE_ADAM = 0,
  MP_RULE_LION = 1,
  MP_RULE_SGD = 2,
  MP_RULE_MUON_MOMENTUM = 3, /* muon */
  MP_RULE_MUON_UPDATE = 4,   /* muon */
  MP_RULE_COUNT = 5
};

/* The range of q8_block: below 32 the scales cost more than 0.25 bytes per element, above 2048
 * a block no longer fits the 2048 elements a CUDA block holds in registers at once (nor its
 * fp32 values half of a 32 KiB L1 cache on the CPU), for a saving under 0.004 bytes. */
#define MP_Q8_BLOCK_MIN 32
#define MP_Q8_BLOCK_MAX 2048

/* Elements [start, start + count) of t's arrays, stepped by the options' rule (Adam, Lion, SGD:
 * the moments it keeps, see mp_adam_options.rule), on the calling thread and the active ISA path:
 * unless *o->found_inf != 0, reads the grads, updates master (or the fp32 param), exp_avg and
 * exp_avg_sq, and writes the param, from the step count *t->step + 1 (t->step is only read: see
 * mp_adam_advance_steps). Every ISA path gives the same bits. Returns MP_ERR_INVALID_ARGUMENT
 * (writing nothing) for a NULL t or o, a bad dtype or master (as described above), a range
 * outside [0, t->n), a NULL array with count > 0, or options out of range; with 8-bit moments
 * also for a bad q8_block, or a range or t->offset that does not start on a block boundary, or
 * a range that does not end on one (or at n). Arrays of one tensor must not overlap each other or the options' scalars. */
mp_status mp_adam_step(const mp_adam_tensor* t, int64_t start, int64_t count,
                       const mp_adam_options* o);

/* Adds 1 to *ts[k].step for every k < ntensors, unless *o->found_inf != 0 or the rule's phase
 * does not end the step (mp_rule_ends_step: Muon's momentum phase): the end of a step
 * whose elements mp_adam_step has updated. Returns MP_ERR_INVALID_ARGUMENT (writing nothing)
 * for ntensors < 0, or NULL ts, o or step pointer. */
mp_status mp_adam_advance_steps(const mp_adam_tensor* ts, int64_t ntensors,
                                const mp_adam_options* o);

#ifdef __cplusplus
}
#endif
#endif /* MPEXT_ADAM_H */
