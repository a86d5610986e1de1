// The Flux MMDiT (MODELS.md §2): its configuration, the named presets, and the table of its
// parameters under the Black Forest Labs flux1 checkpoint names, from which the model, the
// optimizer groups, the FP8 policy and checkpoints are derived.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace fp8t {

struct FluxConfig {
  int hidden_size = 3072;
  int num_heads = 24;
  int mlp_ratio = 4;
  int in_channels = 64;         // latent channels packed 2×2 (16 × 4)
  int context_in_dim = 4096;    // T5 sequence embeddings
  int vec_in_dim = 768;         // CLIP pooled vector
  int double_blocks = 19;       // img and txt streams with their own weights
  int single_blocks = 38;       // on the concatenated [txt; img] sequence
  bool guidance_embed = false;  // a guidance embedder next to the timestep one (flux-dev)
  std::array<int, 3> axes_dim = {16, 56, 56};  // RoPE over the (0, row, col) ids; sums to head_dim
  double rope_theta = 10000.0;

  // flux_tiny (the CPU tests and demo), flux_small (flux_tiny's inputs, wide enough for FP8
  // linears: the GPU loss-parity runs), flux_535m (1 double + 1 single block, Primus' test
  // model), flux_12b (FLUX.1-dev's shape). Throws ConfigError listing the names otherwise.
  static FluxConfig preset(std::string_view name);

  int head_dim() const { return hidden_size / num_heads; }
  int mlp_hidden() const { return hidden_size * mlp_ratio; }
  int timestep_dim() const { return 256; }  // sinusoid width of time_in and guidance_in

  // Throws ConfigError naming the field when the configuration is inconsistent.
  void validate() const;
};

inline constexpr std::string_view kFluxPresets[] = {"flux_tiny", "flux_small", "flux_535m",
                                                    "flux_12b"};

// What a Flux parameter is, for optimizer groups, initialization and the FP8 policy.
enum class FluxParamKind : uint8_t {
  Embedder,    // img_in, txt_in, time_in, vector_in, guidance_in
  Modulation,  // *_mod.lin, modulation.lin, final_layer.adaLN_modulation.1
  Attention,   // qkv and proj of the double blocks
  Mlp,         // img_mlp / txt_mlp of the double blocks
  Single,      // linear1 and linear2 of the single blocks
  NormScale,   // the per-head RMSNorm scales of q and k
  Final,       // final_layer.linear
};

struct FluxParam {
  std::string name;            // BFL flux1 state_dict name
  std::vector<int64_t> shape;  // [out, in] for linear weights, [out] for their biases
  FluxParamKind kind;
  // The block, counting double blocks first and then single ones (the order the FP8 policy's
  // first and last layers count in); -1 outside the blocks.
  int block = -1;

  int64_t numel() const;
  bool is_bias() const;
};

// Every parameter, in the BFL checkpoint's order (embedders, double blocks, single blocks, final
// layer).
std::vector<FluxParam> flux_parameters(const FluxConfig& config);

int64_t flux_parameter_count(const FluxConfig& config);

// Throws ConfigError naming tensor_model_parallel_size unless `size` ranks can split the heads
// and the MLP's hidden features evenly.
void check_flux_tensor_parallel(const FluxConfig& config, int size);

}  // namespace fp8t
