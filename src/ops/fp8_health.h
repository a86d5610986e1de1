// What the FP8 casts of one tensor did over a statistics step (issue: seeing a run): the amax
// and scale of the per-tensor recipes and how many values saturated at ±max or underflowed to
// zero, counted by the cast kernels themselves (numerics/quantize.h, CastHealth). The models
// collect one record per FP8 linear and operand; train/fp8_health_monitor.h judges them.
#pragma once

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

#include "numerics/quantize.h"
#include "numerics/scaling.h"

namespace fp8t {

struct Fp8OperandHealth {
  // Per-tensor recipes: the largest |value| cast and the scale of the casts (delayed: the
  // history's scale and the step's largest amax; tensorwise: the last cast's). NaN under the
  // block recipes, whose scales are one per block.
  float amax = std::numeric_limits<float>::quiet_NaN();
  float scale = std::numeric_limits<float>::quiet_NaN();
  uint64_t elements = 0;  // values cast (each cast of the step counted once)
  CastHealth counts;

  double saturated_fraction() const {
    return elements == 0 ? 0.0 : double(counts.saturated) / double(elements);
  }
  double underflow_fraction() const {
    return elements == 0 ? 0.0 : double(counts.underflow) / double(elements);
  }
  bool per_tensor() const { return !std::isnan(scale); }
};

struct Fp8TensorHealth {
  std::string layer;  // the linear's name, as in the checkpoint ("transformer.h.3.mlp.c_fc")
  TensorRole role = TensorRole::Input;
  Fp8OperandHealth health;
};

}  // namespace fp8t
