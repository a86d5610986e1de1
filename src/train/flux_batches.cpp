#include "train/flux_batches.h"

#include <algorithm>
#include <numeric>
#include <utility>

#include "core/error.h"

namespace fp8t::train {

namespace {

constexpr int64_t kFirstValidationSample = int64_t{1} << 62;
constexpr uint32_t kValidationTag = 0xFFFFFFFFu;
constexpr uint32_t kEpochOrderTag = 0xFFFFFFFEu;

std::mt19937_64 generator_for(uint64_t seed, int64_t position, uint32_t tag) {
  const auto bits = static_cast<uint64_t>(position);
  std::seed_seq seeds{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32),
                      static_cast<uint32_t>(bits), static_cast<uint32_t>(bits >> 32), tag};
  return std::mt19937_64(seeds);
}

}  // namespace

FluxSampleDims FluxShapesSource::dims() const {
  const data::FluxShapesOptions& options = dataset_.options();
  return {.latent = {data::kFluxShapesLatentChannels, options.image_size, options.image_size},
          .text_tokens = options.text_tokens,
          .context_dim = options.context_dim,
          .pooled_dim = options.pooled_dim};
}

void FluxShapesSource::copy_sample(int64_t index, FluxSourceSample& out) const {
  data::FluxSample sample;
  dataset_.sample(index, sample);
  out.latent = std::move(sample.latent);
  out.txt = std::move(sample.txt);
  out.pooled = std::move(sample.pooled);
}

void FluxShapesSource::training_sample(int64_t position, std::mt19937_64& /*generator*/,
                                       FluxSourceSample& out) const {
  copy_sample(position, out);
}

void FluxShapesSource::validation_sample(int64_t index, std::mt19937_64& /*generator*/,
                                         FluxSourceSample& out) const {
  copy_sample(kFirstValidationSample + index, out);
}

FluxShardSource::FluxShardSource(data::FluxShardSet training,
                                 std::optional<data::FluxShardSet> validation, uint64_t seed)
    : training_(std::move(training)), validation_(std::move(validation)), seed_(seed) {
  const FluxSampleDims sizes = dims();
  empty_.txt.assign(size_t(sizes.text_tokens * sizes.context_dim), 0.0f);
  empty_.pooled.assign(size_t(sizes.pooled_dim), 0.0f);
}

FluxSampleDims FluxShardSource::dims() const {
  const data::FluxShardLayout& layout = training_.first().layout();
  return {.latent = layout.latent,
          .text_tokens = layout.text_tokens,
          .context_dim = layout.context_dim,
          .pooled_dim = layout.pooled_dim};
}

const std::vector<int64_t>& FluxShardSource::epoch_order(int64_t epoch) const {
  FP8T_CHECK(epoch >= 0, "expected an epoch >= 0, found {}", epoch);
  if (epoch == order_epoch_) return order_;
  order_.resize(size_t(training_.samples()));
  std::iota(order_.begin(), order_.end(), int64_t{0});
  // Fisher–Yates written out: std::shuffle's algorithm is not specified, mt19937_64 is.
  std::mt19937_64 generator = generator_for(seed_, epoch, kEpochOrderTag);
  for (size_t i = order_.size(); i > 1; --i)
    std::swap(order_[i - 1], order_[size_t(generator() % i)]);
  order_epoch_ = epoch;
  return order_;
}

void FluxShardSource::read(const data::FluxShardSet& shards, int64_t index,
                           std::mt19937_64& generator, FluxSourceSample& out) const {
  shards.read_sample(index, read_buffer_);
  // Swapped rather than copied: the buffers trade places and keep their capacity.
  if (shards.first().layout().mode == data::FluxLatentMode::Latent) {
    out.latent.swap(read_buffer_.latent);
  } else {
    out.latent.resize(read_buffer_.latent_mean.size());
    sample_vae_latents(out.latent.data(), read_buffer_.latent_mean.data(),
                       read_buffer_.latent_logvar.data(), std::ssize(out.latent), generator);
  }
  out.txt.swap(read_buffer_.t5);
  out.pooled.swap(read_buffer_.clip);
}

void FluxShardSource::training_sample(int64_t position, std::mt19937_64& generator,
                                      FluxSourceSample& out) const {
  FP8T_CHECK(position >= 0, "expected a stream position >= 0, found {}", position);
  const int64_t samples = training_.samples();
  read(training_, epoch_order(position / samples)[size_t(position % samples)], generator, out);
}

void FluxShardSource::validation_sample(int64_t index, std::mt19937_64& generator,
                                        FluxSourceSample& out) const {
  FP8T_CHECK(index >= 0, "expected a validation sample >= 0, found {}", index);
  const data::FluxShardSet& shards = validation_ ? *validation_ : training_;
  read(shards, index % shards.samples(), generator, out);
}

FluxBatchBuilder::FluxBatchBuilder(const FluxSampleSource& source, const FluxConfig& model,
                                   const FluxObjectiveOptions& objective, int64_t batch,
                                   uint64_t seed)
    : source_(source),
      model_(model),
      objective_(objective),
      batch_(batch),
      seed_(seed),
      dims_(source.dims()) {
  FP8T_CHECK(batch >= 1, "expected a micro-batch of at least 1, found {}", batch);
  FP8T_CHECK(dims_.latent.token_dim() == model.in_channels &&
                 dims_.context_dim == model.context_in_dim && dims_.pooled_dim == model.vec_in_dim,
             "the data's image tokens, text tokens and pooled vectors have {}, {} and {} "
             "features, the model takes {}, {} and {}",
             dims_.latent.token_dim(), dims_.context_dim, dims_.pooled_dim, model.in_channels,
             model.context_in_dim, model.vec_in_dim);
  img_ids_.resize(size_t(dims_.latent.tokens() * 3));
  latent_image_ids(img_ids_.data(), dims_.latent);
}

void FluxBatchBuilder::size_batch(FluxBatch& out) const {
  out.target.resize(size_t(batch_ * dims_.latent.numel()));
  out.txt.resize(size_t(batch_ * dims_.text_tokens * dims_.context_dim));
  out.y.resize(size_t(batch_ * dims_.pooled_dim));
  out.guidance.assign(model_.guidance_embed ? size_t(batch_) : 0, 1.0f);
}

void FluxBatchBuilder::place_sample(int64_t b, FluxSourceSample& sample, FluxBatch& out) const {
  const int64_t per_sample = dims_.latent.numel();
  const int64_t txt_per_sample = dims_.text_tokens * dims_.context_dim;
  normalize_latents(sample.latent.data(), sample.latent.data(), per_sample, objective_.latent_scale,
                    objective_.latent_shift);
  pack_latents(out.target.data() + b * per_sample, sample.latent.data(), dims_.latent);
  std::copy(sample.txt.begin(), sample.txt.end(), out.txt.begin() + b * txt_per_sample);
  std::copy(sample.pooled.begin(), sample.pooled.end(), out.y.begin() + b * dims_.pooled_dim);
}

void FluxBatchBuilder::add_noise(std::mt19937_64& generator, FluxBatch& out) const {
  const int64_t per_sample = dims_.latent.numel();
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
  std::mt19937_64 generator = generator_for(seed_, step, static_cast<uint32_t>(micro));
  size_batch(out);
  FluxSourceSample sample;
  const int64_t first = (step * accumulation + micro) * batch_;
  for (int64_t b = 0; b < batch_; ++b) {
    source_.training_sample(first + b, generator, sample);
    place_sample(b, sample, out);
  }
  const data::CaptionEncoding& empty = source_.empty_caption();
  apply_cfg_dropout(out.txt.data(), out.y.data(), batch_, std::ssize(empty.txt),
                    std::ssize(empty.pooled), empty.txt.data(), empty.pooled.data(),
                    objective_.cfg_dropout, generator);
  add_noise(generator, out);
}

void FluxBatchBuilder::validation_batch(int64_t index, FluxBatch& out) const {
  FP8T_CHECK(index >= 0, "expected a validation batch >= 0, found {}", index);
  std::mt19937_64 generator = generator_for(seed_, index, kValidationTag);
  size_batch(out);
  FluxSourceSample sample;
  for (int64_t b = 0; b < batch_; ++b) {
    source_.validation_sample(index * batch_ + b, generator, sample);
    place_sample(b, sample, out);
  }
  add_noise(generator, out);
}

}  // namespace fp8t::train
