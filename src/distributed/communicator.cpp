#include "distributed/communicator.h"

#include <algorithm>
#include <climits>
#include <cstdlib>

#include <fmt/format.h>

#include "core/error.h"

#if FP8TRAIN_WITH_MPI
// MPI's C interface only: without these, OpenMPI's and MPICH's headers pull in their deprecated
// C++ bindings and their libraries.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#endif

namespace fp8t::distributed {

#if FP8TRAIN_WITH_MPI

namespace {

void check_mpi(int status, const char* call) {
  if (status == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  MPI_Error_string(status, text, &length);
  throw Error(fmt::format("{} failed: {}", call, text));
}

// MPI counts are ints: larger buffers go in slices.
template <typename T>
void all_reduce(T* values, size_t count, MPI_Datatype type, MPI_Op op) {
  for (size_t done = 0; done < count;) {
    const auto slice = static_cast<int>(std::min<size_t>(count - done, INT_MAX));
    check_mpi(MPI_Allreduce(MPI_IN_PLACE, values + done, slice, type, op, MPI_COMM_WORLD),
              "MPI_Allreduce");
    done += static_cast<size_t>(slice);
  }
}

}  // namespace

Communicator::Communicator(const LaunchInfo& launch) : launch_(launch) {
  if (!several()) return;
  if (launch.launcher == "torchrun") {
    throw Error(fmt::format(
        "this process is {}: several processes talk through MPI here; start them with mpirun or "
        "srun",
        launch.describe()));
  }
  check_mpi(MPI_Init(nullptr, nullptr), "MPI_Init");
  int rank = 0, size = 0;
  check_mpi(MPI_Comm_rank(MPI_COMM_WORLD, &rank), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(MPI_COMM_WORLD, &size), "MPI_Comm_size");
  if (rank != launch.rank || size != launch.world_size) {
    throw Error(fmt::format("MPI sees rank {} of {}, but the launcher said {}", rank, size,
                            launch.describe()));
  }
}

Communicator::~Communicator() {
  if (several()) MPI_Finalize();
}

void Communicator::sum(float* values, size_t count) {
  if (several()) all_reduce(values, count, MPI_FLOAT, MPI_SUM);
}

void Communicator::sum(double* values, size_t count) {
  if (several()) all_reduce(values, count, MPI_DOUBLE, MPI_SUM);
}

int Communicator::max(int value) {
  if (several()) all_reduce(&value, 1, MPI_INT, MPI_MAX);
  return value;
}

void Communicator::max(float* values, size_t count) {
  if (several()) all_reduce(values, count, MPI_FLOAT, MPI_MAX);
}

void Communicator::barrier() {
  if (several()) check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
}

void Communicator::abort(int code) {
  if (several()) MPI_Abort(MPI_COMM_WORLD, code);
  std::exit(code);
}

#else  // without MPI: one process only

Communicator::Communicator(const LaunchInfo& launch) : launch_(launch) {
  if (several()) {
    throw Error(fmt::format(
        "this process is {}, but this fp8train was built without MPI (install libopenmpi-dev and "
        "build again)",
        launch.describe()));
  }
}

Communicator::~Communicator() = default;
void Communicator::sum(float*, size_t) {}
void Communicator::sum(double*, size_t) {}
int Communicator::max(int value) {
  return value;
}
void Communicator::max(float*, size_t) {}
void Communicator::barrier() {}
void Communicator::abort(int code) {
  std::exit(code);
}

#endif  // FP8TRAIN_WITH_MPI

}  // namespace fp8t::distributed
