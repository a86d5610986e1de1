// Tensor parallelism of the Flux on the CPU path (models/tensor_parallel.h): two ranks, threads of
// this process, give the prediction and the gradients of one model on the whole tensors (fp32),
// or its prediction and its FP8 scales (FP8 linears), with sequence parallelism or without.
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "core/error.h"
#include "models/flux_model.h"
#include "models/flux_test_config.h"
#include "models/recompute_checks.h"
#include "models/tensor_parallel_checks.h"

namespace fp8t {
namespace {

// Sequence parallelism splits each stream's tokens: 4 text tokens instead of 3.
constexpr int64_t kBatch = 2, kImgTokens = 8;
constexpr int kRanks = 2;

// Two double and two single blocks with 2 heads: one head per rank.
FluxConfig two_head_config(int hidden) {
  return testing::two_head_flux_config(hidden, 2, 2);
}

std::vector<float> draw(int64_t count, std::mt19937& generator) {
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> values(static_cast<size_t>(count));
  for (float& value : values)
    value = uniform(generator);
  return values;
}

using Case = testing::RecomputeSetting;
using testing::relative_difference;

int64_t text_tokens(bool sequence) {
  return sequence ? 4 : 3;
}

void expect_two_ranks_give_the_prediction_and_gradients_of_one(const Case& setting, bool sequence) {
  const int64_t txt_tokens = text_tokens(sequence);
  const bool fp8 = setting.numbers != testing::Numbers::Fp32;
  // Blockwise's 128x128 tiles need the shares (a head of 128, half an MLP of 1024) to be whole.
  const FluxConfig config =
      two_head_config(setting.numbers == testing::Numbers::Blockwise ? 256 : 64);
  const FluxPrecision precision = testing::precision_of(setting.numbers);

  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 generator(seed);
  FluxModel whole(config, kBatch, kImgTokens, txt_tokens, precision, setting.recompute);
  // Every parameter random (the modulation and final layer too, which the initialization
  // zeroes), so that every gradient path carries signal; the FP8 models nearer a smooth start.
  std::normal_distribution<float> normal(0.0f, fp8 ? 0.05f : 0.3f);
  const std::vector<FluxParam> params = flux_parameters(config);
  for (const FluxParam& param : params) {
    float* values = whole.parameters()[param.name].data<float>();
    for (int64_t i = 0; i < param.numel(); ++i)
      values[i] = (param.kind == FluxParamKind::NormScale ? 1.0f : 0.0f) + normal(generator);
  }
  whole.weights_changed();
  const std::vector<float> img = draw(kBatch * kImgTokens * config.in_channels, generator);
  const std::vector<float> txt = draw(kBatch * txt_tokens * config.context_in_dim, generator);
  const std::vector<float> y = draw(kBatch * config.vec_in_dim, generator);
  const std::vector<float> timesteps = {0.25f, 0.75f};
  std::vector<float> img_ids;
  for (int row = 0; row < 2; ++row) {
    for (int col = 0; col < 4; ++col)
      img_ids.insert(img_ids.end(), {0.0f, float(row), float(col)});
  }
  const FluxInputs inputs{img.data(), img_ids.data(),   txt.data(),
                          y.data(),   timesteps.data(), nullptr};
  const int64_t outputs = kBatch * kImgTokens * config.in_channels;
  const std::vector<float> grad_prediction = draw(outputs, generator);

  std::vector<float> want(static_cast<size_t>(outputs));
  whole.set_record_fp8_health(true);
  whole.forward(inputs, want.data());
  whole.backward(grad_prediction.data());

  testing::ThreadGroup group(kRanks);
  const std::vector<std::unique_ptr<FluxModel>> ranks =
      testing::ranks_like(group, whole, params, [&](TensorParallel member) {
        member.sequence = sequence;
        return std::make_unique<FluxModel>(config, kBatch, kImgTokens, txt_tokens, precision,
                                           setting.recompute, member);
      });
  if (fp8) {
    int fp8_linears = 0;
    for (const FluxLinearPrecision& decision : ranks[0]->linear_precision())
      fp8_linears += decision.fp8;
    EXPECT_EQ(fp8_linears, 2 * 2 * 4 + 2 * 2) << "every block linear, split or not";
  }
  // The ranks hold what their plan says: with sequence parallelism, fewer activations.
  const size_t plain = FluxModel::planned_activation_bytes(config, kBatch, kImgTokens, txt_tokens,
                                                           setting.recompute, kRanks);
  for (const std::unique_ptr<FluxModel>& rank : ranks) {
    if (sequence) {
      EXPECT_LT(rank->activation_bytes(), plain);
    } else {
      EXPECT_EQ(rank->activation_bytes(), plain);
    }
  }
  std::vector<std::vector<float>> predictions(kRanks, std::vector<float>(want.size()));
  std::vector<std::vector<Fp8TensorHealth>> health(kRanks);
  testing::run_ranks<FluxModel>(ranks, [&](FluxModel& model, size_t rank) {
    model.set_record_fp8_health(true);
    model.forward(inputs, predictions[rank].data());
    model.backward(grad_prediction.data());
    model.gather_split_gradients();
    health[rank] = model.take_fp8_health();
  });

  EXPECT_EQ(predictions[0], predictions[1]) << "every rank of the group predicts the same";
  testing::expect_same_gradients(ranks, params);
  const double prediction_difference =
      relative_difference(predictions[0].data(), want.data(), outputs);
  if (!fp8) {  // the same sums in another order
    EXPECT_LT(prediction_difference, 1e-5);
    for (const FluxParam& param : params) {
      const TensorView& got = ranks[0]->gradients()[param.name];
      EXPECT_LT(relative_difference(got.data<float>(), whole.gradients()[param.name].data<float>(),
                                    param.numel()),
                1e-3)
          << param.name;
    }
    return;
  }
  // FP8: row-parallel outputs are sums of the ranks' bf16-rounded shares, and the casts after
  // them round some values the other way: the prediction moves by a few percent (the whole
  // model's moves by 5 % when its proj weights are perturbed by 1e-3), the gradients by more
  // (see gpt_tensor_parallel_test.cpp). The prediction is compared, and the scales.
  EXPECT_LT(prediction_difference, 0.1);
  if (setting.numbers == testing::Numbers::Blockwise) return;  // block scales are local
  const std::vector<Fp8TensorHealth> whole_health = whole.take_fp8_health();
  ASSERT_EQ(health[0].size(), whole_health.size());
  ASSERT_EQ(health[1].size(), whole_health.size());
  for (size_t i = 0; i < whole_health.size(); ++i) {
    const Fp8TensorHealth& expected = whole_health[i];
    SCOPED_TRACE(expected.layer + "." + tensor_role_name(expected.role));
    const float scale = health[0][i].health.scale;
    EXPECT_EQ(health[1][i].health.scale, scale) << "the ranks cast a tensor with different scales";
    if (setting.numbers != testing::Numbers::Tensorwise) continue;
    if (expected.role == TensorRole::Weight) {  // the shares together are the whole weight
      EXPECT_EQ(scale, expected.health.scale);
    }
    if (expected.role == TensorRole::Input) {
      EXPECT_NEAR(scale, expected.health.scale, expected.health.scale * 0.1);
    }
  }
}

const auto kSettings =
    ::testing::Values(Case{testing::Numbers::Fp32, {}},
                      Case{testing::Numbers::Fp32, {RecomputeGranularity::Selective}},
                      Case{testing::Numbers::Fp32, {RecomputeGranularity::Full}},
                      Case{testing::Numbers::Delayed, {}}, Case{testing::Numbers::Tensorwise, {}},
                      Case{testing::Numbers::Tensorwise, {RecomputeGranularity::Full}},
                      Case{testing::Numbers::Blockwise, {}});

class FluxTensorParallel : public ::testing::TestWithParam<Case> {};

TEST_P(FluxTensorParallel, TwoRanksGiveThePredictionAndGradientsOfOne) {
  expect_two_ranks_give_the_prediction_and_gradients_of_one(GetParam(), false);
}

INSTANTIATE_TEST_SUITE_P(FluxModel, FluxTensorParallel, kSettings, testing::test_name);

// Each rank keeps 4 of a sample's 8 image tokens and 2 of its 4 text tokens outside the split
// linears.
class FluxSequenceParallel : public ::testing::TestWithParam<Case> {};

TEST_P(FluxSequenceParallel, TwoRanksGiveThePredictionAndGradientsOfOne) {
  expect_two_ranks_give_the_prediction_and_gradients_of_one(GetParam(), true);
}

INSTANTIATE_TEST_SUITE_P(FluxModel, FluxSequenceParallel, kSettings, testing::test_name);

TEST(FluxTensorParallelSplits, HeadsAndHiddenFeaturesMustSplitEvenly) {
  const FluxConfig config = two_head_config(64);
  EXPECT_NO_THROW(check_flux_tensor_parallel(config, 2));
  for (int size : {0, 3, 4}) {
    try {
      check_flux_tensor_parallel(config, size);
      FAIL() << "expected a ConfigError for " << size << " ranks";
    } catch (const ConfigError& error) {
      EXPECT_NE(std::string(error.what()).find("tensor_model_parallel_size"), std::string::npos)
          << error.what();
    }
  }
}

TEST(FluxTensorParallelSplits, EachRankPlansTheActivationsOfItsShare) {
  const FluxConfig config = two_head_config(64);
  const int64_t txt_tokens = text_tokens(true);
  const size_t whole = FluxModel::planned_activation_bytes(config, kBatch, kImgTokens, txt_tokens);
  const size_t share =
      FluxModel::planned_activation_bytes(config, kBatch, kImgTokens, txt_tokens, {}, kRanks);
  EXPECT_LT(share, whole);
  EXPECT_GT(share, whole / 2);  // the residual streams and the modulation stay whole
  const size_t sequence =
      FluxModel::planned_activation_bytes(config, kBatch, kImgTokens, txt_tokens, {}, kRanks, true);
  EXPECT_LT(sequence, share);  // the residual streams' tensors hold half the tokens
}

TEST(FluxTensorParallelSplits, EachRankHoldsConsecutiveTokensOfEachStream) {
  // 8 image and 4 text tokens over 2 ranks: the second holds image tokens 4-7 and text tokens
  // 2-3, in the joint [txt; img] sequence at 2 and 4 + 4 = 8.
  const FluxOwnTokens image = flux_own_tokens(FluxStream::Image, 8, 4, 2, 1);
  EXPECT_EQ(image.whole, 8);
  EXPECT_EQ(image.own, 4);
  ASSERT_EQ(image.runs.size(), 1u);
  EXPECT_EQ(image.runs[0].whole_first, 4);
  const FluxOwnTokens joint = flux_own_tokens(FluxStream::Joint, 8, 4, 2, 1);
  EXPECT_EQ(joint.whole, 12);
  EXPECT_EQ(joint.own, 6);
  ASSERT_EQ(joint.runs.size(), 2u);
  EXPECT_EQ(joint.runs[0].whole_first, 2);
  EXPECT_EQ(joint.runs[0].own_first, 0);
  EXPECT_EQ(joint.runs[0].count, 2);
  EXPECT_EQ(joint.runs[1].whole_first, 8);
  EXPECT_EQ(joint.runs[1].own_first, 2);
  EXPECT_EQ(joint.runs[1].count, 4);
  // Without a split every rank holds every token from the first.
  const FluxOwnTokens every = flux_own_tokens(FluxStream::Joint, 8, 4, 1, 1);
  EXPECT_EQ(every.own, 12);
  EXPECT_EQ(every.runs[0].whole_first, 0);
  EXPECT_EQ(every.runs[1].whole_first, 4);
}

TEST(FluxTensorParallelSplits, SequenceParallelismNeedsEachStreamToSplit) {
  const FluxConfig config = two_head_config(64);
  testing::ThreadGroup group(kRanks);
  TensorParallel member = group.member(0);
  member.sequence = true;
  const FluxPrecision precision = testing::precision_of(testing::Numbers::Fp32);
  EXPECT_NO_THROW(FluxModel(config, kBatch, kImgTokens, 4, precision, {}, member));
  for (const auto& [img, txt] :
       {std::pair{kImgTokens, int64_t(3)}, std::pair{int64_t(9), int64_t(4)}}) {
    try {
      FluxModel model(config, kBatch, img, txt, precision, {}, member);
      FAIL() << "expected a ConfigError for " << img << " image and " << txt << " text tokens";
    } catch (const ConfigError& error) {
      EXPECT_NE(std::string(error.what()).find("sequence_parallel"), std::string::npos)
          << error.what();
    }
  }
}

}  // namespace
}  // namespace fp8t
