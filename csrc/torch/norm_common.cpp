// No header may bring in every ATen operator: common.h says why.
#define AT_PER_OPERATOR_HEADERS
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include "norm_common.h"

#include "common.h"

namespace mpext {

c10::Device grad_norm_device(at::TensorList tensors, const std::optional<at::Tensor>& inv_scale) {
  return !tensors.empty()        ? tensors[0].device()
         : inv_scale.has_value() ? inv_scale->device()
                                 : c10::Device(c10::kCPU);
}

std::vector<mp_norm_segment> plan_grad_norm(at::TensorList tensors,
                                            const std::optional<at::Tensor>& inv_scale) {
  const char* op = "grad_norm";
  const c10::Device device = grad_norm_device(tensors, inv_scale);
  std::vector<mp_norm_segment> segs;
  segs.reserve(tensors.size());
  for (size_t k = 0; k < tensors.size(); ++k) {
    const at::Tensor& t = tensors[k];
    const Arg name("tensors", static_cast<int64_t>(k));
    check_device(t, op, name, device, Arg("tensors", 0));
    check_dtype(t, op, name, {at::kFloat, at::kBFloat16, at::kHalf});
    check_dense(t, op, name);
    if (t.numel() > 0) segs.push_back({t.const_data_ptr(), to_mp_dtype(t.scalar_type()), t.numel()});
  }
  if (inv_scale.has_value()) {
    check_scalars(*inv_scale, op, "inv_scale", at::kFloat, 1, device, Arg("tensors", 0));
  }
  return segs;
}

}  // namespace mpext
