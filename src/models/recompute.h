// Activation recompute, as Megatron's recompute_granularity, recompute_method and
// recompute_num_layers: which activations a model saves for its backward, and which it computes
// again there. Recompute runs the same operations on the same inputs, so losses and gradients
// are those of a run without it, bit for bit.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace fp8t {

enum class RecomputeGranularity : uint8_t {
  None,       // every activation the backward reads is saved
  Selective,  // the outputs of cheap element-wise steps (activation functions, temporaries of
              // the forward) are computed again; GEMM inputs and attention statistics are saved
  Full,       // the recomputed blocks save only their input; the backward runs their forward again
};

// Which blocks a full recompute reruns (no effect on selective).
enum class RecomputeMethod : uint8_t {
  Uniform,  // every block, in groups of recompute_num_layers consecutive blocks
  Block,    // the first recompute_num_layers blocks, one at a time; the others save everything
};

struct RecomputeOptions {
  RecomputeGranularity granularity = RecomputeGranularity::None;
  RecomputeMethod method = RecomputeMethod::Uniform;
  int num_layers = 1;
};

// Consecutive blocks [first, end) whose forward runs again, together, just before their
// backward. Of a group only the input of its first block and the output of its last are saved.
struct RecomputeGroup {
  int first = 0;
  int end = 0;
};

// The groups of `blocks` blocks that a full recompute reruns, in order; empty for none and
// selective. Throws ConfigError naming recompute_num_layers when it is below 1, or above
// `blocks` under the block method.
std::vector<RecomputeGroup> recompute_groups(const RecomputeOptions& options, int blocks);

// The Flux's groups: of its double blocks and of its single blocks, a group never spanning both;
// the block method counts the double blocks first (the first recompute_num_layers of all).
struct FluxRecomputeGroups {
  std::vector<RecomputeGroup> doubles;
  std::vector<RecomputeGroup> singles;  // numbered among the single blocks
};
FluxRecomputeGroups flux_recompute_groups(const RecomputeOptions& options, int double_blocks,
                                          int single_blocks);

// Per block: -1 when it saves its own activations, else its place in its group. Blocks with the
// same place in different groups never hold saved activations at the same time, so they can
// share one set of buffers; the number of sets is recompute_slot_count().
std::vector<int> recompute_slots(const std::vector<RecomputeGroup>& groups, int blocks);
int recompute_slot_count(const std::vector<RecomputeGroup>& groups);

// The index of the group that starts at `block`, or that ends with it; -1 when none does.
int recompute_group_starting_at(const std::vector<RecomputeGroup>& groups, int block);
int recompute_group_ending_at(const std::vector<RecomputeGroup>& groups, int block);

// The sets of saved activations a stack of `blocks` blocks holds: one for each block outside
// the groups, and one for each place in a group.
int recompute_saved_sets(const std::vector<RecomputeGroup>& groups, int blocks);

// One line for the log, e.g. "full, block: the first 4 of 24 blocks, one at a time" or "none".
std::string recompute_summary(const RecomputeOptions& options, int blocks);

}  // namespace fp8t
