#include "models/flux_sampling.h"

#include <algorithm>

#include "core/error.h"

namespace fp8t {

std::vector<double> flow_sigma_schedule(int steps, double shift) {
  FP8T_CHECK(steps >= 1, "expected at least one sampling step, found {}", steps);
  FP8T_CHECK(shift > 0.0, "expected a shift > 0, found {}", shift);
  std::vector<double> sigmas(size_t(steps) + 1);
  for (int i = 0; i <= steps; ++i)
    sigmas[size_t(i)] = shift_sigma(1.0 - double(i) / double(steps), shift);
  return sigmas;
}

void euler_flow_integrate(std::span<float> x, std::span<const double> sigmas,
                          const VelocityField& velocity) {
  std::vector<float> v(x.size());
  for (size_t i = 0; i + 1 < sigmas.size(); ++i) {
    velocity(x, sigmas[i], v);
    const auto step = static_cast<float>(sigmas[i + 1] - sigmas[i]);
    for (size_t j = 0; j < x.size(); ++j)
      x[j] += step * v[j];
  }
}

FluxSampler::FluxSampler(const FluxConfig& config, int64_t images, int64_t img_tokens,
                         int64_t txt_tokens)
    : config_(config), images_(images), img_tokens_(img_tokens), txt_tokens_(txt_tokens) {
  FP8T_CHECK(images >= 1, "expected at least one image to sample, found {}", images);
  ModelPrecision precision = ModelPrecision::fp32_reference();
  precision.other_linears = ops::LinearOperands::Bf16;
  const int64_t batch = config.guidance_embed ? images : 2 * images;
  model_ = std::make_unique<FluxModel>(config, batch, img_tokens, txt_tokens, precision);
}

void sample_flux(const FluxConfig& config, int64_t img_tokens, int64_t txt_tokens,
                 std::span<float> x, std::span<const float> img_ids, std::span<const float> txt,
                 std::span<const float> pooled, std::span<const float> empty_txt,
                 std::span<const float> empty_pooled, const FluxSamplingOptions& options,
                 const FluxPredict& predict) {
  const int64_t per_image = img_tokens * config.in_channels;
  const int64_t txt_per_image = txt_tokens * config.context_in_dim;
  const int64_t pooled_per_image = config.vec_in_dim;
  const int64_t images = std::ssize(x) / per_image;
  FP8T_CHECK(
      images >= 1 && std::ssize(x) == images * per_image && std::ssize(img_ids) == img_tokens * 3 &&
          std::ssize(txt) == images * txt_per_image &&
          std::ssize(pooled) == images * pooled_per_image &&
          std::ssize(empty_txt) == txt_per_image && std::ssize(empty_pooled) == pooled_per_image,
      "sampling {} images: expected {} noise, {} id, {} + {} text and {} + {} pooled values, "
      "found {}, {}, {} + {} and {} + {}",
      images, images * per_image, img_tokens * 3, images * txt_per_image, txt_per_image,
      images * pooled_per_image, pooled_per_image, x.size(), img_ids.size(), txt.size(),
      empty_txt.size(), pooled.size(), empty_pooled.size());
  // The prompts fill the first `images` rows of the batch; for classifier-free guidance the
  // empty caption fills the rest.
  const bool with_empty_caption = !config.guidance_embed;
  const int64_t batch = with_empty_caption ? 2 * images : images;
  std::vector<float> img(size_t(batch * per_image)), prediction(img.size());
  std::vector<float> batch_txt(size_t(batch * txt_per_image)),
      batch_pooled(size_t(batch * pooled_per_image));
  std::copy(txt.begin(), txt.end(), batch_txt.begin());
  std::copy(pooled.begin(), pooled.end(), batch_pooled.begin());
  for (int64_t b = images; b < batch; ++b) {
    std::copy(empty_txt.begin(), empty_txt.end(), batch_txt.begin() + b * txt_per_image);
    std::copy(empty_pooled.begin(), empty_pooled.end(),
              batch_pooled.begin() + b * pooled_per_image);
  }
  std::vector<float> timesteps(static_cast<size_t>(batch));
  std::vector<float> guidance(with_empty_caption ? 0 : size_t(batch),
                              static_cast<float>(options.guidance));
  const FluxInputs inputs{img.data(),       img_ids.data(),
                          batch_txt.data(), batch_pooled.data(),
                          timesteps.data(), with_empty_caption ? nullptr : guidance.data()};
  const auto g = static_cast<float>(options.guidance);
  euler_flow_integrate(
      x, flow_sigma_schedule(options.steps, options.shift),
      [&](std::span<const float> current, double sigma, std::span<float> velocity) {
        std::copy(current.begin(), current.end(), img.begin());
        if (with_empty_caption)
          std::copy(current.begin(), current.end(), img.begin() + std::ssize(x));
        std::fill(timesteps.begin(), timesteps.end(), static_cast<float>(sigma));
        predict(inputs, batch, prediction.data());
        for (size_t i = 0; i < velocity.size(); ++i) {
          const float prompt = prediction[i];
          const float empty = with_empty_caption ? prediction[i + x.size()] : 0.0f;
          velocity[i] = with_empty_caption ? empty + g * (prompt - empty) : prompt;
        }
      });
}

void FluxSampler::sample(std::span<float> x, std::span<const float> img_ids,
                         std::span<const float> txt, std::span<const float> pooled,
                         std::span<const float> empty_txt, std::span<const float> empty_pooled,
                         const FluxSamplingOptions& options) {
  sample_flux(config_, img_tokens_, txt_tokens_, x, img_ids, txt, pooled, empty_txt, empty_pooled,
              options, predict());
}

FluxPredict FluxSampler::predict() {
  model_->weights_changed();
  const int64_t batch = config_.guidance_embed ? images_ : 2 * images_;
  return [this, batch](const FluxInputs& inputs, int64_t rows, float* prediction) {
    FP8T_CHECK(rows == batch, "expected a sampling batch of {} rows, found {}", batch, rows);
    model_->forward(inputs, prediction);
  };
}

}  // namespace fp8t
