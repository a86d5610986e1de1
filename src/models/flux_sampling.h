// Sampling from a Flux model, as BFL's sampling.py denoises: Euler steps of the rectified flow
// from pure noise at σ = 1 to the data at σ = 0. The model predicts the velocity v = ε − x0 of
// x_σ = (1 − σ)·x0 + σ·ε, which is dx/dσ, so each step is x ← x + (σ_next − σ)·v(x, σ).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <vector>

#include "models/flux_config.h"
#include "models/flux_model.h"
#include "models/flux_objective.h"

namespace fp8t {

// σ_0 = 1 > σ_1 > ... > σ_steps = 0, evenly spaced, then each shifted as training shifts σ
// (shift_sigma), so that sampling spends its steps where training put its noise levels.
std::vector<double> flow_sigma_schedule(int steps, double shift);

// v(x, σ) into velocity, which has x's size.
using VelocityField =
    std::function<void(std::span<const float> x, double sigma, std::span<float> velocity)>;

// Integrates dx/dσ = v(x, σ) along the schedule, one Euler step per interval, in place.
void euler_flow_integrate(std::span<float> x, std::span<const double> sigmas,
                          const VelocityField& velocity);

struct FluxSamplingOptions {
  int steps = 28;
  // Classifier-free guidance v = v_empty + g·(v_prompt − v_empty): without the guidance
  // embedder, one forward pass per step over the prompts and the empty caption together. With
  // it (FLUX.1-dev, guidance-distilled) g is the embedder's input and only the prompts run.
  double guidance = 4.0;
  double shift = 1.0;  // of the σ schedule
};

// A model's prediction v for `rows` samples (each array of `inputs` holds `rows` samples' values)
// into prediction [rows, img_tokens, in_channels]: one call per sampling step.
using FluxPredict = std::function<void(const FluxInputs& inputs, int64_t rows, float* prediction)>;

// BFL's denoise with `predict` as the model: turns the noise x [images, img_tokens,
// in_channels] into samples, each conditioned on its prompt's encodings, txt [images,
// txt_tokens, context_in_dim] and pooled [images, vec_in_dim]; the empty caption's encodings
// (one) are the unconditional input. img_ids [img_tokens, 3] as latent_image_ids gives them.
// Each step predicts 2·images rows (the prompts, then the empty caption), or the images alone
// with the guidance embedder.
void sample_flux(const FluxConfig& config, int64_t img_tokens, int64_t txt_tokens,
                 std::span<float> x, std::span<const float> img_ids, std::span<const float> txt,
                 std::span<const float> pooled, std::span<const float> empty_txt,
                 std::span<const float> empty_pooled, const FluxSamplingOptions& options,
                 const FluxPredict& predict);

// A Flux model for sampling batches of `images` pictures: its linears in BF16, as training's
// non-FP8 linears (an FP8 run's weights are fp32 masters, so BF16 serves every recipe).
class FluxSampler {
 public:
  FluxSampler(const FluxConfig& config, int64_t images, int64_t img_tokens, int64_t txt_tokens);

  // Copy the weights here before sampling (by the names of flux_parameters()).
  FluxParameterSet& parameters() { return model_->parameters(); }

  // This model's forward as sample_flux's prediction, for `images` pictures; take it after
  // changing the parameters.
  FluxPredict predict();
  // sample_flux with predict().
  void sample(std::span<float> x, std::span<const float> img_ids, std::span<const float> txt,
              std::span<const float> pooled, std::span<const float> empty_txt,
              std::span<const float> empty_pooled, const FluxSamplingOptions& options);

 private:
  FluxConfig config_;
  int64_t images_, img_tokens_, txt_tokens_;
  // Batch 2·images (the prompts, then the empty caption), or images with the guidance embedder.
  std::unique_ptr<FluxModel> model_;
};

}  // namespace fp8t
