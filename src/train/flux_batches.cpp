#include "train/flux_batches.h"

#include <algorithm>

#include "core/error.h"

namespace fp8t::train {

namespace {

constexpr int64_t kFirstValidationSample = int64_t{1} << 62;
constexpr uint32_t kValidationTag = 0xFFFFFFFFu;

std::mt19937_64 generator_for(uint64_t seed, int64_t position, uint32_t tag) {
  const auto bits = static_cast<uint64_t>(position);
  std::seed_seq seeds{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32),
                      static_cast<uint32_t>(bits), static_cast<uint32_t>(bits >> 32), tag};
  return std::mt19937_64(seeds);
}

}  // namespace

FluxBatchBuilder::FluxBatchBuilder(const data::FluxShapesDataset& dataset, const FluxConfig& model,
                                   const FluxObjectiveOptions& objective, int64_t batch,
                                   uint64_t seed)
    : dataset_(dataset),
      model_(model),
      objective_(objective),
      batch_(batch),
      seed_(seed),
      latent_{data::kFluxShapesLatentChannels, dataset.options().image_size,
              dataset.options().image_size} {
  FP8T_CHECK(batch >= 1, "expected a micro-batch of at least 1, found {}", batch);
  FP8T_CHECK(latent_.token_dim() == model.in_channels &&
                 dataset.options().context_dim == model.context_in_dim &&
                 dataset.options().pooled_dim == model.vec_in_dim,
             "the data's image tokens, text tokens and pooled vectors have {}, {} and {} "
             "features, the model takes {}, {} and {}",
             latent_.token_dim(), dataset.options().context_dim, dataset.options().pooled_dim,
             model.in_channels, model.context_in_dim, model.vec_in_dim);
  img_ids_.resize(size_t(latent_.tokens() * 3));
  latent_image_ids(img_ids_.data(), latent_);
}

void FluxBatchBuilder::load_samples(int64_t first, FluxBatch& out) const {
  const int64_t per_sample = latent_.numel();
  const int64_t txt_per_sample = int64_t(dataset_.options().text_tokens) * model_.context_in_dim;
  out.target.resize(size_t(batch_ * per_sample));
  out.txt.resize(size_t(batch_ * txt_per_sample));
  out.y.resize(size_t(batch_ * model_.vec_in_dim));
  data::FluxSample sample;
  std::vector<float> x0(static_cast<size_t>(per_sample));
  for (int64_t b = 0; b < batch_; ++b) {
    dataset_.sample(first + b, sample);
    normalize_latents(x0.data(), sample.latent.data(), per_sample, objective_.latent_scale,
                      objective_.latent_shift);
    pack_latents(out.target.data() + b * per_sample, x0.data(), latent_);
    std::copy(sample.txt.begin(), sample.txt.end(), out.txt.begin() + b * txt_per_sample);
    std::copy(sample.pooled.begin(), sample.pooled.end(), out.y.begin() + b * model_.vec_in_dim);
  }
  out.guidance.assign(model_.guidance_embed ? size_t(batch_) : 0, 1.0f);
}

void FluxBatchBuilder::add_noise(std::mt19937_64& generator, FluxBatch& out) const {
  const int64_t per_sample = latent_.numel();
  out.timesteps.resize(size_t(batch_));
  sample_sigmas(out.timesteps.data(), batch_, objective_.sigma, generator);
  out.img.resize(out.target.size());
  fill_standard_normal(out.img.data(), std::ssize(out.img), generator);
  // x0 sits in target; flow_noising reads each element's x0 and noise before writing its
  // target and x_t over them.
  flow_noising(out.img.data(), out.target.data(), out.target.data(), out.img.data(),
               out.timesteps.data(), batch_, per_sample);
}

void FluxBatchBuilder::training_batch(int64_t step, int64_t micro, int64_t accumulation,
                                      FluxBatch& out) const {
  FP8T_CHECK(step >= 0 && micro >= 0 && micro < accumulation,
             "expected step >= 0 and micro-batch 0 .. {}, found {} and {}", accumulation - 1, step,
             micro);
  load_samples((step * accumulation + micro) * batch_, out);
  std::mt19937_64 generator = generator_for(seed_, step, static_cast<uint32_t>(micro));
  const data::CaptionEncoding& empty = dataset_.empty_encodings();
  apply_cfg_dropout(out.txt.data(), out.y.data(), batch_, std::ssize(empty.txt),
                    std::ssize(empty.pooled), empty.txt.data(), empty.pooled.data(),
                    objective_.cfg_dropout, generator);
  add_noise(generator, out);
}

void FluxBatchBuilder::validation_batch(int64_t index, FluxBatch& out) const {
  FP8T_CHECK(index >= 0, "expected a validation batch >= 0, found {}", index);
  load_samples(kFirstValidationSample + index * batch_, out);
  std::mt19937_64 generator = generator_for(seed_, index, kValidationTag);
  add_noise(generator, out);
}

}  // namespace fp8t::train
