#include "models/recompute.h"

#include <algorithm>

#include <fmt/format.h>

#include "core/error.h"

namespace fp8t {

std::vector<RecomputeGroup> recompute_groups(const RecomputeOptions& options, int blocks) {
  if (options.granularity != RecomputeGranularity::Full) return {};
  const int count = options.num_layers;
  if (count < 1) {
    throw ConfigError(
        fmt::format("recompute_num_layers: expected at least 1 under recompute_granularity: "
                    "full, found {}",
                    count));
  }
  std::vector<RecomputeGroup> groups;
  if (options.method == RecomputeMethod::Block) {
    if (count > blocks) {
      throw ConfigError(fmt::format(
          "recompute_num_layers: {} blocks to recompute under recompute_method: block, but the "
          "model has {}",
          count, blocks));
    }
    for (int block = 0; block < count; ++block)
      groups.push_back({block, block + 1});
    return groups;
  }
  for (int first = 0; first < blocks; first += count)
    groups.push_back({first, std::min(first + count, blocks)});
  return groups;
}

FluxRecomputeGroups flux_recompute_groups(const RecomputeOptions& options, int double_blocks,
                                          int single_blocks) {
  FluxRecomputeGroups groups;
  if (options.granularity != RecomputeGranularity::Full) return groups;
  if (options.method == RecomputeMethod::Block) {
    for (const RecomputeGroup& group : recompute_groups(options, double_blocks + single_blocks)) {
      if (group.first < double_blocks) {
        groups.doubles.push_back(group);
      } else {
        groups.singles.push_back({group.first - double_blocks, group.end - double_blocks});
      }
    }
    return groups;
  }
  groups.doubles = recompute_groups(options, double_blocks);
  groups.singles = recompute_groups(options, single_blocks);
  return groups;
}

std::vector<int> recompute_slots(const std::vector<RecomputeGroup>& groups, int blocks) {
  std::vector<int> slots(static_cast<size_t>(blocks), -1);
  for (const RecomputeGroup& group : groups) {
    for (int block = group.first; block < group.end; ++block)
      slots[static_cast<size_t>(block)] = block - group.first;
  }
  return slots;
}

int recompute_slot_count(const std::vector<RecomputeGroup>& groups) {
  int count = 0;
  for (const RecomputeGroup& group : groups)
    count = std::max(count, group.end - group.first);
  return count;
}

int recompute_group_starting_at(const std::vector<RecomputeGroup>& groups, int block) {
  for (size_t group = 0; group < groups.size(); ++group) {
    if (groups[group].first == block) return static_cast<int>(group);
  }
  return -1;
}

int recompute_group_ending_at(const std::vector<RecomputeGroup>& groups, int block) {
  for (size_t group = 0; group < groups.size(); ++group) {
    if (groups[group].end == block + 1) return static_cast<int>(group);
  }
  return -1;
}

int recompute_saved_sets(const std::vector<RecomputeGroup>& groups, int blocks) {
  int recomputed = 0;
  for (const RecomputeGroup& group : groups)
    recomputed += group.end - group.first;
  return blocks - recomputed + recompute_slot_count(groups);
}

std::string recompute_summary(const RecomputeOptions& options, int blocks) {
  switch (options.granularity) {
    case RecomputeGranularity::None:
      return "none";
    case RecomputeGranularity::Selective:
      return "selective";
    case RecomputeGranularity::Full:
      break;
  }
  const std::vector<RecomputeGroup> groups = recompute_groups(options, blocks);
  if (options.method == RecomputeMethod::Block) {
    return fmt::format("full, block: the first {} of {} blocks, one at a time", groups.size(),
                       blocks);
  }
  return fmt::format("full, uniform: every block, in groups of up to {} consecutive block(s)",
                     options.num_layers);
}

}  // namespace fp8t
