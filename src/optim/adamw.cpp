#include "optim/adamw.h"

#include <cmath>
#include <functional>
#include <map>
#include <numeric>
#include <string>
#include <utility>

#include "core/error.h"
#include "optim/gpt_optimizer.h"

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

namespace {

int64_t numel_of(const std::vector<int64_t>& shape) {
  return std::accumulate(shape.begin(), shape.end(), int64_t{1}, std::multiplies<>());
}

}  // namespace

OptimizerShard adamw_shard(const std::vector<AdamWOptimizer::Parameter>& parameters, int rank,
                           int ranks) {
  OptimizerGroup group{};  // only the rule and the parameters matter here
  group.rule = UpdateRule::AdamW;
  std::map<std::string, int64_t> numels;
  for (const AdamWOptimizer::Parameter& parameter : parameters) {
    group.parameters.push_back(parameter.name);
    numels[parameter.name] = numel_of(parameter.shape);
  }
  return OptimizerShard(
      {group}, [&](const std::string& name) { return numels.at(name); }, rank, ranks);
}

AdamWOptimizer::AdamWOptimizer(std::vector<Parameter> parameters, const AdamWHyperparameters& hyper,
                               int rank, int ranks)
    : hyper_(hyper), shard_(adamw_shard(parameters, rank, ranks)), lr_(hyper.lr) {
  for (Parameter& parameter : parameters) {
    const int64_t numel = numel_of(parameter.shape);
    slots_.push_back({std::move(parameter), std::vector<float>(size_t(numel), 0.0f),
                      std::vector<float>(size_t(numel), 0.0f)});
  }
}

void AdamWOptimizer::step(std::span<float* const> parameters,
                          std::span<const float* const> gradients, double lr_multiplier) {
  FP8T_CHECK(parameters.size() == slots_.size() && gradients.size() == slots_.size(),
             "expected {} parameters and gradients, found {} and {}", slots_.size(),
             parameters.size(), gradients.size());
  FP8T_CHECK(std::isfinite(lr_multiplier) && lr_multiplier >= 0,
             "expected a finite lr multiplier >= 0, found {}", lr_multiplier);
  ++steps_;  // the first step's bias correction uses 1
  lr_ = hyper_.lr * lr_multiplier;
  for (size_t i = 0; i < slots_.size(); ++i) {
    Slot& slot = slots_[i];
    if (!shard_.owns(slot.parameter.name)) continue;
    AdamWHyperparameters hyper = hyper_;
    hyper.lr = lr_;
    if (slot.parameter.shape.size() < 2) hyper.weight_decay = 0.0;
    adamw_step(parameters[i], gradients[i], slot.exp_avg.data(), slot.exp_avg_sq.data(),
               std::ssize(slot.exp_avg), steps_, hyper);
  }
}

std::vector<NamedTensor> AdamWOptimizer::state() {
  std::vector<NamedTensor> buffers;
  for (Slot& slot : slots_) {
    const std::vector<int64_t>& shape = slot.parameter.shape;
    const int rank = static_cast<int>(shape.size());
    buffers.push_back({slot.parameter.name + ".exp_avg",
                       TensorView(slot.exp_avg.data(), DType::F32, shape.data(), rank)});
    buffers.push_back({slot.parameter.name + ".exp_avg_sq",
                       TensorView(slot.exp_avg_sq.data(), DType::F32, shape.data(), rank)});
  }
  buffers.push_back({"optimizer.step", TensorView(&steps_, DType::I64, {1})});
  return buffers;
}

size_t AdamWOptimizer::state_bytes() const {
  size_t bytes = sizeof(steps_);
  for (const Slot& slot : slots_)
    bytes += (slot.exp_avg.size() + slot.exp_avg_sq.size()) * sizeof(float);
  return bytes;
}

}  // namespace fp8t::optim
