// Flux's training objective, rectified flow (MODELS.md §2, "Loss"), on host fp32 buffers laid
// out sample-major ([batch, per_sample]):
//   x0 = scale · (latent − shift)                 the VAE latent, normalized
//   σ ~ sampler, then σ' = s·σ / (1 + (s − 1)·σ)  one noise level per sample, optionally shifted
//   x_t = (1 − σ)·x0 + σ·ε,  ε ~ N(0, 1)          what the model sees
//   target = ε − x0                               the velocity it predicts
//   loss = mean((pred − target)²)                 fp32 inputs, summed in double
// and around it: the VAE's posterior resampling, classifier-free-guidance dropout of the text
// inputs, and BFL's 2×2 packing of latents into image tokens with their (0, row, col) ids.
//
// Randomness comes from a caller's std::mt19937_64 (its output is fixed by the standard), turned
// into numbers here rather than by std:: distributions (whose algorithms are not), so a seed
// gives the same batch with every standard library. A uniform draw is u = (g() >> 11) · 2^−53 in
// [0, 1); a normal pair is Box–Muller on two uniforms: r = √(−2 ln(1 − u1)), r·cos(2π u2) and
// r·sin(2π u2). Each function says which draws it makes, in order.
#pragma once

#include <cstdint>
#include <random>
#include <string_view>
#include <vector>

namespace fp8t {

// How σ is drawn (SD3's samplers, as diffusers' compute_density_for_timestep_sampling):
// LogitNormal σ = sigmoid(mean + std·n); Uniform σ = u; Mode σ = 1 − u − mode_scale·(cos²(πu/2)
// − 1 + u), which puts more weight near σ = 0.5 for mode_scale > 0.
enum class SigmaSampler : uint8_t { LogitNormal, Uniform, Mode };

inline constexpr std::string_view kSigmaSamplerNames[] = {"logit_normal", "uniform", "mode"};

// Throws ConfigError naming the value and the allowed names.
SigmaSampler parse_sigma_sampler(std::string_view name);
std::string_view sigma_sampler_name(SigmaSampler sampler);

struct SigmaSamplingOptions {
  SigmaSampler sampler = SigmaSampler::LogitNormal;
  double logit_mean = 0.0;   // LogitNormal
  double logit_std = 1.0;    // LogitNormal
  double mode_scale = 1.29;  // Mode
  double shift = 1.0;        // s; 1 leaves σ as drawn, s > 1 moves it towards 1 (more noise)
};

struct FluxObjectiveOptions {
  SigmaSamplingOptions sigma;
  // FLUX.1's VAE: its latents have mean 0.1159 and spread 1 / 0.3611.
  double latent_scale = 0.3611;
  double latent_shift = 0.1159;
  double cfg_dropout = 0.1;  // probability that a sample trains on the empty caption

  // Throws ConfigError naming the field when a value is out of range.
  void validate() const;
};

// σ' = s·σ / (1 + (s − 1)·σ): keeps 0 and 1 fixed, moves the rest towards 1 for s > 1.
double shift_sigma(double sigma, double shift);

// sigma [count], each from the sampler, then shifted. Draws per value: LogitNormal one normal
// pair (its cosine half), Uniform and Mode one uniform.
void sample_sigmas(float* sigma, int64_t count, const SigmaSamplingOptions& options,
                   std::mt19937_64& generator);

// out [count] ~ N(0, 1): one normal pair per two values (the last pair's sine half is dropped
// when count is odd). Large counts are drawn by several threads, with the values and the
// generator's end state of one.
void fill_standard_normal(float* out, int64_t count, std::mt19937_64& generator);

// x0 = scale · (latent − shift) and its inverse, latent = x0 / scale + shift (for decoding
// samples). out may be the input.
void normalize_latents(float* x0, const float* latent, int64_t count, double scale, double shift);
void denormalize_latents(float* latent, const float* x0, int64_t count, double scale, double shift);

// The VAE posterior's sample, latent = mean + exp(logvar / 2) · n, n ~ N(0, 1) drawn as
// fill_standard_normal draws. latent may be mean.
void sample_vae_latents(float* latent, const float* mean, const float* logvar, int64_t count,
                        std::mt19937_64& generator);

// x_t = (1 − σ_b)·x0 + σ_b·noise and target = noise − x0 for sample b's per_sample elements;
// x0, noise, x_t, target: [batch, per_sample], sigma: [batch]. x_t may be noise.
void flow_noising(float* x_t, float* target, const float* x0, const float* noise,
                  const float* sigma, int64_t batch, int64_t per_sample);

// mean((pred − target)²) over count elements, each difference taken and summed in double.
double flow_mse_loss(const float* pred, const float* target, int64_t count);

// As flow_mse_loss, and writes dpred = dloss · 2·(pred − target) / count. dpred may be pred.
double flow_mse_loss_with_gradient(float* dpred, const float* pred, const float* target,
                                   int64_t count, float dloss = 1.0f);

// Classifier-free-guidance dropout: each sample b, with the given probability, gets the empty
// caption's encodings: txt [batch, txt_elements] row b becomes empty_txt [txt_elements] and
// pooled [batch, pooled_elements] row b becomes empty_pooled. One uniform per sample, in order;
// dropped when u < probability. Returns which samples were dropped.
std::vector<bool> apply_cfg_dropout(float* txt, float* pooled, int64_t batch, int64_t txt_elements,
                                    int64_t pooled_elements, const float* empty_txt,
                                    const float* empty_pooled, double probability,
                                    std::mt19937_64& generator);

// A latent [channels, height, width] and the image tokens Flux packs it into: 2×2 patches in
// row-major order, tokens [(height/2)·(width/2), channels·4], as BFL's
// rearrange("c (h ph) (w pw) -> (h w) (c ph pw)", ph=2, pw=2): token h·(width/2) + w holds, for
// each channel c, the pixels (2h, 2w), (2h, 2w+1), (2h+1, 2w), (2h+1, 2w+1) at features
// 4c .. 4c+3.
struct LatentShape {
  int64_t channels;
  int64_t height;  // even
  int64_t width;   // even

  int64_t numel() const { return channels * height * width; }
  int64_t tokens() const { return (height / 2) * (width / 2); }
  int64_t token_dim() const { return channels * 4; }
};

void pack_latents(float* tokens, const float* latent, const LatentShape& shape);
void unpack_latents(float* latent, const float* tokens, const LatentShape& shape);

// ids [tokens, 3] = (0, h, w) of each image token, the positions Flux's RoPE reads.
void latent_image_ids(float* ids, const LatentShape& shape);

}  // namespace fp8t
