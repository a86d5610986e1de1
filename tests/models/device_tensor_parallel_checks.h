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
  member.sum_bf16 = [&group, rank, add](bf16* values, size_t count, cudaStream_t stream) {
    std::vector<bf16> host(count);
    FP8T_CUDA_CHECK(
        cudaMemcpyAsync(host.data(), values, count * sizeof(bf16), cudaMemcpyDeviceToHost, stream));
    FP8T_CUDA_CHECK(cudaStreamSynchronize(stream));
    std::vector<float> wide(count);
    std::transform(host.begin(), host.end(), wide.begin(), bf16_to_float);
    group.reduce(rank, wide.data(), count, add);
    std::transform(wide.begin(), wide.end(), host.begin(), float_to_bf16);
    FP8T_CUDA_CHECK(
        cudaMemcpyAsync(values, host.data(), count * sizeof(bf16), cudaMemcpyHostToDevice, stream));
    FP8T_CUDA_CHECK(cudaStreamSynchronize(stream));
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
