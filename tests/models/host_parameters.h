// A GPT's whole f32 tensors on the host (parameters or gradients, in an arena of their own):
// what a GPU test fills and uploads, or downloads from a device model or optimizer.
#pragma once

#include <string>
#include <vector>

#include "core/arena.h"
#include "core/tensor.h"
#include "models/gpt_config.h"
#include "models/gpt_memory.h"

namespace fp8t::testing {

// A tensor's f32 values, copied.
inline std::vector<float> values_of(const TensorView& view) {
  const float* first = view.data<float>();
  return {first, first + view.numel()};
}

struct HostParameters {
  Arena arena;
  ParameterSet set;
  explicit HostParameters(const GptConfig& config)
      : arena("host parameters", ParameterSet::planned_bytes(config, DType::F32)),
        set(arena, config, DType::F32) {}
  float* operator[](const std::string& name) { return set[name].data<float>(); }
  std::vector<float> values(const std::string& name) const { return values_of(set[name]); }
};

}  // namespace fp8t::testing
