#include "ops/linear.h"

#include <vector>

#include "core/error.h"
#include "gemm/cpu_gemm.h"
#include "numerics/float_bits.h"

namespace fp8t::ops {

namespace {

void check_shape(const LinearShape& shape) {
  FP8T_CHECK(shape.tokens >= 0 && shape.in_features >= 0 && shape.out_features >= 0,
             "expected a non-negative linear shape, found tokens={} in={} out={}", shape.tokens,
             shape.in_features, shape.out_features);
}

// The operand the GEMM reads: the caller's buffer, or a bf16-rounded copy kept in `storage`.
const float* operand(const float* data, int64_t count, LinearOperands operands,
                     std::vector<float>& storage) {
  if (operands == LinearOperands::Fp32 || data == nullptr) return data;
  storage.resize(static_cast<size_t>(count));
  for (int64_t i = 0; i < count; ++i)
    storage[static_cast<size_t>(i)] = bf16_to_float(float_to_bf16(data[i]));
  return storage.data();
}

}  // namespace

void linear_forward(const float* x, const float* weight, float* y, const LinearShape& shape,
                    LinearOperands operands) {
  check_shape(shape);
  const auto [tokens, in, out] = shape;
  std::vector<float> x_storage, w_storage;
  const float* x_used = operand(x, tokens * in, operands, x_storage);
  const float* w_used = operand(weight, out * in, operands, w_storage);
  gemm::forward_xwt(tokens, out, in, x_used, in, w_used, in, y, out, /*accumulate=*/false);
}

void linear_backward(const float* grad_output, const float* x, const float* weight,
                     float* grad_input, float* grad_weight, const LinearShape& shape,
                     LinearOperands operands) {
  check_shape(shape);
  const auto [tokens, in, out] = shape;
  std::vector<float> dy_storage, operand_storage;
  const float* dy = operand(grad_output, tokens * out, operands, dy_storage);
  if (grad_input != nullptr) {
    const float* w_used = operand(weight, out * in, operands, operand_storage);
    gemm::dgrad_dyw(tokens, out, in, dy, out, w_used, in, grad_input, in);
  }
  if (grad_weight != nullptr) {
    const float* x_used = operand(x, tokens * in, operands, operand_storage);
    gemm::wgrad_dytx(tokens, out, in, dy, out, x_used, in, grad_weight, in);
  }
}

}  // namespace fp8t::ops
