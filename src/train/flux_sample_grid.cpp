#include "train/flux_sample_grid.h"

#include <algorithm>
#include <cstring>
#include <random>
#include <utility>

#include "core/error.h"
#include "io/png.h"
#include "models/flux_objective.h"

namespace fp8t::train {

std::vector<std::string> split_prompts(std::string_view text) {
  std::vector<std::string> prompts;
  for (size_t start = 0; start <= text.size();) {
    const size_t end = std::min(text.find(';', start), text.size());
    std::string_view prompt = text.substr(start, end - start);
    while (!prompt.empty() && prompt.front() == ' ')
      prompt.remove_prefix(1);
    while (!prompt.empty() && prompt.back() == ' ')
      prompt.remove_suffix(1);
    if (!prompt.empty()) prompts.emplace_back(prompt);
    start = end + 1;
  }
  return prompts;
}

namespace {

int64_t picture_count(const FluxGridOptions& options) {
  FP8T_CHECK(!options.prompts.empty() && options.images_per_prompt >= 1,
             "a sample grid needs at least one prompt and one image per prompt, found {} and {}",
             options.prompts.size(), options.images_per_prompt);
  return std::ssize(options.prompts) * options.images_per_prompt;
}

}  // namespace

FluxSampleGrid::FluxSampleGrid(const data::FluxShapesDataset& dataset, const FluxConfig& model,
                               FluxGridOptions options)
    : dataset_(dataset),
      model_(model),
      options_(std::move(options)),
      latent_{data::kFluxShapesLatentChannels, dataset.options().image_size,
              dataset.options().image_size} {
  picture_count(options_);  // throws for an empty grid
  img_ids_.resize(size_t(latent_.tokens() * 3));
  latent_image_ids(img_ids_.data(), latent_);
  for (const std::string& prompt : options_.prompts) {
    const data::CaptionEncoding encoding = dataset.encode_caption(prompt);
    for (int64_t column = 0; column < options_.images_per_prompt; ++column) {
      txt_.insert(txt_.end(), encoding.txt.begin(), encoding.txt.end());
      pooled_.insert(pooled_.end(), encoding.pooled.begin(), encoding.pooled.end());
    }
  }
}

int FluxSampleGrid::width() const {
  const int size = dataset_.options().image_size;
  return int(options_.images_per_prompt) * (size + kGap) + kGap;
}

int FluxSampleGrid::height() const {
  const int size = dataset_.options().image_size;
  return int(options_.prompts.size()) * (size + kGap) + kGap;
}

std::vector<float> FluxSampleGrid::sample(const FluxPredict& predict) const {
  const int64_t pictures = picture_count(options_);
  const int64_t per_picture = latent_.numel();  // = tokens · token_dim
  std::vector<float> x(size_t(pictures * per_picture));
  for (int64_t column = 0; column < options_.images_per_prompt; ++column) {
    std::vector<float> noise(static_cast<size_t>(per_picture));
    const uint64_t seed = options_.seed + uint64_t(column);
    std::seed_seq seeds{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32)};
    std::mt19937_64 generator(seeds);
    fill_standard_normal(noise.data(), per_picture, generator);
    for (size_t row = 0; row < options_.prompts.size(); ++row) {
      const int64_t picture = int64_t(row) * options_.images_per_prompt + column;
      std::copy(noise.begin(), noise.end(), x.begin() + picture * per_picture);
    }
  }
  const data::CaptionEncoding& empty = dataset_.empty_encodings();
  sample_flux(model_, latent_.tokens(), dataset_.options().text_tokens, x, img_ids_, txt_, pooled_,
              empty.txt, empty.pooled, options_.sampling, predict);
  return x;
}

void FluxSampleGrid::write(std::span<const float> latents,
                           const std::filesystem::path& path) const {
  const int64_t pictures = picture_count(options_);
  const int64_t per_picture = latent_.numel();
  FP8T_CHECK(std::ssize(latents) == pictures * per_picture,
             "a grid of {} pictures: expected {} latent values, found {}", pictures,
             pictures * per_picture, latents.size());
  const int size = dataset_.options().image_size;
  std::vector<uint8_t> grid(size_t(width()) * size_t(height()) * 3, kGapGrey);
  std::vector<float> latent(static_cast<size_t>(per_picture));
  for (int64_t picture = 0; picture < pictures; ++picture) {
    unpack_latents(latent.data(), latents.data() + picture * per_picture, latent_);
    denormalize_latents(latent.data(), latent.data(), per_picture, options_.latent_scale,
                        options_.latent_shift);
    const data::RgbImage image = dataset_.decode(latent);
    const int left = kGap + int(picture % options_.images_per_prompt) * (size + kGap);
    const int top = kGap + int(picture / options_.images_per_prompt) * (size + kGap);
    for (int y = 0; y < size; ++y) {
      std::copy_n(image.pixels.begin() + ptrdiff_t(y) * size * 3, size * 3,
                  grid.begin() + (ptrdiff_t(top + y) * width() + left) * 3);
    }
  }
  io::write_png(path, width(), height(), grid);
}

void FluxSampleGrid::write(const FluxParameterSet& weights, const std::filesystem::path& path) {
  if (!sampler_) {
    sampler_ = std::make_unique<FluxSampler>(model_, picture_count(options_), latent_.tokens(),
                                             dataset_.options().text_tokens);
  }
  FluxParameterSet& copy = sampler_->parameters();
  for (const FluxParam& param : copy.specs()) {
    const TensorView& source = weights[param.name];
    FP8T_CHECK(source.numel() == param.numel(), "parameter '{}': expected {} values, found {}",
               param.name, param.numel(), source.numel());
    std::memcpy(copy[param.name].raw(), source.raw(), source.bytes());
  }
  write(sample(sampler_->predict()), path);
}

}  // namespace fp8t::train
