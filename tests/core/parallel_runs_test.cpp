// parallel_copy moves exactly the floats asked for, whatever the split over threads: sizes
// below one chunk, at the chunk boundaries and over many chunks, with a guard past the end.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <vector>

#include "core/parallel_runs.h"

namespace fp8t {
namespace {

TEST(ParallelCopy, CopiesEveryValueAndNothingMore) {
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(testing::Message() << "seed " << seed);
  std::mt19937 generator(seed);
  std::normal_distribution<float> normal;
  constexpr int64_t kChunk = kParallelCopyChunk;
  for (const int64_t count : {int64_t(0), int64_t(1), kChunk - 1, kChunk, 2 * kChunk + 3,
                              int64_t(kHostThreads) * kChunk + 17, 11 * kChunk + 5}) {
    std::vector<float> from(static_cast<size_t>(count));
    for (float& value : from)
      value = normal(generator);
    constexpr int64_t kGuard = 64;
    std::vector<float> to(size_t(count + kGuard), std::nanf(""));
    parallel_copy(from.data(), count, to.data());
    int64_t wrong = 0;
    for (int64_t i = 0; i < count; ++i)
      wrong += to[size_t(i)] == from[size_t(i)] ? 0 : 1;
    EXPECT_EQ(wrong, 0) << count << " floats";
    for (int64_t i = count; i < count + kGuard; ++i)
      EXPECT_TRUE(std::isnan(to[size_t(i)])) << "written past " << count << " at " << i;
  }
}

}  // namespace
}  // namespace fp8t
