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

namespace fp8t::train {
namespace {

namespace fs = std::filesystem;
using test::error_message;
using ::testing::HasSubstr;

// A folder of token shards and a tokenizer, as `fp8train tokenize` makes them, from random
// sentences over a small vocabulary of words.
class TrainerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    fs::create_directories(data_);
    const std::vector<std::string> words = {"the", "cat", "sat", "on",  "a",    "mat",  "and",
                                            "dog", "ran", "to",  "red", "ball", "with", "joy"};
    std::mt19937 generator(std::random_device{}());
    std::vector<std::string> documents(200);
    for (std::string& document : documents) {
      const int length = 5 + int(generator() % 40);
      for (int i = 0; i < length; ++i) {
        document += words[generator() % words.size()];
        document += i + 1 < length ? " " : ".";
      }
    }
    // Asks for 320 tokens; the small corpus runs out of pairs before that.
    const auto tokenizer = tokenizer::BpeTokenizer::train(documents, 320);
    vocab_ = tokenizer.vocab_size();
    tokenizer.save(data_ / "tokenizer.tiktoken");
    std::vector<int32_t> train_tokens, val_tokens;
    for (size_t i = 0; i < documents.size(); ++i) {
      const std::vector<int32_t> ids = tokenizer.encode_document(documents[i]);
      std::vector<int32_t>& into = i % 10 == 9 ? val_tokens : train_tokens;
      into.insert(into.end(), ids.begin(), ids.end());
    }
    data::write_token_shard(data_ / "train_00000.tokens", train_tokens, vocab_, tokenizer.bos_id());
    data::write_token_shard(data_ / "val_00000.tokens", val_tokens, vocab_, tokenizer.bos_id());
  }

  std::vector<std::string> args(const std::string& run, std::vector<std::string> extra = {}) {
    std::vector<std::string> all = {"--depth=2",
                                    "--vocab-size=" + std::to_string(vocab_),
                                    "--sequence-len=64",
                                    "--micro-batch-size=2",
                                    "--global-batch-size=4",
                                    "--train-iters=6",
                                    "--save-every=3",
                                    "--eval-every=0",
                                    "--lr-warmup-iters=2",
                                    "--data-path=" + data_.string(),
                                    "--output-dir=" + (root_ / "runs").string(),
                                    "--run=" + run};
    all.insert(all.end(), extra.begin(), extra.end());
    return all;
  }

  // The losses of metrics.jsonl, by step (a resumed run appends its steps again).
  static std::map<int64_t, double> losses(const fs::path& run_folder) {
    std::map<int64_t, double> by_step;
    std::ifstream in(run_folder / "metrics.jsonl");
    std::string line;
    while (std::getline(in, line)) {
      const nlohmann::json record = nlohmann::json::parse(line);
      if (record.contains("step")) by_step[record["step"]] = record["loss"];
    }
    return by_step;
  }

  static std::vector<std::byte> model_bytes(const fs::path& run_folder, int64_t step) {
    const io::SafetensorsFile file(checkpoint_folder(run_folder, step) / "model.safetensors");
    std::vector<std::byte> bytes;
    for (const std::string& name : file.names()) {
      const io::RawTensor raw = file.raw(name);
      bytes.insert(bytes.end(), raw.bytes.begin(), raw.bytes.end());
    }
    return bytes;
  }

  // Runs 6 steps straight, then resumes a second run at step 3: steps 4 to 6 must give the same
  // losses and the same weights, bit for bit.
  void expect_bit_identical_resume(const std::vector<std::string>& precision) {
    run_training(load_train_config(args("straight", precision)));
    run_training(load_train_config(args("resumed", precision)));
    std::vector<std::string> resume = precision;
    resume.push_back("--resume-from-step=3");
    const std::map<int64_t, double> before = losses(root_ / "runs" / "resumed");
    run_training(load_train_config(args("resumed", resume)));

    const std::map<int64_t, double> straight = losses(root_ / "runs" / "straight");
    const std::map<int64_t, double> resumed = losses(root_ / "runs" / "resumed");
    ASSERT_EQ(straight.size(), 6u);
    for (int64_t step = 4; step <= 6; ++step) {
      EXPECT_EQ(resumed.at(step), straight.at(step)) << "step " << step;
    }
    EXPECT_EQ(before.at(3), straight.at(3));
    EXPECT_EQ(model_bytes(root_ / "runs" / "resumed", 6),
              model_bytes(root_ / "runs" / "straight", 6));
  }

  test::TempFolder root_;
  const fs::path data_ = root_ / "data";
  int vocab_ = 0;
};

TEST_F(TrainerTest, LossFalls) {
  const TrainOutcome outcome = run_training(
      load_train_config(args("falls", {"--train-iters=30", "--save-every=0", "--lr=0.1",
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

}  // namespace
}  // namespace fp8t::train
