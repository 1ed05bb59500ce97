/* One kernel table per ISA build (compiled with the same flags as the kernels it lists), from
 * the rows of isa.h's MP_KERNELS. */
#include "isa.h"

#ifndef MP_ISA_SUFFIX
#error "table.c must be compiled with -DMP_ISA_SUFFIX=scalar|avx2|avx512"
#endif

#define MP_KERNEL_ENTRY_(ret, name, params) .name = MP_ISA_FN(mp_k_##name),
const mp_kernel_table MP_ISA_FN(mp_kernels) = {MP_KERNELS(MP_KERNEL_ENTRY_)};
#undef MP_KERNEL_ENTRY_
