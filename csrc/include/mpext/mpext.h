/* mpext C API: status codes and CPU instruction-set dispatch.
 *
 * The C core (csrc/core) and the CUDA kernels (cuda/) know nothing of PyTorch or Python: they
 * take raw pointers, 64-bit element counts and scalars, allocate nothing, and return an
 * mp_status. The C++ binding (csrc/torch) validates every argument before calling them. */
#ifndef MPEXT_MPEXT_H
#define MPEXT_MPEXT_H

#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef enum mp_status {
  MP_OK = 0,
  MP_ERR_INVALID_ARGUMENT = 1, /* a null pointer with n > 0, a negative count, ... */
  MP_ERR_UNSUPPORTED_ISA = 2,  /* the CPU lacks the instruction set that was asked for */
  MP_ERR_CUDA = 3              /* a CUDA launch failed; cudaGetLastError() has the detail */
} mp_status;

/* Element types of the tensors the kernels read and write: one enum for every op and both
 * tiers (CPU and CUDA). The values below MP_DTYPE_COUNT are the floating-point types every
 * element-wise op takes; the 8-bit codes after it are only Adam's block-quantized moments
 * (mpext/step.h), so the other ops' range checks keep refusing them. */
typedef enum mp_dtype {
  MP_F32 = 0,  /* IEEE binary32 */
  MP_BF16 = 1, /* bfloat16 bits */
  MP_F16 = 2,  /* IEEE binary16 bits */
  MP_DTYPE_COUNT = 3,
  MP_I8 = 8,   /* int8 codes of a block-quantized signed value */
  MP_U8 = 9    /* uint8 codes of a block-quantized non-negative value */
} mp_dtype;

/* Bytes per element of an mp_dtype. A macro, so that C, C++ and CUDA device code share it. */
#define MP_DTYPE_BYTES(d) ((d) == MP_F32 ? 4 : ((d) == MP_I8 || (d) == MP_U8) ? 1 : 2)

/* CPU instruction-set paths. Each is the same C source compiled with different flags. */
typedef enum mp_isa {
  MP_ISA_SCALAR = 0, /* baseline x86-64 / any architecture */
  MP_ISA_AVX2 = 1,   /* AVX2 + FMA + F16C */
  MP_ISA_AVX512 = 2, /* AVX-512 F/BW/VL/DQ */
  MP_ISA_COUNT = 3
} mp_isa;

/* Short human-readable text for a status code (a static string). */
const char* mp_status_string(mp_status s);

/* The lower-case name of an ISA path ("scalar", "avx2", "avx512"), or NULL if out of range. */
const char* mp_isa_name(mp_isa isa);

/* Parses an ISA name; writes it to *out and returns MP_OK, or MP_ERR_INVALID_ARGUMENT. */
mp_status mp_isa_from_name(const char* name, mp_isa* out);

/* 1 if this CPU can run the path (and it was compiled in), else 0. */
int mp_cpu_isa_supported(mp_isa isa);

/* The best path this CPU supports. */
mp_isa mp_cpu_isa_best(void);

/* The path the mp_* entry points currently use. Initially mp_cpu_isa_best(). */
mp_isa mp_cpu_isa_active(void);

/* Makes isa the active path. Returns MP_ERR_UNSUPPORTED_ISA (and changes nothing) if this CPU
 * cannot run it. Thread-safe; calls already running finish on the path they started on. */
mp_status mp_cpu_isa_select(mp_isa isa);

#ifdef __cplusplus
}
#endif
#endif /* MPEXT_MPEXT_H */
