// What every CPU model does for its FP8 linears once per step, at evaluation and after loading
// weights, over its map from linear name to layer (any layer type with a member
// `std::unique_ptr<ops::Fp8Linear> fp8`, null for a linear outside FP8).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "numerics/scaling.h"
#include "ops/fp8_health.h"
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
  for (auto& [name, layer] : linears) {
    if (!layer.fp8 || !layer.fp8->has_delayed_scaling()) continue;
    for (TensorRole role : kTensorRoles) {
      scalings.emplace_back(name + "." + tensor_role_name(role), &layer.fp8->delayed_scaling(role));
    }
  }
  return scalings;
}

// The casts of every FP8 linear count their health (ops/fp8_health.h) while `record` holds.
template <typename LinearMap>
void record_fp8_health(LinearMap& linears, bool record) {
  for (auto& [name, layer] : linears) {
    if (layer.fp8) layer.fp8->set_record_health(record);
  }
}

// A recompute's rerun of a forward: the FP8 linears record no amax and count no health, then
// resume as `training` and `recording_health` say, so that a step's FP8 state is that of one
// forward.
template <typename LinearMap>
void pause_fp8_recording(LinearMap& linears) {
  record_fp8_amaxes(linears, false);
  record_fp8_health(linears, false);
}

template <typename LinearMap>
void resume_fp8_recording(LinearMap& linears, bool training, bool recording_health) {
  record_fp8_amaxes(linears, training);
  record_fp8_health(linears, recording_health);
}

// What the FP8 linears' casts counted since the last call, one record per linear and operand,
// the linears in the order of `order` (each element's `linear.name`: the model's order), and a
// fresh count started.
template <typename LinearMap, typename Decisions>
std::vector<Fp8TensorHealth> take_fp8_health(LinearMap& linears, const Decisions& order) {
  std::vector<Fp8TensorHealth> records;
  for (const auto& decision : order) {
    const auto found = linears.find(decision.linear.name);
    if (found == linears.end() || !found->second.fp8) continue;
    ops::Fp8Linear& fp8 = *found->second.fp8;
    for (TensorRole role : kTensorRoles)
      records.push_back({decision.linear.name, role, fp8.health(role)});
    fp8.clear_health();
  }
  return records;
}

}  // namespace fp8t
