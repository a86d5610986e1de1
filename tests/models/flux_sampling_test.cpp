#include "models/flux_sampling.h"

#include <gtest/gtest.h>

#include <cmath>
#include <numbers>
#include <vector>

#include "core/error.h"

namespace fp8t {
namespace {

TEST(FluxSampling, ScheduleRunsFromOneToZeroShiftedAsTraining) {
  const std::vector<double> plain = flow_sigma_schedule(4, 1.0);
  EXPECT_EQ(plain, (std::vector<double>{1.0, 0.75, 0.5, 0.25, 0.0}));
  const std::vector<double> shifted = flow_sigma_schedule(4, 3.0);
  ASSERT_EQ(shifted.size(), 5u);
  EXPECT_EQ(shifted.front(), 1.0);
  EXPECT_EQ(shifted.back(), 0.0);
  EXPECT_DOUBLE_EQ(shifted[2], shift_sigma(0.5, 3.0));  // 0.75: more steps at high noise
  EXPECT_THROW(flow_sigma_schedule(0, 1.0), Error);
}

// The exact velocity towards a single data point m, v = (x − m) / σ, keeps x on the straight
// path (1 − σ)·m + σ·ε at every step of any schedule and lands on m: Euler is exact there.
TEST(FluxSampling, EulerFollowsTheStraightPathToASinglePoint) {
  const std::vector<float> m = {0.5f, -1.0f, 2.0f}, noise = {1.0f, 0.25f, -0.5f};
  std::vector<float> x = noise;
  const std::vector<double> sigmas = flow_sigma_schedule(7, 2.0);
  size_t calls = 0;
  euler_flow_integrate(x, sigmas, [&](std::span<const float> at, double sigma, std::span<float> v) {
    for (size_t i = 0; i < at.size(); ++i) {
      EXPECT_NEAR(at[i], (1.0 - sigma) * m[i] + sigma * noise[i], 1e-5) << "σ " << sigma;
      v[i] = static_cast<float>((at[i] - m[i]) / sigma);
    }
    ++calls;
  });
  EXPECT_EQ(calls, 7u);
  for (size_t i = 0; i < m.size(); ++i)
    EXPECT_NEAR(x[i], m[i], 1e-5);
}

// dx/dσ = −x from σ = 1 to 0 has x(0) = e·x(1); Euler converges to it at first order: twice the
// steps, half the error.
TEST(FluxSampling, EulerConvergesAtFirstOrderOnALinearField) {
  const auto error_with = [](int steps) {
    std::vector<float> x = {1.0f};
    euler_flow_integrate(
        x, flow_sigma_schedule(steps, 1.0),
        [](std::span<const float> at, double, std::span<float> v) { v[0] = -at[0]; });
    return std::fabs(double(x[0]) - std::numbers::e);
  };
  const double coarse = error_with(100), fine = error_with(200);
  EXPECT_LT(coarse, 0.02);
  EXPECT_NEAR(coarse / fine, 2.0, 0.05);
}

// A new model predicts zero (its final layer is zero), so sampling leaves the noise as it is:
// the batch of prompts and empty captions goes through the model and back without mixing.
TEST(FluxSampling, AnInitializedModelLeavesTheNoise) {
  const FluxConfig config = FluxConfig::preset("flux_tiny");
  const LatentShape latent{4, 4, 4};
  constexpr int64_t kImages = 2, kTxtTokens = 3;
  FluxSampler sampler(config, kImages, latent.tokens(), kTxtTokens);
  init_flux_weights(sampler.parameters(), config, 7);
  std::vector<float> ids(size_t(latent.tokens() * 3));
  latent_image_ids(ids.data(), latent);
  std::vector<float> x(size_t(kImages * latent.numel()));
  for (size_t i = 0; i < x.size(); ++i)
    x[i] = std::sin(float(i));
  const std::vector<float> noise = x;
  const std::vector<float> txt(size_t(kImages * kTxtTokens * config.context_in_dim), 0.5f);
  const std::vector<float> pooled(size_t(kImages * config.vec_in_dim), 0.5f);
  const std::vector<float> empty_txt(size_t(kTxtTokens * config.context_in_dim), -0.5f);
  const std::vector<float> empty_pooled(size_t(config.vec_in_dim), -0.5f);
  sampler.sample(x, ids, txt, pooled, empty_txt, empty_pooled, {.steps = 3});
  EXPECT_EQ(x, noise);
  EXPECT_THROW(sampler.sample(x, ids, txt, pooled, txt, empty_pooled, {}), Error);
}

}  // namespace
}  // namespace fp8t
