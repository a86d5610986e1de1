// The GPU Flux against the CPU Flux: the same weights and inputs give the same prediction, loss
// and gradients within bf16-activation tolerances, in BF16 and in FP8 (tensorwise, blockwise,
// mxfp8).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include "core/arena.h"
#include "core/cuda_check.h"
#include "models/cuda/flux_model_cuda.h"
#include "models/flux_model.h"
#include "models/flux_objective.h"
#include "models/golden.h"
#include "numerics/test_util.h"
#include "ops/gpu_compare.h"

namespace fp8t {
namespace {

using test::TestRng;

// Wide enough for the FP8 policy at min_dim 64; two double and one single block; the guidance
// embedder on. head_dim 64 = 16 + 24 + 24.
FluxConfig small_config() {
  FluxConfig config = FluxConfig::preset("flux_tiny");
  config.hidden_size = 128;
  config.num_heads = 2;
  config.axes_dim = {16, 24, 24};
  config.double_blocks = 2;
  config.single_blocks = 1;
  config.guidance_embed = true;
  return config;
}

// 2 samples of an 8×8 latent grid (64 image tokens) and 8 text tokens: every row count a
// multiple of 16.
constexpr int64_t kBatch = 2, kGrid = 8, kImgTokens = kGrid * kGrid, kTxtTokens = 8;

std::vector<float> uniform(TestRng& rng, int64_t n, double lo, double hi) {
  std::vector<float> values(static_cast<size_t>(n));
  for (float& value : values)
    value = static_cast<float>(rng.uniform(lo, hi));
  return values;
}

struct Batch {
  std::vector<float> img, img_ids, txt, y, timesteps, guidance, target;
  FluxInputs inputs() const {
    return {img.data(), img_ids.data(), txt.data(), y.data(), timesteps.data(), guidance.data()};
  }
};

Batch random_batch(const FluxConfig& config, TestRng& rng) {
  Batch batch;
  const int64_t prediction = kBatch * kImgTokens * config.in_channels;
  batch.img = uniform(rng, prediction, -1.0, 1.0);
  for (int64_t row = 0; row < kGrid; ++row) {
    for (int64_t col = 0; col < kGrid; ++col)
      batch.img_ids.insert(batch.img_ids.end(), {0.0f, float(row), float(col)});
  }
  batch.txt = uniform(rng, kBatch * kTxtTokens * config.context_in_dim, -1.0, 1.0);
  batch.y = uniform(rng, kBatch * config.vec_in_dim, -1.0, 1.0);
  batch.timesteps = uniform(rng, kBatch, 0.0, 1.0);
  batch.guidance = uniform(rng, kBatch, 1.0, 5.0);
  batch.target = uniform(rng, prediction, -1.0, 1.0);
  return batch;
}

// Every weight and bias uniform in ±1/√in (modulation and final layer included, so that every
// gradient path carries signal), norm scales in [0.5, 1.5).
void randomize(FluxParameterSet& parameters, const FluxConfig& config, TestRng& rng) {
  for (const FluxLinear& linear : flux_linears(config)) {
    const double bound = 1.0 / std::sqrt(double(linear.in_features));
    for (const char* part : {".weight", ".bias"}) {
      TensorView& view = parameters[linear.name + part];
      const std::vector<float> values = uniform(rng, view.numel(), -bound, bound);
      std::copy(values.begin(), values.end(), view.data<float>());
    }
  }
  for (const FluxParam& param : flux_parameters(config)) {
    if (param.kind != FluxParamKind::NormScale) continue;
    const std::vector<float> values = uniform(rng, param.numel(), 0.5, 1.5);
    std::copy(values.begin(), values.end(), parameters[param.name].data<float>());
  }
}

FluxPrecision precision_for(Fp8Mode mode, ScalingRecipe recipe) {
  FluxPrecision precision;
  precision.fp8.mode = mode;
  precision.fp8.recipe = recipe;
  precision.policy.mode = mode;
  precision.policy.recipe = recipe;
  precision.policy.min_dim = 64;
  precision.other_linears = ops::LinearOperands::Bf16;
  return precision;
}

// The CPU model's forward and backward of `batch`: its prediction and loss.
struct CpuStep {
  std::vector<float> prediction;
  double loss = 0.0;
};
CpuStep cpu_step(FluxModel& cpu, const FluxConfig& config, const Batch& batch) {
  const int64_t count = kBatch * kImgTokens * config.in_channels;
  CpuStep step;
  step.prediction.resize(static_cast<size_t>(count));
  std::vector<float> dpred(step.prediction.size());
  cpu.forward(batch.inputs(), step.prediction.data());
  step.loss =
      flow_mse_loss_with_gradient(dpred.data(), step.prediction.data(), batch.target.data(), count);
  cpu.backward(dpred.data());
  return step;
}

class FluxModelGpuTest : public ::testing::TestWithParam<std::pair<Fp8Mode, ScalingRecipe>> {};

TEST_P(FluxModelGpuTest, PredictionLossAndGradientsMatchTheCpuModel) {
  const auto [mode, recipe] = GetParam();
  const FluxConfig config = small_config();
  const FluxPrecision precision = precision_for(mode, recipe);
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  const Batch batch = random_batch(config, rng);

  FluxModel cpu(config, kBatch, kImgTokens, kTxtTokens, precision);
  randomize(cpu.parameters(), config, rng);
  cpu.weights_changed();
  const int64_t count = kBatch * kImgTokens * config.in_channels;
  if (mode != Fp8Mode::None) {
    const auto fp8 = std::count_if(cpu.linear_precision().begin(), cpu.linear_precision().end(),
                                   [](const FluxLinearPrecision& d) { return d.fp8; });
    ASSERT_GT(fp8, 0) << "no linear took the FP8 path";
  }

  cudaStream_t stream = nullptr;
  FP8T_CUDA_CHECK(cudaStreamCreate(&stream));
  {
    CudaFluxModel gpu(config, kBatch, kImgTokens, kTxtTokens, precision, stream);
    gpu.upload_parameters(cpu.parameters());
    const auto [cpu_prediction, cpu_loss] = cpu_step(cpu, config, batch);
    gpu.forward(batch.inputs(), batch.target.data(), true);
    const double gpu_loss = gpu.loss_value();
    gpu.backward();
    const std::vector<float> gpu_prediction = gpu.prediction();

    // bf16 activations against fp32 ones: a few bf16 roundings (2^-9) per layer.
    const double bound = mode == Fp8Mode::None ? 0.05 : 0.2;
    EXPECT_LT(testing::relative_error(gpu_prediction.data(), cpu_prediction.data(), count),
              bound / 2);
    EXPECT_NEAR(gpu_loss, cpu_loss, 0.01 * cpu_loss);

    Arena arena("gradients", FluxParameterSet::planned_bytes(config, DType::F32));
    FluxParameterSet gradients(arena, config, DType::F32);
    gpu.download_gradients(gradients);
    for (const FluxParam& param : flux_parameters(config)) {
      const float* got = gradients[param.name].data<float>();
      const float* want = cpu.gradients()[param.name].data<float>();
      const double error = testing::relative_error(got, want, param.numel());
      if (test::verbose()) fmt::print("{:48} error {:.2e}\n", param.name, error);
      EXPECT_LT(error, bound) << param.name;
    }
  }
  FP8T_CUDA_CHECK(cudaStreamDestroy(stream));
}

INSTANTIATE_TEST_SUITE_P(
    Precisions, FluxModelGpuTest,
    ::testing::Values(std::make_pair(Fp8Mode::None, ScalingRecipe::Tensorwise),
                      std::make_pair(Fp8Mode::Hybrid, ScalingRecipe::Tensorwise),
                      std::make_pair(Fp8Mode::Hybrid, ScalingRecipe::Blockwise),
                      std::make_pair(Fp8Mode::Hybrid, ScalingRecipe::Mxfp8)),
    [](const auto& test_param) {
      return fmt::format("{}_{}", mode_name(test_param.param.first),
                         recipe_name(test_param.param.second));
    });

TEST(FluxModelGpu, DelayedScalingIsRefusedByName) {
  cudaStream_t stream = nullptr;
  FP8T_CUDA_CHECK(cudaStreamCreate(&stream));
  const FluxPrecision precision = precision_for(Fp8Mode::Hybrid, ScalingRecipe::Delayed);
  try {
    CudaFluxModel model(small_config(), kBatch, kImgTokens, kTxtTokens, precision, stream);
    ADD_FAILURE() << "expected the delayed recipe to be refused";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("fp8_recipe: delayed"), std::string::npos)
        << error.what();
  }
  FP8T_CUDA_CHECK(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace fp8t
