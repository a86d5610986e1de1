// The GPU path's collectives: one NCCL communicator over the job's ranks, one GPU each (CUDA
// builds with NCCL only). NCCL's unique id travels from rank 0 through the host Communicator.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include <cuda_runtime_api.h>

#include "distributed/communicator.h"
#include "distributed/tensor_parallel_group.h"
#include "models/cuda/device_tensor_parallel.h"
#include "numerics/float_bits.h"

struct ncclComm;

namespace fp8t::distributed {

class NcclGroup {
 public:
  // Joins the ranks of `host` on the current CUDA device; every rank calls it together.
  explicit NcclGroup(Communicator& host);
  ~NcclGroup();
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;

  // The ranks of `layout`'s tensor-parallel group, split off this group (every rank of it calls
  // it together): a group of its own, which outlives this one if need be.
  std::unique_ptr<NcclGroup> tensor_parallel_group(const ParallelLayout& layout);
  // The ranks holding the same place in their tensor-parallel groups (one per replica, in replica
  // order), split off this group likewise: the sums of the shares' data parallelism.
  std::unique_ptr<NcclGroup> data_parallel_group(const ParallelLayout& layout);
  // The collectives of this group for a GPU model, which must not outlive it; `layout` as given
  // to tensor_parallel_group().
  DeviceTensorParallel device_tensor_parallel(const ParallelLayout& layout);

  // In place on the device, queued on `stream`; the same result on every rank.
  void sum(float* values, size_t count, cudaStream_t stream);
  void sum(bf16* values, size_t count, cudaStream_t stream);
  void max(float* values, size_t count, cudaStream_t stream);
  // Every rank's `count` values of `own` into `all` [ranks, count], in rank order.
  void all_gather(const bf16* own, bf16* all, size_t count, cudaStream_t stream);
  // `all` [ranks, count] summed over the group; this rank's `count` of the sum into `own`.
  void reduce_scatter(const bf16* all, bf16* own, size_t count, cudaStream_t stream);

  // A buffer of `bytes` bytes on every rank that `root` holds the current values of.
  struct Piece {
    void* data;
    size_t bytes;
    int root;
  };
  // Every piece from its root to the other ranks, in one NCCL group, queued on `stream`.
  void broadcast(const std::vector<Piece>& pieces, cudaStream_t stream);

  // Overlapped with later work on `producer`: queues the sum on the group's own stream, after
  // the work queued on `producer` so far (which completes `values`).
  void sum_after(float* values, size_t count, cudaStream_t producer);
  // Work queued on `consumer` from now on waits for every sum_after queued so far.
  void join(cudaStream_t consumer);

 private:
  explicit NcclGroup(ncclComm* comm);

  ncclComm* comm_ = nullptr;
  cudaStream_t stream_ = nullptr;  // sum_after's
  cudaEvent_t ready_ = nullptr;    // records a producer's or the own stream's progress
};

}  // namespace fp8t::distributed
