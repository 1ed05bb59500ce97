// The mpext operator library: every schema, defined once, and the Python module mpext._C that
// loads it. Backend implementations live beside their ops (cast.cpp for CPU, cast_cuda.cpp for
// CUDA) and register with TORCH_LIBRARY_IMPL; fake kernels are registered from Python
// (mpext/ops.py).

// No header may bring in every ATen operator: common.h says why.
#define AT_PER_OPERATOR_HEADERS
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

// pybind11 for the module and torch/library.h for the schemas, not <torch/extension.h> (all of
// torch's C++ frontend and its Python bindings): about 10 s to parse instead of 23.
#include <pybind11/pybind11.h>
#include <torch/library.h>

#include <string>

#include "mpext/mpext.h"
#include "mpext/step.h"  // MP_RULES: build_info's rule names

#ifndef MPEXT_TORCH_VERSION
#define MPEXT_TORCH_VERSION "unknown"
#endif
#ifndef MPEXT_CUDA_ARCHS
#define MPEXT_CUDA_ARCHS ""
#endif

TORCH_LIBRARY(mpext, m) {
  // fp32 -> bf16, round to nearest even, or stochastic rounding keyed by (seed, offset).
  m.def("to_bf16(Tensor x, *, bool stochastic=False, int seed=0, int offset=0) -> Tensor");
  // fp32 -> fp16, round to nearest even.
  m.def("to_fp16(Tensor x) -> Tensor");
  // bf16 / fp16 -> fp32, exact.
  m.def("to_fp32(Tensor x) -> Tensor");
  // Multi-tensor copy-cast dst[i] <- src[i] (fp32 <-> bf16/fp16, or same dtype), one pass.
  m.def(
      "cast_(Tensor(a!)[] dst, Tensor[] src, *, bool stochastic=False, int seed=0, int offset=0) "
      "-> ()");
  // Loss scaling. grads *= inv_scale in place over the whole list; found_inf = 1 if any element
  // was NaN/Inf (never cleared). Same results as torch._amp_foreach_non_finite_check_and_unscale_.
  m.def("unscale_(Tensor(a!)[] grads, Tensor(b!) found_inf, Tensor inv_scale) -> ()");
  // --- telemetry (issue 46), begin: csrc/torch/telemetry*.cpp, mpext/_telemetry_ops.py ---
  // unscale_ (same bits in grads and found_inf) that also adds, per gradient i, the counts of
  // its stored (scaled) values to counts[i] = [zeros, subnormal, headroom (|g| * 2 > dtype
  // max), non-finite], merges max(fp32(|g| * stat_inv_scale)) over finite g into max_abs[i],
  // and lowers first_nonfinite to the index of the first gradient holding a NaN/Inf
  // (mpext/telemetry.h defines each). stat_inv_scale defaults to inv_scale.
  m.def(
      "unscale_stats_(Tensor(a!)[] grads, Tensor(b!) found_inf, Tensor inv_scale, "
      "Tensor(c!) counts, Tensor(d!) max_abs, Tensor(e!) first_nonfinite, *, "
      "Tensor? stat_inv_scale=None) -> ()");
  // --- telemetry (issue 46), end ---
  // The dynamic loss-scale rule on the device (torch._amp_update_scale_ by default), plus
  // optional hysteresis, min/max scale and skip statistics (stats = [skipped, overflow streak]).
  m.def(
      "update_scale_(Tensor(a!) scale, Tensor(b!) growth_tracker, Tensor found_inf, "
      "float growth_factor, float backoff_factor, int growth_interval, *, "
      "Tensor(c!)? hysteresis_tracker=None, int hysteresis=1, float min_scale=0., "
      "float max_scale=0., Tensor(d!)? stats=None) -> ()");
  // Fused Adam/AdamW over lists of params, one pass per element: optional fused unscale
  // (inv_scale; with unscale_grads the unscaled gradient is also written back, as torch's fused
  // optimizers leave .grad), skip on the device when found_inf != 0 (nothing written, steps not
  // advanced), per-param float32 step counts. A bf16/fp16 param's fp32 value is an FP32 master
  // (masters[i]), for bf16 an int16 remainder (remainders[i]: the master's low half), or, with
  // master_free, the param itself (written back to nearest even, or with stochastic_rounding);
  // an empty tensor stands for "none", and an fp32 param takes none. Moments are float32 or
  // bfloat16 (stored with stochastic rounding unless moments_round_nearest). Stochastic
  // rounding is reproducible: its bits are a function of seed, the param's step count, its
  // sr_streams entry (default: its index) and the element's position. Moments may also be
  // 8-bit codes, int8 exp_avg with uint8 exp_avg_sq, each block of block_size elements with its
  // float32 absmax in exp_avg_scales / exp_avg_sq_scales (mpext/adam.h has the format).
  // ema_params[i] (fp32, or an empty tensor for none) moves towards the param's new fp32 value
  // by 1 - ema_decay each step (a copy on its first step), in the same pass.
  m.def(
      "adam_step_(Tensor(a!)[] params, Tensor(f!)[] grads, Tensor(b!)[] exp_avgs, "
      "Tensor(c!)[] exp_avg_sqs, Tensor(d!)[] masters, Tensor(e!)[] steps, Tensor lr, "
      "float beta1, float beta2, float eps, float weight_decay, bool decoupled, bool maximize, "
      "*, Tensor? inv_scale=None, Tensor? found_inf=None, bool unscale_grads=False, "
      "Tensor(g!)[]? remainders=None, bool master_free=False, bool stochastic_rounding=False, "
      "bool moments_round_nearest=False, int seed=0, int[]? sr_streams=None, "
      "Tensor(h!)[]? exp_avg_scales=None, Tensor(i!)[]? exp_avg_sq_scales=None, "
      "int block_size=256, Tensor(j!)[]? ema_params=None, float ema_decay=0., "
      "int[]? offsets=None, Tensor(k!)? stats=None) -> ()");
  // stats (every step op): telemetry, a float64 [len(params), 13] tensor the step adds its
  // counters to (mpext/telemetry.h, MP_STS_*: lost and unmoved updates, moment errors, ...),
  // through the pipeline with a counting epilogue; None: the uncounted kernels.
  // offsets (all three rules): per param, the position of its first element in its whole
  // param (a shard's start, default 0), so that a shard draws the random bits the unsharded
  // param would; with 8-bit moments a multiple of block_size.
  // Lion (lion-pytorch's update, decoupled weight decay p *= 1 - lr * weight_decay) over the
  // same storage as adam_step_, with one moment: exp_avgs float32, bfloat16, or int8 codes of
  // blocks with their float32 absmax in exp_avg_scales.
  m.def(
      "lion_step_(Tensor(a!)[] params, Tensor(f!)[] grads, Tensor(b!)[] exp_avgs, "
      "Tensor(d!)[] masters, Tensor(e!)[] steps, Tensor lr, float beta1, float beta2, "
      "float weight_decay, bool maximize, *, Tensor? inv_scale=None, Tensor? found_inf=None, "
      "bool unscale_grads=False, Tensor(g!)[]? remainders=None, bool master_free=False, "
      "bool stochastic_rounding=False, bool moments_round_nearest=False, int seed=0, "
      "int[]? sr_streams=None, Tensor(h!)[]? exp_avg_scales=None, int block_size=256, "
      "Tensor(j!)[]? ema_params=None, float ema_decay=0., int[]? offsets=None, "
      "Tensor(k!)? stats=None) -> ()");
  // SGD (torch.optim.SGD: momentum, dampening, nesterov, L2 weight_decay, maximize) over the
  // same storage; momentum_buffers (float32, bfloat16, or int8 codes with
  // momentum_buffer_scales) empty when momentum is 0. A buffer takes the gradient on its
  // param's first step (steps[i] == 0), as torch's is created.
  m.def(
      "sgd_step_(Tensor(a!)[] params, Tensor(f!)[] grads, Tensor(b!)[] momentum_buffers, "
      "Tensor(d!)[] masters, Tensor(e!)[] steps, Tensor lr, float momentum, float dampening, "
      "float weight_decay, bool nesterov, bool maximize, *, Tensor? inv_scale=None, "
      "Tensor? found_inf=None, bool unscale_grads=False, Tensor(g!)[]? remainders=None, "
      "bool master_free=False, bool stochastic_rounding=False, "
      "bool moments_round_nearest=False, int seed=0, int[]? sr_streams=None, "
      "Tensor(h!)[]? momentum_buffer_scales=None, int block_size=256, "
      "Tensor(j!)[]? ema_params=None, float ema_decay=0., int[]? offsets=None, "
      "Tensor(k!)? stats=None) -> ()");
  // Muon's elementwise phases over the same storage (mpext/rules/muon.h), around its
  // Newton-Schulz (mpext.optim.Muon). muon_momentum_step_: per param buf = lerp(buf, g,
  // 1 - momentum), params[i] = nesterov ? lerp(g, buf, momentum) : buf (params are the updates,
  // written in their dtype; momentum_buffers float32, bfloat16, or int8 codes with
  // momentum_buffer_scales). muon_update_step_: p = p * (1 - lr * weight_decay) -
  // (lr * lr_ratio) * grads[i] (the orthogonalised update).
  m.def(
      "muon_momentum_step_(Tensor(a!)[] params, Tensor(f!)[] grads, "
      "Tensor(b!)[] momentum_buffers, Tensor(d!)[] masters, Tensor(e!)[] steps, Tensor lr, "
      "float momentum, bool nesterov, *, Tensor? inv_scale=None, Tensor? found_inf=None, "
      "bool unscale_grads=False, Tensor(g!)[]? remainders=None, bool master_free=False, "
      "bool stochastic_rounding=False, bool moments_round_nearest=False, int seed=0, "
      "int[]? sr_streams=None, Tensor(h!)[]? momentum_buffer_scales=None, int block_size=256, "
      "Tensor(j!)[]? ema_params=None, float ema_decay=0., int[]? offsets=None, "
      "Tensor(k!)? stats=None) -> ()");
  m.def(
      "muon_update_step_(Tensor(a!)[] params, Tensor(f!)[] grads, Tensor(d!)[] masters, "
      "Tensor(e!)[] steps, Tensor lr, float lr_ratio, float weight_decay, *, "
      "Tensor? inv_scale=None, Tensor? found_inf=None, bool unscale_grads=False, "
      "Tensor(g!)[]? remainders=None, bool master_free=False, bool stochastic_rounding=False, "
      "bool moments_round_nearest=False, int seed=0, int[]? sr_streams=None, "
      "int block_size=256, Tensor(j!)[]? ema_params=None, float ema_decay=0., "
      "int[]? offsets=None, Tensor(k!)? stats=None) -> ()");
  // Multi-tensor L2 norm: sqrt(sum of (float(x) * inv_scale)^2) over every element of every
  // tensor, squared and summed in double, as a 0-dim float32 tensor on the tensors' device (no
  // host sync); NaN anywhere gives NaN, an Inf (and no NaN) +Inf. Deterministic.
  m.def("grad_norm(Tensor[] tensors, *, Tensor? inv_scale=None) -> Tensor");
  // FP8 with one float32 scale per block of block_size elements of the last dimension (x
  // contiguous): scale = finite amax / fp8 max (rounded up to a power of two with pow2_scale, at
  // least 2^-126), q = fp8(x * (1 / scale)) to nearest even or stochastically (seed, offset as
  // to_bf16), scales of shape x.shape[:-1] + (ceil(x.shape[-1] / block_size),). fp8_dtype:
  // float8_e4m3fn (default) or float8_e5m2. NaN/Inf stay non-finite.
  m.def(
      "fp8_quantize(Tensor x, *, int block_size=128, ScalarType? fp8_dtype=None, "
      "bool pow2_scale=False, bool stochastic=False, int seed=0, int offset=0) -> (Tensor, Tensor)");
  // The inverse: float(q) * scale, rounded to nearest even to dtype (default float32).
  m.def(
      "fp8_dequantize(Tensor q, Tensor scales, *, int block_size=128, ScalarType? dtype=None) "
      "-> Tensor");
  // --- int8 block code (issue 42), begin: csrc/torch/int8_block*.cpp, mpext/activations_codes.py
  // The int8 block code of saved activations, blocks of block_size elements along the last
  // dimension (x contiguous): scale = max(float32 absmax / 127, 2^-126) (rounded up to a power of
  // two with pow2_scale), q = clamp(round_half_even(x / scale), -127, 127) as int8, a nonzero x
  // never coded 0; scales of shape x.shape[:-1] + (ceil(x.shape[-1] / block_size),). NaN / Inf
  // make their block's scale non-finite.
  m.def(
      "int8_block_quantize(Tensor x, *, int block_size=128, bool pow2_scale=False) "
      "-> (Tensor, Tensor)");
  // The inverse: q * scale (q * bfloat16(scale) for bfloat16), rounded once to nearest even to
  // dtype (default float32).
  m.def(
      "int8_block_dequantize(Tensor q, Tensor scales, *, int block_size=128, "
      "ScalarType? dtype=None) -> Tensor");
  // --- int8 block code (issue 42), end ---
}

namespace {

mp_isa isa_from_string(const std::string& name) {
  mp_isa isa;
  TORCH_CHECK_VALUE(mp_isa_from_name(name.c_str(), &isa) == MP_OK,
                    "mpext: unknown CPU ISA path '", name, "'; expected one of scalar, avx2, "
                    "avx512");
  return isa;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "mpext native library: loads the torch.ops.mpext operators and reports the build.";
  m.def("cpu_isa", [] { return std::string(mp_isa_name(mp_cpu_isa_active())); },
        "The CPU ISA path the kernels use now.");
  m.def("cpu_isa_best", [] { return std::string(mp_isa_name(mp_cpu_isa_best())); },
        "The best CPU ISA path this CPU supports.");
  m.def("cpu_isa_supported",
        [](const std::string& name) { return mp_cpu_isa_supported(isa_from_string(name)) != 0; },
        "Whether this CPU can run the named ISA path.");
  m.def(
      "set_cpu_isa",
      [](const std::string& name) {
        mp_isa isa = isa_from_string(name);
        mp_status s = mp_cpu_isa_select(isa);
        TORCH_CHECK(s == MP_OK, "mpext: cannot select the CPU ISA path '", name,
                    "': this CPU does not support it (best available: ",
                    mp_isa_name(mp_cpu_isa_best()), ")");
      },
      "Selects the CPU ISA path (scalar, avx2, avx512); raises if this CPU lacks it.");
  m.def(
      "build_info",
      [] {
        pybind11::dict d;
        pybind11::list compiled;
        for (int i = 0; i < MP_ISA_COUNT; ++i) {
#if !defined(MP_X86_PATHS)
          if (i != MP_ISA_SCALAR) continue;
#endif
          compiled.append(mp_isa_name(static_cast<mp_isa>(i)));
        }
        d["cpu_isas_compiled"] = compiled;
        // The rules' rows: each is the op "<name>_step_", and mpext.optim finds each rule's
        // class module and mpext.ops registers each op's fake by these names.
        pybind11::list rules;
#define MP_RULE_NAME_(ID, name, MIN, MAX) rules.append(#name);
        MP_RULES(MP_RULE_NAME_)
#undef MP_RULE_NAME_
        d["rules"] = rules;
#ifdef MPEXT_WITH_CUDA
        d["cuda_built"] = true;
#else
        d["cuda_built"] = false;
#endif
        d["cuda_archs"] = std::string(MPEXT_CUDA_ARCHS);
        d["torch_built_against"] = std::string(MPEXT_TORCH_VERSION);
        return d;
      },
      "What this build of mpext._C contains.");
}
