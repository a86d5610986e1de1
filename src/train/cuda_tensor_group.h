// This rank's tensor-parallel group on the GPU path (CUDA builds): an NCCL communicator of the
// group's own ranks, split off one of every rank, and its collectives for the GPU models. None
// without tensor parallelism (or in builds without NCCL, which refuse several ranks on the GPU).
#pragma once

#include <memory>

#include "distributed/communicator.h"
#include "distributed/tensor_parallel_group.h"
#include "models/cuda/device_tensor_parallel.h"
#include "optim/cuda/gpu_optimizer.h"
#if FP8TRAIN_WITH_NCCL
#include "distributed/nccl_group.h"
#endif

namespace fp8t::train {

struct CudaTensorGroup {
#if FP8TRAIN_WITH_NCCL
  std::unique_ptr<distributed::NcclGroup> nccl;
#endif
  DeviceTensorParallel device;

  // Every rank of the job makes its group together; `communicator` may be null (one process).
  // sequence_parallel: the group's `sequence` (sequence parallelism).
  CudaTensorGroup(distributed::Communicator* communicator,
                  const distributed::ParallelLayout& layout, bool sequence_parallel = false) {
#if FP8TRAIN_WITH_NCCL
    if (communicator == nullptr || layout.tensor == 1) return;
    distributed::NcclGroup every_rank(*communicator);
    nccl = every_rank.tensor_parallel_group(layout);
    device = nccl->device_tensor_parallel(layout);
    device.sequence = sequence_parallel;
#else
    static_cast<void>(communicator);
    static_cast<void>(layout);
    static_cast<void>(sequence_parallel);
#endif
  }
};

// What the GPT optimizer of a tensor-parallel rank's shares needs of its group (none without
// one).
inline optim::ShareCollectives share_collectives(const DeviceTensorParallel& group) {
  if (!group.split()) return {};
  return {group.all_gather_bf16, group.sum, group.sum_bf16};
}

}  // namespace fp8t::train
