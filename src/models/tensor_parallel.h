// Megatron-style tensor parallelism of the GPT's blocks over a group of ranks that see the same
// batch: the query, key, value and MLP-up projections are split by output features
// (column-parallel: each rank computes its heads and its share of the hidden layer), the
// attention and MLP output projections by input features (row-parallel: each rank's partial
// output is summed over the group). Embeddings, norms, gates and lm_head are replicated.
#pragma once

#include <cstddef>
#include <functional>

namespace fp8t {

struct TensorParallel {
  int size = 1;  // ranks in the group; 1: no tensor parallelism
  int rank = 0;  // this rank's place in the group, 0 .. size - 1
  // In place over the group, the same result on every rank of it. Unset when size is 1.
  std::function<void(float* values, size_t count)> sum;
  std::function<float(float value)> max;

  bool split() const { return size > 1; }
};

}  // namespace fp8t
