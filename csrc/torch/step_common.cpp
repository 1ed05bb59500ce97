// No header may bring in every ATen operator: common.h says why.
#define AT_PER_OPERATOR_HEADERS
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include "step_common.h"

#include <cmath>

#include "common.h"
#include "mpext/step_storage.h"
#include "mpext/telemetry.h"

namespace mpext {

void check_hyper(double value, const char* op, const char* name, double lo, bool lo_open,
                 double hi, bool hi_open) {
  bool ok = std::isfinite(value) && (lo_open ? value > lo : value >= lo) &&
            (hi_open ? value < hi : value <= hi);
  TORCH_CHECK_VALUE(ok, "mpext.", op, ": ", name, " must be in ", lo_open ? "(" : "[", lo, ", ",
                    hi, hi_open ? ")" : "]", ", got ", value);
}

// The tensor dtype of an mp_dtype (a moment format's storage).
static at::ScalarType at_dtype_of(int32_t d) {
  return d == MP_F32 ? at::kFloat : d == MP_BF16 ? at::kBFloat16 : d == MP_F16 ? at::kHalf
         : d == MP_I8 ? at::kChar : at::kByte;
}

// A moment (`which`: 0 the first, 1 the second) has the dtype of one of the formats it may be
// in: the rows of mpext/formats/formats.h, listed in the message in their order.
static void check_moment_dtype(const at::Tensor& t, const char* op, Arg name, int which) {
  std::string list;
  for (int32_t f = 0; f < MP_FMT_COUNT; ++f) {
    if (!mp_format_moment_ok(f, which)) continue;
    const at::ScalarType d = at_dtype_of(mp_format_dtype(f));
    if (t.scalar_type() == d) return;
    list += (list.empty() ? "" : " or ") + std::string(dtype_name(d));
  }
  TORCH_CHECK(false, "mpext.", op, ": ", name, " must have dtype ", list, ", got ",
              dtype_name(t.scalar_type()));
}

// The one place a moment's tensor becomes its format id: the row whose storage dtype it has
// (the ops take the moments as tensors, their schemas unchanged); plan_step has checked the
// dtype against the moment's place before.
static int32_t moment_format(const at::Tensor& m, int which) {
  const int32_t f = mp_format_for_moment(to_mp_dtype(m.scalar_type()), which);
  TORCH_INTERNAL_ASSERT(f != MP_FMT_COUNT, "no moment format for ", m.scalar_type());
  return f;
}

mp_step_options rule_options(int32_t rule, double beta1, double beta2, double weight_decay,
                             bool maximize) {
  mp_step_options o{};
  o.rule = rule;
  o.beta1 = beta1;
  o.beta2 = beta2;
  o.weight_decay = weight_decay;
  o.maximize = maximize ? 1 : 0;
  return o;
}

StepPlan plan_step(const RuleLists& rule, at::TensorList params, at::TensorList grads,
                   at::TensorList masters, at::TensorList steps, const at::Tensor& lr,
                   const std::optional<at::Tensor>& inv_scale,
                   const std::optional<at::Tensor>& found_inf, bool unscale_grads,
                   const StepStorage& storage) {
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
  if (rule.nlists >= 2) {  // an op with one moment list has one scale list
    TORCH_CHECK_VALUE(v_scales.empty() || v_scales.size() == n, "mpext.", op, ": ",
                      rule.scale_names[1], " must be empty or have one entry per param (", n,
                      "), got ", v_scales.size());
  }
  const int64_t block = storage.block_size;
  TORCH_CHECK_VALUE(mp_q8_block_ok(block), "mpext.", op,
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

  StepPlan plan{};
  plan.options = rule.options;
  mp_step_options& o = plan.options;
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
  if (storage.stats) {  // telemetry: the counters' rows, one per param
    const at::Tensor& st = *storage.stats;
    check_device(st, op, "stats", device, owner);
    TORCH_CHECK(st.scalar_type() == at::kDouble, "mpext.", op,
                ": stats must have dtype float64, got ", dtype_name(st.scalar_type()));
    TORCH_CHECK_VALUE(st.dim() == 2 && st.size(0) == static_cast<int64_t>(n) &&
                          st.size(1) == MP_STS_NCOLS,
                      "mpext.", op, ": stats must have shape [len(params), ", int(MP_STS_NCOLS),
                      "] = [", n, ", ", int(MP_STS_NCOLS), "], got ", st.sizes());
    TORCH_CHECK_VALUE(st.is_contiguous(), "mpext.", op,
                      ": stats must be contiguous (row k is param k's counters)");
    if (n > 0) plan.stats = static_cast<double*>(st.data_ptr());
  }
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
    const Arg pn("params", i), gn("grads", i);
    const Arg mn(rule.nlists >= 1 ? rule.moment_names[0] : "", i);
    const Arg vn(rule.nlists >= 2 ? rule.moment_names[1] : "", i);
    const Arg wn("masters", i);
    check_device(p, op, pn, device, owner);
    check_device(g, op, gn, device, owner);
    if (nmom >= 1) check_device(m, op, mn, device, owner);
    if (nmom >= 2) check_device(v, op, vn, device, owner);
    check_dtype(p, op, pn, {at::kFloat, at::kBFloat16, at::kHalf});
    TORCH_CHECK(g.scalar_type() == p.scalar_type() || g.scalar_type() == at::kFloat, "mpext.", op,
                ": ", gn, " must have the dtype of ", pn, " (", dtype_name(p.scalar_type()),
                ") or float32, got ", dtype_name(g.scalar_type()));
    if (nmom >= 1) check_moment_dtype(m, op, mn, 0);
    if (nmom >= 2) check_moment_dtype(v, op, vn, 1);
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
      // an empty tensor is "none"; an empty param's own storage is empty as well, and where one
      // launch mixes groups (masters in one, remainders in the other) an empty shard holds the
      // other group's "none" of another shape: for an empty param the two need no telling apart
      if (w.numel() == 0) return false;
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
    TORCH_CHECK_VALUE(!low || p.numel() == 0 || has_master || has_remainder || storage.master_free,
                      "mpext.", op, ": ", pn, " is ", dtype_name(p.scalar_type()),
                      " and needs an fp32 master (masters[", i, "])",
                      p.scalar_type() == at::kBFloat16 ? " or a remainder (remainders[" : "",
                      p.scalar_type() == at::kBFloat16 ? std::to_string(i) + "])" : "",
                      "; pass master_free=True to update it in place without one");
    // The blocks' scales: ceil(n / block) float32 values for 8-bit moments, else none.
    float* scale_ptr[2] = {nullptr, nullptr};
    const at::TensorList scale_lists[2] = {m_scales, v_scales};
    const char* const* scale_names = rule.scale_names;
    for (int j = 0; j < rule.nlists; ++j) {
      const Arg sn(scale_names[j], i);
      if (scale_lists[j].empty()) {
        TORCH_CHECK_VALUE(!q8 || j >= nmom, "mpext.", op, ": ", mn,
                          " holds 8-bit codes, which need ", scale_names[j],
                          " (one float32 scale per block of ", block,
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

    mp_step_tensor t{};
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
    // the moments the rule keeps, each in its format (a moment it does not keep is not read)
    if (nmom >= 1) t.exp_avg_format = moment_format(m, 0);
    if (nmom >= 2) t.exp_avg_sq_format = moment_format(v, 1);
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
  if (storage.stats) ranges.push_back(byte_range(*storage.stats, -1, true, "stats"));
  ranges.push_back(byte_range(lr, -1, false, "lr"));
  if (inv_scale) ranges.push_back(byte_range(*inv_scale, -1, false, "inv_scale"));
  if (found_inf) ranges.push_back(byte_range(*found_inf, -1, false, "found_inf"));
  check_no_overlap(std::move(ranges), op, "", "");
  check_lr_value();
  return plan;
}

}  // namespace mpext
