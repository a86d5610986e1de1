// What the GPU models' tensor-parallel tests share: a group's collectives among the threads of a
// test on one GPU, and the checks of the ranks' FP8 scales.
#pragma once

#include <algorithm>
#include <cstddef>
#include <functional>
#include <iterator>
#include <memory>
#include <vector>

#include <cuda_runtime_api.h>

#include "core/cuda_check.h"
#include "models/cuda/device_tensor_parallel.h"
#include "models/recompute_checks.h"
#include "models/tensor_parallel_checks.h"
#include "numerics/float_bits.h"
#include "numerics/scaling.h"
#include "ops/fp8_linear_layout.h"

namespace fp8t::testing {

// bf16 values on the device as floats on the host (exact), and back, rounded to bf16.
inline std::vector<float> to_host_floats(const bf16* values, size_t count, cudaStream_t stream) {
  std::vector<bf16> host(count);
  FP8T_CUDA_CHECK(
      cudaMemcpyAsync(host.data(), values, count * sizeof(bf16), cudaMemcpyDeviceToHost, stream));
  FP8T_CUDA_CHECK(cudaStreamSynchronize(stream));
  std::vector<float> wide(count);
  std::transform(host.begin(), host.end(), wide.begin(), bf16_to_float);
  return wide;
}

inline void to_device_bf16(const float* values, size_t count, bf16* out, cudaStream_t stream) {
  std::vector<bf16> narrow(count);
  std::transform(values, values + count, narrow.begin(), float_to_bf16);
  FP8T_CUDA_CHECK(
      cudaMemcpyAsync(out, narrow.data(), count * sizeof(bf16), cudaMemcpyHostToDevice, stream));
  FP8T_CUDA_CHECK(cudaStreamSynchronize(stream));
}

// A GPU model's tensor-parallel collectives among the threads of a test on one GPU (NCCL takes one
// GPU per rank): each rank's values go through host memory, where the group combines them in
// rank order. bf16 values are summed in fp32 and rounded once, as NCCL's bf16 sums do.
inline DeviceTensorParallel device_member(ThreadGroup& group, int rank) {
  using Combine = std::function<float(float, float)>;
  const auto reduce = [&group, rank](float* values, size_t count, cudaStream_t stream,
                                     const Combine& combine) {
    std::vector<float> host(count);
    FP8T_CUDA_CHECK(cudaMemcpyAsync(host.data(), values, count * sizeof(float),
                                    cudaMemcpyDeviceToHost, stream));
    FP8T_CUDA_CHECK(cudaStreamSynchronize(stream));
    group.reduce(rank, host.data(), count, combine);
    FP8T_CUDA_CHECK(cudaMemcpyAsync(values, host.data(), count * sizeof(float),
                                    cudaMemcpyHostToDevice, stream));
    FP8T_CUDA_CHECK(cudaStreamSynchronize(stream));
  };
  const Combine add = [](float a, float b) { return a + b; };
  DeviceTensorParallel member;
  member.size = group.size();
  member.rank = rank;
  member.sum = [reduce, add](float* values, size_t count, cudaStream_t stream) {
    reduce(values, count, stream, add);
  };
  member.max = [reduce](float* values, size_t count, cudaStream_t stream) {
    reduce(values, count, stream, [](float a, float b) { return std::max(a, b); });
  };
  // bf16 values summed over the group in fp32: `in` [count] read, and the sum's `out_count`
  // values from `out_first` written to `out`.
  const auto sum_bf16 = [&group, rank, add](const bf16* in, size_t count, bf16* out,
                                            size_t out_count, size_t out_first,
                                            cudaStream_t stream) {
    std::vector<float> wide = to_host_floats(in, count, stream);
    group.reduce(rank, wide.data(), count, add);
    to_device_bf16(wide.data() + out_first, out_count, out, stream);
  };
  member.sum_bf16 = [sum_bf16](bf16* values, size_t count, cudaStream_t stream) {
    sum_bf16(values, count, values, count, 0, stream);
  };
  // Sequence parallelism: a gather is every rank's values side by side, in rank order; a
  // reduce-scatter this rank's slice of the sum.
  const size_t size = static_cast<size_t>(group.size()), place = static_cast<size_t>(rank);
  member.all_gather_bf16 = [&group, rank, size](const bf16* own, bf16* all, size_t count,
                                                cudaStream_t stream) {
    const std::vector<float> mine = to_host_floats(own, count, stream);
    std::vector<float> every(size * count);
    group.all_gather(rank, mine.data(), every.data(), count);
    to_device_bf16(every.data(), every.size(), all, stream);
  };
  member.reduce_scatter_bf16 = [sum_bf16, size, place](const bf16* all, bf16* own, size_t count,
                                                       cudaStream_t stream) {
    sum_bf16(all, size * count, own, count, place * count, stream);
  };
  return member;
}

// Every scale slot of a model's FP8 linears (per-tensor recipes), read back.
template <typename Model>
std::vector<float> scales_of(Model& model, size_t linears) {
  std::vector<float> floats(model.scalings().float_count());
  FP8T_CUDA_CHECK(cudaMemcpy(floats.data(), model.scalings().device_floats(),
                             floats.size() * sizeof(float), cudaMemcpyDeviceToHost));
  std::vector<float> scales;
  for (size_t linear = 0; linear < linears; ++linear) {
    for (const TensorRole role : kTensorRoles) {
      scales.push_back(
          floats[linear * ops::kLinearScalingFloats +
                 static_cast<size_t>(role) * ops::kScalingFloatsPerRole + ops::kScaleSlot]);
    }
  }
  return scales;
}

// The weights' scales among scales_of()'s.
inline std::vector<float> weight_scales(const std::vector<float>& scales) {
  std::vector<float> weights;
  const size_t roles = std::size(kTensorRoles);
  for (size_t at = static_cast<size_t>(TensorRole::Weight); at < scales.size(); at += roles)
    weights.push_back(scales[at]);
  return weights;
}

// The end of a step on the whole model and on every rank (a thread each), with the checks of
// their FP8 scales: tensorwise, every scale the same on every rank (read before end_step); the
// per-tensor recipes, the weights' scales the whole weights'; delayed scaling, the same state on
// every rank.
template <typename Model>
void end_step_with_same_scales(Model& whole, const std::vector<std::unique_ptr<Model>>& ranks,
                               size_t fp8_linears, ScalingRecipe recipe) {
  const bool per_tensor =
      fp8_linears > 0 && (recipe == ScalingRecipe::Tensorwise || recipe == ScalingRecipe::Delayed);
  if (per_tensor && recipe == ScalingRecipe::Tensorwise) {
    for (size_t rank = 1; rank < ranks.size(); ++rank)
      EXPECT_EQ(scales_of(*ranks[rank], fp8_linears), scales_of(*ranks[0], fp8_linears));
  }
  whole.end_step();
  run_ranks<Model>(ranks, [](Model& model, size_t) { model.end_step(); });
  if (per_tensor) {
    EXPECT_EQ(weight_scales(scales_of(*ranks[0], fp8_linears)),
              weight_scales(scales_of(whole, fp8_linears)));
  }
  for (size_t rank = 1; rank < ranks.size(); ++rank)
    expect_same_delayed_scalings(ranks[0]->delayed_scalings(), ranks[rank]->delayed_scalings());
}

}  // namespace fp8t::testing
