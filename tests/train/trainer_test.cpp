#include "train/trainer.h"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/token_shard.h"
#include "io/safetensors.h"
#include "test_files.h"
#include "tokenizer/bpe_tokenizer.h"
#include "train/checkpoint.h"
#include "train/trainer_fixture.h"
#include "train/training_engine.h"

namespace fp8t::train {
namespace {

namespace fs = std::filesystem;
using test::error_message;
using ::testing::HasSubstr;

// Depth 4: at depth 1 or 2 the backout layer (n_layer / 2) is the last one, so the final norm
// sees (1 - backout_lambda)·x, whose loss does not depend on backout_lambda away from 1. Its
// gradient is rounding noise, which Adam at the scalar lr turns into steps of about the lr: once
// it crosses 1 the output changes sign and the loss jumps (seen on the GPU, whose bf16 noise is
// 2^16 times the CPU's).
TEST_F(TrainerTest, LossFalls) {
  const TrainOutcome outcome = run_training(load_train_config(
      args("falls", {"--depth=4", "--train-iters=30", "--save-every=0", "--lr=0.1",
                     "--embedding-lr=1.5", "--unembedding-lr=0.04"})));
  const std::map<int64_t, double> by_step = losses(root_ / "runs" / "falls");
  ASSERT_EQ(outcome.steps_done, 30);
  EXPECT_LT(by_step.at(30), 0.7 * by_step.at(1));
  EXPECT_EQ(saved_steps(root_ / "runs" / "falls"), std::vector<int64_t>{30});
  EXPECT_TRUE(fs::exists(root_ / "runs" / "falls" / "config.yaml"));
}

TEST_F(TrainerTest, ResumeIsBitIdenticalInBf16) {
  expect_bit_identical_resume({});
}

TEST_F(TrainerTest, ResumeIsBitIdenticalWithDelayedScaling) {
  expect_bit_identical_resume({"--fp8=hybrid", "--fp8-recipe=delayed", "--fp8-amax-history-len=4"});
}

TEST_F(TrainerTest, ResumeIsBitIdenticalWithAdamW) {
  expect_bit_identical_resume({"--optimizer=adamw", "--lr=0.003", "--clip-grad=1.0"});
}

TEST_F(TrainerTest, CheckpointsResumeAcrossPrecisions) {
  const std::vector<std::string> fp8 = {"--fp8=hybrid", "--fp8-recipe=delayed"};
  run_training(load_train_config(args("fp8", fp8)));
  EXPECT_TRUE(fs::exists(checkpoint_folder(root_ / "runs" / "fp8", 3) / "fp8_scaling.safetensors"));
  // FP8 -> BF16
  TrainOutcome outcome =
      run_training(load_train_config(args("fp8", {"--fp8=none", "--resume-from-step=3"})));
  EXPECT_EQ(outcome.steps_done, 6);
  // BF16 -> FP8
  run_training(load_train_config(args("bf16")));
  std::vector<std::string> resume = fp8;
  resume.push_back("--resume-from-step=3");
  outcome = run_training(load_train_config(args("bf16", resume)));
  EXPECT_EQ(outcome.steps_done, 6);
  EXPECT_TRUE(std::isfinite(outcome.last_loss));
}

TEST_F(TrainerTest, VocabularyMismatchNamesTheTokenizer) {
  const std::string message =
      error_message([&] { run_training(load_train_config(args("vocab", {"--vocab-size=512"}))); });
  EXPECT_THAT(message, HasSubstr("vocab_size: the model has 512 tokens but the tokenizer"));
  EXPECT_THAT(message, HasSubstr("tokenizer.tiktoken has " + std::to_string(vocab_)));
}

TEST_F(TrainerTest, TruncatedShardIsNamed) {
  const fs::path shard = data_ / "train_00000.tokens";
  fs::resize_file(shard, fs::file_size(shard) - 3);
  EXPECT_THAT(error_message([&] { run_training(load_train_config(args("truncated"))); }),
              HasSubstr("train_00000.tokens"));
}

TEST_F(TrainerTest, MissingDataFolderIsAnError) {
  EXPECT_THROW(
      run_training(load_train_config(args("nodata", {"--data-path=" + (root_ / "none").string()}))),
      ConfigError);
}

// A plan larger than the machine's available memory fails before anything is allocated.
TEST_F(TrainerTest, ModelThatDoesNotFitInMemoryIsRefused) {
  const std::string message = test::error_message<ConfigError>([&] {
    run_training(load_train_config(
        args("huge", {"--micro-batch-size=1000000", "--global-batch-size=1000000"})));
  });
  EXPECT_TRUE(test::Contains(message, "is available; lower micro_batch_size"));
}

TEST_F(TrainerTest, RunFolderThatCannotBeCreatedIsNamed) {
  std::ofstream(root_ / "file") << "x";
  EXPECT_THAT(
      error_message([&] {
        run_training(load_train_config(args("x", {"--output-dir=" + (root_ / "file").string()})));
      }),
      HasSubstr("cannot create the run folder"));
}

TEST_F(TrainerTest, ExistingCheckpointsAreNotOverwrittenByAccident) {
  run_training(load_train_config(args("twice")));
  EXPECT_THAT(error_message([&] { run_training(load_train_config(args("twice"))); }),
              HasSubstr("already holds checkpoints (last step 6)"));
  EXPECT_EQ(saved_steps(root_ / "runs" / "twice"), (std::vector<int64_t>{3, 6}));
  run_training(load_train_config(args("twice", {"--overwrite"})));
  EXPECT_EQ(saved_steps(root_ / "runs" / "twice"), (std::vector<int64_t>{3, 6}));
}

TEST_F(TrainerTest, ResumeFromAMissingStepListsTheSavedOnes) {
  run_training(load_train_config(args("missing")));
  EXPECT_THAT(error_message([&] {
                run_training(load_train_config(args("missing", {"--resume-from-step=4"})));
              }),
              HasSubstr("no checkpoint of step 4; saved steps: 3, 6"));
}

// overlap_grad_reduce takes effect only for the GPT on GPUs over several replicas and no
// tensor parallelism; every other run says why its sum waits for the backward.
TEST(OverlapGradReduceNote, SaysWhereTheSumsOverlapAndWhyNotElsewhere) {
  const distributed::ParallelLayout replicas{.tensor = 1, .tensor_rank = 0, .data = 4};
  const distributed::ParallelLayout groups{.tensor = 2, .tensor_rank = 1, .data = 2};
  EXPECT_EQ(overlap_grad_reduce_note(false, true, false, replicas), "");
  EXPECT_EQ(overlap_grad_reduce_note(false, false, true, groups), "");
  EXPECT_THAT(overlap_grad_reduce_note(true, true, false, replicas),
              HasSubstr("gradient sums: each block's over the 4 replicas while the backward"));
  const auto off = [](bool cuda, bool flux, const distributed::ParallelLayout& layout) {
    const std::string note = overlap_grad_reduce_note(true, cuda, flux, layout);
    EXPECT_THAT(note, HasSubstr("overlap_grad_reduce has no effect here: "));
    return note;
  };
  EXPECT_THAT(off(true, false, {}), HasSubstr("one data-parallel replica"));
  EXPECT_THAT(off(true, false, {.tensor = 2, .tensor_rank = 0, .data = 1}),
              HasSubstr("one data-parallel replica"));
  EXPECT_THAT(off(false, false, replicas), HasSubstr("the CPU path sums the gradients after"));
  EXPECT_THAT(off(true, true, replicas), HasSubstr("the Flux model sums its gradients after"));
  EXPECT_THAT(off(true, false, groups), HasSubstr("under tensor parallelism the group's sums"));
  // The rule the CUDA engine follows is the one the line states.
  EXPECT_EQ(why_gradient_sums_wait(true, false, replicas), nullptr);
  EXPECT_NE(why_gradient_sums_wait(true, false, groups), nullptr);
  EXPECT_NE(why_gradient_sums_wait(true, true, replicas), nullptr);
  EXPECT_NE(why_gradient_sums_wait(false, false, replicas), nullptr);
  EXPECT_NE(why_gradient_sums_wait(true, false, {}), nullptr);
}

}  // namespace
}  // namespace fp8t::train
