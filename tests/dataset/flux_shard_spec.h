// Writes small Flux shards (data/flux_shards.h) for tests: the reader's, the batches' and the
// trainer's.
#pragma once

#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <map>
#include <random>
#include <string>
#include <vector>

#include "io/safetensors.h"
#include "numerics/float_bits.h"

namespace fp8t::test {

// A small shard, in memory, with flux_535m's widths by default: values are multiples of 1/64 in
// [−4, 4), bf16-representable so that both dtypes read back exactly.
struct FluxShardSpec {
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

  // flux_tiny's widths (4 latent channels, T5 32, CLIP 16), 8×8 latents: 16 image tokens.
  static FluxShardSpec flux_tiny(int64_t samples) {
    FluxShardSpec spec;
    spec.samples = samples;
    spec.channels = 4;
    spec.height = 8;
    spec.width = 8;
    spec.context_dim = 32;
    spec.pooled_dim = 16;
    return spec;
  }

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

  void write(const std::filesystem::path& path) const {
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

}  // namespace fp8t::test
