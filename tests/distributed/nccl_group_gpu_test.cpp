// NcclGroup's gather and reduce-scatter on a group of one rank (the machines the tests run on may
// have one GPU, and NCCL takes one GPU per rank): what each copies, and how much, by element
// counts. The buffers start poisoned, so a count taken in bytes or a gather and a scatter with
// their buffers swapped shows as poison where values belong, or values where poison should stay.
// (A one-rank sum in place has nothing to move: only two GPUs can test the sums.)
#if FP8TRAIN_WITH_NCCL

#include <gtest/gtest.h>

#include <cstdint>
#include <memory>
#include <vector>

#include <cuda_runtime_api.h>

#include "core/cuda_check.h"
#include "core/device_buffer.h"
#include "distributed/communicator.h"
#include "distributed/nccl_group.h"
#include "numerics/float_bits.h"
#include "numerics/test_util.h"

namespace fp8t::distributed {
namespace {

// Random bf16 values in [-10, 10]; one equal to the poison (DeviceBuffer::kPoison's bytes, about
// -2.9e-16) is as good as never drawn.
std::vector<bf16> random_values(test::TestRng& rng, size_t count) {
  std::vector<bf16> values(count);
  for (bf16& value : values)
    value = float_to_bf16(static_cast<float>(rng.uniform(-10.0, 10.0)));
  return values;
}

// The bits of `values`, for comparisons that tell poison from values.
std::vector<uint16_t> bits_of(const std::vector<bf16>& values) {
  std::vector<uint16_t> bits;
  for (const bf16 value : values)
    bits.push_back(value.bits);
  return bits;
}

TEST(NcclGroupAlone, GatherAndReduceScatterMoveCountElementsOfTheirOwnPlace) {
  test::TestRng rng;
  SCOPED_TRACE(rng.trace());
  Communicator host(LaunchInfo{}, 0);
  NcclGroup every_rank(host);
  const ParallelLayout layout{.tensor = 1, .tensor_rank = 0, .data = 1, .data_rank = 0};
  const std::unique_ptr<NcclGroup> group = every_rank.tensor_parallel_group(layout);
  constexpr size_t kCount = 1001, kSlack = 23;  // odd sizes: no vector width hides a miscount
  const std::vector<bf16> own_values = random_values(rng, kCount);
  const DeviceBuffer<bf16> own(own_values);
  DeviceBuffer<bf16> all(kCount + kSlack), back(kCount + kSlack);
  const std::vector<bf16> poison = all.download();
  cudaStream_t stream = nullptr;
  FP8T_CUDA_CHECK(cudaStreamCreate(&stream));

  group->all_gather(own.get(), all.get(), kCount, stream);
  group->reduce_scatter(all.get(), back.get(), kCount, stream);
  FP8T_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<bf16> expected = own_values;
  expected.insert(expected.end(), poison.begin() + kCount, poison.end());
  EXPECT_EQ(bits_of(all.download()), bits_of(expected)) << "the gather";
  EXPECT_EQ(bits_of(back.download()), bits_of(expected)) << "the reduce-scatter";
  FP8T_CUDA_CHECK(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace fp8t::distributed

#endif  // FP8TRAIN_WITH_NCCL
