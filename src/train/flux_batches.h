// Flux's training and validation micro-batches from the built-in shapes data: each a function
// of the seed and its place in the run alone, so that a resumed run sees exactly the batches an
// uninterrupted one would.
//
// Training micro-batch m of optimizer step s (both from 0) holds samples (s·A + m)·B ... + B − 1
// of the dataset (A micro-batches per step, B samples each: a stream without epochs, the data
// being unbounded). Its random numbers come from std::mt19937_64 seeded with std::seed_seq{seed
// low, seed high, s low, s high, m} and are drawn in this order: the guidance-dropout uniforms
// (one per sample), σ (one per sample), the noise (all samples' values). Validation
// micro-batch i holds samples 2^62 + i·B ..., far past any training run's, with σ and noise from
// std::seed_seq{seed low, seed high, i low, i high, 2^32 − 1} and no dropout: the same batches
// at every evaluation.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "data/flux_shapes.h"
#include "models/flux_model.h"
#include "models/flux_objective.h"

namespace fp8t::train {

// One micro-batch as the model and the loss take it, host fp32.
struct FluxBatch {
  std::vector<float> img;        // x_t [B, L_img, in_channels], packed noisy latents
  std::vector<float> target;     // ε − x0, same shape
  std::vector<float> txt;        // [B, L_txt, context_in_dim]
  std::vector<float> y;          // [B, vec_in_dim]
  std::vector<float> timesteps;  // σ [B]
  // [B] with the guidance embedder, else empty: 1, since this trainer does not distill
  // guidance into the embedder.
  std::vector<float> guidance;
};

class FluxBatchBuilder {
 public:
  // The dataset's latents must pack into the model's image tokens (4·channels = in_channels).
  FluxBatchBuilder(const data::FluxShapesDataset& dataset, const FluxConfig& model,
                   const FluxObjectiveOptions& objective, int64_t batch, uint64_t seed);

  int64_t batch() const { return batch_; }
  const LatentShape& latent_shape() const { return latent_; }
  // [L_img, 3]: the ids of the image tokens, the same for every sample.
  const std::vector<float>& img_ids() const { return img_ids_; }

  void training_batch(int64_t step, int64_t micro, int64_t accumulation, FluxBatch& out) const;
  void validation_batch(int64_t index, FluxBatch& out) const;

 private:
  // Samples first .. first + B − 1 into out, x0 packed into out.target for noising.
  void load_samples(int64_t first, FluxBatch& out) const;
  // σ, noise, x_t and the target from x0 in out.target.
  void add_noise(std::mt19937_64& generator, FluxBatch& out) const;

  const data::FluxShapesDataset& dataset_;
  FluxConfig model_;
  FluxObjectiveOptions objective_;
  int64_t batch_;
  uint64_t seed_;
  LatentShape latent_;
  std::vector<float> img_ids_;
};

}  // namespace fp8t::train
