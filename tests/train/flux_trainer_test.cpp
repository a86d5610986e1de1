#include "train/flux_trainer.h"

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/arena.h"
#include "core/error.h"
#include "io/safetensors.h"
#include "test_files.h"
#include "train/checkpoint.h"
#include "train/flux_batches.h"

namespace fp8t::train {
namespace {

namespace fs = std::filesystem;

FluxObjectiveOptions shapes_objective() {
  FluxObjectiveOptions objective;
  objective.latent_scale = 1.0;
  objective.latent_shift = 0.0;
  objective.cfg_dropout = 0.5;  // both kinds of sample in a batch of 4
  return objective;
}

bool same(const FluxBatch& a, const FluxBatch& b) {
  return a.img == b.img && a.target == b.target && a.txt == b.txt && a.y == b.y &&
         a.timesteps == b.timesteps && a.guidance == b.guidance;
}

class FluxBatchesTest : public ::testing::Test {
 protected:
  const FluxConfig model_ = FluxConfig::preset("flux_tiny");
  const data::FluxShapesDataset dataset_{{.image_size = 16, .seed = 5}};
  const FluxBatchBuilder builder_{dataset_, model_, shapes_objective(), 4, 5};
};

TEST_F(FluxBatchesTest, TrainingBatchesAreAFunctionOfSeedAndStep) {
  FluxBatch first, again, other;
  builder_.training_batch(3, 1, 2, first);
  builder_.training_batch(0, 0, 2, other);  // whatever came before
  builder_.training_batch(3, 1, 2, again);
  EXPECT_TRUE(same(first, again));
  EXPECT_FALSE(same(first, other));
  builder_.training_batch(3, 0, 2, other);
  EXPECT_NE(first.target, other.target);  // the other micro-batch holds other pictures

  const data::FluxShapesDataset reseeded({.image_size = 16, .seed = 6});
  const FluxBatchBuilder other_seed(reseeded, model_, shapes_objective(), 4, 6);
  other_seed.training_batch(3, 1, 2, other);
  EXPECT_NE(first.target, other.target);
  EXPECT_NE(first.timesteps, other.timesteps);

  // The layout the model takes: 64 tokens of 16 features per picture, σ in (0, 1).
  EXPECT_EQ(first.img.size(), 4u * 64 * 16);
  EXPECT_EQ(first.txt.size(), 4u * 16 * 32);
  EXPECT_EQ(first.y.size(), 4u * 16);
  EXPECT_TRUE(first.guidance.empty());
  for (float sigma : first.timesteps)
    EXPECT_TRUE(sigma > 0.0f && sigma < 1.0f) << sigma;
}

TEST_F(FluxBatchesTest, TrainingBatchesHoldTheDatasetsPicturesAndDropCaptions) {
  FluxBatch batch;
  builder_.training_batch(2, 1, 3, batch);  // samples (2·3 + 1)·4 = 28 .. 31
  data::FluxSample sample;
  std::vector<float> packed(size_t(64 * 16));
  int dropped = 0;
  for (int64_t b = 0; b < 4; ++b) {
    dataset_.sample(28 + b, sample);
    pack_latents(packed.data(), sample.latent.data(), builder_.latent_shape());
    // x_t = (1 − σ)·x0 + σ·ε and target = ε − x0 give x0 = x_t − σ·target.
    const float sigma = batch.timesteps[size_t(b)];
    for (size_t i = 0; i < packed.size(); ++i) {
      const size_t at = size_t(b) * packed.size() + i;
      ASSERT_NEAR(batch.img[at] - sigma * batch.target[at], packed[i], 1e-5) << b;
    }
    const std::vector<float> txt(batch.txt.begin() + b * 512, batch.txt.begin() + (b + 1) * 512);
    if (txt == dataset_.empty_encodings().txt) {
      ++dropped;
    } else {
      EXPECT_EQ(txt, sample.txt) << b;
    }
  }
  EXPECT_GT(dropped, 0);  // with probability 1/2 each; this seed drops some and keeps some
  EXPECT_LT(dropped, 4);
}

TEST_F(FluxBatchesTest, ValidationBatchesAreFixedAndHeldOut) {
  FluxBatch first, again, training;
  builder_.validation_batch(1, first);
  builder_.validation_batch(0, again);
  builder_.validation_batch(1, again);
  EXPECT_TRUE(same(first, again));
  builder_.training_batch(1, 0, 1, training);
  EXPECT_NE(first.target, training.target);
}

class FluxTrainerTest : public ::testing::Test {
 protected:
  std::vector<std::string> args(const std::string& run, std::vector<std::string> extra = {}) {
    std::vector<std::string> all = {"--model=flux_tiny",
                                    "--image-size=16",
                                    "--micro-batch-size=2",
                                    "--global-batch-size=4",
                                    "--train-iters=4",
                                    "--save-every=2",
                                    "--eval-every=0",
                                    "--lr=1e-3",
                                    "--lr-warmup-iters=1",
                                    "--latent-scale=1",
                                    "--latent-shift=0",
                                    "--sample-prompts=",
                                    "--output-dir=" + (root_ / "runs").string(),
                                    "--run=" + run};
    all.insert(all.end(), extra.begin(), extra.end());
    return all;
  }

  // (step, loss) of every step line of metrics.jsonl, in order (a resumed run appends).
  static std::vector<std::pair<int64_t, double>> losses(const fs::path& run_folder) {
    std::vector<std::pair<int64_t, double>> steps;
    std::ifstream in(run_folder / "metrics.jsonl");
    std::string line;
    while (std::getline(in, line)) {
      const nlohmann::json record = nlohmann::json::parse(line);
      if (record.contains("step")) steps.emplace_back(record["step"], record["loss"]);
    }
    return steps;
  }

  static std::vector<std::byte> file_bytes(const fs::path& run_folder, int64_t step,
                                           const std::string& file) {
    const io::SafetensorsFile tensors(checkpoint_folder(run_folder, step) / file);
    std::vector<std::byte> bytes;
    for (const std::string& name : tensors.names()) {
      const io::RawTensor raw = tensors.raw(name);
      bytes.insert(bytes.end(), raw.bytes.begin(), raw.bytes.end());
    }
    return bytes;
  }

  test::TempFolder root_;
};

// 4 steps straight, and a second run resumed from its checkpoint of step 2: steps 3 and 4 give
// the same losses, weights and optimizer state, bit for bit.
TEST_F(FluxTrainerTest, ResumeGivesTheLossesOfAnUninterruptedRun) {
  run_training(load_train_config(args("straight")));
  run_training(load_train_config(args("resumed")));
  const TrainOutcome outcome =
      run_training(load_train_config(args("resumed", {"--resume-from-step=2"})));
  EXPECT_EQ(outcome.steps_done, 4);
  EXPECT_FALSE(outcome.sample_grid.has_filename());  // sample_prompts is empty
  const std::vector<std::pair<int64_t, double>> resumed = losses(root_ / "runs" / "resumed");
  const std::vector<std::pair<int64_t, double>> straight = losses(root_ / "runs" / "straight");
  ASSERT_EQ(straight.size(), 4u);
  ASSERT_EQ(resumed.size(), 6u);  // steps 3 and 4 again, appended by the resumed run
  for (size_t i = 2; i < 4; ++i)
    EXPECT_EQ(resumed[i + 2], straight[i]) << "step " << i + 1;
  EXPECT_LT(straight[3].second, straight[0].second);
  for (const char* file : {"model.safetensors", "optimizer.safetensors"}) {
    EXPECT_EQ(file_bytes(root_ / "runs" / "resumed", 4, file),
              file_bytes(root_ / "runs" / "straight", 4, file))
        << file;
  }
}

TEST_F(FluxTrainerTest, CheckpointsUseBflNamesAndReloadExactly) {
  run_training(load_train_config(args("names", {"--train-iters=1"})));
  const fs::path folder = checkpoint_folder(root_ / "runs" / "names", 1);
  const FluxConfig config = FluxConfig::preset("flux_tiny");
  const io::SafetensorsFile file(folder / "model.safetensors");
  std::set<std::string> expected;
  for (const FluxParam& param : flux_parameters(config)) {
    expected.insert(param.name);
    EXPECT_EQ(file.info(param.name).shape, param.shape) << param.name;
  }
  const std::vector<std::string> names = file.names();
  EXPECT_EQ(std::set<std::string>(names.begin(), names.end()), expected);
  EXPECT_TRUE(expected.contains("double_blocks.0.img_attn.norm.query_norm.scale"));
  EXPECT_TRUE(expected.contains("final_layer.adaLN_modulation.1.weight"));

  Arena arena("weights", FluxParameterSet::planned_bytes(config, DType::F32));
  FluxParameterSet weights(arena, config, DType::F32);
  std::vector<NamedTensor> tensors;
  for (const FluxParam& param : weights.specs())
    tensors.push_back({param.name, weights[param.name]});
  read_checkpoint_tensors(folder / "model.safetensors", tensors);
  for (const NamedTensor& tensor : tensors) {
    const io::RawTensor raw = file.raw(tensor.name);
    ASSERT_EQ(raw.bytes.size(), tensor.view.bytes());
    EXPECT_EQ(std::memcmp(raw.bytes.data(), tensor.view.raw(), raw.bytes.size()), 0) << tensor.name;
  }
  const io::SafetensorsFile optimizer(folder / "optimizer.safetensors");
  EXPECT_TRUE(optimizer.contains("img_in.weight.exp_avg_sq"));
  EXPECT_TRUE(optimizer.contains("optimizer.step"));
}

TEST_F(FluxTrainerTest, WritesSampleGridsOnScheduleAndAtTheEnd) {
  const TrainOutcome outcome = run_training(load_train_config(
      args("grids", {"--train-iters=2", "--sample-every=1", "--sample-steps=2",
                     "--sample-prompts=a red circle on the left; a blue square at the top",
                     "--sample-images-per-prompt=3"})));
  const fs::path samples = root_ / "runs" / "grids" / "samples";
  EXPECT_EQ(outcome.sample_grid, flux_sample_grid_path(root_ / "runs" / "grids", 2));
  EXPECT_TRUE(fs::exists(samples / "step_000001.png"));
  EXPECT_TRUE(fs::exists(samples / "step_000002.png"));
}

TEST_F(FluxTrainerTest, UnknownPromptWordIsAConfigError) {
  EXPECT_TRUE(test::Contains(
      test::error_message<ConfigError>([&] {
        run_training(load_train_config(args("words", {"--sample-prompts=a purple circle"})));
      }),
      "sample_prompts: caption 'a purple circle': unknown word 'purple'"));
}

}  // namespace
}  // namespace fp8t::train
