#include "distributed/communicator.h"

#include <algorithm>
#include <climits>
#include <cstdlib>

#include <fmt/format.h>

#include "core/error.h"
#include "distributed/tcp_group.h"

#if FP8TRAIN_WITH_MPI
// MPI's C interface only: without these, OpenMPI's and MPICH's headers pull in their deprecated
// C++ bindings and their libraries.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#endif

namespace fp8t::distributed {

namespace {

#if FP8TRAIN_WITH_MPI

void check_mpi(int status, const char* call) {
  if (status == MPI_SUCCESS) return;
  char text[MPI_MAX_ERROR_STRING] = {};
  int length = 0;
  MPI_Error_string(status, text, &length);
  throw Error(fmt::format("{} failed: {}", call, text));
}

// MPI counts are ints: calls call(done, slice) for consecutive slices of `count` items, each of at
// most `max_slice` (and INT_MAX) items.
template <typename Call>
void in_mpi_slices(size_t count, size_t max_slice, Call&& call) {
  const size_t limit = std::min(max_slice, size_t{INT_MAX});
  for (size_t done = 0; done < count;) {
    const auto slice = static_cast<int>(std::min(count - done, limit));
    call(done, slice);
    done += static_cast<size_t>(slice);
  }
}

template <typename T>
void mpi_all_reduce(T* values, size_t count, MPI_Datatype type, MPI_Op op, size_t max_slice) {
  in_mpi_slices(count, max_slice, [&](size_t done, int slice) {
    check_mpi(MPI_Allreduce(MPI_IN_PLACE, values + done, slice, type, op, MPI_COMM_WORLD),
              "MPI_Allreduce");
  });
}

// Every rank's `count` values into `all` [ranks, count]: in one call where a row fits one slice,
// else in slices, each landing in every rank's row at the same offset through a receive type
// one slice long whose extent is a whole row. A slice's bytes stay within an int, as some MPI
// calls count a type's size in ints.
void mpi_all_gather(const float* own, float* all, size_t count, size_t max_slice) {
  const size_t slice_limit = std::min(max_slice, size_t{INT_MAX} / sizeof(float));
  if (count <= slice_limit) {
    const auto row = static_cast<int>(count);
    check_mpi(MPI_Allgather(own, row, MPI_FLOAT, all, row, MPI_FLOAT, MPI_COMM_WORLD),
              "MPI_Allgather");
    return;
  }
  in_mpi_slices(count, slice_limit, [&](size_t done, int slice) {
    MPI_Datatype values = MPI_DATATYPE_NULL, row_slice = MPI_DATATYPE_NULL;
    check_mpi(MPI_Type_contiguous(slice, MPI_FLOAT, &values), "MPI_Type_contiguous");
    check_mpi(MPI_Type_create_resized(values, 0, static_cast<MPI_Aint>(count * sizeof(float)),
                                      &row_slice),
              "MPI_Type_create_resized");
    check_mpi(MPI_Type_commit(&row_slice), "MPI_Type_commit");
    const int status =
        MPI_Allgather(own + done, slice, MPI_FLOAT, all + done, 1, row_slice, MPI_COMM_WORLD);
    MPI_Type_free(&row_slice);
    MPI_Type_free(&values);
    check_mpi(status, "MPI_Allgather");
  });
}

constexpr bool kHaveMpi = true;

#else

constexpr bool kHaveMpi = false;

#endif  // FP8TRAIN_WITH_MPI

}  // namespace

Communicator::Communicator(const LaunchInfo& launch, uint64_t job_hash) : launch_(launch) {
  if (!several()) return;
  mpi_ = kHaveMpi && launch.launcher != "torchrun";
  if (!mpi_) {
    if (launch.rendezvous_address.empty() || launch.rendezvous_port == 0) {
      throw Error(fmt::format(
          "this process is {}: {}set MASTER_ADDR and MASTER_PORT (rank 0's host and a free port) "
          "so that the ranks can meet over TCP",
          launch.describe(),
          kHaveMpi ? "" : "this fp8train was built without MPI (libopenmpi-dev); "));
    }
    tcp_ =
        std::make_unique<TcpGroup>(launch.rank, launch.world_size,
                                   TcpRendezvous{launch.rendezvous_address, launch.rendezvous_port,
                                                 launch.rendezvous_timeout_seconds},
                                   job_hash);
    return;
  }
#if FP8TRAIN_WITH_MPI
  check_mpi(MPI_Init(nullptr, nullptr), "MPI_Init");
  int rank = 0, size = 0;
  check_mpi(MPI_Comm_rank(MPI_COMM_WORLD, &rank), "MPI_Comm_rank");
  check_mpi(MPI_Comm_size(MPI_COMM_WORLD, &size), "MPI_Comm_size");
  if (rank != launch.rank || size != launch.world_size) {
    throw Error(fmt::format("MPI sees rank {} of {}, but the launcher said {}", rank, size,
                            launch.describe()));
  }
  if (const int differs = rank_differing_from_first(job_hash); differs >= 0) {
    throw Error(fmt::format(
        "rank {}'s configuration differs from rank 0's: start every rank with the same config "
        "and flags",
        differs));
  }
#endif
}

Communicator::~Communicator() {
#if FP8TRAIN_WITH_MPI
  if (mpi_) MPI_Finalize();
#endif
}

void Communicator::sum(float* values, size_t count) {
#if FP8TRAIN_WITH_MPI
  if (mpi_) return mpi_all_reduce(values, count, MPI_FLOAT, MPI_SUM, mpi_slice_limit_);
#endif
  if (tcp_) tcp_->sum(values, count);
}

void Communicator::sum(double* values, size_t count) {
#if FP8TRAIN_WITH_MPI
  if (mpi_) return mpi_all_reduce(values, count, MPI_DOUBLE, MPI_SUM, mpi_slice_limit_);
#endif
  if (tcp_) tcp_->sum(values, count);
}

int Communicator::max(int value) {
#if FP8TRAIN_WITH_MPI
  if (mpi_) mpi_all_reduce(&value, 1, MPI_INT, MPI_MAX, mpi_slice_limit_);
#endif
  if (tcp_) tcp_->max(&value, 1);
  return value;
}

void Communicator::max(float* values, size_t count) {
#if FP8TRAIN_WITH_MPI
  if (mpi_) return mpi_all_reduce(values, count, MPI_FLOAT, MPI_MAX, mpi_slice_limit_);
#endif
  if (tcp_) tcp_->max(values, count);
}

void Communicator::broadcast(void* bytes, size_t size) {
#if FP8TRAIN_WITH_MPI
  if (mpi_) {
    return in_mpi_slices(size, mpi_slice_limit_, [&](size_t done, int slice) {
      check_mpi(MPI_Bcast(static_cast<char*>(bytes) + done, slice, MPI_BYTE, 0, MPI_COMM_WORLD),
                "MPI_Bcast");
    });
  }
#endif
  if (tcp_) tcp_->broadcast(bytes, size);
}

void Communicator::all_gather(const float* own, float* all, size_t count) {
#if FP8TRAIN_WITH_MPI
  if (mpi_) return mpi_all_gather(own, all, count, mpi_slice_limit_);
#endif
  if (tcp_) return tcp_->all_gather(own, all, count * sizeof(float));
  std::copy_n(own, count, all);
}

int Communicator::rank_differing_from_first(uint64_t value) {
  uint64_t first = value;
  broadcast(&first, sizeof(first));
  return max(first != value ? rank() : -1);
}

void Communicator::barrier() {
#if FP8TRAIN_WITH_MPI
  if (mpi_) return check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier");
#endif
  if (tcp_) tcp_->barrier();
}

void Communicator::abort(int code) {
#if FP8TRAIN_WITH_MPI
  if (mpi_) MPI_Abort(MPI_COMM_WORLD, code);
#endif
  tcp_.reset();  // closed connections: the other ranks stop with an error
  std::exit(code);
}

}  // namespace fp8t::distributed
