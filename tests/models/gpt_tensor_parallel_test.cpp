// Tensor parallelism of the GPT on the CPU path (models/tensor_parallel.h): two ranks, threads of
// this process that meet in an in-memory group, give the loss and the gradients of one model on
// the whole tensors (fp32), or its loss and its FP8 scales (FP8 linears).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "models/gpt_memory.h"
#include "models/gpt_model.h"
#include "models/recompute_checks.h"
#include "models/tensor_parallel_checks.h"

namespace fp8t {
namespace {

// Three blocks with value embeddings on blocks 0 and 2, grouped-query attention (4 query heads,
// 2 kv heads: one kv head per rank of two).
GptConfig three_block_config(int n_embd) {
  GptConfig config;
  config.n_layer = 3;
  config.n_embd = n_embd;
  config.n_head = 4;
  config.n_kv_head = 2;
  config.vocab_size = 40;
  config.sequence_len = 8;
  config.window_pattern = "SL";
  config.short_window = 2;
  config.pad_vocab_to = 64;
  return config;
}

using Case = testing::RecomputeSetting;
using testing::relative_difference;

// Two ranks (with sequence parallelism or without) against one model.
void expect_two_ranks_give_the_loss_and_gradients_of_one(const Case& setting, bool sequence) {
  // Blockwise's 128x128 tiles need the MLP's shares to be 128 wide.
  const GptConfig config =
      three_block_config(setting.numbers == testing::Numbers::Blockwise ? 128 : 64);
  const GptPrecision precision = testing::precision_of(setting.numbers);
  const bool fp8 = setting.numbers != testing::Numbers::Fp32;
  const int64_t batch = 2, seq = 8, tokens = batch * seq;
  constexpr int kRanks = 2;

  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 generator(seed);
  GptModel whole(config, batch, seq, precision, setting.recompute);
  whole.init_weights(generator());
  // Every gradient path non-zero; the FP8 models nearer their initialization, where they are
  // less sensitive to rounding (see below).
  std::normal_distribution<float> normal(0.0f, fp8 ? 0.05f : 0.3f);
  const std::vector<ParamSpec> params = gpt_parameters(config);
  for (const ParamSpec& spec : params) {
    float* data = whole.parameters()[spec.name].data<float>();
    for (int64_t i = 0; i < spec.numel(); ++i)
      data[i] += normal(generator);
  }
  whole.end_step();
  std::uniform_int_distribution<int32_t> token(0, config.vocab_size - 1);
  std::vector<int32_t> idx(static_cast<size_t>(tokens)), targets(idx.size());
  for (size_t i = 0; i < idx.size(); ++i) {
    idx[i] = token(generator);
    targets[i] = i == 3 ? -1 : token(generator);
  }
  whole.set_record_fp8_health(true);
  const double want_loss = whole.forward(idx.data(), targets.data());
  ASSERT_TRUE(std::isfinite(want_loss));
  whole.backward();

  testing::ThreadGroup group(kRanks);
  const std::vector<std::unique_ptr<GptModel>> ranks =
      testing::ranks_like(group, whole, params, [&](TensorParallel member) {
        member.sequence = sequence;
        return std::make_unique<GptModel>(config, batch, seq, precision, setting.recompute, member);
      });
  if (fp8) {
    int fp8_linears = 0;
    for (const LinearPrecision& decision : ranks[0]->linear_precision())
      fp8_linears += decision.fp8;
    EXPECT_GE(fp8_linears, 3 * 2) << "the MLP's linears of every block";
  }
  std::vector<double> losses(kRanks);
  std::vector<std::vector<Fp8TensorHealth>> health(kRanks);
  testing::run_ranks<GptModel>(ranks, [&](GptModel& model, size_t rank) {
    model.set_record_fp8_health(true);
    losses[rank] = model.forward(idx.data(), targets.data());
    model.backward();
    model.gather_split_gradients();
    health[rank] = model.take_fp8_health();
  });

  EXPECT_EQ(losses[0], losses[1]) << "every rank of the group computes the same loss";
  testing::expect_same_gradients(ranks, params);
  if (!fp8) {  // the same sums in another order (a scalar's gradient, a sum that cancels, the most)
    EXPECT_NEAR(losses[0], want_loss, std::abs(want_loss) * 1e-5);
    for (const ParamSpec& spec : params)
      EXPECT_LT(relative_difference(ranks[0]->gradients()[spec.name].data<float>(),
                                    whole.gradients()[spec.name].data<float>(), spec.numel()),
                1e-3)
          << spec.name;
    return;
  }
  // FP8: a row-parallel output is the sum of the ranks' bf16-rounded shares, not one rounding of
  // the whole, and the casts downstream of such differences round some values the other way;
  // the gradients of so small a model move by tens of percent under perturbations that small
  // (its weights perturbed by 1e-3 do the same), so the loss is compared, and the scales.
  EXPECT_NEAR(losses[0], want_loss, std::abs(want_loss) * 1e-2);
  // Block scales, one per block, are the same on every rank by construction.
  if (setting.numbers == testing::Numbers::Blockwise) return;
  const std::vector<Fp8TensorHealth> want = whole.take_fp8_health();
  ASSERT_EQ(health[0].size(), want.size());
  ASSERT_EQ(health[1].size(), want.size());
  const bool tensorwise = setting.numbers == testing::Numbers::Tensorwise;
  for (size_t i = 0; i < want.size(); ++i) {
    SCOPED_TRACE(want[i].layer + "." + tensor_role_name(want[i].role));
    const float scale = health[0][i].health.scale;
    EXPECT_EQ(health[1][i].health.scale, scale) << "the ranks cast a tensor with different scales";
    if (!tensorwise) continue;
    // A weight's shares together are the whole weight: the group's amax is its amax exactly.
    if (want[i].role == TensorRole::Weight) {
      EXPECT_EQ(scale, want[i].health.scale);
    }
    if (want[i].role == TensorRole::Input) {
      EXPECT_NEAR(scale, want[i].health.scale, want[i].health.scale * 0.1);
    }
  }
}

class GptTensorParallel : public ::testing::TestWithParam<Case> {};

TEST_P(GptTensorParallel, TwoRanksGiveTheLossAndGradientsOfOne) {
  expect_two_ranks_give_the_loss_and_gradients_of_one(GetParam(), false);
}

INSTANTIATE_TEST_SUITE_P(
    GptModel, GptTensorParallel,
    ::testing::Values(Case{testing::Numbers::Fp32, {}},
                      Case{testing::Numbers::Fp32, {RecomputeGranularity::Full}},
                      Case{testing::Numbers::Delayed, {}}, Case{testing::Numbers::Tensorwise, {}},
                      Case{testing::Numbers::Tensorwise, {RecomputeGranularity::Selective}},
                      Case{testing::Numbers::Blockwise, {}}),
    testing::test_name);

// Each rank keeps half of the 16 rows outside the split linears; the ignored target (row 3) sits
// in the first rank's half, so the ranks count 7 and 8 rows of the mean.
class GptSequenceParallel : public ::testing::TestWithParam<Case> {};

TEST_P(GptSequenceParallel, TwoRanksGiveTheLossAndGradientsOfOne) {
  expect_two_ranks_give_the_loss_and_gradients_of_one(GetParam(), true);
}

INSTANTIATE_TEST_SUITE_P(
    GptModel, GptSequenceParallel,
    ::testing::Values(Case{testing::Numbers::Fp32, {}},
                      Case{testing::Numbers::Fp32, {RecomputeGranularity::Full}},
                      Case{testing::Numbers::Fp32, {RecomputeGranularity::Selective}},
                      Case{testing::Numbers::Delayed, {}}, Case{testing::Numbers::Tensorwise, {}},
                      Case{testing::Numbers::Blockwise, {}}),
    testing::test_name);

TEST(GptTensorParallelSplits, HeadsAndHiddenFeaturesMustSplitEvenly) {
  GptConfig config = three_block_config(64);
  EXPECT_NO_THROW(check_tensor_parallel(config, 2));
  for (int size : {0, 3, 4}) {  // 4: more ranks than kv heads
    try {
      check_tensor_parallel(config, size);
      FAIL() << "expected a ConfigError for " << size << " ranks";
    } catch (const ConfigError& error) {
      EXPECT_NE(std::string(error.what()).find("tensor_model_parallel_size"), std::string::npos)
          << error.what();
    }
  }
}

TEST(GptTensorParallelSplits, ABlockRecipesShareOutsideWholeBlocksStaysInBf16) {
  // Blockwise at 128 features: the query projection's share (64 of 128 outputs) is not made of
  // 128x128 tiles; the MLP's shares (256 hidden features each) are.
  const GptConfig config = three_block_config(128);
  testing::ThreadGroup group(2);
  const GptModel model(config, 1, 8, testing::precision_of(testing::Numbers::Blockwise), {},
                       group.member(0));
  for (const LinearPrecision& decision : model.linear_precision()) {
    if (decision.linear.name == "transformer.h.1.attn.c_q") {
      EXPECT_FALSE(decision.fp8);
      EXPECT_NE(decision.reason.find("tensor-parallel"), std::string::npos) << decision.reason;
    }
    if (decision.linear.name == "transformer.h.1.mlp.c_fc") {
      EXPECT_TRUE(decision.fp8);
    }
  }
}

TEST(GptTensorParallelSplits, EachRankHoldsTheActivationsOfItsShare) {
  const GptConfig config = three_block_config(64);
  const int64_t batch = 2, seq = 8, tokens = batch * seq;
  testing::ThreadGroup group(2);
  const GptModel model(config, batch, seq, testing::precision_of(testing::Numbers::Fp32), {},
                       group.member(1));
  const BlockActivations& block = model.activations().blocks[0];
  EXPECT_EQ(block.q.numel(), tokens * 2 * config.head_dim());  // 2 of the 4 query heads
  EXPECT_EQ(block.v.numel(), tokens * 1 * config.head_dim());  // 1 of the 2 kv heads
  EXPECT_EQ(block.attn_out.numel(), tokens * config.n_embd / 2);
  EXPECT_EQ(block.fc.numel(), tokens * 4 * config.n_embd / 2);
  EXPECT_EQ(block.input.numel(), tokens * config.n_embd);  // the residual stream is whole

  const GptMemoryPlan whole = plan_gpt_memory(config, batch, seq);
  const GptMemoryPlan share = plan_gpt_memory(config, batch, seq, {}, 2);
  EXPECT_EQ(share.parameters, whole.parameters);  // weights stay whole on every rank
  EXPECT_LT(share.activations, whole.activations);
  EXPECT_LT(share.workspace, whole.workspace);
}

TEST(GptTensorParallelSplits, ASequenceParallelRankHoldsItsRowsOfTheResidualStream) {
  const GptConfig config = three_block_config(64);
  const int64_t batch = 2, seq = 8, tokens = batch * seq;
  testing::ThreadGroup group(2);
  TensorParallel member = group.member(1);
  member.sequence = true;
  const GptModel model(config, batch, seq, testing::precision_of(testing::Numbers::Fp32), {},
                       member);
  const GptActivations& act = model.activations();
  const BlockActivations& block = act.blocks[0];
  EXPECT_EQ(block.input.numel(), tokens / 2 * config.n_embd);
  EXPECT_EQ(block.attn_norm.numel(), tokens / 2 * config.n_embd);
  EXPECT_EQ(block.mlp_rstd.numel(), tokens / 2);
  EXPECT_EQ(block.output.numel(), tokens / 2 * config.n_embd);
  EXPECT_EQ(act.x0.numel(), tokens / 2 * config.n_embd);
  EXPECT_EQ(act.logits.numel(), tokens / 2 * config.padded_vocab());
  EXPECT_EQ(block.q.numel(), tokens * 2 * config.head_dim());  // every row of its 2 heads
  EXPECT_EQ(act.embedding.numel(), tokens * config.n_embd);    // the smear reads every row

  const GptMemoryPlan plain = plan_gpt_memory(config, batch, seq, {}, 2);
  const GptMemoryPlan sequence = plan_gpt_memory(config, batch, seq, {}, 2, true);
  EXPECT_EQ(GptActivations::planned_bytes(config, batch, seq, DType::F32, {}, 2, true),
            sequence.activations);
  EXPECT_LT(sequence.activations, plain.activations);

  // 7 rows do not split over 2 ranks, and a group of one has no ranks to split them over.
  testing::ThreadGroup alone(1);
  TensorParallel single = alone.member(0);
  single.sequence = true;
  for (const auto& [rows, ranks] : {std::pair{int64_t(7), member}, std::pair{int64_t(8), single}}) {
    try {
      const GptModel refused(config, 1, rows, testing::precision_of(testing::Numbers::Fp32), {},
                             ranks);
      FAIL() << "expected a ConfigError for " << rows << " rows over " << ranks.size << " ranks";
    } catch (const ConfigError& error) {
      EXPECT_NE(std::string(error.what()).find("sequence_parallel"), std::string::npos)
          << error.what();
    }
  }
}

}  // namespace
}  // namespace fp8t
