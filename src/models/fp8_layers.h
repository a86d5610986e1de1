// What every CPU model does for its FP8 linears once per step, at evaluation and after loading
// weights, over its map from linear name to layer (any layer type with a member
// `std::unique_ptr<ops::Fp8Linear> fp8`, null for a linear outside FP8).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "numerics/scaling.h"
#include "ops/fp8_linear.h"

namespace fp8t {

// Delayed-scaling updates and the invalidation of the cached weight quantizations.
template <typename LinearMap>
void end_fp8_step(LinearMap& linears) {
  for (auto& [name, layer] : linears) {
    if (layer.fp8) layer.fp8->end_step();
  }
}

// Evaluation passes (training false) leave the amax histories alone.
template <typename LinearMap>
void record_fp8_amaxes(LinearMap& linears, bool training) {
  for (auto& [name, layer] : linears) {
    if (layer.fp8) layer.fp8->set_record_amax(training);
  }
}

template <typename LinearMap>
void invalidate_fp8_weights(LinearMap& linears) {
  for (auto& [name, layer] : linears) {
    if (layer.fp8) layer.fp8->invalidate_weight_cache();
  }
}

// "<linear>.<input|weight|grad_output>" for every FP8 linear with delayed scaling, in the map's
// order (a std::map: by name), for checkpoints.
template <typename LinearMap>
std::vector<std::pair<std::string, DelayedScaling*>> fp8_delayed_scalings(LinearMap& linears) {
  std::vector<std::pair<std::string, DelayedScaling*>> scalings;
  constexpr std::pair<TensorRole, const char*> kRoles[] = {{TensorRole::Input, "input"},
                                                           {TensorRole::Weight, "weight"},
                                                           {TensorRole::GradOutput, "grad_output"}};
  for (auto& [name, layer] : linears) {
    if (!layer.fp8 || !layer.fp8->has_delayed_scaling()) continue;
    for (const auto& [role, role_name] : kRoles)
      scalings.emplace_back(name + "." + role_name, &layer.fp8->delayed_scaling(role));
  }
  return scalings;
}

}  // namespace fp8t
