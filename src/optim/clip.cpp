#include "optim/clip.h"

#include <cmath>

#include "core/error.h"

namespace fp8t::optim {

double global_norm(std::span<const GradientSpan> gradients) {
  double squares = 0.0;
  for (const GradientSpan& gradient : gradients) {
    FP8T_CHECK(gradient.count >= 0, "expected a non-negative element count, found {}",
               gradient.count);
    for (int64_t i = 0; i < gradient.count; ++i)
      squares += double(gradient.data[i]) * gradient.data[i];
  }
  return std::sqrt(squares);
}

double clip_gradients(std::span<const GradientSpan> gradients, double max_norm) {
  FP8T_CHECK(max_norm > 0, "expected a positive clip norm, found {}", max_norm);
  const double norm = global_norm(gradients);
  if (!std::isfinite(norm) || norm <= max_norm) return norm;
  const auto factor = static_cast<float>(max_norm / (norm + 1e-6));
  for (const GradientSpan& gradient : gradients) {
    for (int64_t i = 0; i < gradient.count; ++i)
      gradient.data[i] *= factor;
  }
  return norm;
}

}  // namespace fp8t::optim
