// The Flux memory plan against facts counted by hand from the shapes; the GPU test
// (flux_memory_gpu_test.cpp) compares it with what the GPU model allocates.
#include "models/flux_memory.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <optional>
#include <utility>

#include "core/error.h"
#include "models/flux_model.h"

namespace fp8t {
namespace {

constexpr size_t kBf16 = 2, kFloat = 4;

FluxPrecision precision_for(Fp8Mode mode, ScalingRecipe recipe = ScalingRecipe::Tensorwise) {
  FluxPrecision precision;
  precision.fp8.mode = mode;
  precision.fp8.recipe = recipe;
  precision.policy.mode = mode;
  precision.policy.recipe = recipe;
  return precision;
}

const FluxPrecision kBf16Precision = precision_for(Fp8Mode::None);

// W-FLUX535's tokens: at hidden 3072 every tensor of these shapes is a multiple of the arenas'
// 256 bytes, so no piece is padded and the counts below are exact.
FluxMicroBatch micro_batch(int64_t batch) {
  return {.batch = batch, .img_tokens = 4096, .txt_tokens = 512};
}

TEST(FluxMemory, MasterWeightsAndGradientsAreFp32) {
  // Every tensor of flux_535m and flux_12b holds a multiple of 64 floats: no alignment gaps.
  for (const char* name : {"flux_535m", "flux_12b"}) {
    const FluxConfig config = FluxConfig::preset(name);
    const FluxMemoryPlan plan = plan_flux_memory(config, micro_batch(1), kBf16Precision);
    EXPECT_EQ(plan.parameters, kFloat * size_t(flux_parameter_count(config))) << name;
    EXPECT_EQ(plan.gradients, plan.parameters) << name;
  }
  // flux_tiny's 32-float norm scales and 16-float final bias are padded to 64 floats each.
  const FluxConfig tiny = FluxConfig::preset("flux_tiny");
  const FluxMemoryPlan plan = plan_flux_memory(tiny, micro_batch(1), kBf16Precision);
  EXPECT_GT(plan.parameters, kFloat * size_t(flux_parameter_count(tiny)));
  EXPECT_EQ(plan.parameters % 256, 0u);
}

TEST(FluxMemory, AdamWMomentsAreShardedOverTheGpusAndNothingElseIs) {
  const FluxConfig config = FluxConfig::preset("flux_535m");
  const FluxMemoryPlan one = plan_flux_memory(config, micro_batch(4), kBf16Precision, 1);
  EXPECT_EQ(one.optimizer_state, 2 * one.parameters);  // exp_avg and exp_avg_sq
  // 535 318 336 floats over 2 GPUs: 267 659 168 each, rounded up to 64 floats (256 bytes);
  // over 8: 66 914 792, rounded up likewise.
  ASSERT_EQ(flux_parameter_count(config), 535'318'336);
  const FluxMemoryPlan two = plan_flux_memory(config, micro_batch(4), kBf16Precision, 2);
  EXPECT_EQ(two.optimizer_state, 2 * kFloat * 267'659'200u);
  const FluxMemoryPlan eight = plan_flux_memory(config, micro_batch(4), kBf16Precision, 8);
  EXPECT_EQ(eight.optimizer_state, 2 * kFloat * 66'914'816u);
  for (const FluxMemoryPlan& plan : {two, eight}) {
    EXPECT_EQ(plan.parameters, one.parameters);
    EXPECT_EQ(plan.gradients, one.gradients);
    EXPECT_EQ(plan.activations, one.activations);
    EXPECT_EQ(plan.workspace, one.workspace);
    EXPECT_EQ(plan.linear_copies, one.linear_copies);
    EXPECT_EQ(plan.total(), one.total() - (one.optimizer_state - plan.optimizer_state));
  }
}

TEST(FluxMemory, ActivationsScaleLinearlyWithTheBatch) {
  const FluxConfig config = FluxConfig::preset("flux_535m");
  const FluxMemoryPlan one = plan_flux_memory(config, micro_batch(1), kBf16Precision);
  for (const int64_t batch : {2, 3, 16}) {
    const FluxMemoryPlan plan = plan_flux_memory(config, micro_batch(batch), kBf16Precision);
    EXPECT_EQ(plan.activations, size_t(batch) * one.activations) << batch;
    EXPECT_GT(plan.workspace, one.workspace) << batch;
    EXPECT_EQ(plan.parameters, one.parameters) << batch;
  }
}

TEST(FluxMemory, EachBlockSavesItsStreamsAndItsAttention) {
  const size_t B = 2, Li = 4096, Lt = 512, L = Li + Lt, N = B * L;
  const size_t C = 3072, M = 4 * C, H = 24;
  // The joint attention: q, k, v, q and k before scale and rotation, and the output in bf16;
  // q's and k's rstd per head and the softmax statistics in fp32.
  const size_t attention = 6 * kBf16 * N * C + 2 * kFloat * N * H + kFloat * B * H * L;
  // A double-block stream of r rows: its 6 modulation chunks, 7 [r, C] tensors (norm1,
  // modulated1, attn, proj, norm2, modulated2, mlp_out), 2 rstd, and the MLP's 2 [r, M].
  const auto stream = [&](size_t rows) {
    return kBf16 * B * 6 * C + 7 * kBf16 * rows * C + 2 * kFloat * rows + 2 * kBf16 * rows * M;
  };
  const size_t double_block = stream(B * Li) + stream(B * Lt) + attention;
  // A single block: 3 chunks, normed, modulated, rstd, linear1's [N, 3C + M] output, linear2's
  // [N, C + M] input and its [N, C] output.
  const size_t single_block = kBf16 * B * 3 * C + 2 * kBf16 * N * C + kFloat * N +
                              kBf16 * N * (3 * C + M) + attention + kBf16 * N * (C + M) +
                              kBf16 * N * C;

  const FluxConfig base = FluxConfig::preset("flux_535m");
  FluxConfig more_double = base, more_single = base;
  more_double.double_blocks = 3;
  more_single.single_blocks = 4;
  const size_t activations = plan_flux_memory(base, micro_batch(2), kBf16Precision).activations;
  EXPECT_EQ(plan_flux_memory(more_double, micro_batch(2), kBf16Precision).activations,
            activations + 2 * double_block);
  EXPECT_EQ(plan_flux_memory(more_single, micro_batch(2), kBf16Precision).activations,
            activations + 3 * single_block);
}

TEST(FluxMemory, SelectiveRecomputeSharesGeluOutputsAmongTheBlocks) {
  const size_t B = 2, Li = 4096, Lt = 512, N = B * (Li + Lt), C = 3072, M = 4 * C;
  // Each double block's two streams save no [rows, M] GELU output, each single block no
  // [N, C + M] linear2 input; one buffer of each, for the longer stream and the joint
  // sequence, serves every block.
  const auto saved = [&](int doubles, int singles) {
    return size_t(doubles) * kBf16 * B * (Li + Lt) * M + size_t(singles) * kBf16 * N * (C + M);
  };
  const size_t shared = kBf16 * B * Li * M + kBf16 * N * (C + M);
  for (const auto& [doubles, singles] : {std::pair{1, 1}, std::pair{3, 4}}) {
    FluxConfig config = FluxConfig::preset("flux_535m");
    config.double_blocks = doubles;
    config.single_blocks = singles;
    const size_t none = plan_flux_memory(config, micro_batch(2), kBf16Precision).activations;
    const size_t selective = plan_flux_memory(config, micro_batch(2), kBf16Precision, 1,
                                              {RecomputeGranularity::Selective})
                                 .activations;
    EXPECT_EQ(selective + saved(doubles, singles), none + shared) << doubles << " + " << singles;
  }
}

TEST(FluxMemory, Bf16LinearsKeepEveryWeightAndBiasInBf16) {
  const FluxConfig config = FluxConfig::preset("flux_12b");
  // Everything but the QK-norm scales belongs to a linear: two scales of head_dim per stream of
  // a double block (2 streams) and per single block.
  const int64_t norm_scales =
      2 * 128 * (2 * int64_t{config.double_blocks} + int64_t{config.single_blocks});
  const FluxMemoryPlan plan = plan_flux_memory(config, micro_batch(1), kBf16Precision);
  EXPECT_EQ(plan.linear_copies, kBf16 * size_t(flux_parameter_count(config) - norm_scales));
}

TEST(FluxMemory, Fp8TensorwiseAddsOnlyTheSharedQuantizationScratch) {
  const FluxConfig config = FluxConfig::preset("flux_12b");
  const FluxMemoryPlan bf16 = plan_flux_memory(config, micro_batch(1), kBf16Precision);
  const FluxMemoryPlan fp8 =
      plan_flux_memory(config, micro_batch(1), precision_for(Fp8Mode::Hybrid));
  // All 8 block linears of each double block and 2 of each single block run in FP8: each keeps
  // Ŵ and Ŵᵗ, a byte per weight each, as many bytes as the bf16 copy it replaces. What is added:
  // 12 scaling floats and 3 FP8 health counters (16 bytes each) per FP8 linear, x̂ [T, C + M]
  // (linear2's input is the widest) over the joint sequence's T = 4608 rows, and the backward's
  // x̂ᵗ, dŷ and dŷᵗ of [T, M] each (the MLP's width: linear1 and linear2 run their backward in
  // chunks of rows).
  const size_t fp8_linears = 8 * 19 + 2 * 38;
  const auto aligned = [](size_t bytes) { return (bytes + 255) / 256 * 256; };
  const size_t scaling = aligned(fp8_linears * 12 * kFloat) + aligned(fp8_linears * 3 * 16);
  const size_t T = 4608, C = 3072, M = 4 * C;
  EXPECT_EQ(fp8.linear_copies, bf16.linear_copies + scaling + T * (C + M) + 3 * T * M);
  // FP8 linears save nothing beside the bf16 activations.
  EXPECT_EQ(fp8.activations, bf16.activations);
  EXPECT_EQ(fp8.workspace, bf16.workspace);
  EXPECT_EQ(fp8.optimizer_state, bf16.optimizer_state);
}

TEST(FluxMemory, WeightTransposesMadeInBackwardSaveAByteAWeight) {
  const FluxConfig config = FluxConfig::preset("flux_12b");
  FluxPrecision in_backward = precision_for(Fp8Mode::Hybrid);
  in_backward.fp8_weight_transposes = ops::WeightTransposes::InBackward;
  const FluxMemoryPlan kept =
      plan_flux_memory(config, micro_batch(1), precision_for(Fp8Mode::Hybrid));
  const FluxMemoryPlan made = plan_flux_memory(config, micro_batch(1), in_backward);
  // The FP8 linears' weights, C = 3072 and M = 4C: a double block's two streams each hold qkv
  // (3C²), proj (C²), mlp.0 and mlp.2 (4C² each); a single block linear1 ([3C + M, C]: 7C²) and
  // linear2 ([C, C + M]: 5C²). 19 double and 38 single blocks: 19·24C² + 38·12C² = 912C² Ŵᵗ
  // bytes are no longer kept; the shared scratch holds the largest, linear1's 7C².
  const size_t C2 = size_t{3072} * 3072;
  EXPECT_EQ(kept.linear_copies - made.linear_copies, 912 * C2 - 7 * C2);
  EXPECT_EQ(made.activations, kept.activations);
  EXPECT_EQ(made.parameters, kept.parameters);
  // Blockwise also drops each Ŵᵗ's 128x128 scales and adds the largest grid to the scratch.
  FluxPrecision blockwise = precision_for(Fp8Mode::Hybrid, ScalingRecipe::Blockwise);
  const size_t blockwise_kept = plan_flux_memory(config, micro_batch(1), blockwise).linear_copies;
  blockwise.fp8_weight_transposes = ops::WeightTransposes::InBackward;
  EXPECT_GT(blockwise_kept - plan_flux_memory(config, micro_batch(1), blockwise).linear_copies,
            905 * C2);
}

TEST(FluxMemory, BlockRecipesAddScalesToTheTensorwiseCopies) {
  const FluxConfig config = FluxConfig::preset("flux_535m");
  const size_t tensorwise =
      plan_flux_memory(config, micro_batch(1), precision_for(Fp8Mode::Hybrid)).linear_copies;
  for (const ScalingRecipe recipe : {ScalingRecipe::Blockwise, ScalingRecipe::Mxfp8}) {
    const FluxMemoryPlan plan =
        plan_flux_memory(config, micro_batch(1), precision_for(Fp8Mode::Hybrid, recipe));
    EXPECT_GT(plan.linear_copies, tensorwise) << recipe_name(recipe);
  }
}

TEST(FluxMemory, LargestFittingModelKeepsTheRatioOfBlocks) {
  const FluxConfig config = FluxConfig::preset("flux_12b");
  const FluxPrecision precision = precision_for(Fp8Mode::Hybrid);
  const auto capacity = static_cast<size_t>(kH200MemoryGib * double(1 << 30));
  const auto fits = [&](const FluxConfig& candidate, int gpus) {
    const FluxMemoryPlan plan = plan_flux_memory(candidate, micro_batch(1), precision, gpus);
    return flux_fits(candidate, micro_batch(1), plan, capacity);
  };
  ASSERT_FALSE(fits(config, 1));  // 12B parameters: 16 bytes each in weights, gradients, moments

  const std::optional<FluxConfig> largest =
      largest_fitting_flux(config, micro_batch(1), precision, 1, capacity);
  ASSERT_TRUE(largest.has_value());
  EXPECT_TRUE(fits(*largest, 1));
  EXPECT_LT(largest->double_blocks, config.double_blocks);
  EXPECT_EQ(largest->single_blocks, 2 * largest->double_blocks);  // 19 : 38
  FluxConfig one_more = *largest;
  one_more.double_blocks += 1;
  one_more.single_blocks += 2;
  EXPECT_FALSE(fits(one_more, 1));

  // A model that fits comes back whole; one that cannot fit even one block: none.
  const std::optional<FluxConfig> whole =
      largest_fitting_flux(config, micro_batch(1), precision, 1, size_t{1} << 50);
  ASSERT_TRUE(whole.has_value());
  EXPECT_EQ(whole->double_blocks, 19);
  EXPECT_EQ(whole->single_blocks, 38);
  EXPECT_FALSE(largest_fitting_flux(config, micro_batch(1), precision, 1, size_t{8} << 30));
}

TEST(FluxMemory, TensorParallelRanksHoldTheirSharesOfTheSplitTensors) {
  const FluxConfig config = FluxConfig::preset("flux_535m");
  // Split, in pairs: per double-block stream the modulation, qkv and mlp.0 with their biases,
  // proj and mlp.2; the single block's modulation and linear1 with their biases and linear2; the
  // final layer's modulation with its bias: 500 287 488 of the 535 318 336 parameters, each rank
  // holding half of them and the other 35 030 848 whole.
  constexpr size_t kRankParameters = 535'318'336u - 500'287'488u / 2;
  for (int rank = 0; rank < 2; ++rank) {
    const FluxRankParameters held = flux_rank_parameters(config, 2, rank);
    int64_t numel = 0;
    for (const FluxParam& param : held.parameters)
      numel += param.numel();
    EXPECT_EQ(size_t(numel), kRankParameters) << "rank " << rank;
    // The double block's 10 split weights and 6 column-parallel biases, the single block's 3 and
    // 2, the final layer's 1 and 1.
    EXPECT_EQ(held.shares, 23u);
    EXPECT_EQ(held.parameters.size(), flux_parameters(config).size());
  }
  const FluxMemoryPlan pairs = plan_flux_memory(config, micro_batch(1), kBf16Precision, 2, {}, 2);
  EXPECT_EQ(pairs.parameters, kFloat * kRankParameters);
  EXPECT_EQ(pairs.gradients, pairs.parameters);
  EXPECT_EQ(pairs.optimizer_state, 2 * pairs.parameters);  // one replica: no ZeRO-1
  // Two replicas of a pair: ZeRO-1 halves each rank's moments, 142 587 296 floats rounded up to
  // 64 (256 bytes).
  const FluxMemoryPlan four = plan_flux_memory(config, micro_batch(1), kBf16Precision, 4, {}, 2);
  EXPECT_EQ(four.optimizer_state, 2 * kFloat * 142'587'328u);
  EXPECT_THROW(plan_flux_memory(config, micro_batch(1), kBf16Precision, 1, {}, 2), Error);
  EXPECT_THROW(plan_flux_memory(config, micro_batch(1), kBf16Precision, 3, {}, 2), Error);
}

TEST(FluxMemory, SequenceParallelRanksHoldTheirTokensOfTheResidualStreams) {
  const FluxConfig config = FluxConfig::preset("flux_535m");
  const FluxMemoryPlan plain = plan_flux_memory(config, micro_batch(1), kBf16Precision, 2, {}, 2);
  const FluxMemoryPlan split =
      plan_flux_memory(config, micro_batch(1), kBf16Precision, 2, {}, 2, true);
  EXPECT_EQ(split.parameters, plain.parameters);
  EXPECT_EQ(split.linear_copies, plain.linear_copies);
  // Half of the 4096 image and 512 text tokens leave each rank (bf16, fp32 statistics): the
  // inputs of img_in (64 channels) and txt_in (4096), the double block's six [rows, 3072] stream
  // tensors and two rstd per stream, the single block's normed, modulated and output tensors and
  // rstd, the final layer's normed and modulated tensors and rstd.
  const size_t saved = kBf16 * (2048 * 64 + 256 * 4096) + kBf16 * 6 * (2048 + 256) * 3072 +
                       kFloat * 2 * (2048 + 256) + kBf16 * 3 * 2304 * 3072 + kFloat * 2304 +
                       kBf16 * 2 * 2048 * 3072 + kFloat * 2048;
  EXPECT_EQ(plain.activations - split.activations, saved);
  // The residual streams, their gradients and a branch's gradient (d_branch) halve; the staging
  // and the gathered tokens [4608, 3072], a summed gradient's own tokens [2304, 3072] and the
  // final layer's own output [2048, 64] come in.
  const size_t halved = kBf16 * (2 * (2048 + 256 + 2304) + 2304) * 3072;
  const size_t added = kBf16 * (2 * 4608 * 3072 + 2304 * 3072 + 2048 * 64);
  EXPECT_EQ(split.workspace + halved, plain.workspace + added);
  // 4095 image tokens do not split over a pair.
  EXPECT_THROW(plan_flux_memory(config, {.batch = 1, .img_tokens = 4095, .txt_tokens = 512},
                                kBf16Precision, 2, {}, 2, true),
               ConfigError);
}

TEST(FluxMemory, FitsWhenThePlanAndTheRuntimeReserveDo) {
  const FluxConfig config = FluxConfig::preset("flux_535m");
  const FluxMemoryPlan plan = plan_flux_memory(config, micro_batch(4), kBf16Precision);
  // 1 GiB, and cuDNN's attention workspace: 4 bytes per token and hidden unit.
  const size_t reserve = flux_runtime_reserve_bytes(config, micro_batch(4));
  EXPECT_EQ(reserve, (size_t{1} << 30) + 4 * 4 * (4096 + 512) * 3072);
  EXPECT_TRUE(flux_fits(config, micro_batch(4), plan, plan.total() + reserve));
  EXPECT_FALSE(flux_fits(config, micro_batch(4), plan, plan.total() + reserve - 1));
}

TEST(FluxMemory, RejectsEmptyBatchesAndNoGpu) {
  const FluxConfig config = FluxConfig::preset("flux_tiny");
  EXPECT_THROW(plan_flux_memory(config, {.batch = 0}, kBf16Precision), Error);
  EXPECT_THROW(plan_flux_memory(config, micro_batch(1), kBf16Precision, 0), Error);
}

}  // namespace
}  // namespace fp8t
