// Whole tensors to and from a tensor-parallel group's shares on the GPU (models/cuda/
// share_transfer.h), the ranks as threads of one GPU, through staging that takes a few whole rows
// per pass: every rank gathers the whole, and the first rank's whole scatters into every share,
// bit for bit, against the host's cut of each share (optim::host_share, WeightShare).
#include "models/cuda/share_transfer.h"

#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <random>
#include <span>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <cuda_runtime_api.h>

#include "core/cuda_check.h"
#include "core/cuda_resources.h"
#include "core/device_buffer.h"
#include "core/error.h"
#include "models/device_tensor_parallel_checks.h"
#include "models/weight_share.h"
#include "optim/cuda/device_parameters.h"

namespace fp8t {
namespace {

// body(rank) on every rank of `group` at once, one thread each.
void on_ranks(testing::ThreadGroup& group, const std::function<void(int)>& body) {
  std::vector<std::thread> threads;
  for (int rank = 0; rank < group.size(); ++rank)
    threads.emplace_back(body, rank);
  for (std::thread& thread : threads)
    thread.join();
}

std::vector<float> random_values(size_t count, uint32_t seed) {
  std::mt19937 generator(seed);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> values(count);
  for (float& value : values)
    value = normal(generator);
  return values;
}

// fp32 or bf16 values as floats (exact), to compare.
template <typename T>
std::vector<float> floats(const std::vector<T>& values) {
  std::vector<float> result(values.size());
  std::ranges::transform(values, result.begin(), [](T value) { return to_float(value); });
  return result;
}

template <typename T>
std::vector<float> download(const DeviceBuffer<T>& buffer, cudaStream_t stream) {
  std::vector<T> host(buffer.count());
  FP8T_CUDA_CHECK(
      cudaMemcpyAsync(host.data(), buffer.get(), buffer.bytes(), cudaMemcpyDeviceToHost, stream));
  FP8T_CUDA_CHECK(cudaStreamSynchronize(stream));
  return floats(host);
}

// On one rank: its share `own` (host) gathered into the whole, which must be `whole` (when the
// group's shares do not overlap: `gather`); then the first rank's `whole` scattered into a
// poisoned share, which must be `own`. Staging holds `staged_rows` whole rows and one value
// more, so that the last pass takes fewer rows.
template <typename T>
void check_transfers(const ShareBlocks& share, const std::vector<T>& own,
                     const std::vector<T>& whole, const DeviceTensorParallel& member,
                     int64_t staged_rows, const std::string& what, bool gather = true) {
  ASSERT_EQ(int64_t(whole.size()), share.whole_numel()) << what;
  const CudaStream stream;
  DeviceBuffer<T> device_own(own);
  DeviceBuffer<T> staging(size_t(staged_rows * share.whole_cols + 1));
  FP8T_CUDA_CHECK(cudaDeviceSynchronize());
  const std::span<T> staged(staging.get(), staging.count());
  const GroupSum<T>& sum = group_sum<T>(member);
  if (gather) {
    constexpr float kNan = std::numeric_limits<float>::quiet_NaN();
    std::vector<T> gathered(whole.size());
    for (T& value : gathered) {
      if constexpr (std::is_same_v<T, bf16>) {
        value = float_to_bf16(kNan);
      } else {
        value = kNan;
      }
    }
    gather_share(share, device_own.get(), staged, sum, gathered.data(), stream.get());
    EXPECT_EQ(floats(gathered), floats(whole)) << what << ": gathered on rank " << member.rank;
  }

  device_own.poison();
  FP8T_CUDA_CHECK(cudaDeviceSynchronize());
  scatter_share(share, member.rank == 0 ? whole.data() : nullptr, staged, sum, device_own.get(),
                stream.get());
  EXPECT_EQ(download(device_own, stream.get()), floats(own))
      << what << ": scattered to rank " << member.rank;
}

TEST(ShareTransferGpu, GathersAndScattersAGptLayoutsShares) {
  GptConfig config = GptConfig::from_depth(2);
  config.vocab_size = 100;
  config.n_head = config.n_kv_head = 2;
  constexpr int kRanks = 2;
  testing::ThreadGroup group(kRanks);
  on_ranks(group, [&](int rank) {
    const DeviceTensorParallel member = testing::device_member(group, rank);
    const optim::DeviceParameterLayout layout =
        optim::device_parameter_layout(config, /*bf16_embeddings=*/true, kRanks, rank);
    int split = 0;
    for (const optim::DeviceParameter& tensor : layout.parameters) {
      if (tensor.split == TensorSplit::None) continue;
      ++split;
      const int64_t whole_numel = tensor.numel * kRanks;
      const std::vector<float> whole =
          random_values(size_t(whole_numel), uint32_t(std::hash<std::string>{}(tensor.name)));
      const ShareBlocks share = share_blocks(layout, tensor);
      check_transfers(share, optim::host_share(layout, tensor, whole.data()), whole, member, 3,
                      tensor.name);
      if (!tensor.bf16) continue;
      std::vector<bf16> whole_bf16(whole.size());
      std::ranges::transform(whole, whole_bf16.begin(), float_to_bf16);
      check_transfers(share, optim::host_share(layout, tensor, whole_bf16.data()), whole_bf16,
                      member, 3, tensor.name + " in bf16");
    }
    EXPECT_GT(split, 10);  // the blocks' linears, the value gates and the value embeddings
  });
}

// A Flux linear's share of runs of rows (as q, k and v of a fused qkv) or of columns, and a
// tensor the group does not split.
TEST(ShareTransferGpu, GathersAndScattersRunsOfRowsOrColumns) {
  constexpr int kRanks = 3;
  testing::ThreadGroup group(kRanks);
  on_ranks(group, [&](int rank) {
    const DeviceTensorParallel member = testing::device_member(group, rank);
    const int64_t out = 18, in = 9;
    const std::vector<float> whole = random_values(size_t(out * in), 11);
    const auto check = [&](TensorSplit split, std::vector<ShareSegment> segments, int64_t rows,
                           const std::string& what, bool gather = true) {
      WeightShare reference =
          split == TensorSplit::None ? WeightShare(out, in) : WeightShare(split, segments, out, in);
      reference.refresh(whole.data(), nullptr);
      const std::vector<float> own(
          reference.weight(),
          reference.weight() + reference.out_features() * reference.in_features());
      check_transfers(share_blocks(TensorShare{split, std::move(segments)}, out, in), own, whole,
                      member, rows, what, gather);
    };
    const int64_t r = rank;
    check(TensorSplit::Outputs, {{2 * r, 2}, {6 + 2 * r, 2}, {12 + 2 * r, 2}}, 4, "rows");
    check(TensorSplit::Inputs, {{2 * r, 2}, {6 + r, 1}}, 5, "columns");
    // Each rank holds the whole: the first rank's values scatter to every one (as the Flux
    // model's upload of its replicated tensors); gathering would add the copies.
    check(TensorSplit::None, {}, 2, "whole", false);
  });
}

TEST(ShareTransferGpu, RefusesStagingShorterThanAWholeRow) {
  const ShareBlocks share = share_blocks(TensorShare{}, 4, 8);
  std::vector<float> staging(7), host(32);
  const GroupSum<float> sum = [](float*, size_t, cudaStream_t) {};
  try {
    gather_share(share, staging.data(), std::span<float>(staging), sum, host.data(), nullptr);
    FAIL() << "expected an error";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("staging of 7 elements cannot hold a whole row of 8"),
              std::string::npos)
        << error.what();
  }
}

}  // namespace
}  // namespace fp8t
