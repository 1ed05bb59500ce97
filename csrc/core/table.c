/* One kernel table per ISA build (compiled with the same flags as the kernels it lists). */
#include "isa.h"

#ifndef MP_ISA_SUFFIX
#error "table.c must be compiled with -DMP_ISA_SUFFIX=scalar|avx2|avx512"
#endif

const mp_kernel_table MP_ISA_FN(mp_kernels) = {
    .to_bf16_f32 = MP_ISA_FN(mp_k_to_bf16_f32),
    .to_bf16_sr_f32 = MP_ISA_FN(mp_k_to_bf16_sr_f32),
    .to_fp16_f32 = MP_ISA_FN(mp_k_to_fp16_f32),
    .to_fp32_bf16 = MP_ISA_FN(mp_k_to_fp32_bf16),
    .to_fp32_fp16 = MP_ISA_FN(mp_k_to_fp32_fp16),
    .unscale_f32 = MP_ISA_FN(mp_k_unscale_f32),
    .unscale_bf16 = MP_ISA_FN(mp_k_unscale_bf16),
    .unscale_fp16 = MP_ISA_FN(mp_k_unscale_fp16),
    .adam_step = MP_ISA_FN(mp_k_adam_step),
    .adam_step_generic = MP_ISA_FN(mp_k_adam_step_generic),
    .lion_step = MP_ISA_FN(mp_k_lion_step),
    .sgd_step = MP_ISA_FN(mp_k_sgd_step),
    .muon_step = MP_ISA_FN(mp_k_muon_step),
    .grad_norm_sumsq_f32 = MP_ISA_FN(mp_k_grad_norm_sumsq_f32),
    .grad_norm_sumsq_bf16 = MP_ISA_FN(mp_k_grad_norm_sumsq_bf16),
    .grad_norm_sumsq_fp16 = MP_ISA_FN(mp_k_grad_norm_sumsq_fp16),
    .fp8_quantize = MP_ISA_FN(mp_k_fp8_quantize),
    .fp8_dequantize = MP_ISA_FN(mp_k_fp8_dequantize),
};
