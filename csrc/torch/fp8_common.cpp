// No header may bring in every ATen operator: common.h says why.
#define AT_PER_OPERATOR_HEADERS
#define TORCH_ASSERT_ONLY_METHOD_OPERATORS

#include "fp8_common.h"

#include <ATen/ops/empty.h>

#include <vector>

namespace mpext {
namespace {

// Blocks run along the last dimension of a row-major tensor: anything else is the caller's to
// copy (mpext.activations does, explicitly).
void check_rows(const at::Tensor& t, const char* op, Arg name, c10::DeviceType device) {
  TORCH_CHECK(t.device().type() == device, "mpext.", op, ": ", name, " is on ", t.device(),
              " but this implementation is for ", device == c10::kCPU ? "the CPU" : "CUDA");
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

Fp8Plan plan_of(const at::Tensor& t, int64_t block, at::ScalarType fp8) {
  const int64_t cols = t.size(-1);
  return {cols == 0 ? 0 : t.numel() / cols, cols, block,
          fp8 == at::kFloat8_e5m2 ? MP_FP8_E5M2 : MP_FP8_E4M3};
}

}  // namespace

Fp8Plan plan_fp8_quantize(const at::Tensor& x, int64_t block_size,
                          const std::optional<at::ScalarType>& fp8_dtype, int64_t offset,
                          c10::DeviceType device, at::Tensor* q, at::Tensor* scales) {
  const char* op = "fp8_quantize";
  check_rows(x, op, "x", device);
  check_dtype(x, op, "x", {at::kFloat, at::kBFloat16, at::kHalf});
  check_block(block_size, op);
  const at::ScalarType fp8 = fp8_dtype.value_or(at::kFloat8_e4m3fn);
  TORCH_CHECK_VALUE(fp8 == at::kFloat8_e4m3fn || fp8 == at::kFloat8_e5m2, "mpext.", op,
                    ": fp8_dtype must be float8_e4m3fn or float8_e5m2, got ", dtype_name(fp8));
  TORCH_CHECK_VALUE(offset >= 0, "mpext.", op, ": offset must be >= 0, got ", offset);
  *q = at::empty(x.sizes(), x.options().dtype(fp8));
  *scales = at::empty(scale_sizes(x, block_size), x.options().dtype(at::kFloat));
  return plan_of(x, block_size, fp8);
}

Fp8Plan plan_fp8_dequantize(const at::Tensor& q, const at::Tensor& scales, int64_t block_size,
                            const std::optional<at::ScalarType>& dtype, c10::DeviceType device,
                            at::Tensor* out) {
  const char* op = "fp8_dequantize";
  check_rows(q, op, "q", device);
  const at::ScalarType fp8 = q.scalar_type();
  TORCH_CHECK(fp8 == at::kFloat8_e4m3fn || fp8 == at::kFloat8_e5m2, "mpext.", op,
              ": q must have dtype float8_e4m3fn or float8_e5m2, got ", dtype_name(fp8));
  check_block(block_size, op);
  check_device(scales, op, "scales", q.device(), "q");
  check_dtype(scales, op, "scales", {at::kFloat});
  const std::vector<int64_t> want = scale_sizes(q, block_size);
  TORCH_CHECK_VALUE(scales.sizes() == at::IntArrayRef(want), "mpext.", op, ": scales must have "
                    "shape ", at::IntArrayRef(want), " (q's shape with its last dimension in "
                    "blocks of ", block_size, "), got ", scales.sizes());
  TORCH_CHECK_VALUE(scales.is_contiguous(), "mpext.", op, ": scales must be contiguous");
  const at::ScalarType out_dtype = dtype.value_or(at::kFloat);
  TORCH_CHECK_VALUE(out_dtype == at::kFloat || out_dtype == at::kBFloat16 ||
                        out_dtype == at::kHalf,
                    "mpext.", op, ": dtype must be float32, bfloat16 or float16, got ",
                    dtype_name(out_dtype));
  *out = at::empty(q.sizes(), q.options().dtype(out_dtype));
  return plan_of(q, block_size, fp8);
}

}  // namespace mpext
