#include "train/flux_trainer.h"

#include <gtest/gtest.h>

#include <cmath>
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
#include "dataset/flux_shard_spec.h"
#include "io/safetensors.h"
#include "test_files.h"
#include "train/checkpoint.h"
#include "train/flux_batches.h"
#include "train/flux_engine.h"

namespace fp8t::train {
namespace {

namespace fs = std::filesystem;
using test::FluxShardSpec;

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
  const FluxShapesSource source_{dataset_};
  const FluxBatchBuilder builder_{source_, model_, shapes_objective(), 4, 5};
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
  const FluxShapesSource reseeded_source(reseeded);
  const FluxBatchBuilder other_seed(reseeded_source, model_, shapes_objective(), 4, 6);
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
  // A small flux_tiny run on the built-in data.
  std::vector<std::string> args(const std::string& run, std::vector<std::string> extra = {}) {
    std::vector<std::string> all = {"--image-size=16", "--latent-scale=1", "--latent-shift=0"};
    all.insert(all.end(), extra.begin(), extra.end());
    return run_args(run, all);
  }

  // A small flux_tiny run on the data `data` names.
  std::vector<std::string> run_args(const std::string& run, std::vector<std::string> data) {
    std::vector<std::string> all = {"--model=flux_tiny",
                                    "--micro-batch-size=2",
                                    "--global-batch-size=4",
                                    "--train-iters=4",
                                    "--save-every=2",
                                    "--eval-every=0",
                                    "--lr=1e-3",
                                    "--lr-warmup-iters=1",
                                    "--sample-prompts=",
                                    "--output-dir=" + (root_ / "runs").string(),
                                    "--run=" + run};
    all.insert(all.end(), data.begin(), data.end());
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

// 7 rows through micro-batches of 3: two whole ones and one of a row and two of zeros, each row's
// prediction its own (here a function of every input of that row) and none of the padding's.
TEST(FluxPrediction, MicroBatchesKeepEachRowsPrediction) {
  FluxConfig config = FluxConfig::preset("flux_tiny");
  config.guidance_embed = true;
  const int64_t img_tokens = 2, txt_tokens = 3, batch = 3, rows = 7;
  const int64_t img = img_tokens * config.in_channels, txt = txt_tokens * config.context_in_dim;
  const auto values = [](int64_t count, float base) {
    std::vector<float> v(static_cast<size_t>(count));
    for (size_t i = 0; i < v.size(); ++i)
      v[i] = base + float(i);
    return v;
  };
  const std::vector<float> x = values(rows * img, 1.0f), ids = values(img_tokens * 3, 0.0f),
                           t5 = values(rows * txt, 2.0f),
                           pooled = values(rows * config.vec_in_dim, 3.0f),
                           sigma = values(rows, 0.5f), guidance = values(rows, 4.0f);
  const FluxInputs inputs{x.data(),      ids.data(),   t5.data(),
                          pooled.data(), sigma.data(), guidance.data()};
  // Each row's prediction: its first latent value, its last text and pooled values, its σ and
  // guidance, summed into each of its values plus their place.
  const auto row_value = [&](const FluxInputs& in, int64_t row) {
    return in.img[row * img] + in.txt[(row + 1) * txt - 1] +
           in.y[(row + 1) * config.vec_in_dim - 1] + in.timesteps[row] + in.guidance[row];
  };
  int calls = 0;
  std::vector<float> prediction(static_cast<size_t>(rows * img), -1.0f);
  predict_in_micro_batches(config, batch, img_tokens, txt_tokens, inputs, rows, prediction.data(),
                           [&](const FluxInputs& micro_batch, float* out) {
                             ++calls;
                             EXPECT_EQ(micro_batch.img_ids, ids.data());
                             if (calls == 3) {  // its last two rows: padding, all zeros
                               for (int64_t i = img; i < batch * img; ++i)
                                 EXPECT_EQ(micro_batch.img[i], 0.0f);
                               EXPECT_EQ(micro_batch.timesteps[2], 0.0f);
                               EXPECT_EQ(micro_batch.guidance[1], 0.0f);
                               EXPECT_EQ(micro_batch.y[batch * config.vec_in_dim - 1], 0.0f);
                               EXPECT_EQ(micro_batch.txt[batch * txt - 1], 0.0f);
                             }
                             for (int64_t row = 0; row < batch; ++row)
                               for (int64_t i = 0; i < img; ++i)
                                 out[row * img + i] = row_value(micro_batch, row) + float(i);
                           });
  EXPECT_EQ(calls, 3);
  for (int64_t row = 0; row < rows; ++row) {
    for (int64_t i = 0; i < img; ++i) {
      ASSERT_EQ(prediction[size_t(row * img + i)], row_value(inputs, row) + float(i))
          << "row " << row << ", value " << i;
    }
  }
}

TEST_F(FluxTrainerTest, UnknownPromptWordIsAConfigError) {
  EXPECT_TRUE(test::Contains(
      test::error_message<ConfigError>([&] {
        run_training(load_train_config(args("words", {"--sample-prompts=a purple circle"})));
      }),
      "sample_prompts: caption 'a purple circle': unknown word 'purple'"));
}

// Training on precomputed shards of flux_tiny's widths: train_a (5 samples) and train_b (6), the
// training list of 11, and val_a (4) for validation.
class FluxShardTrainingTest : public FluxTrainerTest {
 protected:
  void SetUp() override {
    fs::create_directories(root_ / "shards");
    write(FluxShardSpec::flux_tiny(5), "shards/train_a.safetensors");
    write(FluxShardSpec::flux_tiny(6), "shards/train_b.safetensors");
    write(FluxShardSpec::flux_tiny(4), "shards/val_a.safetensors");
  }

  fs::path write(FluxShardSpec spec, const std::string& name) {
    spec.fill(seed_++);
    const fs::path path = root_ / name;
    fs::create_directories(path.parent_path());
    spec.write(path);
    return path;
  }

  // A run on the training shards (the pattern train_*) and, with `validation`, on val_a.
  std::vector<std::string> shard_args(const std::string& run, bool validation,
                                      std::vector<std::string> extra = {}) {
    std::vector<std::string> data = {"--flux-shards=" +
                                     (root_ / "shards" / "train_*.safetensors").string()};
    if (validation) {
      data.push_back("--flux-val-shards=" + (root_ / "shards" / "val_a.safetensors").string());
    }
    data.insert(data.end(), extra.begin(), extra.end());
    return run_args(run, data);
  }

  std::string data_error(const std::vector<std::string>& arguments) {
    return test::error_message<ConfigError>([&] { open_flux_data(load_train_config(arguments)); });
  }

  uint64_t seed_ = 1;
};

TEST_F(FluxShardTrainingTest, TrainsAndResumesExactly) {
  const std::vector<std::string> evaluation = {"--eval-every=2", "--eval-iters=3"};
  const TrainOutcome straight =
      run_training(load_train_config(shard_args("straight", true, evaluation)));
  run_training(load_train_config(shard_args("resumed", true, evaluation)));
  std::vector<std::string> resume = evaluation;
  resume.push_back("--resume-from-step=2");
  const TrainOutcome resumed = run_training(load_train_config(shard_args("resumed", true, resume)));
  EXPECT_EQ(straight.steps_done, 4);
  EXPECT_EQ(resumed.steps_done, 4);
  ASSERT_TRUE(straight.last_val_loss.has_value());
  EXPECT_TRUE(std::isfinite(*straight.last_val_loss));
  EXPECT_EQ(resumed.last_val_loss, straight.last_val_loss);

  const std::vector<std::pair<int64_t, double>> straight_losses =
      losses(root_ / "runs" / "straight");
  const std::vector<std::pair<int64_t, double>> resumed_losses = losses(root_ / "runs" / "resumed");
  ASSERT_EQ(straight_losses.size(), 4u);
  ASSERT_EQ(resumed_losses.size(), 6u);  // steps 3 and 4 again, appended by the resumed run
  for (const auto& [step, loss] : straight_losses)
    EXPECT_TRUE(std::isfinite(loss)) << "step " << step;
  for (size_t i = 2; i < 4; ++i)
    EXPECT_EQ(resumed_losses[i + 2], straight_losses[i]) << "step " << i + 1;
}

TEST_F(FluxShardTrainingTest, TrainsOnVaePosteriorsWithoutValidationShards) {
  FluxShardSpec posterior = FluxShardSpec::flux_tiny(5);
  posterior.mean_logvar = true;
  const fs::path shard = write(posterior, "posterior/shard.safetensors");
  const TrainConfig config =
      load_train_config(run_args("posterior", {"--flux-shards=" + shard.parent_path().string(),
                                               "--eval-every=4", "--eval-iters=1"}));
  EXPECT_TRUE(test::Contains(open_flux_data(config).description,
                             "1 shard(s) (" + shard.parent_path().string() +
                                 "), 5 samples, latents [4, 8, 8] (mean+logvar) and 5 text "
                                 "tokens; x0 = 0.3611·(latent − 0.1159) (latent_scale and "
                                 "latent_shift from the shards' metadata); validation: the "
                                 "training shards' first 2 samples (not held out)"));
  const TrainOutcome outcome = run_training(config);
  EXPECT_EQ(outcome.steps_done, 4);
  ASSERT_TRUE(outcome.last_val_loss.has_value());
  EXPECT_TRUE(std::isfinite(*outcome.last_val_loss));
  EXPECT_TRUE(std::isfinite(outcome.last_loss));
}

TEST_F(FluxShardTrainingTest, DataLineDescribesTheShards) {
  const FluxTrainingData data = open_flux_data(load_train_config(shard_args("line", true)));
  EXPECT_EQ(data.shapes.get(), nullptr);
  EXPECT_TRUE(test::Contains(data.description, "2 shard(s) ("));
  EXPECT_TRUE(test::Contains(data.description,
                             "train_*.safetensors), 11 samples, latents [4, 8, 8] (latent) and 5 "
                             "text tokens"));
  EXPECT_TRUE(test::Contains(data.description, "validation: 1 shard(s) ("));
  EXPECT_TRUE(test::Contains(data.description, "val_a.safetensors), 4 samples"));
}

TEST_F(FluxShardTrainingTest, LatentNormalizationComesFromTheMetadataOrTheConfig) {
  const FluxTrainingData data = open_flux_data(load_train_config(shard_args("norm", false)));
  EXPECT_EQ(data.objective.latent_scale, 0.3611);
  EXPECT_EQ(data.objective.latent_shift, 0.1159);
  // A value the config changed must agree with the metadata.
  EXPECT_TRUE(test::Contains(data_error(shard_args("norm", false, {"--latent-scale=0.5"})),
                             "latent_scale: 0.5 contradicts the shards' metadata latent_scale = "
                             "0.3611 (" +
                                 (root_ / "shards" / "train_a.safetensors").string() + ")"));
  EXPECT_EQ(data_error(shard_args("norm", false, {"--latent-shift=0.1159"})), test::kNoError);

  // Shards without the metadata take the config's.
  FluxShardSpec bare = FluxShardSpec::flux_tiny(2);
  bare.metadata.erase("latent_scale");
  bare.metadata.erase("latent_shift");
  const fs::path shard = write(bare, "bare/shard.safetensors");
  const FluxTrainingData configured = open_flux_data(load_train_config(
      run_args("norm", {"--flux-shards=" + shard.string(), "--latent-scale=0.5"})));
  EXPECT_EQ(configured.objective.latent_scale, 0.5);
  EXPECT_EQ(configured.objective.latent_shift, 0.1159);
  EXPECT_TRUE(
      test::Contains(configured.description, "x0 = 0.5·(latent − 0.1159) (from the config)"));
}

TEST_F(FluxShardTrainingTest, ShardsThatDoNotFitAreErrorsNamingKeyAndFile) {
  const fs::path wide = write(FluxShardSpec{}, "wide/shard.safetensors");  // flux_535m's widths
  EXPECT_TRUE(test::Contains(
      data_error(run_args("errors", {"--flux-shards=" + wide.parent_path().string()})),
      "flux_shards: " + wide.string() +
          ": tensor 'latent': 16 latent channels pack into 64 features, the model's in_channels "
          "is 16 (expected 4 channels)"));

  const std::string nothing = (root_ / "shards" / "test_*.safetensors").string();
  EXPECT_TRUE(test::Contains(data_error(run_args("errors", {"--flux-shards=" + nothing})),
                             "flux_shards: '" + nothing + "': expected a folder"));

  FluxShardSpec longer_text = FluxShardSpec::flux_tiny(2);
  longer_text.text_tokens = 7;
  const fs::path longer = write(longer_text, "longer/shard.safetensors");
  EXPECT_TRUE(test::Contains(
      data_error(shard_args("errors", false, {"--flux-val-shards=" + longer.string()})),
      "flux_val_shards: " + longer.string() + ": tensor 't5': per-sample shape [7, 32]"));
}

TEST_F(FluxShardTrainingTest, ConfigRefusesWhatOnlyTheBuiltInDataDoes) {
  const auto load_error = [](const std::vector<std::string>& arguments) {
    return test::error_message<ConfigError>([&] { load_train_config(arguments); });
  };
  EXPECT_TRUE(test::Contains(
      load_error(shard_args("errors", false, {"--sample-prompts=a red circle on the left"})),
      "command line: --sample-prompts: the sample grids need the built-in shapes data"));
  EXPECT_TRUE(test::Contains(load_error(shard_args("errors", false, {"--image-size=16"})),
                             "command line: --image-size: sizes the built-in shapes pictures"));
  EXPECT_TRUE(test::Contains(load_error(run_args("errors", {"--flux-val-shards=val"})),
                             "command line: --flux-val-shards: validation shards go with "
                             "training shards"));
  // The larger presets train on shards only.
  EXPECT_TRUE(test::Contains(load_error({"--model=flux_535m", "--sample-prompts="}),
                             "flux_535m takes image tokens of 64 features, but the built-in "
                             "shapes data makes 16"));
  EXPECT_EQ(load_error({"--model=flux_535m", "--flux-shards=shards", "--sample-prompts="}),
            test::kNoError);
}

}  // namespace
}  // namespace fp8t::train
