// The collectives data parallelism needs, between the processes of one training job: one
// process (every collective a no-op), or several ranks launched by mpirun or srun, which talk
// through MPI (the CPU path's backend; the GPU path will use NCCL). Built with MPI when CMake
// finds it (FP8TRAIN_MPI).
#pragma once

#include <cstddef>

#include "distributed/launch.h"

namespace fp8t::distributed {

class Communicator {
 public:
  // One process when !launch.several(); otherwise initializes MPI (the destructor finalizes it)
  // and checks that MPI sees the rank and world size the launcher set. Throws fp8t::Error when
  // this build has no MPI, or for a torchrun-style launch (MPI cannot join it).
  explicit Communicator(const LaunchInfo& launch);
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
  void barrier();
  // Ends the whole job with `code`: with several ranks through MPI, so that no rank waits
  // forever for one that failed.
  [[noreturn]] void abort(int code);

 private:
  LaunchInfo launch_;
};

}  // namespace fp8t::distributed
