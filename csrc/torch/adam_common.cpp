#include "adam_common.h"

#include <cmath>

#include "common.h"

namespace mpext {
namespace {

mp_dtype to_mp_dtype(at::ScalarType t) {
  return t == at::kFloat ? MP_F32 : (t == at::kBFloat16 ? MP_BF16 : MP_F16);
}

bool same_layout(const at::Tensor& a, const at::Tensor& b) {
  if (a.sizes() != b.sizes()) return false;
  for (int64_t d = 0; d < a.dim(); ++d) {
    if (a.size(d) > 1 && a.stride(d) != b.stride(d)) return false;
  }
  return true;
}

void check_one_element(const at::Tensor& t, const char* op, Arg name) {
  TORCH_CHECK(t.scalar_type() == at::kFloat, "mpext.", op, ": ", name,
              " must have dtype float32, got ", dtype_name(t.scalar_type()));
  TORCH_CHECK(t.numel() == 1, "mpext.", op, ": ", name, " must have 1 element, got ", t.numel());
}

void check_hyper(double value, const char* op, const char* name, double lo, bool lo_open,
                 double hi, bool hi_open) {
  bool ok = std::isfinite(value) && (lo_open ? value > lo : value >= lo) &&
            (hi_open ? value < hi : value <= hi);
  TORCH_CHECK_VALUE(ok, "mpext.", op, ": ", name, " must be in ", lo_open ? "(" : "[", lo, ", ",
                    hi, hi_open ? ")" : "]", ", got ", value);
}

}  // namespace

std::vector<AdamTensor> plan_adam(at::TensorList params, at::TensorList grads,
                                  at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                                  at::TensorList masters, at::TensorList steps,
                                  const at::Tensor& lr, double beta1, double beta2, double eps,
                                  double weight_decay,
                                  const std::optional<at::Tensor>& inv_scale,
                                  const std::optional<at::Tensor>& found_inf) {
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
  check_one_element(lr, op, "lr");
  check_dense(lr, op, "lr");
  if (inv_scale) check_one_element(*inv_scale, op, "inv_scale");
  if (found_inf) check_one_element(*found_inf, op, "found_inf");

  std::vector<AdamTensor> plan;
  if (n == 0) return plan;
  const c10::Device device = params[0].device();
  // Tensors that may live on the CPU while params are on CUDA (read-only or step counters).
  auto check_device = [&](const at::Tensor& t, Arg name, bool cpu_ok) {
    TORCH_CHECK(t.device() == device || (cpu_ok && t.is_cpu()), "mpext.", op, ": ", name,
                " is on ", t.device(), " but params[0] is on ", device,
                cpu_ok ? " (it may also be on the CPU)" : "");
  };
  check_device(lr, "lr", true);
  if (inv_scale) check_device(*inv_scale, "inv_scale", false);
  if (found_inf) check_device(*found_inf, "found_inf", false);

  std::vector<ByteRange> ranges;
  ranges.reserve(6 * n + 3);
  plan.reserve(n);
  for (size_t k = 0; k < n; ++k) {
    const int64_t i = static_cast<int64_t>(k);
    const at::Tensor& p = params[k];
    const at::Tensor& g = grads[k];
    const at::Tensor& m = exp_avgs[k];
    const at::Tensor& v = exp_avg_sqs[k];
    const at::Tensor& s = steps[k];
    const Arg pn("params", i), gn("grads", i), mn("exp_avgs", i), vn("exp_avg_sqs", i);
    const Arg sn("steps", i), wn("masters", i);
    check_device(p, pn, false);
    check_device(g, gn, false);
    check_device(m, mn, false);
    check_device(v, vn, false);
    check_device(s, sn, false);
    check_dtype(p, op, pn, {at::kFloat, at::kBFloat16, at::kHalf});
    TORCH_CHECK(g.scalar_type() == p.scalar_type() || g.scalar_type() == at::kFloat, "mpext.", op,
                ": ", gn, " must have the dtype of ", pn, " (", dtype_name(p.scalar_type()),
                ") or float32, got ", dtype_name(g.scalar_type()));
    check_dtype(m, op, mn, {at::kFloat});
    check_dtype(v, op, vn, {at::kFloat});
    check_one_element(s, op, sn);
    check_dense(p, op, pn);
    check_dense(g, op, gn);
    check_dense(m, op, mn);
    check_dense(v, op, vn);
    TORCH_CHECK_VALUE(same_layout(p, g), "mpext.", op, ": ", gn, " (sizes ", g.sizes(),
                      ", strides ", g.strides(), ") must match ", pn, " (sizes ", p.sizes(),
                      ", strides ", p.strides(), ")");
    TORCH_CHECK_VALUE(same_layout(p, m), "mpext.", op, ": ", mn, " (sizes ", m.sizes(),
                      ", strides ", m.strides(), ") must match ", pn, " (sizes ", p.sizes(),
                      ", strides ", p.strides(), ")");
    TORCH_CHECK_VALUE(same_layout(p, v), "mpext.", op, ": ", vn, " (sizes ", v.sizes(),
                      ", strides ", v.strides(), ") must match ", pn, " (sizes ", p.sizes(),
                      ", strides ", p.strides(), ")");
    float* master = nullptr;
    const bool needs_master = p.scalar_type() != at::kFloat;
    if (masters.empty()) {
      TORCH_CHECK_VALUE(!needs_master, "mpext.", op, ": ", pn, " is ",
                        dtype_name(p.scalar_type()),
                        " and needs an FP32 master, but masters is empty");
    } else {
      const at::Tensor& w = masters[k];
      check_device(w, wn, false);
      check_dtype(w, op, wn, {at::kFloat});
      if (needs_master) {
        check_dense(w, op, wn);
        TORCH_CHECK_VALUE(same_layout(p, w), "mpext.", op, ": ", wn, " (sizes ", w.sizes(),
                          ", strides ", w.strides(), ") must match ", pn, " (sizes ", p.sizes(),
                          ", strides ", p.strides(), ")");
        if (w.numel() > 0) master = static_cast<float*>(w.data_ptr());
        ranges.push_back(byte_range(w, i, true, wn));
      } else {
        TORCH_CHECK_VALUE(w.numel() == 0, "mpext.", op, ": ", pn,
                          " is float32 and takes no master, so ", wn,
                          " must be an empty tensor, got ", w.numel(), " elements");
      }
    }
    plan.push_back({p.data_ptr(), to_mp_dtype(p.scalar_type()), g.data_ptr(),
                    to_mp_dtype(g.scalar_type()), master, static_cast<float*>(m.data_ptr()),
                    static_cast<float*>(v.data_ptr()), static_cast<float*>(s.data_ptr()),
                    p.numel(), i});
    ranges.push_back(byte_range(p, i, true, pn));
    ranges.push_back(byte_range(g, i, false, gn));
    ranges.push_back(byte_range(m, i, true, mn));
    ranges.push_back(byte_range(v, i, true, vn));
    ranges.push_back(byte_range(s, i, true, sn));
  }
  ranges.push_back(byte_range(lr, -1, false, "lr"));
  if (inv_scale) ranges.push_back(byte_range(*inv_scale, -1, false, "inv_scale"));
  if (found_inf) ranges.push_back(byte_range(*found_inf, -1, false, "found_inf"));
  check_no_overlap(std::move(ranges), op, "", "");
  return plan;
}

}  // namespace mpext
