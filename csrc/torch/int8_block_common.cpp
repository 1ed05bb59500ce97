// No header may bring in every ATen operator: common.h says why.
#define AT_PER_OPERATOR_HEADERS
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include "int8_block_common.h"

#include <ATen/ops/empty.h>

#include <vector>

namespace mpext {
namespace {

// Blocks run along the last dimension of a row-major tensor: anything else is the caller's to
// copy (mpext.activations does, explicitly).
void check_rows(const at::Tensor& t, const char* op, Arg name, c10::DeviceType device) {
  check_backend(t.device(), device, op, name);
  TORCH_CHECK(t.layout() == at::kStrided, "mpext.", op, ": ", name,
              " must be a strided (dense) tensor, got layout ", t.layout());
  TORCH_CHECK_VALUE(t.dim() >= 1, "mpext.", op, ": ", name,
                    " must have at least one dimension (the blocks run along the last one)");
  TORCH_CHECK_VALUE(t.is_contiguous(), "mpext.", op, ": ", name,
                    " must be contiguous (the blocks run along its last dimension); got sizes ",
                    t.sizes(), " and strides ", t.strides(), ". Call .contiguous() on it first.");
}

void check_block(int64_t block_size, const char* op) {
  TORCH_CHECK_VALUE(block_size >= 1, "mpext.", op, ": block_size must be >= 1, got ", block_size);
}

std::vector<int64_t> scale_sizes(const at::Tensor& t, int64_t block) {
  std::vector<int64_t> sizes(t.sizes().begin(), t.sizes().end());
  sizes.back() = (sizes.back() + block - 1) / block;
  return sizes;
}

Int8BlockPlan plan_of(const at::Tensor& t, int64_t block) {
  const int64_t cols = t.size(-1);
  return {cols == 0 ? 0 : t.numel() / cols, cols, block};
}

}  // namespace

Int8BlockPlan plan_int8_block_quantize(const at::Tensor& x, int64_t block_size,
                                       c10::DeviceType device, at::Tensor* q, at::Tensor* scales) {
  const char* op = "int8_block_quantize";
  check_rows(x, op, "x", device);
  check_dtype(x, op, "x", {at::kFloat, at::kBFloat16, at::kHalf});
  check_block(block_size, op);
  *q = at::empty(x.sizes(), x.options().dtype(at::kChar));
  *scales = at::empty(scale_sizes(x, block_size), x.options().dtype(at::kFloat));
  return plan_of(x, block_size);
}

Int8BlockPlan plan_int8_block_dequantize(const at::Tensor& q, const at::Tensor& scales,
                                         int64_t block_size,
                                         const std::optional<at::ScalarType>& dtype,
                                         c10::DeviceType device, at::Tensor* out) {
  const char* op = "int8_block_dequantize";
  check_rows(q, op, "q", device);
  check_dtype(q, op, "q", {at::kChar});
  check_block(block_size, op);
  check_device(scales, op, "scales", q.device(), "q");
  check_dtype(scales, op, "scales", {at::kFloat});
  const std::vector<int64_t> want = scale_sizes(q, block_size);
  TORCH_CHECK_VALUE(scales.sizes() == at::IntArrayRef(want), "mpext.", op, ": scales must have "
                    "shape ", at::IntArrayRef(want), " (q's shape with its last dimension in "
                    "blocks of ", block_size, "), got ", scales.sizes());
  TORCH_CHECK_VALUE(scales.is_contiguous(), "mpext.", op, ": scales must be contiguous; got "
                    "strides ", scales.strides());
  const at::ScalarType out_dtype = dtype.value_or(at::kFloat);
  TORCH_CHECK_VALUE(out_dtype == at::kFloat || out_dtype == at::kBFloat16 ||
                        out_dtype == at::kHalf,
                    "mpext.", op, ": dtype must be float32, bfloat16 or float16, got ",
                    dtype_name(out_dtype));
  *out = at::empty(q.sizes(), q.options().dtype(out_dtype));
  return plan_of(q, block_size);
}

}  // namespace mpext
