// AdamW as nanochat and PyTorch compute it: decoupled weight decay first, then the moment
// updates, bias correction and the step. fp32 state on the CPU path.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "optim/optimizer_shard.h"

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

// AdamW over named fp32 parameters with one set of hyperparameters, as Megatron and Primus run
// it: weight decay on the matrices, none on 1-D parameters (biases, norm scales), which decay
// would pull towards zero for no gain. The state is named as GptOptimizer's AdamW state, for
// checkpoints: "<parameter>.exp_avg", "<parameter>.exp_avg_sq" and "optimizer.step".
class AdamWOptimizer {
 public:
  struct Parameter {
    std::string name;
    std::vector<int64_t> shape;
  };

  // With ranks > 1 (ZeRO-1, optim/optimizer_shard.h: the tensors balanced by size) step()
  // updates only the parameters `rank` owns, and only their part of the whole state it holds.
  AdamWOptimizer(std::vector<Parameter> parameters, const AdamWHyperparameters& hyper, int rank = 0,
                 int ranks = 1);
  // The state views point into the optimizer.
  AdamWOptimizer(const AdamWOptimizer&) = delete;
  AdamWOptimizer& operator=(const AdamWOptimizer&) = delete;

  // One step at lr · lr_multiplier over the parameters this rank owns; the data of each
  // parameter and gradient in the constructor's order.
  void step(std::span<float* const> parameters, std::span<const float* const> gradients,
            double lr_multiplier);

  double lr() const { return lr_; }  // of the last step; the base lr before the first
  int64_t steps_taken() const { return steps_; }
  const OptimizerShard& shard() const { return shard_; }
  std::vector<NamedTensor> state();
  size_t state_bytes() const;

 private:
  struct Slot {
    Parameter parameter;
    std::vector<float> exp_avg, exp_avg_sq;
  };

  AdamWHyperparameters hyper_;
  std::vector<Slot> slots_;
  OptimizerShard shard_;
  double lr_;
  int64_t steps_ = 0;
};

// Which of `ranks` ranks updates each parameter under ZeRO-1, as AdamWOptimizer assigns them
// (the tensors balanced by size), without its state: for the GPU path's optimizer.
OptimizerShard adamw_shard(const std::vector<AdamWOptimizer::Parameter>& parameters, int rank,
                           int ranks);

}  // namespace fp8t::optim
