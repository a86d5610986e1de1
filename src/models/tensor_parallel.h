// Megatron-style tensor parallelism of a model's blocks over a group of ranks that see the same
// batch: the query, key, value and MLP-up projections are split by output features
// (column-parallel: each rank computes its heads and its share of the hidden layer), the
// attention and MLP output projections by input features (row-parallel: each rank's partial
// output is summed over the group). The Flux model's modulations are split by output features
// too, their chunks gathered over the group. The rest (embeddings, norms, the output layer) is
// replicated.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <initializer_list>
#include <string_view>
#include <utility>

#include "core/error.h"

namespace fp8t {

// How tensor parallelism splits a linear's weight [out, in] over the group.
enum class TensorSplit : uint8_t {
  None,     // replicated
  Outputs,  // column-parallel: this rank's rows (and their bias), its share of the outputs
  Inputs,   // row-parallel: this rank's columns; its outputs are partial sums over the group
};

struct TensorParallel {
  int size = 1;  // ranks in the group; 1: no tensor parallelism
  int rank = 0;  // this rank's place in the group, 0 .. size - 1
  // Sequence parallelism (Megatron's, with size > 1): outside the split linears (the residual
  // stream, the norms, the output layer and the loss) each rank holds its 1/size of the
  // micro-batch's tokens; the input of a column-parallel linear is gathered over the group, and
  // a row-parallel output summed and scattered back to each rank's tokens. The GPU models take
  // theirs from DeviceTensorParallel::sequence.
  bool sequence = false;
  // In place over the group, the same result on every rank of it. Unset when size is 1.
  std::function<void(float* values, size_t count)> sum;
  std::function<float(float value)> max;
  // Every rank's `count` values of `own` into `all` [size, count], in the group's rank order, on
  // every rank of it; `own` must not overlap `all`. Unset when size is 1.
  std::function<void(const float* own, float* all, size_t count)> all_gather;

  bool split() const { return size > 1; }
};

// Throws ConfigError naming tensor_model_parallel_size unless `size` is at least 1 and divides
// each of a model's counts (what, count): its heads, its MLP's hidden features.
inline void check_splits_evenly(
    int size, std::initializer_list<std::pair<std::string_view, int64_t>> counts) {
  if (size < 1) {
    throw ConfigError(
        fmt::format("tensor_model_parallel_size: expected at least 1, found {}", size));
  }
  for (const auto& [what, count] : counts) {
    if (count % size != 0) {
      throw ConfigError(fmt::format(
          "tensor_model_parallel_size: {} must divide the model's {} ({}); expected one of its "
          "divisors",
          size, what, count));
    }
  }
}

// Throws ConfigError naming sequence_parallel unless a tensor-parallel group has more than one
// rank.
inline void check_sequence_parallel_group(int size) {
  if (size < 2) {
    throw ConfigError(fmt::format(
        "sequence_parallel: true needs tensor_model_parallel_size above 1 (it splits the tokens "
        "over a tensor-parallel group), found {}",
        size));
  }
}

// Throws ConfigError naming sequence_parallel unless a tensor-parallel group of `size` ranks
// (more than one) splits a micro-batch of `batch` sequences of `seq` tokens into equal runs of
// rows.
inline void check_sequence_parallel(int size, int64_t batch, int64_t seq) {
  check_sequence_parallel_group(size);
  if (batch * seq % size != 0) {
    throw ConfigError(fmt::format(
        "sequence_parallel: the {} tokens of a micro-batch (micro_batch_size {} × sequence_len "
        "{}) do not split over tensor_model_parallel_size {}; expected a multiple of it",
        batch * seq, batch, seq, size));
  }
}

// Throws ConfigError naming sequence_parallel unless a tensor-parallel group of `size` ranks
// (more than one) splits each Flux sample's image tokens and its text tokens evenly.
inline void check_flux_sequence_parallel(int size, int64_t img_tokens, int64_t txt_tokens) {
  check_sequence_parallel_group(size);
  if (img_tokens % size != 0 || txt_tokens % size != 0) {
    throw ConfigError(fmt::format(
        "sequence_parallel: a sample's {} image tokens and {} text tokens must each split over "
        "tensor_model_parallel_size {}; expected multiples of it",
        img_tokens, txt_tokens, size));
  }
}

// What a model checks of the group it is given: a rank in it, its collectives, and no FP8
// attention (whose per-tensor scales would follow each rank's heads).
inline void check_group(const TensorParallel& group, bool fp8_attention) {
  FP8T_CHECK(group.rank >= 0 && group.rank < group.size,
             "expected a tensor-parallel rank in [0, {}), found {}", group.size, group.rank);
  FP8T_CHECK(!group.split() || (group.sum && group.max),
             "expected the tensor-parallel group's sum and max, found none");
  FP8T_CHECK(!group.split() || !fp8_attention,
             "fp8_dot_product_attention does not run with tensor_model_parallel_size {}",
             group.size);
}

}  // namespace fp8t
