#include "norm_common.h"

#include "common.h"

namespace mpext {

c10::Device check_grad_norm(at::TensorList tensors, const std::optional<at::Tensor>& inv_scale) {
  const char* op = "grad_norm";
  const c10::Device device = !tensors.empty()    ? tensors[0].device()
                             : inv_scale.has_value() ? inv_scale->device()
                                                     : c10::Device(c10::kCPU);
  for (size_t k = 0; k < tensors.size(); ++k) {
    const at::Tensor& t = tensors[k];
    const Arg name("tensors", static_cast<int64_t>(k));
    TORCH_CHECK(t.device() == device, "mpext.", op, ": ", name, " is on ", t.device(),
                " but tensors[0] is on ", device, "; all tensors must be on one device");
    check_dtype(t, op, name, {at::kFloat, at::kBFloat16, at::kHalf});
    check_dense(t, op, name);
  }
  if (inv_scale.has_value()) {
    const at::Tensor& s = *inv_scale;
    TORCH_CHECK(s.scalar_type() == at::kFloat, "mpext.", op,
                ": inv_scale must have dtype float32, got ", dtype_name(s.scalar_type()));
    TORCH_CHECK(s.numel() == 1, "mpext.", op, ": inv_scale must have 1 element, got ",
                s.numel());
    TORCH_CHECK(s.device() == device, "mpext.", op, ": inv_scale is on ", s.device(),
                " but tensors[0] is on ", device);
    check_dense(s, op, "inv_scale");
  }
  return device;
}

}  // namespace mpext
