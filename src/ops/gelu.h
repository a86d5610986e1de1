// GELU with the tanh approximation (Flux's MLPs: nn.GELU(approximate="tanh")):
// y = x/2 · (1 + tanh(√(2/π) · (x + 0.044715 x³))).
//
// Backward ADDS (+=) into its gradient buffer, like every op in src/ops.
#pragma once

#include <cstdint>

namespace fp8t::ops {

// out = gelu(inp) over n elements; out may be inp, but the backward needs inp.
template <typename T>
void gelu_tanh_forward(T* out, const T* inp, int64_t n);

// dinp += gelu'(inp) · dout. dinp must not alias dout or inp.
template <typename T>
void gelu_tanh_backward(T* dinp, const T* dout, const T* inp, int64_t n);

}  // namespace fp8t::ops
