// Flux's training and validation micro-batches: each a function of the seed and its place in
// the run alone, so that a resumed run sees exactly the batches an uninterrupted one would.
//
// Training micro-batch m of optimizer step s (both from 0) holds the samples at stream positions
// (s·A + m)·B ... + B − 1 (A micro-batches per step, B samples each); the source says which
// sample a position is. Its random numbers come from std::mt19937_64 seeded with
// std::seed_seq{seed low, seed high, s low, s high, m} and are drawn in this order: the source's
// own draws, sample by sample (shards of VAE posteriors draw their latents; the built-in data
// draws nothing), the guidance-dropout uniforms (one per sample), σ (one per sample), the noise
// (all samples' values). Validation micro-batch i holds the source's validation samples i·B ...
// + B − 1, with its draws, σ and noise from std::seed_seq{seed low, seed high, i low, i high,
// 2^32 − 1} and no dropout: the same batches at every evaluation.
//
// The sources:
// - FluxShapesSource, the built-in shapes data: position p is sample p (a stream without
//   epochs, the data being unbounded); validation sample i is sample 2^62 + i, far past any
//   training run's.
// - FluxShardSource, precomputed shards (data/flux_shards.h). The training shards are one list of
//   N samples (data::FluxShardSet). Position p is in epoch e = p / N and is sample order_e[p mod
//   N], order_e the permutation of 0 .. N − 1 that Fisher–Yates makes from the identity with
//   g = std::mt19937_64 seeded with std::seed_seq{seed low, seed high, e low, e high, 2^32 − 2}:
//   for i from N − 1 down to 1, swap items i and g() mod (i + 1). So every epoch visits every
//   sample once, in an order of its own. Validation sample i is sample i mod N_val of the
//   validation shards, or of the training shards when there are none (then not held out). A
//   latent-mode shard's latent is used as stored; a mean+logvar shard's is drawn anew each time,
//   latent = mean + exp(logvar / 2)·n (sample_vae_latents), so every epoch sees other latents.
//   The shards hold no encoding of the empty caption: guidance dropout trains on zero T5 and
//   CLIP inputs. t5_mask is not read: Flux's attention has no mask, and the padded positions
//   keep their stored embeddings.
#pragma once

#include <cstdint>
#include <optional>
#include <random>
#include <vector>

#include "data/flux_shapes.h"
#include "data/flux_shards.h"
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

// The per-sample sizes of a source.
struct FluxSampleDims {
  LatentShape latent;
  int64_t text_tokens = 0;  // L_txt
  int64_t context_dim = 0;  // width of a text token
  int64_t pooled_dim = 0;   // width of the pooled vector
};

// One sample as a source gives it.
struct FluxSourceSample {
  std::vector<float> latent;  // [C, H, W], not yet normalized
  std::vector<float> txt;     // [L_txt, context_dim]
  std::vector<float> pooled;  // [pooled_dim]
};

// Where a builder's samples come from (the rules above). `generator` is the micro-batch's, for
// sources that draw.
class FluxSampleSource {
 public:
  virtual ~FluxSampleSource() = default;

  virtual FluxSampleDims dims() const = 0;
  // The sample at training stream position `position` >= 0.
  virtual void training_sample(int64_t position, std::mt19937_64& generator,
                               FluxSourceSample& out) const = 0;
  // Validation sample `index` >= 0.
  virtual void validation_sample(int64_t index, std::mt19937_64& generator,
                                 FluxSourceSample& out) const = 0;
  // What a guidance-dropped sample trains on.
  virtual const data::CaptionEncoding& empty_caption() const = 0;
};

class FluxShapesSource final : public FluxSampleSource {
 public:
  explicit FluxShapesSource(const data::FluxShapesDataset& dataset) : dataset_(dataset) {}

  FluxSampleDims dims() const override;
  void training_sample(int64_t position, std::mt19937_64& generator,
                       FluxSourceSample& out) const override;
  void validation_sample(int64_t index, std::mt19937_64& generator,
                         FluxSourceSample& out) const override;
  const data::CaptionEncoding& empty_caption() const override { return dataset_.empty_encodings(); }

 private:
  void copy_sample(int64_t index, FluxSourceSample& out) const;

  const data::FluxShapesDataset& dataset_;
};

// Not thread-safe: it keeps the order of the last epoch it was asked about.
class FluxShardSource final : public FluxSampleSource {
 public:
  // `validation`, when given, must share the training shards' per-sample shapes (FluxShardSet's
  // reference).
  FluxShardSource(data::FluxShardSet training, std::optional<data::FluxShardSet> validation,
                  uint64_t seed);

  const data::FluxShardSet& training() const { return training_; }
  const std::optional<data::FluxShardSet>& validation() const { return validation_; }

  FluxSampleDims dims() const override;
  void training_sample(int64_t position, std::mt19937_64& generator,
                       FluxSourceSample& out) const override;
  void validation_sample(int64_t index, std::mt19937_64& generator,
                         FluxSourceSample& out) const override;
  const data::CaptionEncoding& empty_caption() const override { return empty_; }

 private:
  // order_e of the rule above, for epoch `epoch` >= 0; valid until the next call.
  const std::vector<int64_t>& epoch_order(int64_t epoch) const;
  void read(const data::FluxShardSet& shards, int64_t index, std::mt19937_64& generator,
            FluxSourceSample& out) const;

  data::FluxShardSet training_;
  std::optional<data::FluxShardSet> validation_;
  uint64_t seed_;
  data::CaptionEncoding empty_;  // zeros
  mutable int64_t order_epoch_ = -1;
  mutable std::vector<int64_t> order_;
  mutable data::FluxShardSample read_buffer_;
};

class FluxBatchBuilder {
 public:
  // The source's latents must pack into the model's image tokens (4·channels = in_channels), its
  // text tokens and pooled vectors be the model's widths.
  FluxBatchBuilder(const FluxSampleSource& source, const FluxConfig& model,
                   const FluxObjectiveOptions& objective, int64_t batch, uint64_t seed);

  int64_t batch() const { return batch_; }
  const FluxSampleDims& dims() const { return dims_; }
  const LatentShape& latent_shape() const { return dims_.latent; }
  // [L_img, 3]: the ids of the image tokens, the same for every sample.
  const std::vector<float>& img_ids() const { return img_ids_; }

  void training_batch(int64_t step, int64_t micro, int64_t accumulation, FluxBatch& out) const;
  void validation_batch(int64_t index, FluxBatch& out) const;

 private:
  // Room for B samples in out; guidance set.
  void size_batch(FluxBatch& out) const;
  // Sample b's latent normalized (in place) and packed into out.target (for add_noise), its text
  // into out.txt and out.y.
  void place_sample(int64_t b, FluxSourceSample& sample, FluxBatch& out) const;
  // σ, noise, x_t and the target from x0 in out.target.
  void add_noise(std::mt19937_64& generator, FluxBatch& out) const;

  const FluxSampleSource& source_;
  FluxConfig model_;
  FluxObjectiveOptions objective_;
  int64_t batch_;
  uint64_t seed_;
  FluxSampleDims dims_;
  std::vector<float> img_ids_;
};

}  // namespace fp8t::train
