// Grids of Flux samples for prompts in the words of the built-in shapes data's captions: one row
// per prompt, one column per seed, decoded to pixels by the dataset and written as a PNG. The
// trainer writes them during and after training; `fp8train sample` from a checkpoint.
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "data/flux_shapes.h"
#include "models/flux_sampling.h"

namespace fp8t::train {

// "a; b ;c" -> {"a", "b", "c"}: split at ';', spaces around each prompt trimmed, empty ones
// dropped.
std::vector<std::string> split_prompts(std::string_view text);

struct FluxGridOptions {
  std::vector<std::string> prompts;  // the rows
  int64_t images_per_prompt = 4;     // the columns
  uint64_t seed = 0;                 // column j starts from the noise of seed + j, in every row
  FluxSamplingOptions sampling;
  // The latent normalization of training, undone before decoding.
  double latent_scale = 1.0;
  double latent_shift = 0.0;
};

class FluxSampleGrid {
 public:
  // Pixels between and around the pictures, mid grey so that black backgrounds stand out.
  static constexpr int kGap = 2;
  static constexpr uint8_t kGapGrey = 128;

  // Throws fp8t::Error naming the first prompt with a word the data does not know, or one
  // that is too long.
  FluxSampleGrid(const data::FluxShapesDataset& dataset, const FluxConfig& model,
                 FluxGridOptions options);

  int width() const;
  int height() const;
  const FluxGridOptions& options() const { return options_; }

  // Every picture's packed latents [pictures, tokens, token_dim], row by row, sampled with
  // `predict` (sample_flux: 2·pictures rows a step, the pictures alone with the guidance
  // embedder): a training model's forward, on whatever device it runs.
  std::vector<float> sample(const FluxPredict& predict) const;
  // Decodes sample()'s latents into the grid and writes it to `path`.
  void write(std::span<const float> latents, const std::filesystem::path& path) const;
  // Both, with a BF16 model of the grid's own (made on first use) holding a copy of `weights`.
  void write(const FluxParameterSet& weights, const std::filesystem::path& path);

 private:
  const data::FluxShapesDataset& dataset_;
  FluxConfig model_;
  FluxGridOptions options_;
  LatentShape latent_;
  std::vector<float> img_ids_, txt_, pooled_;  // the prompts' encodings, one per picture
  std::unique_ptr<FluxSampler> sampler_;
};

}  // namespace fp8t::train
