// Where each parameter of a model (the GPT, the Flux) lives in one contiguous device buffer: the
// GPU path keeps its fp32 parameters and gradients in one allocation each, tensors in
// gpt_parameters() order, each starting at a 256-byte aligned offset (cuBLASLt's and the vector
// loads' alignment, and what DeviceArena::take hands out). The model allocates with this layout and
// the optimizer indexes it, so both agree by construction. The gaps between tensors belong to no
// tensor: keep them zero (clear the whole buffer) so that a norm over the buffer sees only the
// tensors.
//
// Parameters stored in bf16 (the GPT's embedding tables, as nanochat keeps them on a GPU) come
// last, from bf16_offset on: the fp32 parameters fill the first bf16_offset elements of their
// buffer, each at the same offset as its gradient, and a bf16 parameter's values sit in a bf16
// buffer at offset − bf16_offset. Gradients stay fp32 for every tensor, at `offset`.
//
// Plain C++17, no CUDA: CPU builds and CUDA sources include it.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "models/flux_config.h"
#include "models/gpt_config.h"
#include "models/tensor_parallel.h"

namespace fp8t::optim {

struct DeviceParameter {
  std::string name;
  std::vector<int64_t> shape;
  int64_t numel = 0;
  int64_t offset = 0;  // in elements from the buffer's base; offset · element size is aligned
  bool bf16 = false;   // stored in bf16 (its gradient is still fp32)
  // Under tensor parallelism, a tensor [out, in] the group splits: shape is this rank's share,
  // its run of whole_shape's rows (Outputs) or of each row's columns (Inputs). None: whole.
  TensorSplit split{};
  std::vector<int64_t> whole_shape;

  // The elements of the whole tensor (numel when it is not split).
  int64_t whole_numel() const {
    if (split == TensorSplit::None) return numel;
    int64_t count = 1;
    for (const int64_t dim : whole_shape)
      count *= dim;
    return count;
  }
};

// A rank's share [rows, cols] of a whole tensor, row by row: share row r is the whole tensor's
// elements from whole_first + r·whole_cols on (a whole tensor when nothing is split).
struct ShareRows {
  int64_t rows = 0, cols = 0;
  int64_t whole_cols = 0;
  int64_t whole_first = 0;
};

struct DeviceParameterLayout {
  static constexpr size_t kAlignmentBytes = 256;

  size_t element_bytes = sizeof(float);
  std::vector<DeviceParameter> parameters;  // gpt_parameters() or flux_parameters() order
  int64_t total_elements = 0;               // a multiple of the alignment, gaps included
  int64_t bf16_offset = 0;  // where the bf16 parameters begin; total_elements when none
  // The tensor-parallel group whose rank this layout is (the split tensors' shares).
  int tensor_parallel = 1;
  int tensor_rank = 0;

  size_t total_bytes() const { return static_cast<size_t>(total_elements) * element_bytes; }
  // Elements of the fp32 parameter buffer and of the bf16 one.
  int64_t fp32_parameter_elements() const { return bf16_offset; }
  int64_t bf16_parameter_elements() const { return total_elements - bf16_offset; }

  // Throws fp8t::Error for a name the layout does not hold.
  DeviceParameter& operator[](const std::string& name) {
    return const_cast<DeviceParameter&>(std::as_const(*this)[name]);
  }
  const DeviceParameter& operator[](const std::string& name) const {
    for (const DeviceParameter& parameter : parameters) {
      if (parameter.name == name) return parameter;
    }
    throw Error(fmt::format("the device parameter layout holds no tensor named '{}'", name));
  }
  // Element ranges {offset, count}.
  using Range = std::pair<int64_t, int64_t>;
  // The i-th tensor's range with the padding after it, up to the next tensor or the end.
  Range padded_range(size_t i) const {
    const int64_t end = i + 1 < parameters.size() ? parameters[i + 1].offset : total_elements;
    return {parameters[i].offset, end - parameters[i].offset};
  }
  bool has_shares() const { return tensor_parallel > 1; }
  ShareRows share_rows(const DeviceParameter& parameter) const {
    const int64_t rows = parameter.shape[0];
    const int64_t cols = parameter.numel / std::max<int64_t>(1, rows);
    if (parameter.split == TensorSplit::Outputs)
      return {rows, cols, cols, tensor_rank * rows * cols};
    if (parameter.split == TensorSplit::Inputs)
      return {rows, cols, parameter.whole_shape[1], tensor_rank * cols};
    return {rows, cols, cols, 0};
  }
};

// `range` after `ranges`, one range with the last when they are adjacent.
inline void append_range(std::vector<DeviceParameterLayout::Range>& ranges,
                         DeviceParameterLayout::Range range) {
  if (!ranges.empty() && ranges.back().first + ranges.back().second == range.first) {
    ranges.back().second += range.second;
  } else {
    ranges.push_back(range);
  }
}

// The share of a whole host tensor that this rank of a layout holds.
template <typename T>
std::vector<T> host_share(const DeviceParameterLayout& layout, const DeviceParameter& parameter,
                          const T* whole) {
  const ShareRows share = layout.share_rows(parameter);
  std::vector<T> values(static_cast<size_t>(parameter.numel));
  for (int64_t row = 0; row < share.rows; ++row) {
    std::copy_n(whole + share.whole_first + row * share.whole_cols, share.cols,
                values.begin() + row * share.cols);
  }
  return values;
}

// Lays the tensors out one after the other, each rounded up to the alignment, those for which
// stored_in_bf16(spec) holds after all others (each group in the specs' order). Spec: any
// parameter description with name, shape and numel() (the GPT's ParamSpec, the Flux's FluxParam).
template <typename Spec, typename Bf16Predicate>
DeviceParameterLayout device_parameter_layout(const std::vector<Spec>& specs, size_t element_bytes,
                                              Bf16Predicate stored_in_bf16) {
  FP8T_CHECK(element_bytes > 0 && DeviceParameterLayout::kAlignmentBytes % element_bytes == 0,
             "expected an element size dividing {} bytes, found {}",
             DeviceParameterLayout::kAlignmentBytes, element_bytes);
  const auto granule = static_cast<int64_t>(DeviceParameterLayout::kAlignmentBytes / element_bytes);
  DeviceParameterLayout layout;
  layout.element_bytes = element_bytes;
  for (const bool bf16 : {false, true}) {
    if (bf16) layout.bf16_offset = layout.total_elements;
    for (const Spec& spec : specs) {
      if (static_cast<bool>(stored_in_bf16(spec)) != bf16) continue;
      const int64_t numel = spec.numel();
      DeviceParameter& parameter = layout.parameters.emplace_back();
      parameter.name = spec.name;
      parameter.shape = spec.shape;
      parameter.numel = numel;
      parameter.offset = layout.total_elements;
      parameter.bf16 = bf16;
      layout.total_elements += (numel + granule - 1) / granule * granule;
    }
  }
  return layout;
}

template <typename Spec>
DeviceParameterLayout device_parameter_layout(const std::vector<Spec>& specs,
                                              size_t element_bytes = sizeof(float)) {
  return device_parameter_layout(specs, element_bytes, [](const Spec&) { return false; });
}

// bf16_embeddings: wte and the value embeddings in bf16, as GptOptimizer with
// OptimizerSettings::bf16_embeddings updates them. With a tensor-parallel group of
// tensor_parallel ranks, the layout of its rank tensor_rank: the split tensors
// (gpt_parameter_split) as that rank's shares, in the same order.
inline DeviceParameterLayout device_parameter_layout(const GptConfig& config,
                                                     bool bf16_embeddings = false,
                                                     int tensor_parallel = 1, int tensor_rank = 0) {
  FP8T_CHECK(tensor_rank >= 0 && tensor_rank < tensor_parallel,
             "expected a tensor-parallel rank in [0, {}), found {}", tensor_parallel, tensor_rank);
  std::vector<ParamSpec> specs = gpt_parameters(config);
  std::vector<std::vector<int64_t>> whole_shapes(specs.size());
  for (size_t i = 0; i < specs.size(); ++i) {
    const TensorSplit split = tensor_parallel > 1 ? gpt_parameter_split(specs[i]) : TensorSplit{};
    if (split == TensorSplit{}) continue;
    whole_shapes[i] = specs[i].shape;
    const size_t dim = split == TensorSplit::Outputs ? 0 : 1;
    FP8T_CHECK(specs[i].shape[dim] % tensor_parallel == 0, "'{}': {} ranks cannot split its {} {}",
               specs[i].name, tensor_parallel, specs[i].shape[dim], dim == 0 ? "rows" : "columns");
    specs[i].shape[dim] /= tensor_parallel;
  }
  DeviceParameterLayout layout =
      device_parameter_layout(specs, sizeof(float), [bf16_embeddings](const ParamSpec& spec) {
        return bf16_embeddings && spec.kind == ParamKind::Embedding;
      });
  layout.tensor_parallel = tensor_parallel;
  layout.tensor_rank = tensor_rank;
  for (size_t i = 0; i < specs.size(); ++i) {
    if (whole_shapes[i].empty()) continue;
    DeviceParameter& parameter = layout[specs[i].name];
    parameter.split = gpt_parameter_split(specs[i]);
    parameter.whole_shape = whole_shapes[i];
  }
  return layout;
}

inline DeviceParameterLayout device_parameter_layout(const FluxConfig& config,
                                                     size_t element_bytes = sizeof(float)) {
  return device_parameter_layout(flux_parameters(config), element_bytes);
}

}  // namespace fp8t::optim
