/* The public entry points of the int8 block code (mpext/int8_block.h): argument checks and the
 * choice of the ISA build of int8_block.c by the path the rest of the core uses
 * (mp_cpu_isa_active), its table generated from isa.h's MP_ISAS rows. Compiled once, with
 * baseline flags. Kept beside isa.h's MP_KERNELS rather than in them, as telemetry_cpu.c is, so
 * that the code is one pair of files. */
#include <stddef.h>

#include "isa.h"
#include "mpext/int8_block.h"

typedef void (*i8b_quantize_fn)(const void*, int, int8_t*, float*, int64_t, int64_t, int64_t,
                                int);
typedef void (*i8b_dequantize_fn)(const int8_t*, const float*, void*, int, int64_t, int64_t,
                                  int64_t);

#define MP_I8B_DECL_(ID, suffix)                                                              \
  void mp_k_int8_block_quantize__##suffix(const void* x, int dtype, int8_t* q, float* scales, \
                                          int64_t rows, int64_t cols, int64_t block,         \
                                          int pow2);                                          \
  void mp_k_int8_block_dequantize__##suffix(const int8_t* q, const float* scales, void* out,  \
                                            int dtype, int64_t rows, int64_t cols,           \
                                            int64_t block);
MP_ISAS(MP_I8B_DECL_)
#undef MP_I8B_DECL_

static const struct {
  i8b_quantize_fn quantize;
  i8b_dequantize_fn dequantize;
} kernels[MP_ISA_COUNT] = {
#define MP_I8B_ROW_(ID, suffix) \
  [MP_ISA_##ID] = {mp_k_int8_block_quantize__##suffix, mp_k_int8_block_dequantize__##suffix},
    MP_ISAS(MP_I8B_ROW_)
#undef MP_I8B_ROW_
};

static int active_isa(void) {
  const int isa = (int)mp_cpu_isa_active();
  return kernels[isa].quantize != NULL ? isa : MP_ISA_SCALAR; /* a path not compiled in */
}

static int args_ok(int dtype, int64_t rows, int64_t cols, int64_t block, const void* a,
                   const void* b, const void* c) {
  if (rows < 0 || cols < 0 || block < 1) return 0;
  if (dtype != MP_F32 && dtype != MP_BF16 && dtype != MP_F16) return 0;
  if (rows > 0 && cols > INT64_MAX / rows) return 0;
  return rows * cols == 0 || (a != NULL && b != NULL && c != NULL);
}

mp_status mp_int8_block_quantize(const void* x, mp_dtype dtype, int8_t* q, float* scales,
                                 int64_t rows, int64_t cols, int64_t block, int pow2) {
  if (!args_ok((int)dtype, rows, cols, block, x, q, scales)) return MP_ERR_INVALID_ARGUMENT;
  if (rows * cols == 0) return MP_OK;
  kernels[active_isa()].quantize(x, (int)dtype, q, scales, rows, cols, block, pow2 != 0);
  return MP_OK;
}

mp_status mp_int8_block_dequantize(const int8_t* q, const float* scales, void* out,
                                   mp_dtype out_dtype, int64_t rows, int64_t cols,
                                   int64_t block) {
  if (!args_ok((int)out_dtype, rows, cols, block, q, scales, out))
    return MP_ERR_INVALID_ARGUMENT;
  if (rows * cols == 0) return MP_OK;
  kernels[active_isa()].dequantize(q, scales, out, (int)out_dtype, rows, cols, block);
  return MP_OK;
}
