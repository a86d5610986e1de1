// The host-side collectives data parallelism needs, between the processes of one training job:
// one process (every collective a no-op), or several ranks. Ranks started by mpirun or srun talk
// through MPI when this build has it (FP8TRAIN_MPI); others (torchrun-style launchers,
// `train --nproc-per-node`) through a TCP group that meets at MASTER_ADDR:MASTER_PORT. The GPU
// path's gradients travel through NCCL (nccl_group.h); these collectives carry the small things:
// losses, stop signals, checks, and NCCL's unique id.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>

#include "distributed/launch.h"

namespace fp8t::distributed {

class TcpGroup;

class Communicator {
 public:
  // One process when !launch.several(). Otherwise joins the other ranks: through MPI for an
  // OpenMPI or Slurm launch in a build with MPI (the destructor finalizes it), else over TCP.
  // `job_hash` identifies the job's configuration: ranks whose hashes differ stop with an error,
  // as do ranks that disagree about the world size or do not arrive in time. Throws fp8t::Error
  // when neither way is open (no MPI in this build and no MASTER_ADDR / MASTER_PORT).
  Communicator(const LaunchInfo& launch, uint64_t job_hash);
  ~Communicator();
  Communicator(const Communicator&) = delete;
  Communicator& operator=(const Communicator&) = delete;

  int rank() const { return launch_.rank; }
  int size() const { return launch_.world_size; }
  bool several() const { return launch_.several(); }
  const LaunchInfo& launch() const { return launch_; }

  // In place, the same result on every rank.
  void sum(float* values, size_t count);
  void sum(double* values, size_t count);
  int max(int value);
  void max(float* values, size_t count);
  // Rank 0's bytes to every rank.
  void broadcast(void* bytes, size_t size);
  // Every rank's `count` values of `own` into `all` [size(), count], in rank order, on every
  // rank. `own` must not overlap `all`.
  void all_gather(const float* own, float* all, size_t count);
  // On every rank: the highest rank whose `value` differs from rank 0's, or -1 when all agree.
  int rank_differing_from_first(uint64_t value);
  void barrier();
  // For tests: at most `values` values (bytes for broadcast) per MPI call, so that buffers of
  // a few values take the slices that MPI's int counts otherwise impose on gigabytes.
  void limit_mpi_slices(size_t values) { mpi_slice_limit_ = values; }
  // Ends the whole job with `code`: through MPI, or by closing this rank's connections so that
  // the others stop with an error, instead of waiting forever for one that failed.
  [[noreturn]] void abort(int code);

 private:
  LaunchInfo launch_;
  bool mpi_ = false;
  size_t mpi_slice_limit_ = SIZE_MAX;
  std::unique_ptr<TcpGroup> tcp_;
};

}  // namespace fp8t::distributed
