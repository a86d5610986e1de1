// The micro-batch losses of a step, copied from the device without waiting and summed on take():
// more losses than the pinned buffer holds are all counted, in order, and take() starts the next
// step from zero.
#include <gtest/gtest.h>

#include <random>
#include <vector>

#include <cuda_runtime_api.h>

#include "core/cuda_check.h"
#include "train/micro_batch_losses.h"

namespace fp8t::train {
namespace {

TEST(MicroBatchLossesGpu, SumsEveryLossAddedSinceTheLastTake) {
  std::mt19937 generator(std::random_device{}());
  std::uniform_real_distribution<float> loss_of(0.5f, 2.0f);
  constexpr int kLosses = 150;  // more than two buffers' worth
  std::vector<float> losses(kLosses);
  for (float& loss : losses)
    loss = loss_of(generator);
  float* device = nullptr;
  FP8T_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&device), kLosses * sizeof(float)));
  FP8T_CUDA_CHECK(
      cudaMemcpy(device, losses.data(), kLosses * sizeof(float), cudaMemcpyHostToDevice));
  cudaStream_t stream = nullptr;
  FP8T_CUDA_CHECK(cudaStreamCreate(&stream));

  MicroBatchLosses sums;
  double expected = 0.0;
  for (int i = 0; i < kLosses; ++i) {
    sums.add(device + i, stream);
    expected += losses[size_t(i)];
  }
  EXPECT_EQ(sums.take(stream), expected) << "the sum in the order added";
  sums.add(device + 3, stream);
  sums.add(device + 7, stream);
  EXPECT_EQ(sums.take(stream), double(losses[3]) + double(losses[7])) << "the next step's alone";
  EXPECT_EQ(sums.take(stream), 0.0) << "nothing added";

  FP8T_CUDA_CHECK(cudaStreamDestroy(stream));
  FP8T_CUDA_CHECK(cudaFree(device));
}

}  // namespace
}  // namespace fp8t::train
