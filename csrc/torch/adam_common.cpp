#include "adam_common.h"

#include <cmath>

#include "common.h"

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

AdamPlan plan_adam(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs,
                   at::TensorList exp_avg_sqs, at::TensorList masters, at::TensorList steps,
                   const at::Tensor& lr, double beta1, double beta2, double eps,
                   double weight_decay, bool decoupled, bool maximize,
                   const std::optional<at::Tensor>& inv_scale,
                   const std::optional<at::Tensor>& found_inf, bool unscale_grads) {
  const char* op = "adam_step_";
  const size_t n = params.size();
  auto same_len = [&](at::TensorList l, const char* name) {
    TORCH_CHECK_VALUE(l.size() == n, "mpext.", op, ": ", name, " must have one entry per param (",
                      n, "), got ", l.size());
  };
  same_len(grads, "grads");
  same_len(exp_avgs, "exp_avgs");
  same_len(exp_avg_sqs, "exp_avg_sqs");
  same_len(steps, "steps");
  TORCH_CHECK_VALUE(masters.empty() || masters.size() == n, "mpext.", op,
                    ": masters must be empty or have one entry per param (", n, "), got ",
                    masters.size());
  check_hyper(beta1, op, "beta1", 0.0, false, 1.0, true);
  check_hyper(beta2, op, "beta2", 0.0, false, 1.0, true);
  check_hyper(eps, op, "eps", 0.0, false, INFINITY, true);
  check_hyper(weight_decay, op, "weight_decay", 0.0, false, INFINITY, true);
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
  mp_adam_options& o = plan.options;
  o.beta1 = beta1;
  o.beta2 = beta2;
  o.eps = eps;
  o.weight_decay = weight_decay;
  o.decoupled = decoupled ? 1 : 0;
  o.maximize = maximize ? 1 : 0;
  o.lr = lr.device() == device ? lr.const_data_ptr<float>() : nullptr;
  o.lr_value = 0.0f;
  o.inv_scale = inv_scale ? inv_scale->const_data_ptr<float>() : nullptr;
  o.found_inf = found_inf ? found_inf->const_data_ptr<float>() : nullptr;
  o.unscale_grads = unscale_grads ? 1 : 0;
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
  ranges.reserve(6 * n + 3);
  plan.tensors.reserve(n);
  for (size_t k = 0; k < n; ++k) {
    const int64_t i = static_cast<int64_t>(k);
    const at::Tensor& p = params[k];
    const at::Tensor& g = grads[k];
    const at::Tensor& m = exp_avgs[k];
    const at::Tensor& v = exp_avg_sqs[k];
    const Arg pn("params", i), gn("grads", i), mn("exp_avgs", i), vn("exp_avg_sqs", i);
    const Arg wn("masters", i);
    check_device(p, op, pn, device, owner);
    check_device(g, op, gn, device, owner);
    check_device(m, op, mn, device, owner);
    check_device(v, op, vn, device, owner);
    check_dtype(p, op, pn, {at::kFloat, at::kBFloat16, at::kHalf});
    TORCH_CHECK(g.scalar_type() == p.scalar_type() || g.scalar_type() == at::kFloat, "mpext.", op,
                ": ", gn, " must have the dtype of ", pn, " (", dtype_name(p.scalar_type()),
                ") or float32, got ", dtype_name(g.scalar_type()));
    check_dtype(m, op, mn, {at::kFloat});
    check_dtype(v, op, vn, {at::kFloat});
    check_scalars(steps[k], op, Arg("steps", i), at::kFloat, 1, device, owner);
    check_dense(p, op, pn);
    check_dense(g, op, gn);
    check_dense(m, op, mn);
    check_dense(v, op, vn);
    check_same_layout(g, gn, p, pn, op);
    check_same_layout(m, mn, p, pn, op);
    check_same_layout(v, vn, p, pn, op);
    float* master = nullptr;
    const bool needs_master = p.scalar_type() != at::kFloat;
    if (masters.empty()) {
      TORCH_CHECK_VALUE(!needs_master, "mpext.", op, ": ", pn, " is ",
                        dtype_name(p.scalar_type()),
                        " and needs an FP32 master, but masters is empty");
    } else {
      const at::Tensor& w = masters[k];
      check_device(w, op, wn, device, owner);
      check_dtype(w, op, wn, {at::kFloat});
      if (needs_master) {
        check_dense(w, op, wn);
        check_same_layout(w, wn, p, pn, op);
        if (w.numel() > 0) master = static_cast<float*>(w.data_ptr());
        ranges.push_back(byte_range(w, i, true, wn));
      } else {
        TORCH_CHECK_VALUE(w.numel() == 0, "mpext.", op, ": ", pn,
                          " is float32 and takes no master, so ", wn,
                          " must be an empty tensor, got ", w.numel(), " elements");
      }
    }
    plan.tensors.push_back({p.data_ptr(), to_mp_dtype(p.scalar_type()), g.data_ptr(),
                            to_mp_dtype(g.scalar_type()), master,
                            static_cast<float*>(m.data_ptr()), static_cast<float*>(v.data_ptr()),
                            static_cast<float*>(steps[k].data_ptr()), p.numel()});
    ranges.push_back(byte_range(p, i, true, pn));
    ranges.push_back(byte_range(g, i, unscale_grads, gn));  // written back with unscale_grads
    ranges.push_back(byte_range(m, i, true, mn));
    ranges.push_back(byte_range(v, i, true, vn));
    ranges.push_back(byte_range(steps[k], i, true, Arg("steps", i)));
  }
  ranges.push_back(byte_range(lr, -1, false, "lr"));
  if (inv_scale) ranges.push_back(byte_range(*inv_scale, -1, false, "inv_scale"));
  if (found_inf) ranges.push_back(byte_range(*found_inf, -1, false, "found_inf"));
  check_no_overlap(std::move(ranges), op, "", "");
  check_lr_value();
  return plan;
}

}  // namespace mpext
