#include "train/memory_fit.h"

#include <gtest/gtest.h>

#include <string>

#include "core/error.h"

namespace fp8t::train {
namespace {

constexpr double kGiB = double(1 << 30);

// The error names where, every item with its bytes, the total, what is available and the advice.
TEST(MemoryFit, PlanOverTheAvailableMemoryIsAnErrorNamingEveryItem) {
  try {
    check_memory_plan("the GPU path,", {{"parameters", 2 * kGiB}, {"activations", 3 * kGiB}},
                      4 * kGiB, "is free on a GPU", "micro_batch_size 2 would fit");
    FAIL() << "expected an error";
  } catch (const ConfigError& error) {
    EXPECT_EQ(std::string(error.what()),
              "the GPU path, needs 5.0 GiB (parameters 2.0 GiB, activations 3.0 GiB) but 4.0 GiB "
              "is free on a GPU; micro_batch_size 2 would fit");
  }
}

TEST(MemoryFit, PlanThatFitsOrUnknownMemoryPasses) {
  EXPECT_NO_THROW(check_memory_plan("x", {{"a", 4 * kGiB}}, 4 * kGiB, "free", ""));
  EXPECT_NO_THROW(check_memory_plan("x", {{"a", 4 * kGiB}}, 0.0, "free", ""));
}

TEST(MemoryFit, LargestFittingBatch) {
  EXPECT_EQ(largest_fitting_batch(10.0, 3.0, 22.0), 4);  // 10 + 4 · 3 = 22
  EXPECT_EQ(largest_fitting_batch(10.0, 3.0, 21.9), 3);
  EXPECT_EQ(largest_fitting_batch(10.0, 3.0, 12.0), 0);
  EXPECT_EQ(largest_fitting_batch(10.0, 3.0, 9.0), 0);
}

}  // namespace
}  // namespace fp8t::train
