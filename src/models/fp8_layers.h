// What every CPU model does for its FP8 linears once per step, at evaluation and after loading
// weights, over its map from linear name to layer (any layer type with a member
// `std::unique_ptr<ops::Fp8Linear> fp8`, null for a linear outside FP8).
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "models/precision_policy.h"
#include "models/tensor_parallel.h"
#include "numerics/scaling.h"
#include "ops/fp8_health.h"
#include "ops/fp8_linear.h"

namespace fp8t {

// The FP8 linear of a rank's share [in, out] of a linear (the whole linear without tensor
// parallelism), or null when the policy's decision (`fp8`, `reason`) keeps it in BF16; a share
// that a block recipe cannot cast in whole blocks moves the decision to BF16, with the reason.
inline std::unique_ptr<ops::Fp8Linear> make_fp8_share(bool& fp8, std::string& reason,
                                                      const ops::LinearShape& share,
                                                      TensorSplit split,
                                                      const ModelPrecision& precision,
                                                      const TensorParallel& group) {
  if (std::optional<std::string> why = tensor_parallel_share_reason(
          share.in_features, share.out_features, precision.fp8.recipe, group.size);
      fp8 && why) {
    fp8 = false;
    reason = *why;
  }
  if (!fp8) return nullptr;
  auto linear = std::make_unique<ops::Fp8Linear>(precision.fp8, precision.family, share.in_features,
                                                 share.out_features, precision.fp8_wgrad);
  if (split != TensorSplit::None) {
    // Column-parallel: the input is whole on every rank, the weight and the output gradient
    // are shares; row-parallel: the input and the weight are shares.
    const bool outputs = split == TensorSplit::Outputs;
    linear->set_split_operands(group.max, {!outputs, true, outputs});
  }
  return linear;
}

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
