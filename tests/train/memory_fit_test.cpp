#include "train/memory_fit.h"

#include <gtest/gtest.h>

#include <cstdint>
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

// The largest fitting micro-batch is looked for only when the plan does not fit.
TEST(MemoryFit, GpuPlanAsksForTheFittingBatchOnlyWhenItDoesNotFit) {
  const GpuMemoryPlan plan{.parameters = 1 * kGiB, .activations = 2 * kGiB, .runtime = 1 * kGiB};
  int asked = 0;
  const auto three = [&asked] {
    ++asked;
    return int64_t{3};
  };
  EXPECT_NO_THROW(check_gpu_memory_plan(plan, 4, 4 * kGiB, "GPU 0", "tokens", three, "none"));
  EXPECT_NO_THROW(check_gpu_memory_plan(plan, 4, 0.0, "GPU 0", "tokens", three, "none"));
  EXPECT_EQ(asked, 0);
  try {
    check_gpu_memory_plan(plan, 4, 3.5 * kGiB, "GPU 0", "samples", three, "none");
    FAIL() << "expected an error";
  } catch (const ConfigError& error) {
    EXPECT_EQ(
        std::string(error.what()),
        "the GPU path, with micro_batch_size 4, needs 4.0 GiB (parameters 1.0 GiB, "
        "gradients 0.0 MiB, optimizer 0.0 MiB, activations 2.0 GiB, workspace 0.0 MiB, linear "
        "copies 0.0 MiB, CUDA, cuBLASLt and cuDNN 1.0 GiB) but 3.5 GiB is free on GPU 0; "
        "micro_batch_size 3 would fit (gradient accumulation keeps the samples per step); "
        "more data-parallel GPUs shard only the optimizer state, while recompute_granularity, "
        "tensor_model_parallel_size and (with it) sequence_parallel take activations off each "
        "GPU");
  }
  EXPECT_EQ(asked, 1);
  GpuMemoryPlan fp8 = plan;
  fp8.weight_transposes_saving = 0.5 * kGiB;
  try {
    check_gpu_memory_plan(fp8, 4, 3.5 * kGiB, "GPU 0", "samples", three, "none");
    FAIL() << "expected an error";
  } catch (const ConfigError& error) {
    EXPECT_TRUE(std::string(error.what())
                    .ends_with("take activations off each GPU; fp8_weight_transposes: "
                               "in_backward takes 512.0 MiB off the linear copies"))
        << error.what();
  }
  EXPECT_THROW(
      {
        try {
          check_gpu_memory_plan(
              plan, 1, kGiB, "GPU 0", "tokens", [] { return int64_t{0}; }, "a smaller model");
        } catch (const ConfigError& error) {
          EXPECT_TRUE(std::string(error.what()).ends_with("is free on GPU 0; a smaller model"))
              << error.what();
          throw;
        }
      },
      ConfigError);
}

TEST(MemoryFit, LargestFittingBatch) {
  EXPECT_EQ(largest_fitting_batch(10.0, 3.0, 22.0), 4);  // 10 + 4 · 3 = 22
  EXPECT_EQ(largest_fitting_batch(10.0, 3.0, 21.9), 3);
  EXPECT_EQ(largest_fitting_batch(10.0, 3.0, 12.0), 0);
  EXPECT_EQ(largest_fitting_batch(10.0, 3.0, 9.0), 0);
  // A region of 2 a sample that holds 8 at the least: 10 + 3·b + max(2·b, 8).
  EXPECT_EQ(largest_fitting_batch(10.0, 3.0, 30.0, 2.0, 8.0), 4);  // 10 + 12 + 8
  EXPECT_EQ(largest_fitting_batch(10.0, 3.0, 29.0, 2.0, 8.0), 3);  // the floor: 10 + 9 + 8
  EXPECT_EQ(largest_fitting_batch(10.0, 3.0, 25.0, 2.0, 8.0), 2);  // 10 + 6 + 8
  EXPECT_EQ(largest_fitting_batch(10.0, 3.0, 41.0, 2.0, 8.0), 6);  // its growth: 10 + 18 + 12
  EXPECT_EQ(largest_fitting_batch(10.0, 3.0, 17.0, 2.0, 8.0), 0);
}

}  // namespace
}  // namespace fp8t::train
