#include "models/flux_objective.h"

#include <algorithm>
#include <cmath>
#include <iterator>
#include <numbers>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/error.h"
#include "core/parallel_runs.h"

namespace fp8t {

namespace {

// Beyond this the mode sampler's map u -> σ stops being monotone and leaves [0, 1]:
// dσ/du = −1 − mode_scale·(1 − (π/2)·sin(πu)) must stay <= 0 for every u.
constexpr double kMaxModeScale = 1.0 / (std::numbers::pi / 2.0 - 1.0);
constexpr double kMinModeScale = -1.0;

// Below this many normal pairs per thread, fill_standard_normal draws on the caller's thread
// alone (a pair costs tens of ns; a thread's start, tens of µs).
constexpr int64_t kNormalPairsPerThread = int64_t(1) << 15;

double uniform(std::mt19937_64& generator) {
  return static_cast<double>(generator() >> 11) * 0x1.0p-53;
}

std::pair<double, double> normal_pair(std::mt19937_64& generator) {
  const double u1 = uniform(generator);
  const double u2 = uniform(generator);
  const double radius = std::sqrt(-2.0 * std::log(1.0 - u1));  // 1 − u1 is in (0, 1]
  const double angle = 2.0 * std::numbers::pi * u2;
  return {radius * std::cos(angle), radius * std::sin(angle)};
}

double draw_sigma(const SigmaSamplingOptions& options, std::mt19937_64& generator) {
  switch (options.sampler) {
    case SigmaSampler::LogitNormal: {
      const double n = options.logit_mean + options.logit_std * normal_pair(generator).first;
      return 1.0 / (1.0 + std::exp(-n));
    }
    case SigmaSampler::Uniform:
      return uniform(generator);
    case SigmaSampler::Mode: {
      const double u = uniform(generator);
      const double c = std::cos(std::numbers::pi * u / 2.0);
      return 1.0 - u - options.mode_scale * (c * c - 1.0 + u);
    }
  }
  return 0.0;
}

void check_latent_shape(const LatentShape& shape) {
  FP8T_CHECK(shape.channels > 0 && shape.height > 0 && shape.width > 0,
             "expected a positive latent shape, found [{}, {}, {}]", shape.channels, shape.height,
             shape.width);
  FP8T_CHECK(shape.height % 2 == 0 && shape.width % 2 == 0,
             "expected an even latent height and width (2×2 patches), found {}×{}", shape.height,
             shape.width);
}

// Calls visit(latent_index, token_index) for every element, in token order.
template <typename Visit>
void for_each_packed(const LatentShape& shape, const Visit& visit) {
  check_latent_shape(shape);
  const int64_t rows = shape.height / 2, cols = shape.width / 2;
  int64_t token_index = 0;
  for (int64_t h = 0; h < rows; ++h) {
    for (int64_t w = 0; w < cols; ++w) {
      for (int64_t c = 0; c < shape.channels; ++c) {
        for (int64_t ph = 0; ph < 2; ++ph) {
          for (int64_t pw = 0; pw < 2; ++pw) {
            visit((c * shape.height + 2 * h + ph) * shape.width + 2 * w + pw, token_index++);
          }
        }
      }
    }
  }
}

}  // namespace

SigmaSampler parse_sigma_sampler(std::string_view name) {
  for (size_t i = 0; i < std::size(kSigmaSamplerNames); ++i) {
    if (kSigmaSamplerNames[i] == name) return static_cast<SigmaSampler>(i);
  }
  throw ConfigError(fmt::format("sigma sampler: unknown value '{}'; allowed: {}", name,
                                fmt::join(kSigmaSamplerNames, ", ")));
}

std::string_view sigma_sampler_name(SigmaSampler sampler) {
  return kSigmaSamplerNames[static_cast<size_t>(sampler)];
}

void FluxObjectiveOptions::validate() const {
  const auto fail = [](const std::string& message) { throw ConfigError(message); };
  if (!(sigma.logit_std >= 0.0 && std::isfinite(sigma.logit_std))) {
    fail(fmt::format("logit_std: must be a finite number >= 0, found {}", sigma.logit_std));
  }
  if (!std::isfinite(sigma.logit_mean)) {
    fail(fmt::format("logit_mean: must be finite, found {}", sigma.logit_mean));
  }
  if (!(sigma.mode_scale >= kMinModeScale && sigma.mode_scale <= kMaxModeScale)) {
    fail(fmt::format("mode_scale: must lie in [{}, {:.4f}] (σ leaves [0, 1] outside), found {}",
                     kMinModeScale, kMaxModeScale, sigma.mode_scale));
  }
  if (!(sigma.shift > 0.0 && std::isfinite(sigma.shift))) {
    fail(fmt::format("shift: must be a finite number > 0, found {}", sigma.shift));
  }
  if (!(latent_scale > 0.0 && std::isfinite(latent_scale))) {
    fail(fmt::format("latent_scale: must be a finite number > 0, found {}", latent_scale));
  }
  if (!std::isfinite(latent_shift)) {
    fail(fmt::format("latent_shift: must be finite, found {}", latent_shift));
  }
  if (!(cfg_dropout >= 0.0 && cfg_dropout <= 1.0)) {
    fail(fmt::format("cfg_dropout: must lie in [0, 1], found {}", cfg_dropout));
  }
}

double shift_sigma(double sigma, double shift) {
  return shift * sigma / (1.0 + (shift - 1.0) * sigma);
}

void sample_sigmas(float* sigma, int64_t count, const SigmaSamplingOptions& options,
                   std::mt19937_64& generator) {
  FP8T_CHECK(count >= 0, "expected count >= 0, found {}", count);
  FP8T_CHECK(options.shift > 0.0, "expected shift > 0, found {}", options.shift);
  for (int64_t i = 0; i < count; ++i) {
    sigma[i] = static_cast<float>(shift_sigma(draw_sigma(options, generator), options.shift));
  }
}

void fill_standard_normal(float* out, int64_t count, std::mt19937_64& generator) {
  FP8T_CHECK(count >= 0, "expected count >= 0, found {}", count);
  const int64_t pairs = (count + 1) / 2;
  const auto fill_pairs = [out, count](int64_t first, int64_t last, std::mt19937_64& from) {
    for (int64_t pair = first; pair < last; ++pair) {
      const auto [cosine, sine] = normal_pair(from);
      out[2 * pair] = static_cast<float>(cosine);
      if (2 * pair + 1 < count) out[2 * pair + 1] = static_cast<float>(sine);
    }
  };
  // Every pair takes exactly two draws, so a run of pairs can start from a copy of the generator
  // moved past the pairs before it: several threads give the values one thread would, and the
  // generator ends where one thread's would.
  const std::mt19937_64 start = generator;
  int64_t first_run_end = 0;  // the caller's thread draws the first run with the generator itself
  parallel_runs(pairs, kNormalPairsPerThread, [&](int64_t first, int64_t last) {
    if (first == 0) {
      fill_pairs(first, last, generator);
      first_run_end = last;
      return;
    }
    std::mt19937_64 from = start;
    from.discard(static_cast<unsigned long long>(2 * first));
    fill_pairs(first, last, from);
  });
  generator.discard(static_cast<unsigned long long>(2 * (pairs - first_run_end)));
}

void normalize_latents(float* x0, const float* latent, int64_t count, double scale, double shift) {
  FP8T_CHECK(count >= 0, "expected count >= 0, found {}", count);
  for (int64_t i = 0; i < count; ++i) {
    x0[i] = static_cast<float>(scale * (double(latent[i]) - shift));
  }
}

void denormalize_latents(float* latent, const float* x0, int64_t count, double scale,
                         double shift) {
  FP8T_CHECK(count >= 0, "expected count >= 0, found {}", count);
  FP8T_CHECK(scale != 0.0, "expected a non-zero scale, found {}", scale);
  for (int64_t i = 0; i < count; ++i) {
    latent[i] = static_cast<float>(double(x0[i]) / scale + shift);
  }
}

void sample_vae_latents(float* latent, const float* mean, const float* logvar, int64_t count,
                        std::mt19937_64& generator) {
  FP8T_CHECK(count >= 0, "expected count >= 0, found {}", count);
  for (int64_t i = 0; i < count; i += 2) {
    const auto [first, second] = normal_pair(generator);
    latent[i] = static_cast<float>(mean[i] + std::exp(0.5 * logvar[i]) * first);
    if (i + 1 < count) {
      latent[i + 1] = static_cast<float>(mean[i + 1] + std::exp(0.5 * logvar[i + 1]) * second);
    }
  }
}

void flow_noising(float* x_t, float* target, const float* x0, const float* noise,
                  const float* sigma, int64_t batch, int64_t per_sample) {
  FP8T_CHECK(batch >= 0 && per_sample >= 0, "expected batch, per_sample >= 0, found {}, {}", batch,
             per_sample);
  for (int64_t b = 0; b < batch; ++b) {
    const float s = sigma[b];
    const int64_t begin = b * per_sample;
    for (int64_t i = begin; i < begin + per_sample; ++i) {
      const float clean = x0[i], epsilon = noise[i];  // read first: x_t may alias noise
      target[i] = epsilon - clean;
      x_t[i] = (1.0f - s) * clean + s * epsilon;
    }
  }
}

double flow_mse_loss(const float* pred, const float* target, int64_t count) {
  FP8T_CHECK(count > 0, "expected count > 0, found {}", count);
  double sum = 0.0;
  for (int64_t i = 0; i < count; ++i) {
    const double difference = double(pred[i]) - double(target[i]);
    sum += difference * difference;
  }
  return sum / static_cast<double>(count);
}

double flow_mse_loss_with_gradient(float* dpred, const float* pred, const float* target,
                                   int64_t count, float dloss) {
  const double loss = flow_mse_loss(pred, target, count);
  const double factor = 2.0 * double(dloss) / static_cast<double>(count);
  for (int64_t i = 0; i < count; ++i) {
    dpred[i] = static_cast<float>(factor * (double(pred[i]) - double(target[i])));
  }
  return loss;
}

std::vector<bool> apply_cfg_dropout(float* txt, float* pooled, int64_t batch, int64_t txt_elements,
                                    int64_t pooled_elements, const float* empty_txt,
                                    const float* empty_pooled, double probability,
                                    std::mt19937_64& generator) {
  FP8T_CHECK(batch >= 0 && txt_elements >= 0 && pooled_elements >= 0,
             "expected non-negative sizes, found batch {}, txt {}, pooled {}", batch, txt_elements,
             pooled_elements);
  FP8T_CHECK(probability >= 0.0 && probability <= 1.0, "expected a probability in [0, 1], found {}",
             probability);
  std::vector<bool> dropped(static_cast<size_t>(batch));
  for (int64_t b = 0; b < batch; ++b) {
    if (uniform(generator) >= probability) continue;
    dropped[size_t(b)] = true;
    std::copy(empty_txt, empty_txt + txt_elements, txt + b * txt_elements);
    std::copy(empty_pooled, empty_pooled + pooled_elements, pooled + b * pooled_elements);
  }
  return dropped;
}

void pack_latents(float* tokens, const float* latent, const LatentShape& shape) {
  for_each_packed(shape, [&](int64_t from, int64_t to) { tokens[to] = latent[from]; });
}

void unpack_latents(float* latent, const float* tokens, const LatentShape& shape) {
  for_each_packed(shape, [&](int64_t to, int64_t from) { latent[to] = tokens[from]; });
}

void latent_image_ids(float* ids, const LatentShape& shape) {
  check_latent_shape(shape);
  const int64_t rows = shape.height / 2, cols = shape.width / 2;
  for (int64_t h = 0; h < rows; ++h) {
    for (int64_t w = 0; w < cols; ++w) {
      float* id = ids + 3 * (h * cols + w);
      id[0] = 0.0f;
      id[1] = static_cast<float>(h);
      id[2] = static_cast<float>(w);
    }
  }
}

}  // namespace fp8t
