// Where each parameter of a model (the GPT, the Flux) lives in one contiguous device buffer: the
// GPU path keeps its fp32 parameters and gradients in one allocation each, tensors in
// gpt_parameters() order, each starting at a 256-byte aligned offset (cuBLASLt's and the vector
// loads' alignment, and what DeviceArena::take hands out). The model allocates with this layout and
// the optimizer indexes it, so both agree by construction. The gaps between tensors belong to no
// tensor: keep them zero (clear the whole buffer) so that a norm over the buffer sees only the
// tensors.
//
// Plain C++17, no CUDA: CPU builds and CUDA sources include it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "core/error.h"
#include "models/flux_config.h"
#include "models/gpt_config.h"

namespace fp8t::optim {

struct DeviceParameter {
  std::string name;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  int64_t offset = 0;  // in elements from the buffer's base; offset · element size is aligned
};

struct DeviceParameterLayout {
  static constexpr size_t kAlignmentBytes = 256;

  size_t element_bytes = sizeof(float);
  std::vector<DeviceParameter> parameters;  // gpt_parameters() or flux_parameters() order
  int64_t total_elements = 0;               // a multiple of the alignment, gaps included

  size_t total_bytes() const { return static_cast<size_t>(total_elements) * element_bytes; }

  // Throws fp8t::Error for a name the layout does not hold.
  const DeviceParameter& operator[](const std::string& name) const {
    for (const DeviceParameter& parameter : parameters) {
      if (parameter.name == name) return parameter;
    }
    throw Error(fmt::format("the device parameter layout holds no tensor named '{}'", name));
  }
};

// Lays the tensors out one after the other, each rounded up to the alignment. Spec: any
// parameter description with name, shape and numel() (the GPT's ParamSpec, the Flux's FluxParam).
template <typename Spec>
DeviceParameterLayout device_parameter_layout(const std::vector<Spec>& specs,
                                              size_t element_bytes = sizeof(float)) {
  FP8T_CHECK(element_bytes > 0 && DeviceParameterLayout::kAlignmentBytes % element_bytes == 0,
             "expected an element size dividing {} bytes, found {}",
             DeviceParameterLayout::kAlignmentBytes, element_bytes);
  const auto granule = static_cast<int64_t>(DeviceParameterLayout::kAlignmentBytes / element_bytes);
  DeviceParameterLayout layout;
  layout.element_bytes = element_bytes;
  for (const Spec& spec : specs) {
    const int64_t numel = spec.numel();
    layout.parameters.push_back({spec.name, spec.shape, numel, layout.total_elements});
    layout.total_elements += (numel + granule - 1) / granule * granule;
  }
  return layout;
}

inline DeviceParameterLayout device_parameter_layout(const GptConfig& config,
                                                     size_t element_bytes = sizeof(float)) {
  return device_parameter_layout(gpt_parameters(config), element_bytes);
}

inline DeviceParameterLayout device_parameter_layout(const FluxConfig& config,
                                                     size_t element_bytes = sizeof(float)) {
  return device_parameter_layout(flux_parameters(config), element_bytes);
}

}  // namespace fp8t::optim
