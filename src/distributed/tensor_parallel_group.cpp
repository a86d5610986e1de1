#include "distributed/tensor_parallel_group.h"

#include <algorithm>
#include <limits>
#include <memory>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"

namespace fp8t::distributed {

ParallelLayout parallel_layout(int world_size, int rank, int tensor) {
  if (tensor < 1 || world_size % tensor != 0) {
    throw ConfigError(fmt::format(
        "tensor_model_parallel_size: expected a divisor of the {} ranks of this job, found {}",
        world_size, tensor));
  }
  return {tensor, rank % tensor, world_size / tensor, rank / tensor};
}

TensorParallel training_tensor_parallel_group(Communicator* communicator,
                                              const ParallelLayout& layout,
                                              bool sequence_parallel) {
  if (communicator == nullptr) return {};
  TensorParallel group = tensor_parallel_group(*communicator, layout);
  group.sequence = sequence_parallel;
  return group;
}

TensorParallel tensor_parallel_group(Communicator& communicator, const ParallelLayout& layout) {
  TensorParallel group;
  group.size = layout.tensor;
  group.rank = layout.tensor_rank;
  if (!group.split()) return group;
  // One slot per group in a job-wide collective: the other groups' slots add zeros (or take the
  // maximum with -inf), so each group's result is exactly its own ranks'. The host collectives
  // have no sub-groups; the copies cost replicas x the data, small on the CPU path.
  const auto slots = static_cast<size_t>(layout.data);
  const auto slot = static_cast<size_t>(layout.data_rank);
  // One staging vector for the three, kept from call to call: a step makes many collectives of
  // a few sizes, and assign and resize reuse what it holds.
  const auto staging = std::make_shared<std::vector<float>>();
  group.sum = [&communicator, slots, slot, staging](float* values, size_t count) {
    if (slots == 1) return communicator.sum(values, count);
    std::vector<float>& all = *staging;
    all.assign(slots * count, 0.0f);
    std::copy(values, values + count, all.begin() + static_cast<ptrdiff_t>(slot * count));
    communicator.sum(all.data(), all.size());
    std::copy_n(all.begin() + static_cast<ptrdiff_t>(slot * count), count, values);
  };
  group.max = [&communicator, slots, slot, staging](float value) {
    std::vector<float>& all = *staging;
    all.assign(slots, -std::numeric_limits<float>::infinity());
    all[slot] = value;
    communicator.max(all.data(), all.size());
    return all[slot];
  };
  // Every rank's values, of which this group's are the run of its consecutive ranks.
  const auto ranks = static_cast<size_t>(layout.tensor);
  group.all_gather = [&communicator, slots, slot, ranks, staging](const float* own, float* all,
                                                                  size_t count) {
    if (slots == 1) return communicator.all_gather(own, all, count);
    std::vector<float>& every = *staging;
    every.resize(slots * ranks * count);
    communicator.all_gather(own, every.data(), count);
    std::copy_n(every.begin() + static_cast<ptrdiff_t>(slot * ranks * count), ranks * count, all);
  };
  return group;
}

}  // namespace fp8t::distributed
