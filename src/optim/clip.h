// Gradient clipping by the global norm over all gradients, as torch.nn.utils.clip_grad_norm_.
#pragma once

#include <cstdint>
#include <span>

namespace fp8t::optim {

struct GradientSpan {
  float* data;
  int64_t count;
};

// sqrt of the sum of squares over every element, accumulated in double.
double global_norm(std::span<const GradientSpan> gradients);

// When the global norm exceeds max_norm, scales every gradient by max_norm / (norm + 1e-6).
// Returns the norm before clipping. A non-finite norm leaves the gradients untouched: the
// caller sees it and skips the step rather than spreading NaN into every parameter.
double clip_gradients(std::span<const GradientSpan> gradients, double max_norm);

}  // namespace fp8t::optim
