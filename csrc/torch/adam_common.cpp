// No header may bring in every ATen operator: common.h says why.
#define AT_PER_OPERATOR_HEADERS
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include "adam_common.h"

#include <cmath>

#include "common.h"
#include "mpext/adam_rule.h"

namespace mpext {
namespace {

void check_hyper(double value, const char* op, const char* name, double lo, bool lo_open,
                 double hi, bool hi_open) {
  bool ok = std::isfinite(value) && (lo_open ? value > lo : value >= lo) &&
            (hi_open ? value < hi : value <= hi);
  TORCH_CHECK_VALUE(ok, "mpext.", op, ": ", name, " must be in ", lo_open ? "(" : "[", lo, ", ",
                    hi, hi_open ? ")" : "]", ", got ", value);
}

}  // namespace

AdamPlan plan_step(const RuleLists& rule, at::TensorList params, at::TensorList grads,
                   at::TensorList masters, at::TensorList steps, const at::Tensor& lr,
                   const std::optional<at::Tensor>& inv_scale,
                   const std::optional<at::Tensor>& found_inf, bool unscale_grads,
                   const AdamStorage& storage) {
  const char* op = rule.op;
  const int nmom = rule.nmoments;
  const size_t n = params.size();
  auto same_len = [&](at::TensorList l, const char* name) {
    TORCH_CHECK_VALUE(l.size() == n, "mpext.", op, ": ", name, " must have one entry per param (",
                      n, "), got ", l.size());
  };
  same_len(grads, "grads");
  for (int j = 0; j < nmom; ++j) same_len(rule.moments[j], rule.moment_names[j]);
  same_len(steps, "steps");
  TORCH_CHECK_VALUE(masters.empty() || masters.size() == n, "mpext.", op,
                    ": masters must be empty or have one entry per param (", n, "), got ",
                    masters.size());
  const at::TensorList remainders = storage.remainders.value_or(at::TensorList());
  TORCH_CHECK_VALUE(remainders.empty() || remainders.size() == n, "mpext.", op,
                    ": remainders must be empty or have one entry per param (", n, "), got ",
                    remainders.size());
  const at::TensorList emas = storage.ema_params.value_or(at::TensorList());
  TORCH_CHECK_VALUE(emas.empty() || emas.size() == n, "mpext.", op,
                    ": ema_params must be empty or have one entry per param (", n, "), got ",
                    emas.size());
  if (storage.sr_streams) {
    const at::IntArrayRef streams = *storage.sr_streams;
    TORCH_CHECK_VALUE(streams.size() == n, "mpext.", op,
                      ": sr_streams must have one entry per param (", n, "), got ",
                      streams.size());
    for (size_t k = 0; k < n; ++k) {
      TORCH_CHECK_VALUE(streams[k] >= 0 && streams[k] <= INT64_C(0xFFFFFFFF), "mpext.", op,
                        ": sr_streams[", k, "] must be in [0, 2^32), got ", streams[k]);
    }
  }
  if (storage.offsets) {
    const at::IntArrayRef offsets = *storage.offsets;
    TORCH_CHECK_VALUE(offsets.size() == n, "mpext.", op,
                      ": offsets must have one entry per param (", n, "), got ", offsets.size());
    for (size_t k = 0; k < n; ++k) {
      TORCH_CHECK_VALUE(offsets[k] >= 0 && offsets[k] <= INT64_MAX - params[k].numel(), "mpext.",
                        op, ": offsets[", k, "] must be >= 0 (the position of the tensor's first "
                        "element in its whole param), got ", offsets[k]);
    }
  }
  const at::TensorList m_scales = storage.exp_avg_scales.value_or(at::TensorList());
  const at::TensorList v_scales = storage.exp_avg_sq_scales.value_or(at::TensorList());
  TORCH_CHECK_VALUE(m_scales.empty() || m_scales.size() == n, "mpext.", op, ": ",
                    rule.scale_names[0], " must be empty or have one entry per param (", n,
                    "), got ", m_scales.size());
  TORCH_CHECK_VALUE(v_scales.empty() || v_scales.size() == n, "mpext.", op, ": ",
                    rule.scale_names[1], " must be empty or have one entry per param (", n,
                    "), got ", v_scales.size());
  const int64_t block = storage.block_size;
  TORCH_CHECK_VALUE(mp_adam_q8_block_ok(block), "mpext.", op,
                    ": block_size must be a power of two in [", MP_Q8_BLOCK_MIN, ", ",
                    MP_Q8_BLOCK_MAX, "], got ", block);
  if (rule.check_rule) rule.check_rule();
  check_hyper(storage.ema_decay, op, "ema_decay", 0.0, false, 1.0, false);
  // With no params there is no device to agree with: each scalar is checked on its own.
  const Arg owner("params", 0);
  auto device_for = [&](const at::Tensor& t) { return n > 0 ? params[0].device() : t.device(); };
  const c10::Device device = device_for(lr);
  check_scalars(lr, op, "lr", at::kFloat, 1, device, owner, /*cpu_ok=*/true);
  if (inv_scale) {
    check_scalars(*inv_scale, op, "inv_scale", at::kFloat, 1, device_for(*inv_scale), owner);
  }
  if (found_inf) {
    check_scalars(*found_inf, op, "found_inf", at::kFloat, 1, device_for(*found_inf), owner);
  }

  AdamPlan plan{};
  plan.options = rule.options;
  mp_adam_options& o = plan.options;
  o.lr = lr.device() == device ? lr.const_data_ptr<float>() : nullptr;
  o.lr_value = 0.0f;
  o.inv_scale = inv_scale ? inv_scale->const_data_ptr<float>() : nullptr;
  o.found_inf = found_inf ? found_inf->const_data_ptr<float>() : nullptr;
  o.unscale_grads = unscale_grads ? 1 : 0;
  o.sr_params = storage.stochastic_rounding ? 1 : 0;
  o.moments_nearest = storage.moments_round_nearest ? 1 : 0;
  o.seed = static_cast<uint64_t>(storage.seed);  // any 64 bits (a negative seed: 2's complement)
  o.q8_block = block;
  o.ema_decay = storage.ema_decay;
  // An lr on the CPU is read here (a host read, free), after the tensors are known not to
  // overlap: a bad value is refused before anything runs.
  auto check_lr_value = [&]() {
    if (!lr.is_cpu()) return;
    const float value = lr.const_data_ptr<float>()[0];
    TORCH_CHECK_VALUE(std::isfinite(value) && value >= 0.0f, "mpext.", op,
                      ": lr must be a finite number >= 0, got ", value);
    o.lr_value = value;
  };
  if (n == 0) {
    check_lr_value();
    return plan;
  }

  std::vector<ByteRange> ranges;
  ranges.reserve(8 * n + 3);
  plan.tensors.reserve(n);
  for (size_t k = 0; k < n; ++k) {
    const int64_t i = static_cast<int64_t>(k);
    const at::Tensor& p = params[k];
    const at::Tensor& g = grads[k];
    // A rule's missing moments are stood in for by the param (never read nor written).
    const at::Tensor& m = nmom >= 1 ? rule.moments[0][k] : p;
    const at::Tensor& v = nmom >= 2 ? rule.moments[1][k] : p;
    const Arg pn("params", i), gn("grads", i), mn(rule.moment_names[0], i);
    const Arg vn(rule.moment_names[1], i);
    const Arg wn("masters", i);
    check_device(p, op, pn, device, owner);
    check_device(g, op, gn, device, owner);
    if (nmom >= 1) check_device(m, op, mn, device, owner);
    if (nmom >= 2) check_device(v, op, vn, device, owner);
    check_dtype(p, op, pn, {at::kFloat, at::kBFloat16, at::kHalf});
    TORCH_CHECK(g.scalar_type() == p.scalar_type() || g.scalar_type() == at::kFloat, "mpext.", op,
                ": ", gn, " must have the dtype of ", pn, " (", dtype_name(p.scalar_type()),
                ") or float32, got ", dtype_name(g.scalar_type()));
    if (nmom >= 1) check_dtype(m, op, mn, {at::kFloat, at::kBFloat16, at::kChar});
    if (nmom >= 2) check_dtype(v, op, vn, {at::kFloat, at::kBFloat16, at::kByte});
    // 8-bit moments come as a pair: int8 codes of m with uint8 codes of v (or m alone)
    const bool q8 = nmom >= 1 && m.scalar_type() == at::kChar;
    if (nmom >= 2) {
      TORCH_CHECK(q8 == (v.scalar_type() == at::kByte), "mpext.", op, ": ", q8 ? mn : vn,
                  " is ", q8 ? "int8" : "uint8", " (8-bit moment codes), so ", q8 ? vn : mn,
                  " must be ", q8 ? "uint8" : "int8", ", got ",
                  dtype_name((q8 ? v : m).scalar_type()));
    }
    const int64_t offset = storage.offsets ? (*storage.offsets)[k] : 0;
    TORCH_CHECK_VALUE(!q8 || offset % block == 0, "mpext.", op, ": offsets[", i, "] (", offset,
                      ") must be a multiple of block_size (", block, ") for ", mn,
                      "'s 8-bit codes: a block is coded whole, by one tensor");
    check_scalars(steps[k], op, Arg("steps", i), at::kFloat, 1, device, owner);
    check_dense(p, op, pn);
    check_dense(g, op, gn);
    if (nmom >= 1) check_dense(m, op, mn);
    if (nmom >= 2) check_dense(v, op, vn);
    check_same_layout(g, gn, p, pn, op);
    if (nmom >= 1) check_same_layout(m, mn, p, pn, op);
    if (nmom >= 2) check_same_layout(v, vn, p, pn, op);
    // The param's fp32 value: itself (fp32), a master, a remainder (bf16), or nothing
    // (master_free). An empty tensor in masters or remainders stands for "none".
    const bool low = p.scalar_type() != at::kFloat;
    float* master = nullptr;
    int16_t* remainder = nullptr;
    bool has_master = false, has_remainder = false;
    auto storage_of = [&](const at::Tensor& w, const Arg& name, at::ScalarType dtype) {
      check_device(w, op, name, device, owner);
      check_dtype(w, op, name, {dtype});
      if (w.numel() == 0 && (p.numel() != 0 || !low)) return false;  // "none"
      TORCH_CHECK_VALUE(low, "mpext.", op, ": ", pn, " is float32 and takes no master, so ",
                        name, " must be an empty tensor, got ", w.numel(), " elements");
      check_dense(w, op, name);
      check_same_layout(w, name, p, pn, op);
      ranges.push_back(byte_range(w, i, true, name));
      return true;
    };
    if (!masters.empty()) {
      has_master = storage_of(masters[k], wn, at::kFloat);
      if (has_master && p.numel() > 0) master = static_cast<float*>(masters[k].data_ptr());
    }
    if (!remainders.empty()) {
      const Arg rn("remainders", i);
      has_remainder = storage_of(remainders[k], rn, at::kShort);
      TORCH_CHECK_VALUE(!has_remainder || p.scalar_type() == at::kBFloat16, "mpext.", op, ": ",
                        rn, " is given but ", pn, " is ", dtype_name(p.scalar_type()),
                        "; only a bfloat16 param is its fp32 value's high half");
      TORCH_CHECK_VALUE(!(has_master && has_remainder), "mpext.", op, ": ", pn,
                        " has both a master (", wn, ") and a remainder (", rn,
                        "); give one of them");
      if (has_remainder && p.numel() > 0) {
        remainder = static_cast<int16_t*>(remainders[k].data_ptr());
      }
    }
    TORCH_CHECK_VALUE(!low || has_master || has_remainder || storage.master_free,
                      "mpext.", op, ": ", pn, " is ", dtype_name(p.scalar_type()),
                      " and needs an fp32 master (masters[", i, "])",
                      p.scalar_type() == at::kBFloat16 ? " or a remainder (remainders[" : "",
                      p.scalar_type() == at::kBFloat16 ? std::to_string(i) + "])" : "",
                      "; pass master_free=True to update it in place without one");
    // The blocks' scales: ceil(n / block) float32 values for 8-bit moments, else none.
    float* scale_ptr[2] = {nullptr, nullptr};
    const at::TensorList scale_lists[2] = {m_scales, v_scales};
    const char* const* scale_names = rule.scale_names;
    for (int j = 0; j < 2; ++j) {
      const Arg sn(scale_names[j], i);
      if (scale_lists[j].empty()) {
        TORCH_CHECK_VALUE(!q8 || j >= nmom, "mpext.", op, ": ", mn, " holds 8-bit codes, which need ",
                          scale_names[j], " (one float32 scale per block of ", block,
                          " elements); got none");
        continue;
      }
      const at::Tensor& sc = scale_lists[j][k];
      check_device(sc, op, sn, device, owner);
      check_dtype(sc, op, sn, {at::kFloat});
      if (!q8 || j >= nmom) {
        TORCH_CHECK_VALUE(sc.numel() == 0, "mpext.", op, ": ", sn, " must be an empty tensor (",
                          j >= nmom ? "the rule keeps no such moment" : mn, " is not 8-bit",
                          "), got ", sc.numel(), " elements");
        continue;
      }
      const int64_t want = (p.numel() + block - 1) / block;
      TORCH_CHECK_VALUE(sc.numel() == want, "mpext.", op, ": ", sn, " must have ", want,
                        " elements (one per block of ", block, " elements of ", pn, "), got ",
                        sc.numel());
      if (want == 0) continue;
      check_dense(sc, op, sn);
      ranges.push_back(byte_range(sc, i, true, sn));
      scale_ptr[j] = static_cast<float*>(sc.data_ptr());
    }

    mp_adam_tensor t{};
    t.param = p.data_ptr();
    t.param_dtype = to_mp_dtype(p.scalar_type());
    t.grad = g.data_ptr();
    t.grad_dtype = to_mp_dtype(g.scalar_type());
    t.master = master;
    t.exp_avg = nmom >= 1 && p.numel() > 0 ? m.data_ptr() : nullptr;
    t.exp_avg_sq = nmom >= 2 && p.numel() > 0 ? v.data_ptr() : nullptr;
    t.step = static_cast<float*>(steps[k].data_ptr());
    t.n = p.numel();
    t.remainder = remainder;
    t.exp_avg_dtype = nmom >= 1 ? to_mp_dtype(m.scalar_type()) : MP_F32;
    t.exp_avg_sq_dtype = nmom >= 2 ? to_mp_dtype(v.scalar_type()) : (q8 ? MP_U8 : MP_F32);
    t.offset = offset;
    t.sr_stream = storage.sr_streams ? static_cast<uint64_t>((*storage.sr_streams)[k])
                                     : static_cast<uint64_t>(k);
    t.exp_avg_scale = scale_ptr[0];
    t.exp_avg_sq_scale = scale_ptr[1];
    if (!emas.empty()) {
      const at::Tensor& e = emas[k];
      const Arg en("ema_params", i);
      check_device(e, op, en, device, owner);
      check_dtype(e, op, en, {at::kFloat});
      if (e.numel() > 0 || p.numel() == 0) {  // an empty tensor: no ema for this param
        check_dense(e, op, en);
        check_same_layout(e, en, p, pn, op);
        if (e.numel() > 0) t.ema = static_cast<float*>(e.data_ptr());
        ranges.push_back(byte_range(e, i, true, en));
      }
    }
    plan.tensors.push_back(t);
    ranges.push_back(byte_range(p, i, true, pn));
    ranges.push_back(byte_range(g, i, unscale_grads, gn));  // written back with unscale_grads
    if (nmom >= 1) ranges.push_back(byte_range(m, i, true, mn));
    if (nmom >= 2) ranges.push_back(byte_range(v, i, true, vn));
    ranges.push_back(byte_range(steps[k], i, true, Arg("steps", i)));
  }
  ranges.push_back(byte_range(lr, -1, false, "lr"));
  if (inv_scale) ranges.push_back(byte_range(*inv_scale, -1, false, "inv_scale"));
  if (found_inf) ranges.push_back(byte_range(*found_inf, -1, false, "found_inf"));
  check_no_overlap(std::move(ranges), op, "", "");
  check_lr_value();
  return plan;
}

namespace {
const char* const kAdamScales[2] = {"exp_avg_scales", "exp_avg_sq_scales"};

// The options' fields a rule sets (the rest are plan_step's): which rule, and its
// hyperparameters as mp_adam_options names them.
mp_adam_options rule_options(int32_t rule, double beta1, double beta2, double weight_decay,
                             bool maximize) {
  mp_adam_options o{};
  o.rule = rule;
  o.beta1 = beta1;
  o.beta2 = beta2;
  o.weight_decay = weight_decay;
  o.maximize = maximize ? 1 : 0;
  return o;
}
}  // namespace

// The checks capture their values (not references): a RuleLists outlives the call that made it.
RuleLists adam_rule(at::TensorList exp_avgs, at::TensorList exp_avg_sqs, double beta1,
                    double beta2, double eps, double weight_decay, bool decoupled,
                    bool maximize) {
  const char* op = "adam_step_";
  auto check = [=]() {
    check_hyper(beta1, op, "beta1", 0.0, false, 1.0, true);
    check_hyper(beta2, op, "beta2", 0.0, false, 1.0, true);
    check_hyper(eps, op, "eps", 0.0, false, INFINITY, true);
    check_hyper(weight_decay, op, "weight_decay", 0.0, false, INFINITY, true);
  };
  mp_adam_options o = rule_options(MP_RULE_ADAM, beta1, beta2, weight_decay, maximize);
  o.eps = eps;
  o.decoupled = decoupled ? 1 : 0;
  return {op, 2, {exp_avgs, exp_avg_sqs}, {"exp_avgs", "exp_avg_sqs"}, kAdamScales, check, o};
}

RuleLists lion_rule(at::TensorList exp_avgs, double beta1, double beta2, double weight_decay,
                    bool maximize) {
  const char* op = "lion_step_";
  auto check = [=]() {
    check_hyper(beta1, op, "beta1", 0.0, false, 1.0, false);
    check_hyper(beta2, op, "beta2", 0.0, false, 1.0, false);
    check_hyper(weight_decay, op, "weight_decay", 0.0, false, INFINITY, true);
  };
  mp_adam_options o = rule_options(MP_RULE_LION, beta1, beta2, weight_decay, maximize);
  o.decoupled = 1;
  return {op, 1, {exp_avgs, at::TensorList()}, {"exp_avgs", "exp_avg_sqs"}, kAdamScales, check,
          o};
}

RuleLists sgd_rule(at::TensorList momentum_buffers, double momentum, double dampening,
                   double weight_decay, bool nesterov, bool maximize) {
  const char* op = "sgd_step_";
  static const char* const scales[2] = {"momentum_buffer_scales", "unused_scales"};
  auto check = [=]() {
    check_hyper(momentum, op, "momentum", 0.0, false, INFINITY, true);
    check_hyper(dampening, op, "dampening", -INFINITY, true, INFINITY, true);
    check_hyper(weight_decay, op, "weight_decay", 0.0, false, INFINITY, true);
    TORCH_CHECK_VALUE(!nesterov || (momentum > 0.0 && dampening == 0.0), "mpext.", op,
                      ": Nesterov momentum requires a momentum and zero dampening");
  };
  const int nmom = momentum != 0.0 ? 1 : 0;
  TORCH_CHECK_VALUE(nmom == 1 || momentum_buffers.empty(), "mpext.", op,
                    ": momentum is 0, which keeps no buffer, so momentum_buffers must be empty, "
                    "got ", momentum_buffers.size(), " tensors");
  // The momentum is the rule's beta1 (mp_adam_options.rule says so).
  mp_adam_options o = rule_options(MP_RULE_SGD, momentum, 0.0, weight_decay, maximize);
  o.dampening = dampening;
  o.nesterov = nesterov ? 1 : 0;
  return {op, nmom, {momentum_buffers, at::TensorList()}, {"momentum_buffers", "unused"}, scales,
          check, o};
}

// muon
RuleLists muon_rule(at::TensorList momentum_buffers, int64_t phase, double momentum,
                    bool nesterov, double lr_ratio, double weight_decay) {
  const char* op = "muon_step_";
  static const char* const scales[2] = {"momentum_buffer_scales", "unused_scales"};
  TORCH_CHECK_VALUE(phase == 1 || phase == 3, "mpext.", op,
                    ": phase must be 1 (momentum) or 3 (update), got ", phase);
  const int nmom = phase == 1 ? 1 : 0;
  TORCH_CHECK_VALUE(nmom == 1 || momentum_buffers.empty(), "mpext.", op,
                    ": phase 3 keeps no buffer, so momentum_buffers must be empty, got ",
                    momentum_buffers.size(), " tensors");
  auto check = [=]() {
    if (phase == 1) {
      check_hyper(momentum, op, "momentum", 0.0, false, INFINITY, true);
    } else {
      check_hyper(lr_ratio, op, "lr_ratio", 0.0, true, INFINITY, true);
      check_hyper(weight_decay, op, "weight_decay", 0.0, false, INFINITY, true);
    }
  };
  // Phase 1's hyperparameter is beta1 = momentum, phase 3's beta1 = lr_ratio (mp_adam_options).
  mp_adam_options o = rule_options(phase == 1 ? MP_RULE_MUON_MOMENTUM : MP_RULE_MUON_UPDATE,
                                   phase == 1 ? momentum : lr_ratio, 0.0,
                                   phase == 1 ? 0.0 : weight_decay, false);
  o.nesterov = phase == 1 && nesterov ? 1 : 0;
  o.decoupled = 1;
  return {op, nmom, {momentum_buffers, at::TensorList()}, {"momentum_buffers", "unused"}, scales,
          check, o};
}

}  // namespace mpext
