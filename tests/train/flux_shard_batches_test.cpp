// Flux batches from precomputed shards: FluxShardSource's order, latents and validation samples
// through FluxBatchBuilder, on flux_tiny-sized shards written to a temporary folder.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <numeric>
#include <optional>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "dataset/flux_shard_spec.h"
#include "test_files.h"
#include "train/flux_batches.h"
#include "train/step_prefetch.h"

namespace fp8t::train {
namespace {

namespace fs = std::filesystem;
using test::FluxShardSpec;

constexpr double kScale = 0.5;
constexpr double kShift = 0.25;

bool same(const FluxBatch& a, const FluxBatch& b) {
  return a.img == b.img && a.target == b.target && a.txt == b.txt && a.y == b.y &&
         a.timesteps == b.timesteps && a.guidance == b.guidance;
}

std::vector<float> slice(const std::vector<float>& values, int64_t index, int64_t size) {
  const auto begin = values.begin() + index * size;
  return {begin, begin + size};
}

class FluxShardBatchesTest : public ::testing::Test {
 protected:
  void SetUp() override { write_training_shards(false); }

  // Shards a (3 samples) and b (4): a list of N = 7.
  void write_training_shards(bool mean_logvar) {
    specs_.clear();
    paths_.clear();
    for (const auto& [name, samples] : {std::pair{"a", 3}, std::pair{"b", 4}}) {
      FluxShardSpec spec = FluxShardSpec::flux_tiny(samples);
      spec.mean_logvar = mean_logvar;
      spec.fill(seed_++);
      paths_.push_back(folder_ / fmt::format("{}.safetensors", name));
      spec.write(paths_.back());
      specs_.push_back(spec);
    }
  }

  data::FluxShardSet training() const { return data::FluxShardSet(paths_, model_); }

  static FluxObjectiveOptions objective(double cfg_dropout) {
    FluxObjectiveOptions options;
    options.latent_scale = kScale;
    options.latent_shift = kShift;
    options.cfg_dropout = cfg_dropout;
    return options;
  }

  // Tensor `name` of sample `index` of the training list.
  std::vector<float> row(const std::string& name, int64_t index) const {
    for (const FluxShardSpec& spec : specs_) {
      if (index < spec.samples) return spec.row(name, index);
      index -= spec.samples;
    }
    ADD_FAILURE() << "no sample " << index;
    return {};
  }

  // Which of `count` samples (by their CLIP vectors, `clip_of`) sample b of the batch is.
  template <typename ClipOf>
  static int64_t identify(const FluxBatch& batch, int64_t b, int64_t count, ClipOf clip_of) {
    const std::vector<float> pooled = slice(batch.y, b, 16);
    for (int64_t i = 0; i < count; ++i) {
      if (clip_of(i) == pooled) return i;
    }
    ADD_FAILURE() << "sample " << b << " of the batch is in no shard";
    return -1;
  }
  int64_t training_sample_in(const FluxBatch& batch, int64_t b) const {
    return identify(batch, b, 7, [&](int64_t i) { return row("clip", i); });
  }

  // x0 of sample b, packed: x_t − σ·target.
  static std::vector<float> x0_of(const FluxBatch& batch, int64_t b) {
    const size_t size = 16 * 16;  // 16 tokens of 16 features
    std::vector<float> x0(size);
    const float sigma = batch.timesteps[size_t(b)];
    for (size_t i = 0; i < size; ++i) {
      const size_t at = size_t(b) * size + i;
      x0[i] = batch.img[at] - sigma * batch.target[at];
    }
    return x0;
  }

  // A latent [4, 8, 8] packed into 16 tokens.
  static std::vector<float> packed(const std::vector<float>& latent) {
    std::vector<float> tokens(latent.size());
    pack_latents(tokens.data(), latent.data(), LatentShape{4, 8, 8});
    return tokens;
  }

  const FluxConfig model_ = FluxConfig::preset("flux_tiny");
  test::TempFolder folder_;
  std::vector<FluxShardSpec> specs_;
  std::vector<fs::path> paths_;
  uint64_t seed_ = 1;
};

TEST_F(FluxShardBatchesTest, TrainingBatchesAreAFunctionOfSeedStepAndMicroBatch) {
  for (const bool mean_logvar : {false, true}) {
    SCOPED_TRACE(mean_logvar ? "mean+logvar" : "latent");
    write_training_shards(mean_logvar);
    const FluxShardSource source(training(), std::nullopt, 5);
    const FluxBatchBuilder builder(source, model_, objective(0.5), 2, 5);
    FluxBatch first, again, other;
    builder.training_batch(9, 1, 2, first);  // positions 38 and 39: epoch 5
    builder.training_batch(0, 0, 2, other);  // epoch 0
    builder.training_batch(9, 1, 2, again);
    EXPECT_TRUE(same(first, again));
    EXPECT_FALSE(same(first, other));

    // A resumed run's builder starts at its step, with nothing before it.
    const FluxShardSource resumed_source(training(), std::nullopt, 5);
    const FluxBatchBuilder resumed(resumed_source, model_, objective(0.5), 2, 5);
    resumed.training_batch(9, 1, 2, again);
    EXPECT_TRUE(same(first, again));

    const FluxShardSource reseeded_source(training(), std::nullopt, 6);
    const FluxBatchBuilder reseeded(reseeded_source, model_, objective(0.5), 2, 6);
    reseeded.training_batch(9, 1, 2, other);
    EXPECT_NE(first.timesteps, other.timesteps);

    // The layout the model takes: 16 tokens of 16 features, 5 text tokens of 32.
    EXPECT_EQ(first.img.size(), 2u * 16 * 16);
    EXPECT_EQ(first.txt.size(), 2u * 5 * 32);
    EXPECT_EQ(first.y.size(), 2u * 16);
  }
}

// The trainer's loading ahead (StepPrefetch) on a thread of its own, epochs crossed on the way,
// gives every step the micro-batches a builder of its own makes in turn.
TEST_F(FluxShardBatchesTest, BatchesLoadedAheadAreTheOnesMadeInTurn) {
  const FluxShardSource source(training(), std::nullopt, 5);
  const FluxBatchBuilder builder(source, model_, objective(0.5), 2, 5);
  StepPrefetch<std::vector<FluxBatch>> prefetch(
      [&](int64_t step, std::vector<FluxBatch>& micro_batches) {
        micro_batches.resize(2);
        for (int64_t micro = 0; micro < 2; ++micro)
          builder.training_batch(step, micro, 2, micro_batches[size_t(micro)]);
      });
  const FluxShardSource direct_source(training(), std::nullopt, 5);
  const FluxBatchBuilder direct(direct_source, model_, objective(0.5), 2, 5);
  constexpr int64_t kSteps = 6;  // 24 samples: three epochs of 7 and more
  for (int64_t step = 0; step < kSteps; ++step) {
    const std::vector<FluxBatch>& loaded = prefetch.take(step, step + 1 < kSteps ? step + 1 : -1);
    for (int64_t micro = 0; micro < 2; ++micro) {
      FluxBatch expected;
      direct.training_batch(step, micro, 2, expected);
      EXPECT_TRUE(same(loaded[size_t(micro)], expected)) << "step " << step << ", micro " << micro;
    }
    prefetch.wait();
  }
}

// Micro-batches of 2 over N = 7 samples: epochs end inside a micro-batch.
TEST_F(FluxShardBatchesTest, EachEpochVisitsEverySampleOnceInItsOwnOrder) {
  const FluxShardSource source(training(), std::nullopt, 5);
  const FluxBatchBuilder builder(source, model_, objective(0.0), 2, 5);
  std::vector<int64_t> visited;
  FluxBatch batch;
  for (int64_t step = 0; step < 7; ++step) {
    builder.training_batch(step, 0, 1, batch);
    for (int64_t b = 0; b < 2; ++b) {
      const int64_t sample = training_sample_in(batch, b);
      visited.push_back(sample);
      // x0 = scale · (latent − shift), packed; the text as stored.
      std::vector<float> x0 = row("latent", sample);
      for (float& value : x0)
        value = float(kScale * (value - kShift));
      const std::vector<float> expected = packed(x0);
      const std::vector<float> actual = x0_of(batch, b);
      for (size_t i = 0; i < expected.size(); ++i)
        ASSERT_NEAR(actual[i], expected[i], 1e-5) << "step " << step << ", element " << i;
      EXPECT_EQ(slice(batch.txt, b, 5 * 32), row("t5", sample));
    }
  }
  std::vector<int64_t> identity(7);
  std::iota(identity.begin(), identity.end(), int64_t{0});
  std::vector<std::vector<int64_t>> orders;
  for (int64_t epoch = 0; epoch < 2; ++epoch) {
    const std::vector<int64_t>& order =
        orders.emplace_back(visited.begin() + epoch * 7, visited.begin() + epoch * 7 + 7);
    // The documented rule: Fisher–Yates from the identity, seeded by (seed, epoch, 2^32 − 2).
    std::vector<int64_t> expected = identity;
    std::seed_seq seeds{5u, 0u, static_cast<uint32_t>(epoch), 0u, 0xFFFFFFFEu};
    std::mt19937_64 generator(seeds);
    for (size_t i = expected.size(); i > 1; --i)
      std::swap(expected[i - 1], expected[size_t(generator() % i)]);
    EXPECT_EQ(order, expected) << "epoch " << epoch;
    std::vector<int64_t> sorted = order;
    std::sort(sorted.begin(), sorted.end());
    EXPECT_EQ(sorted, identity) << "epoch " << epoch;
  }
  EXPECT_NE(orders[0], identity);
  EXPECT_NE(orders[0], orders[1]);
}

// latent = mean + exp(logvar / 2)·n: each epoch draws other latents, and the draws, standardized
// by the stored mean and log-variance, have a mean square of about 1.
TEST_F(FluxShardBatchesTest, MeanLogvarShardsDrawNewLatentsEachEpoch) {
  write_training_shards(true);
  const FluxShardSource source(training(), std::nullopt, 5);
  const FluxBatchBuilder builder(source, model_, objective(0.0), 7, 5);  // a step is an epoch
  FluxBatch epoch0, epoch1;
  builder.training_batch(0, 0, 1, epoch0);
  builder.training_batch(1, 0, 1, epoch1);
  double square_sum = 0.0;
  int64_t count = 0;
  for (int64_t sample = 0; sample < 7; ++sample) {
    std::vector<std::vector<float>> draws;
    for (const FluxBatch* batch : {&epoch0, &epoch1}) {
      for (int64_t b = 0; b < 7; ++b) {
        if (training_sample_in(*batch, b) == sample) draws.push_back(x0_of(*batch, b));
      }
    }
    ASSERT_EQ(draws.size(), 2u) << "sample " << sample << " once per epoch";
    EXPECT_NE(draws[0], draws[1]) << "sample " << sample;
    const std::vector<float> mean = packed(row("latent_mean", sample));
    const std::vector<float> logvar = packed(row("latent_logvar", sample));
    for (const std::vector<float>& x0 : draws) {
      for (size_t i = 0; i < x0.size(); ++i) {
        const double latent = x0[i] / kScale + kShift;
        const double n = (latent - mean[i]) / std::exp(logvar[i] / 2.0);
        square_sum += n * n;
        ++count;
      }
    }
  }
  EXPECT_NEAR(square_sum / double(count), 1.0, 0.1);
}

TEST_F(FluxShardBatchesTest, ValidationBatchesAreFixedAndComeFromTheValidationShards) {
  FluxShardSpec held_out = FluxShardSpec::flux_tiny(3);
  held_out.fill(seed_++);
  const std::vector<fs::path> validation_paths = {folder_ / "val.safetensors"};
  held_out.write(validation_paths[0]);
  const data::FluxShardSet reference = training();
  const FluxShardSource source(training(), data::FluxShardSet(validation_paths, model_, &reference),
                               5);
  const FluxBatchBuilder builder(source, model_, objective(0.5), 2, 5);
  FluxBatch first, again;
  builder.validation_batch(1, first);  // validation samples 2 and 3 = 0 (of 3)
  builder.validation_batch(0, again);
  builder.validation_batch(1, again);
  EXPECT_TRUE(same(first, again));
  const auto held_out_clip = [&](int64_t i) { return held_out.row("clip", i); };
  EXPECT_EQ(identify(first, 0, 3, held_out_clip), 2);
  EXPECT_EQ(identify(first, 1, 3, held_out_clip), 0);

  // Without validation shards: the training list in its stored order, not held out.
  const FluxShardSource without(training(), std::nullopt, 5);
  const FluxBatchBuilder training_only(without, model_, objective(0.5), 2, 5);
  training_only.validation_batch(3, first);  // samples 6 and 7 = 0 (of 7)
  EXPECT_EQ(training_sample_in(first, 0), 6);
  EXPECT_EQ(training_sample_in(first, 1), 0);
}

TEST_F(FluxShardBatchesTest, GuidanceDropoutTrainsOnZeroTextInputs) {
  const FluxShardSource source(training(), std::nullopt, 5);
  const FluxBatchBuilder builder(source, model_, objective(1.0), 2, 5);
  FluxBatch batch;
  builder.training_batch(0, 0, 1, batch);
  EXPECT_EQ(batch.txt, std::vector<float>(batch.txt.size(), 0.0f));
  EXPECT_EQ(batch.y, std::vector<float>(batch.y.size(), 0.0f));
}

}  // namespace
}  // namespace fp8t::train
