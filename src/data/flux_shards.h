// Precomputed Flux shards: the VAE latents and text encodings of real pictures, prepared once so
// that training runs no VAE, T5 or CLIP (docs/data.md, "Flux shards", is the reference).
//
// One shard is one safetensors file holding N samples:
//   latent         [N, C, H, W]  F32 or BF16   the VAE latent (C = 16 for FLUX.1's VAE), or
//   latent_mean    [N, C, H, W]  F32 or BF16   the VAE posterior's mean and log-variance, from
//   latent_logvar  [N, C, H, W]  F32 or BF16   which training draws a fresh latent each time
//   t5             [N, L, D]     F32 or BF16   T5 sequence embeddings (D = 4096), padding kept
//   t5_mask        [N, L]        U8 or I64     optional: 1 for a real token, 0 for padding
//   clip           [N, P]        F32 or BF16   CLIP pooled vector (P = 768)
// H and W even (Flux packs 2×2 patches). Metadata: format "fp8train-flux-shard", version "1"
// (both required); latent_scale and latent_shift (decimal numbers: x0 = scale · (latent −
// shift)), image_size (pixels per side) and vae (free text) optional.
#pragma once

#include <cstdint>
#include <filesystem>
#include <map>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "io/safetensors.h"
#include "models/flux_config.h"
#include "models/flux_objective.h"

namespace fp8t::data {

inline constexpr std::string_view kFluxShardFormat = "fp8train-flux-shard";
inline constexpr std::string_view kFluxShardVersion = "1";

// Whether a shard stores latents, or the posterior to sample them from (sample_vae_latents).
enum class FluxLatentMode : uint8_t { Latent, MeanLogvar };

std::string_view flux_latent_mode_name(FluxLatentMode mode);  // "latent", "mean+logvar"

// What a shard holds, from its header alone.
struct FluxShardLayout {
  int64_t samples = 0;
  FluxLatentMode mode = FluxLatentMode::Latent;
  LatentShape latent{0, 0, 0};  // per sample
  int64_t text_tokens = 0;      // L
  int64_t context_dim = 0;      // D
  int64_t pooled_dim = 0;       // P
  bool has_t5_mask = false;
  io::DType latent_dtype = io::DType::F32;  // of latent, or of latent_mean and latent_logvar
  io::DType t5_dtype = io::DType::F32;
  io::DType clip_dtype = io::DType::F32;
};

// One sample in fp32. Only the mode's latent buffers are filled; the others are left empty.
struct FluxShardSample {
  std::vector<float> latent;         // [C, H, W], Latent mode
  std::vector<float> latent_mean;    // [C, H, W], MeanLogvar mode
  std::vector<float> latent_logvar;  // [C, H, W], MeanLogvar mode
  std::vector<float> t5;             // [L, D]
  std::vector<int64_t> t5_mask;      // [L], as stored (1: real token); empty without t5_mask
  std::vector<float> clip;           // [P]
};

// An open shard: the header is read and checked on construction, sample data is read from the
// file on each read_sample, so a shard of any size costs one sample of memory.
class FluxShard {
 public:
  // Throws fp8t::Error starting with the path (and naming the tensor or metadata key) for an
  // unreadable safetensors file, a missing or wrong format / version, a metadata number that
  // does not parse, both or neither of the latent modes, a missing, unknown or wrongly shaped
  // tensor, a dtype the format does not allow, N that differs between tensors or is 0, and an
  // odd H or W. Values are not read (check_flux_shards scans them).
  explicit FluxShard(std::filesystem::path path);

  const std::filesystem::path& path() const { return file_.path(); }
  const FluxShardLayout& layout() const { return layout_; }
  int64_t samples() const { return layout_.samples; }
  const std::map<std::string, std::string>& metadata() const { return file_.metadata(); }
  std::optional<double> latent_scale() const { return latent_scale_; }
  std::optional<double> latent_shift() const { return latent_shift_; }

  // Fills `out` with sample `index` in [0, samples()); throws fp8t::Error otherwise.
  void read_sample(int64_t index, FluxShardSample& out) const;

 private:
  io::SafetensorsFile file_;
  FluxShardLayout layout_;
  uint64_t data_start_ = 0;  // file offset of the data section
  std::optional<double> latent_scale_;
  std::optional<double> latent_shift_;
};

// Several shards read as one list of samples: the shards in the given order, each shard's
// samples in file order. Only the headers are read on construction; read_sample reads one
// sample from its file, so a set of any size costs one sample of memory.
class FluxShardSet {
 public:
  // Opens each shard and checks it as check_flux_shards does, except for the value scan:
  // against `model`, and against the first shard of `reference` when given, else this set's
  // first. Throws fp8t::Error with the first defect, naming its file (and tensor or key), or
  // for an empty list.
  FluxShardSet(std::span<const std::filesystem::path> paths, const FluxConfig& model,
               const FluxShardSet* reference = nullptr);

  const std::vector<FluxShard>& shards() const { return shards_; }
  // The per-sample shapes, mode and normalization every shard shares.
  const FluxShard& first() const { return shards_.front(); }
  int64_t samples() const { return first_sample_.back(); }

  // Sample `index` in [0, samples()) of the list; throws fp8t::Error otherwise.
  void read_sample(int64_t index, FluxShardSample& out) const;

 private:
  std::vector<FluxShard> shards_;
  std::vector<int64_t> first_sample_;  // [shards + 1]: the list index of each shard's sample 0
};

// The shard files `folder_or_pattern` names: a folder's *.safetensors files, or the files a
// glob(3) pattern (*, ?, [...]) matches, a plain file name matching itself; sorted by path.
// Throws fp8t::Error naming the folder or pattern when it names no file.
std::vector<std::filesystem::path> find_flux_shard_files(const std::string& folder_or_pattern);

// The outcome of checking one file.
struct FluxShardCheck {
  std::filesystem::path path;
  std::optional<FluxShardLayout> layout;  // set when the header could be read
  std::string error;                      // empty when the file passed
};

// Checks each file: FluxShard's header checks, the dimensions against `model` when given
// (in_channels = 4·C, context_in_dim = D, vec_in_dim = P), the same C, H, W, L, D, P, latent
// mode and latent_scale / latent_shift as the first file that passed the header checks, every
// value finite and every t5_mask value 0 or 1. Each error names the file and, where there is
// one, the tensor (and the sample and element of a bad value). Stops at a file's first error.
std::vector<FluxShardCheck> check_flux_shards(std::span<const std::filesystem::path> paths,
                                              const FluxConfig* model);

}  // namespace fp8t::data
