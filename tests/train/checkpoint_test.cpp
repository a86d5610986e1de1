#include "train/checkpoint.h"

#include <sys/resource.h>

#include <csignal>
#include <filesystem>
#include <fstream>
#include <random>
#include <set>
#include <string>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "core/error.h"
#include "io/safetensors.h"
#include "test_files.h"

namespace fp8t::train {
namespace {

namespace fs = std::filesystem;
using test::error_message;
using ::testing::AllOf;
using ::testing::HasSubstr;

class CheckpointTest : public ::testing::Test {
 protected:
  void SetUp() override {
    std::mt19937 generator(std::random_device{}());
    std::normal_distribution<float> normal;
    for (std::vector<float>* values : {&weight_, &bias_, &moment_}) {
      for (float& value : *values)
        value = normal(generator);
    }
  }

  CheckpointContents contents(int64_t step) {
    CheckpointContents c;
    c.step = step;
    c.model = {{"lm_head.weight", TensorView(weight_.data(), DType::F32, {4, 3})},
               {"resid_lambdas", TensorView(bias_.data(), DType::F32, {2})}};
    c.optimizer = {{"lm_head.weight.exp_avg", TensorView(moment_.data(), DType::F32, {4, 3})},
                   {"optimizer.step", TensorView(&steps_, DType::I64, {1})}};
    c.trainer_state = {{"data_position", {{"epoch", 1}}}};
    c.config_yaml = "depth: 2\n";
    return c;
  }

  test::TempFolder folder_;
  const fs::path run_ = folder_.path();
  std::vector<float> weight_ = std::vector<float>(12);
  std::vector<float> bias_ = std::vector<float>(2);
  std::vector<float> moment_ = std::vector<float>(12);
  int64_t steps_ = 0;
};

TEST_F(CheckpointTest, RoundTripsEveryBuffer) {
  steps_ = 7;
  save_checkpoint(run_, contents(7));
  const std::vector<float> saved_weight = weight_, saved_moment = moment_;
  std::fill(weight_.begin(), weight_.end(), -1.0f);
  std::fill(moment_.begin(), moment_.end(), -1.0f);
  steps_ = 0;
  const LoadedCheckpoint loaded = load_checkpoint(run_, 7, contents(7));
  EXPECT_EQ(weight_, saved_weight);
  EXPECT_EQ(moment_, saved_moment);
  EXPECT_EQ(steps_, 7);
  EXPECT_EQ(loaded.trainer_state["step"], 7);
  EXPECT_EQ(loaded.trainer_state["data_position"]["epoch"], 1);
  EXPECT_EQ(loaded.config_yaml, "depth: 2\n");
  EXPECT_FALSE(loaded.had_fp8_scaling);
  EXPECT_EQ(saved_steps(run_), std::vector<int64_t>{7});
  // The weights carry nanochat's names, readable by any safetensors reader.
  const io::SafetensorsFile model(checkpoint_folder(run_, 7) / "model.safetensors");
  EXPECT_EQ(model.tensor<float>("lm_head.weight").data, saved_weight);
}

// A rank that keeps no copy of the tensors (they reach it from another rank) reads the rest.
TEST_F(CheckpointTest, LoadWithoutTensorsReadsTheRest) {
  save_checkpoint(run_, contents(5));
  CheckpointContents rest;
  rest.with_tensors = false;
  const LoadedCheckpoint loaded = load_checkpoint(run_, 5, rest);
  EXPECT_EQ(loaded.trainer_state["step"], 5);
  EXPECT_EQ(loaded.trainer_state["data_position"]["epoch"], 1);
  EXPECT_EQ(loaded.config_yaml, "depth: 2\n");
  rest.with_tensors = true;  // the same empty buffers, read: the file's tensors are extra
  EXPECT_THROW(load_checkpoint(run_, 5, rest), Error);
}

TEST_F(CheckpointTest, MissingStepListsTheSavedOnes) {
  save_checkpoint(run_, contents(100));
  save_checkpoint(run_, contents(200));
  EXPECT_THAT(error_message([&] { load_checkpoint(run_, 150, contents(150)); }),
              HasSubstr("no checkpoint of step 150; saved steps: 100, 200"));
}

TEST_F(CheckpointTest, MissingTensorIsNamed) {
  save_checkpoint(run_, contents(3));
  CheckpointContents wanted = contents(3);
  std::vector<float> extra(5);
  wanted.model.push_back({"smear_lambda", TensorView(extra.data(), DType::F32, {5})});
  EXPECT_THAT(error_message([&] { load_checkpoint(run_, 3, wanted); }),
              HasSubstr("model.safetensors: tensor 'smear_lambda' is missing"));
}

TEST_F(CheckpointTest, WrongShapeIsNamed) {
  save_checkpoint(run_, contents(3));
  CheckpointContents wanted = contents(3);
  wanted.model[0].view = TensorView(weight_.data(), DType::F32, {3, 4});
  EXPECT_THAT(error_message([&] { load_checkpoint(run_, 3, wanted); }),
              HasSubstr("tensor 'lm_head.weight' has shape [4, 3], expected [3, 4]"));
}

TEST_F(CheckpointTest, UnexpectedTensorIsAnError) {
  save_checkpoint(run_, contents(3));
  CheckpointContents wanted = contents(3);
  wanted.model.pop_back();
  EXPECT_THROW(load_checkpoint(run_, 3, wanted), Error);
}

// The FP8 linears may change between a save and a load (the NaN guard's bf16_layer): the
// delayed-scaling state is read by name, and what does not match is listed.
TEST_F(CheckpointTest, Fp8ScalingStateIsReadByName) {
  std::vector<float> first = {1, 2}, second = {3, 4};
  CheckpointContents saved = contents(3);
  saved.fp8_scaling = {{"a.input.state", TensorView(first.data(), DType::F32, {2})},
                       {"b.input.state", TensorView(second.data(), DType::F32, {2})}};
  save_checkpoint(run_, saved);
  std::vector<float> a(2), c = {7, 8};
  CheckpointContents wanted = contents(3);
  wanted.fp8_scaling = {{"a.input.state", TensorView(a.data(), DType::F32, {2})},
                        {"c.input.state", TensorView(c.data(), DType::F32, {2})}};
  const LoadedCheckpoint loaded = load_checkpoint(run_, 3, wanted);
  EXPECT_EQ(a, first);
  EXPECT_EQ(c, (std::vector<float>{7, 8}));  // left as it was
  EXPECT_EQ(loaded.fp8_scaling_missing, std::vector<std::string>{"c.input.state"});
  EXPECT_EQ(loaded.fp8_scaling_ignored, std::vector<std::string>{"b.input.state"});
}

TEST_F(CheckpointTest, DiscardingAfterAStepKeepsTheEarlierOnes) {
  for (int64_t step : {2, 4, 6})
    save_checkpoint(run_, contents(step));
  discard_checkpoints_after(run_, 2);
  EXPECT_EQ(saved_steps(run_), std::vector<int64_t>{2});
  EXPECT_FALSE(fs::exists(checkpoint_folder(run_, 4)));
}

TEST_F(CheckpointTest, ReSavingAStepReplacesIt) {
  save_checkpoint(run_, contents(5));
  weight_[0] = 42.0f;
  save_checkpoint(run_, contents(5));
  weight_[0] = 0.0f;
  load_checkpoint(run_, 5, contents(5));
  EXPECT_EQ(weight_[0], 42.0f);
  EXPECT_EQ(saved_steps(run_), std::vector<int64_t>{5});
  // Nothing of the old one or of the save is left beside it.
  size_t folders = 0;
  for ([[maybe_unused]] const auto& entry :
       std::filesystem::directory_iterator(run_ / "checkpoints"))
    ++folders;
  EXPECT_EQ(folders, 1u);
}

TEST_F(CheckpointTest, RunFolderThatIsAFileIsAnError) {
  const fs::path file = run_ / "not_a_folder";
  std::ofstream(file) << "x";
  EXPECT_THAT(error_message([&] { save_checkpoint(file, contents(1)); }),
              HasSubstr("not_a_folder/checkpoints: cannot create"));
}

// A full disk, as the file-size limit makes writes fail: the save reports the file and the
// reason, and the checkpoint saved before is intact and still the only one.
TEST_F(CheckpointTest, FullDiskDuringSaveKeepsTheEarlierCheckpoint) {
  std::vector<float> big(1 << 16, 1.0f);
  CheckpointContents first = contents(10);
  first.optimizer.push_back({"big", TensorView(big.data(), DType::F32, {1 << 16})});
  save_checkpoint(run_, first);
  const std::vector<float> saved_weight = weight_;

  CheckpointContents second = contents(20);
  second.optimizer.push_back({"big", TensorView(big.data(), DType::F32, {1 << 16})});
  rlimit previous{};
  ASSERT_EQ(::getrlimit(RLIMIT_FSIZE, &previous), 0);
  const auto previous_handler = std::signal(SIGXFSZ, SIG_IGN);
  rlimit limited = previous;
  limited.rlim_cur = 4096;
  ASSERT_EQ(::setrlimit(RLIMIT_FSIZE, &limited), 0);
  const std::string message = error_message([&] { save_checkpoint(run_, second); });
  ::setrlimit(RLIMIT_FSIZE, &previous);
  std::signal(SIGXFSZ, previous_handler);

  EXPECT_THAT(message, HasSubstr("optimizer.safetensors: cannot write: File too large"));
  EXPECT_EQ(saved_steps(run_), std::vector<int64_t>{10});
  EXPECT_FALSE(fs::exists(checkpoint_folder(run_, 20)));
  std::fill(weight_.begin(), weight_.end(), 0.0f);
  load_checkpoint(run_, 10, first);
  EXPECT_EQ(weight_, saved_weight);
}

// A crash between the files of a save leaves a folder without trainer_state.json: it is never
// listed or loaded, and the next save of that step clears it.
TEST_F(CheckpointTest, PartialFolderIsIgnored) {
  fs::create_directories(run_ / "checkpoints" / "step_000004.partial");
  fs::create_directories(checkpoint_folder(run_, 6));  // no trainer_state.json
  EXPECT_TRUE(saved_steps(run_).empty());
  save_checkpoint(run_, contents(4));
  EXPECT_EQ(saved_steps(run_), std::vector<int64_t>{4});
  EXPECT_FALSE(fs::exists(run_ / "checkpoints" / "step_000004.partial"));
}

// Flips one byte of a file in place: its size stays, its contents change.
void flip_byte(const fs::path& path, std::streamoff offset) {
  std::fstream file(path, std::ios::in | std::ios::out | std::ios::binary);
  file.seekg(offset);
  const char byte = static_cast<char>(file.get() ^ 0x40);
  file.seekp(offset);
  file.put(byte);
}

TEST_F(CheckpointTest, ManifestHoldsEveryFileAndVerifies) {
  save_checkpoint(run_, contents(9));
  const fs::path folder = checkpoint_folder(run_, 9);
  const CheckpointCheck check = verify_checkpoint(folder);
  ASSERT_TRUE(check.has_manifest);
  std::set<std::string> files;
  uint64_t bytes = 0;
  for (const FileCheck& file : check.files) {
    EXPECT_EQ(file.problem, "") << file.file;
    files.insert(file.file);
    bytes += fs::file_size(folder / file.file);
  }
  EXPECT_EQ(files, (std::set<std::string>{"model.safetensors", "optimizer.safetensors",
                                          "config.yaml", "trainer_state.json"}));
  EXPECT_EQ(check.bytes, bytes);
  EXPECT_EQ(check.first_problem(folder), "");
}

TEST_F(CheckpointTest, DamagedFileIsNamedOnLoadWithTheEarlierCheckpoints) {
  save_checkpoint(run_, contents(4));
  save_checkpoint(run_, contents(8));
  const fs::path folder = checkpoint_folder(run_, 8);
  flip_byte(folder / "optimizer.safetensors", 100);
  const CheckpointCheck check = verify_checkpoint(folder);
  EXPECT_THAT(check.first_problem(folder), HasSubstr("optimizer.safetensors: CRC-32 "));
  EXPECT_THAT(error_message([&] { load_checkpoint(run_, 8, contents(8)); }),
              AllOf(HasSubstr("step_000008/optimizer.safetensors: CRC-32"),
                    HasSubstr("the contents changed; earlier checkpoints: 4")));
  fs::resize_file(folder / "model.safetensors", 10);
  EXPECT_THAT(verify_checkpoint(folder).first_problem(folder),
              HasSubstr("model.safetensors: 10 bytes, the manifest says"));
  fs::remove(folder / "config.yaml");
  bool missing_named = false;
  for (const FileCheck& file : verify_checkpoint(folder).files)
    missing_named |= file.file == "config.yaml" && file.problem == "missing or unreadable";
  EXPECT_TRUE(missing_named);
  load_checkpoint(run_, 4, contents(4));  // the earlier one is intact
}

TEST_F(CheckpointTest, CheckpointWithoutManifestStillLoads) {
  steps_ = 3;
  save_checkpoint(run_, contents(3));
  fs::remove(checkpoint_folder(run_, 3) / "manifest.json");
  EXPECT_FALSE(verify_checkpoint(checkpoint_folder(run_, 3)).has_manifest);
  steps_ = 0;
  load_checkpoint(run_, 3, contents(3));
  EXPECT_EQ(steps_, 3);
}

TEST_F(CheckpointTest, PruningKeepsTheNewest) {
  for (int64_t step : {2, 4, 6, 8})
    save_checkpoint(run_, contents(step));
  prune_checkpoints(run_, 0);
  EXPECT_EQ(saved_steps(run_), (std::vector<int64_t>{2, 4, 6, 8}));
  prune_checkpoints(run_, 2);
  EXPECT_EQ(saved_steps(run_), (std::vector<int64_t>{6, 8}));
  EXPECT_FALSE(fs::exists(checkpoint_folder(run_, 2)));
  prune_checkpoints(run_, 5);
  EXPECT_EQ(saved_steps(run_), (std::vector<int64_t>{6, 8}));
}

}  // namespace
}  // namespace fp8t::train
