// FP8 health: the casts' records of a real FP8 linear judged by the monitor (a crafted overflow
// trips it and, kept up, moves the linear to BF16; healthy data never trips it), the rule's
// details on crafted records, and the state a checkpoint keeps.
#include "train/fp8_health_monitor.h"

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "ops/fp8_linear.h"

namespace fp8t::train {
namespace {

constexpr int64_t kIn = 128, kOut = 128, kTokens = 48;  // whole blocks for every recipe
const std::string kLayer = "transformer.h.0.mlp.c_fc";

Fp8Section settings_for(ScalingRecipe recipe) {
  Fp8Section settings;
  settings.scaling.mode = Fp8Mode::Hybrid;
  settings.scaling.recipe = recipe;
  settings.health_every = 1;
  settings.auto_fallback = true;
  settings.fallback_after = 3;
  return settings;
}

// One training step of the linear, counting, on the same N(0, 1) draws each step (a steady
// state: delayed scaling's history then covers every amax), the input times input_scale; its
// records as a model's take_fp8_health() gives them.
std::vector<Fp8TensorHealth> counted_step(ops::Fp8Linear& linear, float input_scale) {
  std::mt19937 random(7);
  std::normal_distribution<float> normal;
  std::vector<float> x(kTokens * kIn), weight(kOut * kIn), y(kTokens * kOut), dy(kTokens * kOut),
      dx(kTokens * kIn, 0.0f), dweight(kOut * kIn, 0.0f);
  for (float& value : x)
    value = input_scale * normal(random);
  for (float& value : weight)
    value = 0.1f * normal(random);
  for (float& value : dy)
    value = 1e-3f * normal(random);
  linear.set_record_health(true);
  linear.forward(x.data(), kTokens, weight.data(), y.data());
  linear.backward(dy.data(), kTokens, dx.data(), dweight.data());
  linear.set_record_health(false);
  linear.end_step();
  std::vector<Fp8TensorHealth> records;
  for (TensorRole role : kTensorRoles)
    records.push_back({kLayer, role, linear.health(role)});
  linear.clear_health();
  return records;
}

TEST(Fp8HealthMonitor, CraftedOverflowTripsAndAfterThreeStepsInARowFallsBack) {
  const Fp8Section settings = settings_for(ScalingRecipe::Delayed);
  ops::Fp8Linear linear(settings.scaling, Fp8Family::Ocp, kIn, kOut);
  Fp8HealthMonitor monitor(settings, /*fp8=*/true);
  for (int64_t step = 1; step <= 3; ++step) {  // healthy: the history learns the amaxes
    const Fp8HealthVerdict verdict = monitor.check(step, counted_step(linear, 1.0f));
    EXPECT_TRUE(verdict.warnings.empty()) << verdict.warnings.front();
  }
  // Each step's input 100 times the last: delayed scaling's history-based scale saturates it.
  float input_scale = 1.0f;
  for (int64_t step = 4; step <= 6; ++step) {
    input_scale *= 100.0f;
    const std::vector<Fp8TensorHealth> records = counted_step(linear, input_scale);
    const Fp8OperandHealth& input = records[0].health;
    EXPECT_EQ(input.elements, uint64_t(kTokens * kIn));
    EXPECT_GT(input.saturated_fraction(), 0.5) << "step " << step;
    EXPECT_GT(input.amax, 2.0f * input_scale);
    const Fp8HealthVerdict verdict = monitor.check(step, records);
    ASSERT_EQ(verdict.warnings.size(), 1u) << "step " << step;
    const std::string& warning = verdict.warnings[0];
    EXPECT_NE(warning.find(kLayer + " input"), std::string::npos) << warning;
    EXPECT_NE(warning.find("saturated"), std::string::npos) << warning;
    EXPECT_NE(warning.find("amax jumped"), std::string::npos) << warning;
    if (step < 6) {
      EXPECT_TRUE(verdict.fallbacks.empty()) << "step " << step;
    } else {
      ASSERT_EQ(verdict.fallbacks.size(), 1u);
      EXPECT_EQ(verdict.fallbacks[0].linear, kLayer);
      EXPECT_EQ(verdict.fallbacks[0].step, 6);
      EXPECT_NE(verdict.fallbacks[0].evidence.find("3 statistics step(s) in a row"),
                std::string::npos);
    }
  }
  ModelPrecision configured;
  configured.fp8 = settings.scaling;
  const ModelPrecision fallen = monitor.precision(configured);
  EXPECT_EQ(fallen.policy.fallback_linears, std::vector<std::string>{kLayer});
  EXPECT_TRUE(monitor.changes_precision());
}

TEST(Fp8HealthMonitor, HealthyTrainingNeverTrips) {
  for (ScalingRecipe recipe : {ScalingRecipe::Delayed, ScalingRecipe::Tensorwise,
                               ScalingRecipe::Blockwise, ScalingRecipe::Mxfp8}) {
    const Fp8Section settings = settings_for(recipe);
    ops::Fp8Linear linear(settings.scaling, Fp8Family::Ocp, kIn, kOut);
    Fp8HealthMonitor monitor(settings, /*fp8=*/true);
    for (int64_t step = 1; step <= 8; ++step) {
      const std::vector<Fp8TensorHealth> records = counted_step(linear, 1.0f);
      for (const Fp8TensorHealth& record : records) {
        EXPECT_GT(record.health.elements, 0u);
        EXPECT_EQ(record.health.per_tensor(),
                  recipe == ScalingRecipe::Delayed || recipe == ScalingRecipe::Tensorwise);
      }
      const Fp8HealthVerdict verdict = monitor.check(step, records);
      EXPECT_TRUE(verdict.warnings.empty()) << recipe_name(recipe) << ": " << verdict.warnings[0];
    }
    EXPECT_FALSE(monitor.changes_precision());
  }
}

Fp8TensorHealth record_of(const std::string& layer, TensorRole role, uint64_t underflow,
                          float amax) {
  Fp8TensorHealth record;
  record.layer = layer;
  record.role = role;
  record.health.elements = 1000;
  record.health.counts.underflow = underflow;
  record.health.amax = amax;
  record.health.scale = std::isnan(amax) ? 1.0f : 448.0f / amax;
  return record;
}

TEST(Fp8HealthMonitor, OnlyTripsInARowCountTowardsTheFallback) {
  const Fp8Section settings = settings_for(ScalingRecipe::Tensorwise);
  Fp8HealthMonitor monitor(settings, /*fp8=*/true);
  const auto step_with = [&](int64_t step, uint64_t underflow) {
    return monitor.check(step, {record_of("a", TensorRole::GradOutput, underflow, 1.0f),
                                record_of("b", TensorRole::Input, 0, 1.0f)});
  };
  EXPECT_EQ(step_with(1, 900).warnings.size(), 1u);  // 90 % > 25 %
  EXPECT_TRUE(step_with(2, 10).warnings.empty());    // the run ends
  EXPECT_EQ(step_with(3, 900).fallbacks.size(), 0u);
  EXPECT_EQ(step_with(4, 900).fallbacks.size(), 0u);
  const Fp8HealthVerdict third = step_with(5, 900);
  ASSERT_EQ(third.fallbacks.size(), 1u);
  EXPECT_EQ(third.fallbacks[0].linear, "a");
  EXPECT_EQ(monitor.describe_fallbacks(), "a (step 5)");
  // Without fp8_auto_fallback only the warnings.
  Fp8Section warn_only = settings;
  warn_only.auto_fallback = false;
  Fp8HealthMonitor quiet(warn_only, true);
  for (int64_t step = 1; step <= 5; ++step) {
    const Fp8HealthVerdict verdict =
        quiet.check(step, {record_of("a", TensorRole::GradOutput, 900, 1.0f)});
    EXPECT_EQ(verdict.warnings.size(), 1u);
    EXPECT_TRUE(verdict.fallbacks.empty());
  }
}

TEST(Fp8HealthMonitor, AmaxJumpsTripDelayedScalingOnly) {
  for (ScalingRecipe recipe : {ScalingRecipe::Delayed, ScalingRecipe::Tensorwise}) {
    Fp8HealthMonitor monitor(settings_for(recipe), true);
    EXPECT_TRUE(monitor.check(1, {record_of("a", TensorRole::Input, 0, 1.0f)}).warnings.empty());
    const Fp8HealthVerdict jump = monitor.check(2, {record_of("a", TensorRole::Input, 0, 20.0f)});
    EXPECT_EQ(jump.warnings.size(), recipe == ScalingRecipe::Delayed ? 1u : 0u)
        << recipe_name(recipe);
    // Not finite: a trip under every recipe.
    EXPECT_EQ(monitor.check(3, {record_of("a", TensorRole::Input, 0, NAN)}).warnings.size(), 1u);
  }
}

TEST(Fp8HealthMonitor, StatisticsStepsOnlyForFp8Runs) {
  Fp8Section settings = settings_for(ScalingRecipe::Delayed);
  settings.health_every = 50;
  EXPECT_TRUE(Fp8HealthMonitor(settings, true).due(100));
  EXPECT_FALSE(Fp8HealthMonitor(settings, true).due(101));
  EXPECT_FALSE(Fp8HealthMonitor(settings, false).due(100));
  settings.health_every = 0;
  EXPECT_FALSE(Fp8HealthMonitor(settings, true).due(100));
}

TEST(Fp8HealthMonitor, StateRoundTripsThroughTheCheckpointJson) {
  Fp8HealthMonitor monitor(settings_for(ScalingRecipe::Delayed), true);
  for (int64_t step = 1; step <= 4; ++step)
    monitor.check(step, {record_of("a", TensorRole::GradOutput, 900, float(step))});
  ASSERT_TRUE(monitor.changes_precision());
  const nlohmann::json saved = monitor.state();
  Fp8HealthMonitor resumed(settings_for(ScalingRecipe::Delayed), true);
  resumed.resume(saved.get<Fp8HealthState>());
  EXPECT_EQ(nlohmann::json(resumed.state()), saved);
  EXPECT_EQ(resumed.describe_fallbacks(), monitor.describe_fallbacks());
  // A checkpoint from before the monitor reads as a fresh state.
  EXPECT_FALSE(Fp8HealthMonitor(settings_for(ScalingRecipe::Delayed), true).changes_precision());
  const Fp8HealthState fresh = nlohmann::json::object().get<Fp8HealthState>();
  EXPECT_TRUE(fresh.fallbacks.empty());
  EXPECT_TRUE(fresh.trips_in_a_row.empty());
}

TEST(Fp8HealthMonitor, LinesAndScalarsCarryTheNumbers) {
  const Fp8TensorHealth record = record_of("h.1.c_q", TensorRole::Weight, 250, 2.0f);
  const nlohmann::json line = health_line(7, record);
  EXPECT_EQ(line.at("step"), 7);
  EXPECT_EQ(line.at("layer"), "h.1.c_q");
  EXPECT_EQ(line.at("operand"), "weight");
  EXPECT_EQ(line.at("underflow"), 250);
  EXPECT_DOUBLE_EQ(line.at("underflow_fraction").get<double>(), 0.25);
  EXPECT_FLOAT_EQ(line.at("amax").get<float>(), 2.0f);
  const auto scalars = health_scalars(record);
  ASSERT_EQ(scalars.size(), 4u);
  EXPECT_EQ(scalars[1].first, "fp8/h.1.c_q/weight/underflow_fraction");
  EXPECT_FLOAT_EQ(scalars[1].second, 0.25f);
  Fp8TensorHealth block = record;
  block.health.amax = block.health.scale = NAN;  // block recipes: no per-tensor amax or scale
  EXPECT_TRUE(health_line(7, block).at("amax").is_null());
  EXPECT_EQ(health_scalars(block).size(), 2u);
}

}  // namespace
}  // namespace fp8t::train
