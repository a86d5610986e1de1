// The GPU models' tensor-parallel group (models/tensor_parallel.h has the split and the CPU
// models' group): its collectives take device memory and run queued on the model's stream, in
// training through NCCL (distributed/nccl_group.h). Every rank of the group calls each one, in
// the same order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include "core/error.h"
#include "numerics/float_bits.h"

namespace fp8t {

struct DeviceTensorParallel {
  int size = 1;  // ranks in the group; 1: no tensor parallelism
  int rank = 0;  // this rank's place in the group, 0 .. size - 1
  // Sequence parallelism (TensorParallel::sequence), both models.
  bool sequence = false;
  // In place over the group, the same result on every rank of it. Unset when size is 1.
  std::function<void(bf16* values, size_t count, cudaStream_t stream)> sum_bf16;
  std::function<void(float* values, size_t count, cudaStream_t stream)> sum;
  std::function<void(float* values, size_t count, cudaStream_t stream)> max;
  // Sequence parallelism. all_gather_bf16: every rank's `count` values of `own` into `all`
  // [size, count], in rank order. reduce_scatter_bf16: `all` [size, count] summed over the
  // group, this rank's `count` of the sum into `own`.
  std::function<void(const bf16* own, bf16* all, size_t count, cudaStream_t stream)>
      all_gather_bf16;
  std::function<void(const bf16* all, bf16* own, size_t count, cudaStream_t stream)>
      reduce_scatter_bf16;

  bool split() const { return size > 1; }

  // Row-parallel partial outputs and column-parallel input gradients: summed over the group when
  // it is split, left alone otherwise.
  void sum_partials(bf16* values, int64_t count, cudaStream_t stream) const {
    if (split()) sum_bf16(values, static_cast<size_t>(count), stream);
  }
  // Each range {offset, count} of `values` summed over the group (split gradients).
  void sum_ranges(float* values, const std::vector<std::pair<int64_t, int64_t>>& ranges,
                  cudaStream_t stream) const {
    for (const auto& [offset, count] : ranges)
      sum(values + offset, static_cast<size_t>(count), stream);
  }
};

// What a GPU model checks of the group it is given: a rank in it, its collectives, and no FP8
// attention (whose per-tensor scales would follow each rank's heads).
inline void check_device_group(const DeviceTensorParallel& group, bool fp8_attention) {
  FP8T_CHECK(group.rank >= 0 && group.rank < group.size,
             "expected a tensor-parallel rank in [0, {}), found {}", group.size, group.rank);
  FP8T_CHECK(!group.split() || (group.sum_bf16 && group.sum && group.max),
             "expected the tensor-parallel group's collectives, found none");
  FP8T_CHECK(
      !group.split() || !group.sequence || (group.all_gather_bf16 && group.reduce_scatter_bf16),
      "expected the tensor-parallel group's gather and reduce-scatter for sequence "
      "parallelism, found none");
  if (group.split() && fp8_attention) {
    throw ConfigError(fmt::format(
        "fp8_dot_product_attention does not run with tensor_model_parallel_size {}", group.size));
  }
}

}  // namespace fp8t
