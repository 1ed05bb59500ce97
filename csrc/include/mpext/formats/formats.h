/* mpext: the moment formats of the optimizer step, listed once. Each row of MP_MOMENT_FORMATS
 * is one format:
 *   X(ID, name, DTYPE, BYTES, BLOCK, SIGNED)
 * ID its enum suffix (MP_FMT_<ID>: the value of mp_step_tensor.exp_avg_format and
 * exp_avg_sq_format, the row's position), name its codec's prefix, DTYPE the mp_dtype of an
 * element as stored (what the kernels load and store), BYTES per element, BLOCK 1 when its
 * elements are coded in blocks of the options' q8_block with one fp32 absmax scale per block
 * (the tensor's exp_avg_scale / exp_avg_sq_scale), SIGNED 1 when it holds values of either sign
 * (a first moment must; a second moment, non-negative, may be in either). A pair of moments in
 * block formats is coded block by block together, so both or neither are: the first (signed)
 * moment in the signed one, the second in the non-negative one. The codecs themselves: the
 * 16-bit roundings of mpext/numerics.h, mpext/formats/q8.h (shared by both tiers), the CPU's
 * tile loops in csrc/core/formats/tiles.h.
 *
 * The format of a moment is an id, not a tensor dtype: the C++ layer maps the op's tensors to
 * ids in one place (csrc/torch/step_common.cpp, moment_format), and the ops' schemas still take
 * the tensors as they are (float32, bfloat16, int8 / uint8 codes). Header-only, C and CUDA. */
#ifndef MPEXT_FORMATS_FORMATS_H
#define MPEXT_FORMATS_FORMATS_H

#include <stdint.h>

#include "mpext/mpext.h"    /* mp_dtype */
#include "mpext/numerics.h" /* MP_HD */

#define MP_MOMENT_FORMATS(X)     \
  X(F32, f32, MP_F32, 4, 0, 1)   \
  X(BF16, bf16, MP_BF16, 2, 0, 1) \
  X(Q8S, q8s, MP_I8, 1, 1, 1)    \
  X(Q8U, q8u, MP_U8, 1, 1, 0)
/* F32: fp32 as it is. BF16: bf16, stochastically rounded (or to nearest: moments_nearest).
 * Q8S: the signed 8-bit block code (sign + E3M4), Q8U: the non-negative one (E4M4)
 * (mpext/formats/q8.h). A pair of 8-bit moments is Q8S with Q8U; a rule's one moment is Q8S. */

#define MP_FORMAT_ENUM_(ID, name, DTYPE, BYTES, BLOCK, SIGNED) MP_FMT_##ID,
/* The moment formats of mp_step_tensor. */
enum { MP_MOMENT_FORMATS(MP_FORMAT_ENUM_) MP_FMT_COUNT };
#undef MP_FORMAT_ENUM_

/* A row's columns. */
typedef struct mp_format_info {
  int32_t dtype, bytes, block, is_signed;
} mp_format_info;

/* 1 if f is a format's id. */
MP_HD int mp_format_ok(int32_t f) { return f >= 0 && f < MP_FMT_COUNT; }

/* The columns of format f's row (f a valid id; fp32's for any other). */
MP_HD mp_format_info mp_format_of(int32_t f) {
  mp_format_info info = {MP_F32, 4, 0, 1};
  switch (f) {
#define MP_FORMAT_CASE_(ID, name, DTYPE, BYTES, BLOCK, SIGNED) \
  case MP_FMT_##ID: {                                          \
    const mp_format_info row = {DTYPE, BYTES, BLOCK, SIGNED};  \
    info = row;                                                \
    break;                                                     \
  }
    MP_MOMENT_FORMATS(MP_FORMAT_CASE_)
#undef MP_FORMAT_CASE_
    default: break;
  }
  return info;
}

MP_HD int32_t mp_format_dtype(int32_t f) { return mp_format_of(f).dtype; }

/* 1 if format f can hold moment `which` of a rule (0: the first, signed; 1: the second,
 * non-negative), from its row: the first needs a signed format; the second takes any but a
 * signed block code (a pair of block codes is the signed one with the non-negative one). */
MP_HD int mp_format_moment_ok(int32_t f, int which) {
  const mp_format_info info = mp_format_of(f);
  return mp_format_ok(f) && (which == 0 ? info.is_signed : !(info.block && info.is_signed));
}

/* The format of moment `which` (as mp_format_moment_ok) stored as mp_dtype d -- the map from a
 * moment tensor's dtype to its id, from the rows (each dtype names one format) -- or
 * MP_FMT_COUNT if no format of the moment is stored so. */
MP_HD int32_t mp_format_for_moment(int32_t d, int which) {
  for (int32_t f = 0; f < MP_FMT_COUNT; ++f) {
    if (mp_format_dtype(f) == d && mp_format_moment_ok(f, which)) return f;
  }
  return MP_FMT_COUNT;
}
MP_HD int mp_format_bytes(int32_t f) { return mp_format_of(f).bytes; }
MP_HD int mp_format_block(int32_t f) { return mp_format_of(f).block; }
MP_HD int mp_format_signed(int32_t f) { return mp_format_of(f).is_signed; }

#endif /* MPEXT_FORMATS_FORMATS_H */
