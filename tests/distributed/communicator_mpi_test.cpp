// The MPI collectives between real ranks: ctest runs this binary under mpiexec. Each call is cut
// into slices of 3 values (bytes for broadcast), as MPI's int counts cut buffers of gigabytes,
// so that every slice must land in its place: 10 values are 3 + 3 + 3 + 1. The all-gather also
// runs unsliced, as rows that fit one slice do.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "distributed/communicator.h"
#include "distributed/launch.h"

namespace fp8t::distributed {
namespace {

constexpr size_t kCount = 10;
constexpr size_t kSlice = 3;

// Rank r's value i: distinct over ranks and positions, so a value in the wrong place shows.
double value_of(int rank, size_t i) {
  return 100.0 * rank + static_cast<double>(i);
}

// One test: MPI starts once per process (the communicator's constructor) and ends with it.
TEST(CommunicatorMpi, CollectivesInSlicesPutEveryValueInItsPlace) {
  const LaunchInfo launch = detect_launch();
  ASSERT_TRUE(launch.several()) << "run this under mpiexec with 2 or more ranks";
  Communicator communicator(launch, /*job_hash=*/42);
  communicator.limit_mpi_slices(kSlice);
  const int rank = communicator.rank(), ranks = communicator.size();

  std::vector<float> floats(kCount);
  std::vector<double> doubles(kCount);
  for (size_t i = 0; i < kCount; ++i) {
    floats[i] = static_cast<float>(value_of(rank, i));
    doubles[i] = value_of(rank, i);
  }
  communicator.sum(floats.data(), kCount);
  communicator.sum(doubles.data(), kCount);
  for (size_t i = 0; i < kCount; ++i) {
    double expected = 0.0;
    for (int r = 0; r < ranks; ++r)
      expected += value_of(r, i);
    EXPECT_EQ(floats[i], static_cast<float>(expected)) << "float sum, value " << i;
    EXPECT_EQ(doubles[i], expected) << "double sum, value " << i;
  }

  // Value i's largest is on rank i % ranks; the others hold less.
  for (size_t i = 0; i < kCount; ++i)
    floats[i] = static_cast<int>(i) % ranks == rank ? 1000.0f + static_cast<float>(i) : -1.0f;
  communicator.max(floats.data(), kCount);
  for (size_t i = 0; i < kCount; ++i)
    EXPECT_EQ(floats[i], 1000.0f + static_cast<float>(i)) << "max, value " << i;
  EXPECT_EQ(communicator.max(rank), ranks - 1);

  std::string bytes = rank == 0 ? "rank zero's" : std::string(11, '?');
  communicator.broadcast(bytes.data(), bytes.size());
  EXPECT_EQ(bytes, "rank zero's");

  std::vector<float> own(kCount);
  for (size_t i = 0; i < kCount; ++i)
    own[i] = static_cast<float>(value_of(rank, i));
  // In slices, then a whole row in one call.
  for (const size_t slice : {kSlice, kCount}) {
    communicator.limit_mpi_slices(slice);
    std::vector<float> all(kCount * static_cast<size_t>(ranks),
                           std::numeric_limits<float>::quiet_NaN());
    communicator.all_gather(own.data(), all.data(), kCount);
    for (int r = 0; r < ranks; ++r) {
      for (size_t i = 0; i < kCount; ++i) {
        EXPECT_EQ(all[static_cast<size_t>(r) * kCount + i], static_cast<float>(value_of(r, i)))
            << "all-gather in slices of " << slice << ", rank " << r << "'s value " << i;
      }
    }
  }
  EXPECT_EQ(communicator.rank_differing_from_first(42), -1);
  communicator.barrier();
}

}  // namespace
}  // namespace fp8t::distributed
