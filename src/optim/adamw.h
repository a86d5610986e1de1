// AdamW as nanochat and PyTorch compute it: decoupled weight decay first, then the moment
// updates, bias correction and the step. fp32 state on the CPU path.
#pragma once

#include <cstdint>

namespace fp8t::optim {

struct AdamWHyperparameters {
  double lr = 1e-3;
  double beta1 = 0.9;
  double beta2 = 0.999;
  double eps = 1e-8;
  double weight_decay = 0.0;
};

// One step for one tensor of n elements; `step` counts from 1 (the bias corrections use it).
//   p *= 1 - lr * wd
//   m = lerp(m, g, 1 - beta1);  v = lerp(v, g², 1 - beta2)
//   p -= lr / (1 - beta1^step) * m / (sqrt(v / (1 - beta2^step)) + eps)
void adamw_step(float* param, const float* grad, float* exp_avg, float* exp_avg_sq, int64_t n,
                int64_t step, const AdamWHyperparameters& hyper);

}  // namespace fp8t::optim
