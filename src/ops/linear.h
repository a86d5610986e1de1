// A plain (non-FP8) linear layer on the CPU: y = x·Wᵀ in fp32, optionally on bf16 operands.
// Layout as nn.Linear: x [tokens, in_features], W [out_features, in_features],
// y [tokens, out_features], all row-major.
#pragma once

#include <cstdint>

namespace fp8t::ops {

// Which operands the GEMMs see. Accumulation is fp32 either way.
enum class LinearOperands : uint8_t {
  Fp32,  // as given
  Bf16,  // each operand rounded to bf16 first (the BF16 path of the CPU emulation)
};

struct LinearShape {
  int64_t tokens;
  int64_t in_features;
  int64_t out_features;
};

// y = x·Wᵀ. y is overwritten and holds the fp32 result (not rounded to bf16: the caller decides
// how activations are stored).
void linear_forward(const float* x, const float* weight, float* y, const LinearShape& shape,
                    LinearOperands operands);

// ADDS the gradients: dx += dy·W and dW += dyᵀ·x (dW summed over the tokens), so that
// micro-batches and several consumers of x accumulate. Pass null for a gradient that is not
// needed (then its operand, W for dx or x for dW, may be null too).
void linear_backward(const float* grad_output, const float* x, const float* weight,
                     float* grad_input, float* grad_weight, const LinearShape& shape,
                     LinearOperands operands);

}  // namespace fp8t::ops
