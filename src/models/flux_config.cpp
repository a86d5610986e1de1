#include "models/flux_config.h"

#include <numeric>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/error.h"
#include "models/tensor_parallel.h"

namespace fp8t {

FluxConfig FluxConfig::preset(std::string_view name) {
  FluxConfig config;
  if (name == "flux_12b") {
    config.guidance_embed = true;
    return config;
  }
  if (name == "flux_535m") {
    config.double_blocks = 1;
    config.single_blocks = 1;
    return config;
  }
  if (name == "flux_small") {
    config = preset("flux_tiny");
    config.hidden_size = 256;
    config.num_heads = 4;
    config.double_blocks = 2;
    config.single_blocks = 2;
    config.axes_dim = {16, 24, 24};
    return config;
  }
  if (name == "flux_tiny") {
    config.hidden_size = 64;
    config.num_heads = 2;
    config.in_channels = 16;  // 4 latent channels packed 2×2
    config.context_in_dim = 32;
    config.vec_in_dim = 16;
    config.double_blocks = 1;
    config.single_blocks = 1;
    config.axes_dim = {8, 12, 12};
    return config;
  }
  throw ConfigError(fmt::format("flux model: unknown preset '{}'; known: {}", name,
                                fmt::join(kFluxPresets, ", ")));
}

void FluxConfig::validate() const {
  const auto fail = [](const std::string& message) { throw ConfigError(message); };
  const auto positive = [&](int value, const char* field) {
    if (value < 1) fail(fmt::format("{}: must be at least 1, found {}", field, value));
  };
  positive(hidden_size, "hidden_size");
  positive(num_heads, "num_heads");
  positive(mlp_ratio, "mlp_ratio");
  positive(in_channels, "in_channels");
  positive(context_in_dim, "context_in_dim");
  positive(vec_in_dim, "vec_in_dim");
  if (double_blocks < 0 || single_blocks < 0 || double_blocks + single_blocks < 1) {
    fail(fmt::format("double_blocks, single_blocks: need at least one block, found {} and {}",
                     double_blocks, single_blocks));
  }
  if (hidden_size % num_heads != 0) {
    fail(fmt::format("num_heads: must divide hidden_size ({}), found {}", hidden_size, num_heads));
  }
  const int axes = std::accumulate(axes_dim.begin(), axes_dim.end(), 0);
  if (axes != head_dim()) {
    fail(fmt::format("axes_dim: must sum to head_dim ({}), found [{}] (sum {})", head_dim(),
                     fmt::join(axes_dim, ", "), axes));
  }
  for (int axis : axes_dim) {
    if (axis < 2 || axis % 2 != 0) {
      fail(fmt::format("axes_dim: each axis must be even and at least 2 (rotary pairs), found [{}]",
                       fmt::join(axes_dim, ", ")));
    }
  }
  if (!(rope_theta > 0.0)) fail(fmt::format("rope_theta: must be > 0, found {}", rope_theta));
}

int64_t FluxParam::numel() const {
  int64_t count = 1;
  for (int64_t extent : shape)
    count *= extent;
  return count;
}

bool FluxParam::is_bias() const {
  return name.ends_with(".bias");
}

std::vector<FluxParam> flux_parameters(const FluxConfig& config) {
  config.validate();
  const int64_t hidden = config.hidden_size, mlp = config.mlp_hidden();
  const int64_t head_dim = config.head_dim();
  std::vector<FluxParam> params;
  const auto linear = [&](const std::string& name, int64_t in, int64_t out, FluxParamKind kind,
                          int block = -1) {
    params.push_back({name + ".weight", {out, in}, kind, block});
    params.push_back({name + ".bias", {out}, kind, block});
  };
  const auto embedder = [&](const std::string& name, int64_t in) {  // Linear, SiLU, Linear
    linear(name + ".in_layer", in, hidden, FluxParamKind::Embedder);
    linear(name + ".out_layer", hidden, hidden, FluxParamKind::Embedder);
  };
  const auto qk_norm = [&](const std::string& prefix, int block) {
    params.push_back({prefix + ".query_norm.scale", {head_dim}, FluxParamKind::NormScale, block});
    params.push_back({prefix + ".key_norm.scale", {head_dim}, FluxParamKind::NormScale, block});
  };

  linear("img_in", config.in_channels, hidden, FluxParamKind::Embedder);
  embedder("time_in", config.timestep_dim());
  embedder("vector_in", config.vec_in_dim);
  if (config.guidance_embed) embedder("guidance_in", config.timestep_dim());
  linear("txt_in", config.context_in_dim, hidden, FluxParamKind::Embedder);

  for (int block = 0; block < config.double_blocks; ++block) {
    for (const char* stream : {"img", "txt"}) {
      const std::string prefix = fmt::format("double_blocks.{}.{}", block, stream);
      linear(prefix + "_mod.lin", hidden, 6 * hidden, FluxParamKind::Modulation, block);
      linear(prefix + "_attn.qkv", hidden, 3 * hidden, FluxParamKind::Attention, block);
      qk_norm(prefix + "_attn.norm", block);
      linear(prefix + "_attn.proj", hidden, hidden, FluxParamKind::Attention, block);
      linear(prefix + "_mlp.0", hidden, mlp, FluxParamKind::Mlp, block);
      linear(prefix + "_mlp.2", mlp, hidden, FluxParamKind::Mlp, block);
    }
  }
  for (int block = 0; block < config.single_blocks; ++block) {
    const std::string prefix = fmt::format("single_blocks.{}", block);
    const int index = config.double_blocks + block;
    linear(prefix + ".linear1", hidden, 3 * hidden + mlp, FluxParamKind::Single, index);
    linear(prefix + ".linear2", hidden + mlp, hidden, FluxParamKind::Single, index);
    qk_norm(prefix + ".norm", index);
    linear(prefix + ".modulation.lin", hidden, 3 * hidden, FluxParamKind::Modulation, index);
  }
  linear("final_layer.linear", hidden, config.in_channels, FluxParamKind::Final);
  linear("final_layer.adaLN_modulation.1", hidden, 2 * hidden, FluxParamKind::Modulation);
  return params;
}

int64_t flux_parameter_count(const FluxConfig& config) {
  int64_t count = 0;
  for (const FluxParam& param : flux_parameters(config))
    count += param.numel();
  return count;
}

void check_flux_tensor_parallel(const FluxConfig& config, int size) {
  check_splits_evenly(size,
                      {{"heads", config.num_heads}, {"MLP hidden features", config.mlp_hidden()}});
}

}  // namespace fp8t
