#include "data/flux_shards.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <map>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"
#include "io/safetensors.h"
#include "numerics/float_bits.h"
#include "test_files.h"

namespace fp8t::data {
namespace {

namespace fs = std::filesystem;
using test::Contains;

// A small shard, in memory: values are bf16-representable so that both dtypes read back exactly.
struct ShardSpec {
  int64_t samples = 3;
  int64_t channels = 16;
  int64_t height = 4;
  int64_t width = 6;
  int64_t text_tokens = 5;
  int64_t context_dim = 4096;
  int64_t pooled_dim = 768;
  bool mean_logvar = false;
  int64_t t5_samples = 0;  // 0: samples; else t5 alone has this many (a defect)
  bool with_mask = true;
  io::DType dtype = io::DType::BF16;  // of every float tensor
  std::map<std::string, std::string> metadata = {
      {"format", "fp8train-flux-shard"}, {"version", "1"},           {"vae", "FLUX.1 ae"},
      {"latent_scale", "0.3611"},        {"latent_shift", "0.1159"}, {"image_size", "48"}};
  std::map<std::string, std::vector<float>> values;  // filled by fill()
  std::vector<uint8_t> mask;

  int64_t latent_numel() const { return channels * height * width; }

  void fill(uint64_t seed) {
    std::mt19937_64 generator(seed);
    // Multiples of 1/64 in [-4, 4): exact in bf16.
    const auto random_values = [&](int64_t count) {
      std::vector<float> out(static_cast<size_t>(count));
      for (float& v : out)
        v = static_cast<float>(static_cast<int>(generator() % 512) - 256) / 64;
      return out;
    };
    values.clear();
    for (const char* name : mean_logvar ? std::vector<const char*>{"latent_mean", "latent_logvar"}
                                        : std::vector<const char*>{"latent"}) {
      values[name] = random_values(io::shape_numel(shape_of(name)));
    }
    values["t5"] = random_values(io::shape_numel(shape_of("t5")));
    values["clip"] = random_values(io::shape_numel(shape_of("clip")));
    mask.assign(static_cast<size_t>(samples * text_tokens), 0);
    for (size_t i = 0; i < mask.size(); ++i)
      mask[i] = i % 5 < 3 ? 1 : 0;
  }

  std::vector<int64_t> shape_of(const std::string& name) const {
    if (name == "t5") return {t5_samples > 0 ? t5_samples : samples, text_tokens, context_dim};
    if (name == "clip") return {samples, pooled_dim};
    return {samples, channels, height, width};
  }

  void write(const fs::path& path) const {
    std::vector<std::vector<bf16>> bf16_copies;
    bf16_copies.reserve(values.size());
    std::vector<io::TensorToWrite> tensors;
    for (const auto& [name, data] : values) {
      if (dtype == io::DType::F32) {
        tensors.push_back(io::TensorToWrite::of<float>(name, shape_of(name), data));
        continue;
      }
      std::vector<bf16>& copy = bf16_copies.emplace_back(data.size());
      for (size_t i = 0; i < data.size(); ++i)
        copy[i] = float_to_bf16(data[i]);
      tensors.push_back(io::TensorToWrite::of<bf16>(name, shape_of(name), copy));
    }
    if (with_mask) {
      tensors.push_back(io::TensorToWrite::of<uint8_t>("t5_mask", {samples, text_tokens}, mask));
    }
    io::write_safetensors(path, tensors, metadata);
  }

  // Sample `index` of tensor `name`, [per-sample numel].
  std::vector<float> row(const std::string& name, int64_t index) const {
    const std::vector<float>& all = values.at(name);
    const size_t size = all.size() / static_cast<size_t>(samples);
    const auto begin = all.begin() + static_cast<std::ptrdiff_t>(size * static_cast<size_t>(index));
    return {begin, begin + static_cast<std::ptrdiff_t>(size)};
  }
};

class FluxShardsTest : public ::testing::Test {
 protected:
  // Writes `spec` (filled with fresh values) as `name` and returns its path.
  fs::path write(ShardSpec spec, const std::string& name = "shard.safetensors") {
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
      ShardSpec spec;
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
  ShardSpec latent;
  ShardSpec posterior;
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
  ShardSpec good;

  // A good shard without one tensor.
  const auto without = [&](const std::string& tensor) {
    ShardSpec spec = good;
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

  ShardSpec short_t5 = good;
  short_t5.t5_samples = 2;
  EXPECT_TRUE(Contains(check_error(write(short_t5, "n_mismatch.safetensors")),
                       "n_mismatch.safetensors: tensor 't5': expected 3 samples (the first "
                       "dimension of latent), found 2"));

  ShardSpec odd = good;
  odd.height = 5;
  EXPECT_TRUE(Contains(check_error(write(odd, "odd.safetensors")),
                       "odd.safetensors: tensor 'latent': height and width must be even"));

  ShardSpec channels = good;
  channels.channels = 4;
  EXPECT_TRUE(Contains(check_error(write(channels, "channels.safetensors")),
                       "channels.safetensors: tensor 'latent': 4 latent channels pack into 16 "
                       "features, the model's in_channels is 64 (expected 16 channels)"));

  ShardSpec nan = good;
  nan.mean_logvar = true;
  nan.fill(seed_);
  nan.values["latent_logvar"][static_cast<size_t>(nan.latent_numel() + 7)] =
      std::numeric_limits<float>::quiet_NaN();
  nan.write(folder_ / "nan.safetensors");
  EXPECT_TRUE(Contains(check_error(folder_ / "nan.safetensors"),
                       "nan.safetensors: tensor 'latent_logvar': sample 1, element 7: nan"));

  ShardSpec format = good;
  format.metadata["format"] = "kohya-latents";
  EXPECT_TRUE(Contains(check_error(write(format, "format.safetensors")),
                       "format.safetensors: metadata 'format': expected 'fp8train-flux-shard', "
                       "found 'kohya-latents'"));

  EXPECT_TRUE(
      Contains(check_error(folder_ / "absent.safetensors"), "absent.safetensors: no such file"));
}

TEST_F(FluxShardsTest, CheckComparesShardsWithTheFirst) {
  ShardSpec first;
  ShardSpec longer_text = first;
  longer_text.text_tokens = 7;
  const std::vector<fs::path> paths = {write(first, "a.safetensors"),
                                       write(longer_text, "b.safetensors")};
  const std::vector<FluxShardCheck> checks = check_flux_shards(paths, nullptr);
  EXPECT_EQ(checks.at(0).error, "");
  EXPECT_TRUE(Contains(checks.at(1).error,
                       "b.safetensors: tensor 't5': per-sample shape [7, "
                       "4096]"));
}

}  // namespace
}  // namespace fp8t::data
