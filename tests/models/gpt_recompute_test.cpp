// Activation recompute (models/recompute.h) on the GPT's CPU path: the groups each setting
// reruns, and a model with recompute giving exactly the losses, gradients, FP8 scaling state
// and FP8 health counts of one without it, with less activation memory.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"
#include "models/gpt_memory.h"
#include "models/gpt_model.h"
#include "models/recompute.h"
#include "models/recompute_checks.h"

namespace fp8t {
namespace {

RecomputeOptions full(RecomputeMethod method, int num_layers) {
  return {RecomputeGranularity::Full, method, num_layers};
}

std::vector<std::pair<int, int>> bounds(const std::vector<RecomputeGroup>& groups) {
  std::vector<std::pair<int, int>> out;
  for (const RecomputeGroup& group : groups)
    out.emplace_back(group.first, group.end);
  return out;
}

TEST(RecomputeGroups, UniformCoversEveryBlockInGroupsBlockTakesTheFirstOnes) {
  using Bounds = std::vector<std::pair<int, int>>;
  EXPECT_EQ(bounds(recompute_groups(full(RecomputeMethod::Uniform, 2), 5)),
            (Bounds{{0, 2}, {2, 4}, {4, 5}}));
  EXPECT_EQ(bounds(recompute_groups(full(RecomputeMethod::Uniform, 1), 3)),
            (Bounds{{0, 1}, {1, 2}, {2, 3}}));
  EXPECT_EQ(bounds(recompute_groups(full(RecomputeMethod::Uniform, 9), 3)), (Bounds{{0, 3}}));
  EXPECT_EQ(bounds(recompute_groups(full(RecomputeMethod::Block, 2), 5)), (Bounds{{0, 1}, {1, 2}}));
  EXPECT_TRUE(
      recompute_groups({RecomputeGranularity::Selective, RecomputeMethod::Uniform, 2}, 5).empty());
  EXPECT_TRUE(recompute_groups({}, 5).empty());

  const std::vector<RecomputeGroup> groups = recompute_groups(full(RecomputeMethod::Uniform, 2), 5);
  EXPECT_EQ(recompute_slots(groups, 5), (std::vector<int>{0, 1, 0, 1, 0}));
  EXPECT_EQ(recompute_slot_count(groups), 2);
  EXPECT_EQ(recompute_slots(recompute_groups(full(RecomputeMethod::Block, 2), 4), 4),
            (std::vector<int>{0, 0, -1, -1}));
  EXPECT_EQ(recompute_group_starting_at(groups, 2), 1);
  EXPECT_EQ(recompute_group_starting_at(groups, 3), -1);
  EXPECT_EQ(recompute_group_ending_at(groups, 3), 1);
  EXPECT_EQ(recompute_group_ending_at(groups, 2), -1);
  EXPECT_EQ(recompute_group_ending_at(recompute_groups(full(RecomputeMethod::Block, 1), 3), 2), -1);
  EXPECT_EQ(recompute_saved_sets(groups, 5), 2);  // every block in a group: the two places
  EXPECT_EQ(recompute_saved_sets(recompute_groups(full(RecomputeMethod::Block, 2), 5), 5), 4);
}

TEST(RecomputeGroups, ABadLayerCountNamesTheKey) {
  for (const RecomputeOptions& options :
       {full(RecomputeMethod::Uniform, 0), full(RecomputeMethod::Block, 6)}) {
    try {
      recompute_groups(options, 5);
      FAIL() << "expected a ConfigError for " << options.num_layers;
    } catch (const ConfigError& error) {
      EXPECT_NE(std::string(error.what()).find("recompute_num_layers"), std::string::npos)
          << error.what();
    }
  }
}

// Five blocks: the backout layer (2) sits inside groups of 4 and at a group's start with groups
// of 2; value embeddings on blocks 0, 2 and 4.
GptConfig five_block_config(int n_embd) {
  GptConfig config;
  config.n_layer = 5;
  config.n_embd = n_embd;
  config.n_head = n_embd / 16;
  config.n_kv_head = 1;
  config.vocab_size = 40;
  config.sequence_len = 8;
  config.window_pattern = "SL";
  config.short_window = 2;
  config.pad_vocab_to = 64;
  return config;
}

using testing::name_of;
using testing::Numbers;
using testing::precision_of;

using Setting = testing::RecomputeSetting;
using testing::test_name;

class GptRecompute : public ::testing::TestWithParam<Setting> {};

// Two training steps of each model on the same weights and tokens, an update between them as
// an optimizer makes, with FP8 health counted on the second.
TEST_P(GptRecompute, GivesTheLossesGradientsAndFp8StateOfARunWithoutIt) {
  const Setting setting = GetParam();
  // Blockwise's 128x128 weight blocks need 128-wide linears.
  const GptConfig config = five_block_config(setting.numbers == Numbers::Blockwise ? 128 : 32);
  const GptPrecision precision = precision_of(setting.numbers);
  const int64_t batch = 2, seq = 8, tokens = batch * seq;
  GptModel plain(config, batch, seq, precision);
  GptModel recomputing(config, batch, seq, precision, setting.recompute);
  if (setting.numbers != Numbers::Fp32) {
    int fp8_linears = 0;
    for (const LinearPrecision& decision : recomputing.linear_precision())
      fp8_linears += decision.fp8;
    ASSERT_GE(fp8_linears, 5 * 4);  // c_k and c_v may be too narrow for the recipe
  }

  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 generator(seed);
  plain.init_weights(generator());
  std::normal_distribution<float> normal(0.0f, 0.3f);
  for (const ParamSpec& spec : gpt_parameters(config)) {  // every gradient path non-zero
    float* data = plain.parameters()[spec.name].data<float>();
    for (int64_t i = 0; i < spec.numel(); ++i)
      data[i] += normal(generator);
  }
  const auto copy_weights = [&] {
    for (const ParamSpec& spec : gpt_parameters(config)) {
      std::memcpy(recomputing.parameters()[spec.name].raw(), plain.parameters()[spec.name].raw(),
                  plain.parameters()[spec.name].bytes());
    }
  };
  copy_weights();
  plain.end_step();
  recomputing.end_step();

  std::uniform_int_distribution<int32_t> token(0, config.vocab_size - 1);
  std::vector<int32_t> idx(static_cast<size_t>(tokens)), targets(idx.size());
  for (int step = 1; step <= 2; ++step) {
    SCOPED_TRACE(::testing::Message() << "step " << step);
    for (size_t i = 0; i < idx.size(); ++i) {
      idx[i] = token(generator);
      targets[i] = step == 2 && i == 3 ? -1 : token(generator);
    }
    plain.set_record_fp8_health(step == 2);
    recomputing.set_record_fp8_health(step == 2);
    const double plain_loss = plain.forward(idx.data(), targets.data());
    const double loss = recomputing.forward(idx.data(), targets.data());
    ASSERT_TRUE(std::isfinite(plain_loss));
    EXPECT_EQ(loss, plain_loss);
    plain.zero_gradients();
    recomputing.zero_gradients();
    plain.backward();
    recomputing.backward();
    for (const ParamSpec& spec : gpt_parameters(config)) {
      const TensorView& expected = plain.gradients()[spec.name];
      const TensorView& actual = recomputing.gradients()[spec.name];
      double norm = 0.0;
      for (int64_t i = 0; i < expected.numel(); ++i)
        norm += std::abs(expected.data<float>()[i]);
      EXPECT_GT(norm, 0.0) << spec.name << ": a gradient that cannot differ";
      EXPECT_EQ(std::memcmp(actual.raw(), expected.raw(), expected.bytes()), 0) << spec.name;
    }
    if (step == 2 && setting.numbers != Numbers::Fp32)
      testing::expect_same_fp8_health(plain.take_fp8_health(), recomputing.take_fp8_health());
    // The update an optimizer would make, the same on both.
    for (const ParamSpec& spec : gpt_parameters(config)) {
      float* weights = plain.parameters()[spec.name].data<float>();
      const float* grad = plain.gradients()[spec.name].data<float>();
      for (int64_t i = 0; i < spec.numel(); ++i)
        weights[i] -= 0.01f * std::copysign(1.0f, grad[i]);
    }
    copy_weights();
    plain.end_step();
    recomputing.end_step();
  }
  testing::expect_same_delayed_scalings(plain.delayed_scalings(), recomputing.delayed_scalings());
  if (setting.numbers == Numbers::Delayed) {
    EXPECT_FALSE(plain.delayed_scalings().empty());
  }
}

std::vector<Setting> settings() {
  std::vector<Setting> out;
  const std::vector<RecomputeOptions> recomputes = {
      {RecomputeGranularity::Selective, RecomputeMethod::Uniform, 1},
      full(RecomputeMethod::Uniform, 1),
      full(RecomputeMethod::Uniform, 2),
      full(RecomputeMethod::Uniform, 4),
      full(RecomputeMethod::Block, 1),
      full(RecomputeMethod::Block, 3),
  };
  for (Numbers numbers : {Numbers::Fp32, Numbers::Delayed, Numbers::Tensorwise, Numbers::Blockwise})
    for (const RecomputeOptions& recompute : recomputes)
      out.push_back({numbers, recompute});
  out.push_back({Numbers::DelayedFp8Attention, full(RecomputeMethod::Uniform, 2)});
  out.push_back({Numbers::DelayedFp8Attention,
                 {RecomputeGranularity::Selective, RecomputeMethod::Uniform, 1}});
  return out;
}

INSTANTIATE_TEST_SUITE_P(GptModel, GptRecompute, ::testing::ValuesIn(settings()), test_name);

// The saved activations of d12 at nanochat's micro-batch: each setting saves less than the one
// before it, and full recompute of one block at a time keeps little more than the blocks'
// outputs.
TEST(GptRecomputeMemory, EachSettingSavesLess) {
  GptConfig config;
  config.n_layer = 12;
  config.n_embd = 768;
  config.n_head = 6;
  config.n_kv_head = 6;
  config.vocab_size = 32768;
  const int64_t batch = 4, seq = 2048;
  const auto bytes = [&](const RecomputeOptions& recompute) {
    return GptActivations::planned_bytes(config, batch, seq, DType::F32, recompute);
  };
  const size_t none = bytes({});
  const size_t selective = bytes({RecomputeGranularity::Selective, RecomputeMethod::Uniform, 1});
  const size_t block_half = bytes(full(RecomputeMethod::Block, 6));
  const size_t uniform_one = bytes(full(RecomputeMethod::Uniform, 1));
  EXPECT_LT(selective, none);
  EXPECT_LT(block_half, none);
  EXPECT_LT(uniform_one, block_half);
  EXPECT_LT(uniform_one, selective);
  // What stays with one block at a time: the embedding's tensors, each block's output, one
  // block's activations and the logits.
  const size_t tokens_bytes = size_t(batch * seq) * sizeof(float);
  const size_t logits = tokens_bytes * size_t(config.padded_vocab());
  EXPECT_LT(uniform_one - logits, tokens_bytes * size_t(config.n_embd) * (12 + 30));
  EXPECT_EQ(plan_gpt_memory(config, batch, seq, full(RecomputeMethod::Uniform, 1)).activations,
            uniform_one);
}

}  // namespace
}  // namespace fp8t
