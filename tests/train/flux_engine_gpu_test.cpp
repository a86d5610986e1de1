// The GPU Flux engine's prediction for sample grids (FluxEngine::predict): rows in micro-batches
// of the training model, against the CPU engine's on the same weights, each micro-batch's rows
// as when predicted alone.
#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <memory>
#include <vector>

#include "models/flux_test_config.h"
#include "models/golden.h"
#include "numerics/test_util.h"
#include "train/flux_engine.h"

namespace fp8t::train {
namespace {

using test::TestRng;

std::vector<float> uniform(TestRng& rng, int64_t count, double lo, double hi) {
  std::vector<float> values(static_cast<size_t>(count));
  for (float& value : values)
    value = static_cast<float>(rng.uniform(lo, hi));
  return values;
}

TEST(FluxEngineGpu, PredictsRowsInMicroBatchesAsTheCpuEngine) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  constexpr int64_t kBatch = 2, kGrid = 8, kImgTokens = kGrid * kGrid, kTxtTokens = 8;
  constexpr int64_t kRows = 5;  // two whole micro-batches and one of one row
  // Two double and one single block of 128 features, with the guidance embedder.
  FluxConfig config = testing::two_head_flux_config(128, 2, 1);
  config.guidance_embed = true;
  FluxEngineSetup setup;
  setup.model = config;
  // BF16: FP8's per-tensor scales would tie a micro-batch's rows together.
  setup.precision.fp8.mode = Fp8Mode::None;
  setup.precision.policy.mode = Fp8Mode::None;
  setup.precision.other_linears = ops::LinearOperands::Bf16;
  setup.batch = kBatch;
  setup.img_tokens = kImgTokens;
  setup.txt_tokens = kTxtTokens;
  for (int64_t row = 0; row < kGrid; ++row) {
    for (int64_t col = 0; col < kGrid; ++col)
      setup.img_ids.insert(setup.img_ids.end(), {0.0f, float(row), float(col)});
  }
  const std::unique_ptr<FluxEngine> cpu = make_flux_cpu_engine(setup);
  const std::unique_ptr<FluxEngine> gpu = make_flux_cuda_engine(setup);
  // Every weight random (a zero modulation would make the blocks the identity).
  FluxParameterSet& weights = *cpu->host_parameters();
  for (const FluxParam& param : weights.specs()) {
    const double bound = param.kind == FluxParamKind::NormScale ? 0.5 : 1.0 / std::sqrt(128.0);
    const double centre = param.kind == FluxParamKind::NormScale ? 1.0 : 0.0;
    const std::vector<float> values = uniform(rng, param.numel(), centre - bound, centre + bound);
    std::copy(values.begin(), values.end(), weights[param.name].data<float>());
  }
  cpu->from_host();
  FluxParameterSet& gpu_weights = *gpu->host_parameters();
  for (const FluxParam& param : weights.specs()) {
    std::copy_n(weights[param.name].data<float>(), param.numel(),
                gpu_weights[param.name].data<float>());
  }
  gpu->from_host();

  const int64_t per_row = kImgTokens * config.in_channels;
  const std::vector<float> img = uniform(rng, kRows * per_row, -1.0, 1.0);
  const std::vector<float> txt = uniform(rng, kRows * kTxtTokens * config.context_in_dim, -1, 1);
  const std::vector<float> y = uniform(rng, kRows * config.vec_in_dim, -1.0, 1.0);
  const std::vector<float> sigma = uniform(rng, kRows, 0.0, 1.0);
  const std::vector<float> guidance = uniform(rng, kRows, 1.0, 5.0);
  const FluxInputs inputs{img.data(), setup.img_ids.data(), txt.data(),
                          y.data(),   sigma.data(),         guidance.data()};
  const float nan = std::numeric_limits<float>::quiet_NaN();
  std::vector<float> want(size_t(kRows * per_row), nan), got(want.size(), nan);
  cpu->predict(inputs, kRows, want.data());
  gpu->predict(inputs, kRows, got.data());
  for (float value : got)
    ASSERT_TRUE(std::isfinite(value));
  // bf16 activations against fp32 ones, as the model tests bound them.
  EXPECT_LT(testing::relative_error(got.data(), want.data(), std::ssize(want)), 0.025);

  // The first micro-batch predicted alone: the same values, bit for bit.
  std::vector<float> alone(size_t(kBatch * per_row), nan);
  gpu->predict(inputs, kBatch, alone.data());
  EXPECT_TRUE(std::equal(alone.begin(), alone.end(), got.begin()));
  // Row 3's σ changed: row 2, in the same micro-batch, predicts what it did, row 3 does not.
  std::vector<float> other_sigma = sigma;
  other_sigma[3] = 1.0f - other_sigma[3];
  FluxInputs other = inputs;
  other.timesteps = other_sigma.data();
  std::vector<float> moved(got.size(), nan);
  gpu->predict(other, kRows, moved.data());
  const auto row = [&](const std::vector<float>& values, int64_t r) {
    return std::vector<float>(values.begin() + r * per_row, values.begin() + (r + 1) * per_row);
  };
  EXPECT_EQ(row(moved, 2), row(got, 2));
  EXPECT_NE(row(moved, 3), row(got, 3));
  // Row 4, alone with a padding row of zeros, predicts what it does beside row 3.
  FluxInputs shifted{img.data() + 3 * per_row,
                     setup.img_ids.data(),
                     txt.data() + 3 * kTxtTokens * config.context_in_dim,
                     y.data() + 3 * config.vec_in_dim,
                     sigma.data() + 3,
                     guidance.data() + 3};
  std::vector<float> pair(size_t(2 * per_row), nan);
  gpu->predict(shifted, 2, pair.data());
  EXPECT_EQ(row(pair, 1), row(got, 4));
}

}  // namespace
}  // namespace fp8t::train
