#include "optim/adamw.h"

#include <cmath>

#include "core/error.h"

namespace fp8t::optim {

void adamw_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n,
                int64_t step, const AdamWHyperparameters& hyper) {
  FP8T_CHECK(n >= 0, "expected a non-negative element count, found {}", n);
  FP8T_CHECK(step >= 1, "AdamW steps count from 1, found {}", step);
  FP8T_CHECK(hyper.beta1 >= 0 && hyper.beta1 < 1 && hyper.beta2 >= 0 && hyper.beta2 < 1,
             "expected betas in [0, 1), found ({}, {})", hyper.beta1, hyper.beta2);
  // Scalars in double, elementwise math in fp32 as on the GPU.
  const auto decay = static_cast<float>(1.0 - hyper.lr * hyper.weight_decay);
  const auto weight1 = static_cast<float>(1.0 - hyper.beta1);
  const auto weight2 = static_cast<float>(1.0 - hyper.beta2);
  const double bias1 = 1.0 - std::pow(hyper.beta1, double(step));
  const auto inv_bias2 = static_cast<float>(1.0 / (1.0 - std::pow(hyper.beta2, double(step))));
  const auto step_size = static_cast<float>(hyper.lr / bias1);
  const auto eps = static_cast<float>(hyper.eps);
  for (int64_t i = 0; i < n; ++i) {
    const float g = grad[i];
    exp_avg[i] += weight1 * (g - exp_avg[i]);
    exp_avg_sq[i] += weight2 * (g * g - exp_avg_sq[i]);
    const float denominator = std::sqrt(exp_avg_sq[i] * inv_bias2) + eps;
    param[i] = param[i] * decay - step_size * (exp_avg[i] / denominator);
  }
}

}  // namespace fp8t::optim
