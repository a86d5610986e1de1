// Activation recompute (models/recompute.h) on the Flux's CPU path: a model with recompute gives
// exactly the predictions, gradients, FP8 scaling state and FP8 health counts of one without
// it, with less activation memory.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <ostream>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"
#include "models/flux_model.h"
#include "models/flux_test_config.h"
#include "models/recompute.h"
#include "models/recompute_checks.h"

namespace fp8t {
namespace {

RecomputeOptions selective() {
  return {RecomputeGranularity::Selective, RecomputeMethod::Uniform, 1};
}

RecomputeOptions full(RecomputeMethod method, int num_layers) {
  return {RecomputeGranularity::Full, method, num_layers};
}

constexpr int kDoubleBlocks = 3, kSingleBlocks = 3;
constexpr int64_t kBatch = 2, kImgTokens = 8, kTxtTokens = 3;

// Three double and three single blocks: groups of 2 leave a group of one in each stack, and
// block recompute of 4 takes every double block and the first single one.
FluxConfig test_config(int hidden) {
  return testing::two_head_flux_config(hidden, kDoubleBlocks, kSingleBlocks);
}

using testing::name_of;
using testing::Numbers;
using testing::precision_of;

using Setting = testing::RecomputeSetting;
using testing::test_name;

// One micro-batch of random inputs on a 2×4 latent grid.
struct Inputs {
  std::vector<float> img, img_ids, txt, y, timesteps;

  Inputs(const FluxConfig& config, std::mt19937& generator) {
    std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
    const auto draw = [&](int64_t count) {
      std::vector<float> values(static_cast<size_t>(count));
      for (float& value : values)
        value = uniform(generator);
      return values;
    };
    img = draw(kBatch * kImgTokens * config.in_channels);
    for (int row = 0; row < 2; ++row) {
      for (int col = 0; col < 4; ++col)
        img_ids.insert(img_ids.end(), {0.0f, float(row), float(col)});
    }
    txt = draw(kBatch * kTxtTokens * config.context_in_dim);
    y = draw(kBatch * config.vec_in_dim);
    timesteps = {0.25f, 0.75f};
  }

  FluxInputs view() const {
    return {img.data(), img_ids.data(), txt.data(), y.data(), timesteps.data(), nullptr};
  }
};

// Random weights for every parameter (the modulation and final layer too, which the
// initialization zeroes), so that every gradient path carries signal.
void randomize(FluxModel& model, std::mt19937& generator) {
  std::normal_distribution<float> normal(0.0f, 0.3f);
  for (const FluxParam& param : flux_parameters(model.config())) {
    float* values = model.parameters()[param.name].data<float>();
    for (int64_t i = 0; i < param.numel(); ++i)
      values[i] = (param.kind == FluxParamKind::NormScale ? 1.0f : 0.0f) + normal(generator);
  }
  model.weights_changed();
}

void copy_parameters(FluxModel& to, FluxModel& from) {
  for (const FluxParam& param : flux_parameters(from.config())) {
    std::memcpy(to.parameters()[param.name].raw(), from.parameters()[param.name].raw(),
                from.parameters()[param.name].bytes());
  }
  to.weights_changed();
}

void expect_same_gradients(FluxModel& actual, FluxModel& expected) {
  for (const FluxParam& param : flux_parameters(expected.config())) {
    const TensorView& want = expected.gradients()[param.name];
    const TensorView& got = actual.gradients()[param.name];
    double norm = 0.0;
    for (int64_t i = 0; i < want.numel(); ++i)
      norm += std::abs(want.data<float>()[i]);
    EXPECT_GT(norm, 0.0) << param.name << ": a gradient that cannot differ";
    EXPECT_EQ(std::memcmp(got.raw(), want.raw(), want.bytes()), 0) << param.name;
  }
}

class FluxRecompute : public ::testing::TestWithParam<Setting> {};

// Two training steps of each model on the same weights and inputs, an update between them as
// an optimizer makes, with FP8 health counted on the second.
TEST_P(FluxRecompute, GivesThePredictionsGradientsAndFp8StateOfARunWithoutIt) {
  const Setting setting = GetParam();
  // Blockwise's 128x128 weight blocks need 128-wide linears.
  const FluxConfig config = test_config(setting.numbers == Numbers::Blockwise ? 128 : 32);
  const FluxPrecision precision = precision_of(setting.numbers);
  FluxModel plain(config, kBatch, kImgTokens, kTxtTokens, precision);
  FluxModel recomputing(config, kBatch, kImgTokens, kTxtTokens, precision, setting.recompute);
  if (setting.numbers != Numbers::Fp32) {
    int fp8_linears = 0;
    for (const FluxLinearPrecision& decision : recomputing.linear_precision())
      fp8_linears += decision.fp8;
    EXPECT_EQ(fp8_linears, kDoubleBlocks * 2 * 4 + kSingleBlocks * 2);
  }

  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 generator(seed);
  randomize(plain, generator);
  copy_parameters(recomputing, plain);

  const int64_t outputs = kBatch * kImgTokens * config.in_channels;
  std::vector<float> expected(static_cast<size_t>(outputs)), prediction(expected.size());
  std::vector<float> grad_prediction(expected.size());
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (int step = 1; step <= 2; ++step) {
    SCOPED_TRACE(::testing::Message() << "step " << step);
    const Inputs inputs(config, generator);
    plain.set_record_fp8_health(step == 2);
    recomputing.set_record_fp8_health(step == 2);
    plain.forward(inputs.view(), expected.data());
    recomputing.forward(inputs.view(), prediction.data());
    ASSERT_TRUE(std::isfinite(expected[0]));
    EXPECT_EQ(std::memcmp(prediction.data(), expected.data(), expected.size() * sizeof(float)), 0);
    for (float& value : grad_prediction)
      value = normal(generator);
    plain.zero_gradients();
    recomputing.zero_gradients();
    plain.backward(grad_prediction.data());
    recomputing.backward(grad_prediction.data());
    expect_same_gradients(recomputing, plain);
    if (step == 2 && setting.numbers != Numbers::Fp32)
      testing::expect_same_fp8_health(plain.take_fp8_health(), recomputing.take_fp8_health());
    // The update an optimizer would make, the same on both.
    for (const FluxParam& param : flux_parameters(config)) {
      float* weights = plain.parameters()[param.name].data<float>();
      const float* grad = plain.gradients()[param.name].data<float>();
      for (int64_t i = 0; i < param.numel(); ++i)
        weights[i] -= 0.01f * std::copysign(1.0f, grad[i]);
    }
    copy_parameters(recomputing, plain);
    plain.end_step();
    recomputing.end_step();
  }
  testing::expect_same_delayed_scalings(plain.delayed_scalings(), recomputing.delayed_scalings());
  if (setting.numbers == Numbers::Delayed) {
    EXPECT_FALSE(plain.delayed_scalings().empty());
  }
}

std::vector<Setting> settings() {
  const std::vector<RecomputeOptions> recomputes = {
      selective(),
      full(RecomputeMethod::Uniform, 1),
      full(RecomputeMethod::Uniform, 2),
      full(RecomputeMethod::Uniform, 3),
      full(RecomputeMethod::Block, 1),
      full(RecomputeMethod::Block, 4),
      full(RecomputeMethod::Block, kDoubleBlocks + kSingleBlocks),
  };
  std::vector<Setting> out;
  for (Numbers numbers : {Numbers::Fp32, Numbers::Delayed, Numbers::Tensorwise})
    for (const RecomputeOptions& recompute : recomputes)
      out.push_back({numbers, recompute});
  // Blockwise's 128-wide model is the slow one: a setting of each kind.
  for (const RecomputeOptions& recompute :
       {selective(), full(RecomputeMethod::Uniform, 2), full(RecomputeMethod::Block, 4)})
    out.push_back({Numbers::Blockwise, recompute});
  out.push_back({Numbers::DelayedFp8Attention, selective()});
  out.push_back({Numbers::DelayedFp8Attention, full(RecomputeMethod::Uniform, 2)});
  out.push_back({Numbers::DelayedFp8Attention, full(RecomputeMethod::Block, 4)});
  return out;
}

INSTANTIATE_TEST_SUITE_P(FluxModel, FluxRecompute, ::testing::ValuesIn(settings()), test_name);

// FluxModel::backward may run again on the same forward: with recompute it reruns what it
// computes again and adds the same gradients a second time, as a model without it does (with
// FP8 attention, the second backward scales from what the first measured).
TEST(FluxRecomputeBackward, RunsAgainOnTheSameForward) {
  const FluxConfig config = test_config(32);
  const FluxPrecision precision = precision_of(Numbers::DelayedFp8Attention);
  std::mt19937 generator(7);
  const Inputs inputs(config, generator);
  std::vector<float> prediction(static_cast<size_t>(kBatch * kImgTokens * config.in_channels));
  std::vector<float> grad_prediction(prediction.size());
  std::normal_distribution<float> normal(0.0f, 1.0f);
  for (float& value : grad_prediction)
    value = normal(generator);
  FluxModel plain(config, kBatch, kImgTokens, kTxtTokens, precision);
  randomize(plain, generator);
  plain.forward(inputs.view(), prediction.data());
  plain.zero_gradients();
  plain.backward(grad_prediction.data());
  plain.backward(grad_prediction.data());
  for (const RecomputeOptions& recompute : {selective(), full(RecomputeMethod::Uniform, 2)}) {
    SCOPED_TRACE(name_of(recompute));
    FluxModel recomputing(config, kBatch, kImgTokens, kTxtTokens, precision, recompute);
    copy_parameters(recomputing, plain);
    recomputing.forward(inputs.view(), prediction.data());
    recomputing.zero_gradients();
    recomputing.backward(grad_prediction.data());
    recomputing.backward(grad_prediction.data());
    expect_same_gradients(recomputing, plain);
  }
}

// Each setting saves less than the one before it; block recompute of every block saves what
// uniform groups of one save. (Block recompute of a single block saves more than none: its set
// of activations is its own still, and its input comes on top.)
TEST(FluxRecomputeMemory, EachSettingSavesLess) {
  const FluxConfig config = test_config(32);
  const auto bytes = [&](const RecomputeOptions& recompute) {
    return FluxModel::planned_activation_bytes(config, kBatch, kImgTokens, kTxtTokens, recompute);
  };
  const size_t none = bytes({});
  const size_t with_selective = bytes(selective());
  const size_t block_four = bytes(full(RecomputeMethod::Block, 4));
  const size_t uniform_one = bytes(full(RecomputeMethod::Uniform, 1));
  const size_t uniform_two = bytes(full(RecomputeMethod::Uniform, 2));
  EXPECT_LT(with_selective, none);
  EXPECT_LT(block_four, none);
  EXPECT_LT(uniform_one, with_selective);
  EXPECT_LT(uniform_one, uniform_two);
  EXPECT_LT(uniform_two, none);
  EXPECT_EQ(bytes(full(RecomputeMethod::Block, kDoubleBlocks + kSingleBlocks)), uniform_one);
  EXPECT_EQ(bytes({RecomputeGranularity::None, RecomputeMethod::Block, 99}), none);
}

TEST(FluxRecomputeMemory, ABadLayerCountNamesTheKey) {
  const FluxConfig config = test_config(32);
  for (const RecomputeOptions& options :
       {full(RecomputeMethod::Uniform, 0),
        full(RecomputeMethod::Block, kDoubleBlocks + kSingleBlocks + 1)}) {
    SCOPED_TRACE(name_of(options));
    for (const bool construct : {false, true}) {
      try {
        if (construct) {
          FluxModel model(config, kBatch, kImgTokens, kTxtTokens, FluxPrecision::fp32_reference(),
                          options);
        } else {
          FluxModel::planned_activation_bytes(config, kBatch, kImgTokens, kTxtTokens, options);
        }
        ADD_FAILURE() << "expected a ConfigError";
      } catch (const ConfigError& error) {
        EXPECT_NE(std::string(error.what()).find("recompute_num_layers"), std::string::npos)
            << error.what();
      }
    }
  }
}

}  // namespace
}  // namespace fp8t
