// The trainer tests' fixture: a folder of token shards and a tokenizer made from random
// sentences, the arguments of a small run over it on a chosen device, and readers of what a run
// wrote. Shared by the CPU tests and the GPU ones.
#pragma once

#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "config/train_config.h"
#include "data/token_shard.h"
#include "io/safetensors.h"
#include "test_files.h"
#include "tokenizer/bpe_tokenizer.h"
#include "train/checkpoint.h"
#include "train/trainer.h"

namespace fp8t::train {

// A folder of token shards and a tokenizer, as `fp8train tokenize` makes them, from random
// sentences over a small vocabulary of words.
class TrainerTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::filesystem::create_directories(data_);
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

  // The device of the runs: the CPU tests pin the CPU path, whatever the machine has.
  virtual std::string device() const { return "cpu"; }

  std::vector<std::string> args(const std::string& run, std::vector<std::string> extra = {}) {
    std::vector<std::string> all = {"--device=" + device(),
                                    "--depth=2",
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
  static std::map<int64_t, double> losses(const std::filesystem::path& run_folder) {
    std::map<int64_t, double> by_step;
    std::ifstream in(run_folder / "metrics.jsonl");
    std::string line;
    while (std::getline(in, line)) {
      const nlohmann::json record = nlohmann::json::parse(line);
      if (record.contains("step")) by_step[record["step"]] = record["loss"];
    }
    return by_step;
  }

  static std::vector<std::byte> model_bytes(const std::filesystem::path& run_folder, int64_t step) {
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
  const std::filesystem::path data_ = root_ / "data";
  int vocab_ = 0;
};

}  // namespace fp8t::train
