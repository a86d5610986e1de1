// The host memory plan (models/flux_memory.h) against what the GPU path allocates: every
// category of CudaFluxModel::memory() and CudaAdamW's moments, byte for byte, in BF16 and FP8
// (with FP8 weight transposes kept, and made in backward).
#include <gtest/gtest.h>

#include <algorithm>
#include <cstdint>
#include <ostream>
#include <string>

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include "core/cuda_check.h"
#include "models/cuda/flux_model_cuda.h"
#include "models/flux_memory.h"
#include "optim/cuda/adamw_cuda.h"
#include "optim/cuda/gpu_optimizer.h"

namespace fp8t {
namespace {

struct PlanCase {
  const char* preset;
  bool guidance;
  Fp8Mode mode;
  ScalingRecipe recipe;
  ops::WeightTransposes transposes = ops::WeightTransposes::Kept;
};

std::string case_name(const PlanCase& plan_case) {
  return fmt::format(
      "{}{}_{}_{}{}", plan_case.preset, plan_case.guidance ? "_guidance" : "",
      mode_name(plan_case.mode), recipe_name(plan_case.recipe),
      plan_case.transposes == ops::WeightTransposes::InBackward ? "_transposes_in_backward" : "");
}

// gtest prints a case by its name instead of its bytes.
void PrintTo(const PlanCase& plan_case, std::ostream* out) {
  *out << case_name(plan_case);
}

class FluxMemoryGpuTest : public ::testing::TestWithParam<PlanCase> {};

TEST_P(FluxMemoryGpuTest, PlanMatchesTheModelAndOptimizerAllocations) {
  const PlanCase& plan_case = GetParam();
  FluxConfig config = FluxConfig::preset(plan_case.preset);
  config.guidance_embed = plan_case.guidance;
  FluxPrecision precision;
  precision.fp8.mode = plan_case.mode;
  precision.fp8.recipe = plan_case.recipe;
  precision.policy.mode = plan_case.mode;
  precision.policy.recipe = plan_case.recipe;
  precision.fp8_weight_transposes = plan_case.transposes;
  // 2 samples of 64 image and 16 text tokens: FP8 row counts are multiples of 16, and flux_tiny's
  // narrow tensors leave pieces the arenas pad.
  const FluxMicroBatch micro_batch{.batch = 2, .img_tokens = 64, .txt_tokens = 16};
  const FluxMemoryPlan plan = plan_flux_memory(config, micro_batch, precision);

  cudaStream_t stream = nullptr;
  FP8T_CUDA_CHECK(cudaStreamCreate(&stream));
  {
    const CudaFluxModel model(config, micro_batch.batch, micro_batch.img_tokens,
                              micro_batch.txt_tokens, precision, stream);
    if (plan_case.mode != Fp8Mode::None && config.hidden_size >= 128) {
      const auto& decisions = model.linear_precision();
      ASSERT_TRUE(std::any_of(decisions.begin(), decisions.end(),
                              [](const FluxLinearPrecision& decision) { return decision.fp8; }))
          << "no linear took the FP8 path";
    }
    const CudaFluxMemory& memory = model.memory();
    EXPECT_EQ(plan.parameters, memory.parameters);
    EXPECT_EQ(plan.gradients, memory.gradients);
    EXPECT_EQ(plan.activations, memory.activations);
    EXPECT_EQ(plan.workspace, memory.workspace);
    EXPECT_EQ(plan.linear_copies, memory.linear_copies);

    // CudaAdamW keeps, beside the moments, a descriptor per chunk of each tensor and the
    // gradient norm's partial sums.
    const optim::CudaAdamW adamw(model.layout(), {});
    size_t chunks = 0;
    for (const optim::DeviceParameter& tensor : model.layout().parameters) {
      chunks += static_cast<size_t>((tensor.numel + optim::cuda::kAdamWChunkElements - 1) /
                                    optim::cuda::kAdamWChunkElements);
    }
    EXPECT_EQ(plan.optimizer_state + chunks * sizeof(optim::cuda::AdamWChunk) +
                  optim::cuda::kNormPartials * sizeof(double),
              adamw.device_bytes());
  }
  FP8T_CUDA_CHECK(cudaStreamDestroy(stream));
}

INSTANTIATE_TEST_SUITE_P(
    PresetsAndPrecisions, FluxMemoryGpuTest,
    ::testing::Values(PlanCase{"flux_tiny", false, Fp8Mode::None, ScalingRecipe::Tensorwise},
                      PlanCase{"flux_tiny", true, Fp8Mode::Hybrid, ScalingRecipe::Tensorwise},
                      PlanCase{"flux_small", false, Fp8Mode::None, ScalingRecipe::Tensorwise},
                      PlanCase{"flux_small", false, Fp8Mode::Hybrid, ScalingRecipe::Tensorwise},
                      PlanCase{"flux_small", true, Fp8Mode::Hybrid, ScalingRecipe::Blockwise},
                      PlanCase{"flux_small", false, Fp8Mode::Hybrid, ScalingRecipe::Tensorwise,
                               ops::WeightTransposes::InBackward},
                      PlanCase{"flux_small", false, Fp8Mode::Hybrid, ScalingRecipe::Blockwise,
                               ops::WeightTransposes::InBackward},
                      PlanCase{"flux_small", false, Fp8Mode::Hybrid, ScalingRecipe::Mxfp8}),
    [](const auto& test_param) { return case_name(test_param.param); });

}  // namespace
}  // namespace fp8t
