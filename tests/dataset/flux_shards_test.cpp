#include "data/flux_shards.h"

#include <gtest/gtest.h>

#include <fstream>
#include <limits>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"
#include "dataset/flux_shard_spec.h"
#include "io/safetensors.h"
#include "test_files.h"

namespace fp8t::data {
namespace {

namespace fs = std::filesystem;
using test::Contains;
using test::FluxShardSpec;

class FluxShardsTest : public ::testing::Test {
 protected:
  // Writes `spec` (filled with fresh values) as `name` and returns its path.
  fs::path write(FluxShardSpec spec, const std::string& name = "shard.safetensors") {
    spec.fill(seed_++);
    const fs::path path = folder_ / name;
    spec.write(path);
    return path;
  }

  // The one error check_flux_shards reports for a file, against flux_535m.
  std::string check_error(const fs::path& path) {
    const FluxConfig model = FluxConfig::preset("flux_535m");
    const std::vector<fs::path> paths = {path};
    const std::vector<FluxShardCheck> checks = check_flux_shards(paths, &model);
    EXPECT_EQ(checks.size(), 1u);
    EXPECT_FALSE(checks[0].error.empty()) << path;
    return checks[0].error;
  }

  test::TempFolder folder_;
  uint64_t seed_ = 1;
};

TEST_F(FluxShardsTest, SamplesReadBackExactlyInEveryModeAndDtype) {
  for (const bool mean_logvar : {false, true}) {
    for (const io::DType dtype : {io::DType::BF16, io::DType::F32}) {
      SCOPED_TRACE(::testing::Message()
                   << "mean_logvar " << mean_logvar << ", " << io::dtype_name(dtype));
      FluxShardSpec spec;
      spec.mean_logvar = mean_logvar;
      spec.dtype = dtype;
      spec.fill(seed_++);
      const fs::path path = folder_ / "shard.safetensors";
      spec.write(path);

      const FluxShard shard(path);
      const FluxShardLayout& layout = shard.layout();
      EXPECT_EQ(layout.samples, spec.samples);
      EXPECT_EQ(layout.mode, mean_logvar ? FluxLatentMode::MeanLogvar : FluxLatentMode::Latent);
      EXPECT_EQ(layout.latent.channels, 16);
      EXPECT_EQ(layout.latent.height, 4);
      EXPECT_EQ(layout.latent.width, 6);
      EXPECT_EQ(layout.text_tokens, 5);
      EXPECT_EQ(layout.context_dim, 4096);
      EXPECT_EQ(layout.pooled_dim, 768);
      EXPECT_TRUE(layout.has_t5_mask);
      EXPECT_EQ(layout.latent_dtype, dtype);
      EXPECT_EQ(shard.latent_scale(), 0.3611);
      EXPECT_EQ(shard.latent_shift(), 0.1159);

      FluxShardSample sample;
      for (const int64_t index : {int64_t{2}, int64_t{0}, int64_t{1}}) {
        shard.read_sample(index, sample);
        if (mean_logvar) {
          EXPECT_TRUE(sample.latent.empty());
          EXPECT_EQ(sample.latent_mean, spec.row("latent_mean", index));
          EXPECT_EQ(sample.latent_logvar, spec.row("latent_logvar", index));
        } else {
          EXPECT_EQ(sample.latent, spec.row("latent", index));
          EXPECT_TRUE(sample.latent_mean.empty());
        }
        EXPECT_EQ(sample.t5, spec.row("t5", index));
        EXPECT_EQ(sample.clip, spec.row("clip", index));
        const auto mask_begin = spec.mask.begin() + index * spec.text_tokens;
        EXPECT_EQ(sample.t5_mask, std::vector<int64_t>(mask_begin, mask_begin + spec.text_tokens));
      }
      EXPECT_TRUE(Contains(test::error_message([&] { shard.read_sample(3, sample); }),
                           "sample 3 out of range [0, 3)"));
    }
  }
}

TEST_F(FluxShardsTest, CheckAcceptsGoodShardsAndComparesAgainstTheModel) {
  FluxShardSpec latent;
  FluxShardSpec posterior;
  posterior.mean_logvar = true;
  posterior.with_mask = false;
  posterior.dtype = io::DType::F32;
  const std::vector<fs::path> paths = {write(latent, "a.safetensors"),
                                       write(latent, "b.safetensors")};
  const FluxConfig model = FluxConfig::preset("flux_535m");
  for (const FluxShardCheck& check : check_flux_shards(paths, &model)) {
    EXPECT_EQ(check.error, "") << check.path;
    ASSERT_TRUE(check.layout.has_value());
    EXPECT_EQ(check.layout->samples, 3);
  }
  // Without a model any widths pass; against flux_tiny the 16 channels are wrong.
  EXPECT_EQ(check_flux_shards(std::vector<fs::path>{write(posterior, "c.safetensors")}, nullptr)
                .at(0)
                .error,
            "");
  const FluxConfig tiny = FluxConfig::preset("flux_tiny");
  const std::string error = check_flux_shards(paths, &tiny).at(0).error;
  EXPECT_TRUE(Contains(error,
                       "a.safetensors: tensor 'latent': 16 latent channels pack into 64 "
                       "features, the model's in_channels is 16 (expected 4 channels)"));
}

TEST_F(FluxShardsTest, CheckNamesTheFileAndTensorOfEachDefect) {
  FluxShardSpec good;

  // A good shard without one tensor.
  const auto without = [&](const std::string& tensor) {
    FluxShardSpec spec = good;
    spec.fill(seed_);
    spec.values.erase(tensor);
    const fs::path path = folder_ / fmt::format("no_{}.safetensors", tensor);
    spec.write(path);
    return path;
  };
  EXPECT_TRUE(
      Contains(check_error(without("clip")), "no_clip.safetensors: tensor 'clip': missing"));
  EXPECT_TRUE(
      Contains(check_error(without("latent")), "no_latent.safetensors: tensor 'latent': missing"));

  FluxShardSpec short_t5 = good;
  short_t5.t5_samples = 2;
  EXPECT_TRUE(Contains(check_error(write(short_t5, "n_mismatch.safetensors")),
                       "n_mismatch.safetensors: tensor 't5': expected 3 samples (the first "
                       "dimension of latent), found 2"));

  FluxShardSpec odd = good;
  odd.height = 5;
  EXPECT_TRUE(Contains(check_error(write(odd, "odd.safetensors")),
                       "odd.safetensors: tensor 'latent': height and width must be even"));

  FluxShardSpec channels = good;
  channels.channels = 4;
  EXPECT_TRUE(Contains(check_error(write(channels, "channels.safetensors")),
                       "channels.safetensors: tensor 'latent': 4 latent channels pack into 16 "
                       "features, the model's in_channels is 64 (expected 16 channels)"));

  FluxShardSpec nan = good;
  nan.mean_logvar = true;
  nan.fill(seed_);
  nan.values["latent_logvar"][static_cast<size_t>(nan.latent_numel() + 7)] =
      std::numeric_limits<float>::quiet_NaN();
  nan.write(folder_ / "nan.safetensors");
  EXPECT_TRUE(Contains(check_error(folder_ / "nan.safetensors"),
                       "nan.safetensors: tensor 'latent_logvar': sample 1, element 7: nan"));

  FluxShardSpec format = good;
  format.metadata["format"] = "kohya-latents";
  EXPECT_TRUE(Contains(check_error(write(format, "format.safetensors")),
                       "format.safetensors: metadata 'format': expected 'fp8train-flux-shard', "
                       "found 'kohya-latents'"));

  EXPECT_TRUE(
      Contains(check_error(folder_ / "absent.safetensors"), "absent.safetensors: no such file"));
}

TEST_F(FluxShardsTest, CheckComparesShardsWithTheFirst) {
  FluxShardSpec first;
  FluxShardSpec longer_text = first;
  longer_text.text_tokens = 7;
  const std::vector<fs::path> paths = {write(first, "a.safetensors"),
                                       write(longer_text, "b.safetensors")};
  const std::vector<FluxShardCheck> checks = check_flux_shards(paths, nullptr);
  EXPECT_EQ(checks.at(0).error, "");
  EXPECT_TRUE(Contains(checks.at(1).error,
                       "b.safetensors: tensor 't5': per-sample shape [7, "
                       "4096]"));
}

TEST_F(FluxShardsTest, ShardSetReadsItsShardsAsOneListInOrder) {
  const FluxShardSpec three = FluxShardSpec::flux_tiny(3);
  FluxShardSpec two = FluxShardSpec::flux_tiny(2);
  two.fill(seed_++);
  two.write(folder_ / "b.safetensors");
  const std::vector<fs::path> paths = {write(three, "a.safetensors"), folder_ / "b.safetensors"};
  const FluxShardSet set(paths, FluxConfig::preset("flux_tiny"));
  EXPECT_EQ(set.shards().size(), 2u);
  EXPECT_EQ(set.samples(), 5);
  FluxShardSample sample;
  set.read_sample(3, sample);  // b's first
  EXPECT_EQ(sample.clip, two.row("clip", 0));
  set.read_sample(4, sample);
  EXPECT_EQ(sample.latent, two.row("latent", 1));
  EXPECT_TRUE(Contains(test::error_message([&] { set.read_sample(5, sample); }),
                       "sample 5 out of range [0, 5) of 2 shards"));
}

TEST_F(FluxShardsTest, ShardSetRefusesShardsThatDoNotFitTheModelOrEachOther) {
  const FluxConfig tiny = FluxConfig::preset("flux_tiny");
  const fs::path good = write(FluxShardSpec::flux_tiny(2), "a.safetensors");
  const auto error = [&](std::vector<fs::path> paths, const FluxShardSet* reference = nullptr) {
    return test::error_message([&] { static_cast<void>(FluxShardSet(paths, tiny, reference)); });
  };
  EXPECT_TRUE(Contains(error({write(FluxShardSpec{}, "wide.safetensors")}),
                       "wide.safetensors: tensor 'latent': 16 latent channels pack into 64 "
                       "features, the model's in_channels is 16 (expected 4 channels)"));
  FluxShardSpec longer_text = FluxShardSpec::flux_tiny(2);
  longer_text.text_tokens = 7;
  const fs::path longer = write(longer_text, "longer.safetensors");
  EXPECT_TRUE(Contains(error({good, longer}),
                       "longer.safetensors: tensor 't5': per-sample shape [7, 32], " +
                           good.string() + " has [5, 32]"));
  // Against a reference set: validation shards must match the training shards.
  const FluxShardSet training(std::vector<fs::path>{good}, tiny);
  EXPECT_TRUE(Contains(error({longer}, &training), "longer.safetensors: tensor 't5'"));
  EXPECT_EQ(error({good}, &training), test::kNoError);
  EXPECT_TRUE(Contains(error({}), "expected at least one Flux shard, found none"));
}

TEST_F(FluxShardsTest, ShardFilesComeFromAFolderOrAPatternInPathOrder) {
  const FluxShardSpec spec = FluxShardSpec::flux_tiny(1);
  const fs::path b = write(spec, "train_b.safetensors");
  const fs::path a = write(spec, "train_a.safetensors");
  const fs::path val = write(spec, "val_a.safetensors");
  std::ofstream(folder_ / "notes.txt") << "not a shard";
  EXPECT_EQ(find_flux_shard_files(folder_.path().string()), (std::vector<fs::path>{a, b, val}));
  EXPECT_EQ(find_flux_shard_files((folder_ / "train_*.safetensors").string()),
            (std::vector<fs::path>{a, b}));
  EXPECT_EQ(find_flux_shard_files(val.string()), std::vector<fs::path>{val});

  const std::string pattern = (folder_ / "test_*.safetensors").string();
  EXPECT_TRUE(Contains(test::error_message([&] { find_flux_shard_files(pattern); }),
                       "'" + pattern + "': expected a folder of .safetensors shards"));
  fs::create_directories(folder_ / "empty");
  EXPECT_TRUE(
      Contains(test::error_message([&] { find_flux_shard_files((folder_ / "empty").string()); }),
               "empty': a folder without .safetensors files"));
}

}  // namespace
}  // namespace fp8t::data
