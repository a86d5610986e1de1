// What the activation recompute tests of both models share: the numbers a model runs in, the
// names of the settings, and the checks that two models of the same weights and inputs (one with
// recompute, one without) ended a step in the same FP8 state.
#pragma once

#include <gtest/gtest.h>

#include <cstdint>
#include <ostream>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "models/precision_policy.h"
#include "models/recompute.h"
#include "numerics/scaling.h"
#include "ops/fp8_health.h"

namespace fp8t::testing {

enum class Numbers { Fp32, Delayed, Tensorwise, Blockwise, DelayedFp8Attention };

inline std::string name_of(Numbers numbers) {
  constexpr const char* kNames[] = {"fp32", "delayed", "tensorwise", "blockwise",
                                    "delayed_fp8_attention"};
  return kNames[static_cast<int>(numbers)];
}

// fp32, or FP8 linears (hybrid formats) from 16 features up with the recipe, the other linears
// in bf16.
inline ModelPrecision precision_of(Numbers numbers) {
  ModelPrecision precision = ModelPrecision::fp32_reference();
  if (numbers == Numbers::Fp32) return precision;
  precision.fp8.mode = Fp8Mode::Hybrid;
  precision.fp8.recipe = numbers == Numbers::Tensorwise  ? ScalingRecipe::Tensorwise
                         : numbers == Numbers::Blockwise ? ScalingRecipe::Blockwise
                                                         : ScalingRecipe::Delayed;
  precision.policy = precision_options(precision.fp8);
  precision.policy.min_dim = 16;
  precision.policy.require_divisible_by = 16;
  precision.fp8_attention = numbers == Numbers::DelayedFp8Attention;
  precision.other_linears = ops::LinearOperands::Bf16;
  return precision;
}

// "none", "selective", "full_uniform_2", "full_block_1".
inline std::string name_of(const RecomputeOptions& options) {
  constexpr const char* kGranularities[] = {"none", "selective", "full"};
  const std::string granularity = kGranularities[static_cast<int>(options.granularity)];
  if (options.granularity != RecomputeGranularity::Full) return granularity;
  return fmt::format("{}_{}_{}", granularity,
                     options.method == RecomputeMethod::Block ? "block" : "uniform",
                     options.num_layers);
}

// One case of a model's recompute test: its numbers and its recompute setting.
struct RecomputeSetting {
  Numbers numbers;
  RecomputeOptions recompute;
};

inline void PrintTo(const RecomputeSetting& setting, std::ostream* out) {
  *out << name_of(setting.numbers) << ", " << name_of(setting.recompute);
}

inline std::string test_name(const ::testing::TestParamInfo<RecomputeSetting>& setting) {
  return name_of(setting.param.numbers) + "_" + name_of(setting.param.recompute);
}

// The same records in the same order, with the same counts; some values were counted (not all
// records count: a linear that reads another's cast of its input counts no input).
inline void expect_same_fp8_health(const std::vector<Fp8TensorHealth>& want,
                                   const std::vector<Fp8TensorHealth>& got) {
  ASSERT_EQ(got.size(), want.size());
  uint64_t counted = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    SCOPED_TRACE(want[i].layer);
    counted += want[i].health.elements;
    EXPECT_EQ(got[i].health.elements, want[i].health.elements);
    EXPECT_EQ(got[i].health.counts.saturated, want[i].health.counts.saturated);
    EXPECT_EQ(got[i].health.counts.underflow, want[i].health.counts.underflow);
  }
  EXPECT_GT(counted, 0u) << "no FP8 cast counted";
}

// Every delayed-scaling state with the same amax history and scale.
inline void expect_same_delayed_scalings(
    const std::vector<std::pair<std::string, DelayedScaling*>>& want,
    const std::vector<std::pair<std::string, DelayedScaling*>>& got) {
  ASSERT_EQ(got.size(), want.size());
  for (size_t i = 0; i < want.size(); ++i) {
    SCOPED_TRACE(want[i].first);
    EXPECT_EQ(got[i].first, want[i].first);
    EXPECT_EQ(got[i].second->history(), want[i].second->history());
    EXPECT_EQ(got[i].second->scale(), want[i].second->scale());
  }
}

}  // namespace fp8t::testing
