// How the ranks of a job split into tensor-parallel groups and data-parallel replicas, and the
// collectives of this rank's tensor-parallel group over the job's host collectives.
#pragma once

#include "distributed/communicator.h"
#include "models/tensor_parallel.h"

namespace fp8t::distributed {

// Megatron's order: a tensor-parallel group is `tensor` consecutive ranks (on one node, where
// the links are fast), and the groups are the data-parallel replicas.
struct ParallelLayout {
  int tensor = 1;       // ranks per tensor-parallel group
  int tensor_rank = 0;  // this rank's place in its group
  int data = 1;         // data-parallel replicas: groups
  int data_rank = 0;    // this rank's group

  // Whether a rank evaluates the validation loss: the leader alone, or under tensor parallelism
  // every rank with it, since each collective of a tensor-parallel group takes every rank of
  // the job.
  bool evaluates(bool leader) const { return leader || tensor > 1; }
};

// Throws ConfigError naming tensor_model_parallel_size unless it divides the world size.
ParallelLayout parallel_layout(int world_size, int rank, int tensor);

// The sums and maxima of this rank's tensor-parallel group, every rank of the job taking part in
// each (the ranks run their groups' collectives in step). `communicator` must outlive the group.
TensorParallel tensor_parallel_group(Communicator& communicator, const ParallelLayout& layout);
// A training rank's group: none in one process (no communicator), else the above with sequence
// parallelism as set.
TensorParallel training_tensor_parallel_group(Communicator* communicator,
                                              const ParallelLayout& layout, bool sequence_parallel);

}  // namespace fp8t::distributed
