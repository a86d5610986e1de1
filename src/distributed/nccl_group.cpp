#if FP8TRAIN_WITH_NCCL

#include "distributed/nccl_group.h"

#include <nccl.h>

#include <fmt/format.h>

#include "core/cuda_check.h"
#include "core/error.h"

namespace fp8t::distributed {

namespace {

void check_nccl(ncclResult_t status, const char* call) {
  if (status == ncclSuccess) return;
  throw Error(fmt::format("{} failed: {} ({})", call, ncclGetErrorString(status),
                          ncclGetLastError(nullptr)));
}

}  // namespace

NcclGroup::NcclGroup(Communicator& host) {
  ncclUniqueId id{};
  if (host.rank() == 0) check_nccl(ncclGetUniqueId(&id), "ncclGetUniqueId");
  host.broadcast(&id, sizeof(id));
  check_nccl(ncclCommInitRank(&comm_, host.size(), id, host.rank()), "ncclCommInitRank");
  FP8T_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  FP8T_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
}

NcclGroup::NcclGroup(ncclComm* comm) : comm_(comm) {
  FP8T_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  FP8T_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
}

std::unique_ptr<NcclGroup> NcclGroup::tensor_parallel_group(const ParallelLayout& layout) {
  // Megatron's order: a replica's ranks (colour) in their tensor-parallel order (key).
  ncclComm* comm = nullptr;
  check_nccl(ncclCommSplit(comm_, layout.data_rank, layout.tensor_rank, &comm, nullptr),
             "ncclCommSplit");
  return std::unique_ptr<NcclGroup>(new NcclGroup(comm));
}

std::unique_ptr<NcclGroup> NcclGroup::data_parallel_group(const ParallelLayout& layout) {
  ncclComm* comm = nullptr;
  check_nccl(ncclCommSplit(comm_, layout.tensor_rank, layout.data_rank, &comm, nullptr),
             "ncclCommSplit");
  return std::unique_ptr<NcclGroup>(new NcclGroup(comm));
}

DeviceTensorParallel NcclGroup::device_tensor_parallel(const ParallelLayout& layout) {
  DeviceTensorParallel group;
  group.size = layout.tensor;
  group.rank = layout.tensor_rank;
  if (!group.split()) return group;
  group.sum_bf16 = [this](bf16* values, size_t count, cudaStream_t stream) {
    sum(values, count, stream);
  };
  group.sum = [this](float* values, size_t count, cudaStream_t stream) {
    sum(values, count, stream);
  };
  group.max = [this](float* values, size_t count, cudaStream_t stream) {
    max(values, count, stream);
  };
  group.all_gather_bf16 = [this](const bf16* own, bf16* all, size_t count, cudaStream_t stream) {
    all_gather(own, all, count, stream);
  };
  group.reduce_scatter_bf16 = [this](const bf16* all, bf16* own, size_t count,
                                     cudaStream_t stream) {
    reduce_scatter(all, own, count, stream);
  };
  return group;
}

NcclGroup::~NcclGroup() {
  cudaStreamSynchronize(stream_);
  cudaEventDestroy(ready_);
  cudaStreamDestroy(stream_);
  ncclCommDestroy(comm_);
}

void NcclGroup::sum_after(float* values, size_t count, cudaStream_t producer) {
  // One event serves every call: a wait takes the event's state when it is queued.
  FP8T_CUDA_CHECK(cudaEventRecord(ready_, producer));
  FP8T_CUDA_CHECK(cudaStreamWaitEvent(stream_, ready_, 0));
  sum(values, count, stream_);
}

void NcclGroup::join(cudaStream_t consumer) {
  FP8T_CUDA_CHECK(cudaEventRecord(ready_, stream_));
  FP8T_CUDA_CHECK(cudaStreamWaitEvent(consumer, ready_, 0));
}

void NcclGroup::sum(float* values, size_t count, cudaStream_t stream) {
  check_nccl(ncclAllReduce(values, values, count, ncclFloat32, ncclSum, comm_, stream),
             "ncclAllReduce");
}

void NcclGroup::sum(bf16* values, size_t count, cudaStream_t stream) {
  check_nccl(ncclAllReduce(values, values, count, ncclBfloat16, ncclSum, comm_, stream),
             "ncclAllReduce");
}

void NcclGroup::broadcast(const std::vector<Piece>& pieces, cudaStream_t stream) {
  check_nccl(ncclGroupStart(), "ncclGroupStart");
  for (const Piece& piece : pieces) {
    const ncclResult_t status =
        ncclBroadcast(piece.data, piece.data, piece.bytes, ncclUint8, piece.root, comm_, stream);
    if (status != ncclSuccess) {
      ncclGroupEnd();
      check_nccl(status, "ncclBroadcast");
    }
  }
  check_nccl(ncclGroupEnd(), "ncclGroupEnd");
}

void NcclGroup::all_gather(const bf16* own, bf16* all, size_t count, cudaStream_t stream) {
  check_nccl(ncclAllGather(own, all, count, ncclBfloat16, comm_, stream), "ncclAllGather");
}

void NcclGroup::reduce_scatter(const bf16* all, bf16* own, size_t count, cudaStream_t stream) {
  check_nccl(ncclReduceScatter(all, own, count, ncclBfloat16, ncclSum, comm_, stream),
             "ncclReduceScatter");
}

void NcclGroup::max(float* values, size_t count, cudaStream_t stream) {
  check_nccl(ncclAllReduce(values, values, count, ncclFloat32, ncclMax, comm_, stream),
             "ncclAllReduce");
}

}  // namespace fp8t::distributed

#endif  // FP8TRAIN_WITH_NCCL
