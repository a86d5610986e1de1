#include "models/gpt_config.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "core/error.h"
#include "models/tensor_parallel.h"

namespace fp8t {

GptConfig GptConfig::from_depth(int depth) {
  if (depth < 1) throw ConfigError(fmt::format("depth: must be at least 1, found {}", depth));
  GptConfig config;
  config.n_layer = depth;
  config.n_embd = (depth * 64 + 127) / 128 * 128;
  config.n_head = config.n_embd / 128;
  config.n_kv_head = config.n_head;
  return config;
}

int GptConfig::window(int layer) const {
  const int long_window = sequence_len;
  const int short_size =
      short_window > 0 ? short_window : ((sequence_len + 3) / 4 + 127) / 128 * 128;
  if (layer == n_layer - 1) return long_window;
  const char kind = window_pattern[static_cast<size_t>(layer) % window_pattern.size()];
  return kind == 'S' ? short_size : long_window;
}

void GptConfig::validate() const {
  const auto fail = [](const std::string& message) { throw ConfigError(message); };
  if (n_layer < 1) fail(fmt::format("n_layer: must be at least 1, found {}", n_layer));
  if (n_head < 1 || n_embd % n_head != 0) {
    fail(fmt::format("n_head: must divide n_embd ({}), found {}", n_embd, n_head));
  }
  if (head_dim() % 2 != 0)
    fail(fmt::format("head_dim (n_embd / n_head): must be even for rotary, found {}", head_dim()));
  if (n_kv_head < 1 || n_head % n_kv_head != 0) {
    fail(fmt::format("n_kv_head: must divide n_head ({}), found {}", n_head, n_kv_head));
  }
  if (n_embd < kSmearGateChannels) {
    fail(fmt::format(
        "n_embd: must be at least {} (the smear gate reads that many channels), found {}",
        kSmearGateChannels, n_embd));
  }
  if (vocab_size < 1) fail(fmt::format("vocab_size: must be at least 1, found {}", vocab_size));
  if (sequence_len < 2)
    fail(fmt::format("sequence_len: must be at least 2, found {}", sequence_len));
  if (pad_vocab_to < 1)
    fail(fmt::format("pad_vocab_to: must be at least 1, found {}", pad_vocab_to));
  if (window_pattern.empty() || !std::all_of(window_pattern.begin(), window_pattern.end(),
                                             [](char c) { return c == 'S' || c == 'L'; })) {
    fail(fmt::format("window_pattern: only the letters S and L are allowed, found '{}'",
                     window_pattern));
  }
}

int64_t ParamSpec::numel() const {
  int64_t count = 1;
  for (int64_t dim : shape)
    count *= dim;
  return count;
}

std::vector<ParamSpec> gpt_parameters(const GptConfig& config) {
  const int64_t dim = config.n_embd;
  const int64_t vocab = config.padded_vocab();
  std::vector<ParamSpec> params;
  params.push_back({"transformer.wte.weight", {vocab, dim}, ParamKind::Embedding});
  for (int layer = 0; layer < config.n_layer; ++layer) {
    const std::string prefix = fmt::format("transformer.h.{}.", layer);
    params.push_back({prefix + "attn.c_q.weight",
                      {config.n_head * int64_t{config.head_dim()}, dim},
                      ParamKind::BlockLinear,
                      layer});
    params.push_back(
        {prefix + "attn.c_k.weight", {config.kv_dim(), dim}, ParamKind::BlockLinear, layer});
    params.push_back(
        {prefix + "attn.c_v.weight", {config.kv_dim(), dim}, ParamKind::BlockLinear, layer});
    params.push_back({prefix + "attn.c_proj.weight", {dim, dim}, ParamKind::BlockLinear, layer});
    if (config.has_value_embedding(layer)) {
      params.push_back({prefix + "attn.ve_gate.weight",
                        {config.n_kv_head, kValueGateChannels},
                        ParamKind::Gate,
                        layer});
    }
    params.push_back({prefix + "mlp.c_fc.weight", {4 * dim, dim}, ParamKind::BlockLinear, layer});
    params.push_back({prefix + "mlp.c_proj.weight", {dim, 4 * dim}, ParamKind::BlockLinear, layer});
  }
  params.push_back({"lm_head.weight", {vocab, dim}, ParamKind::LmHead});
  params.push_back({"resid_lambdas", {config.n_layer}, ParamKind::Scalar});
  params.push_back({"x0_lambdas", {config.n_layer}, ParamKind::Scalar});
  params.push_back({"smear_gate.weight", {1, kSmearGateChannels}, ParamKind::Gate});
  params.push_back({"smear_lambda", {1}, ParamKind::Scalar});
  params.push_back({"backout_lambda", {1}, ParamKind::Scalar});
  for (int layer = 0; layer < config.n_layer; ++layer) {
    if (config.has_value_embedding(layer)) {
      params.push_back({fmt::format("value_embeds.{}.weight", layer),
                        {vocab, config.kv_dim()},
                        ParamKind::Embedding,
                        layer});
    }
  }
  return params;
}

const ParamSpec* find_parameter(const std::vector<ParamSpec>& specs, std::string_view name) {
  const auto found = std::find_if(specs.begin(), specs.end(),
                                  [&](const ParamSpec& spec) { return spec.name == name; });
  return found != specs.end() ? &*found : nullptr;
}

int backward_gradient_group(const ParamSpec& spec, int n_layer) {
  if (spec.kind == ParamKind::LmHead) return 0;
  return spec.layer >= 0 ? 1 + (n_layer - 1 - spec.layer) : 1 + n_layer;
}

std::vector<LinearSpec> gpt_linears(const GptConfig& config) {
  std::vector<LinearSpec> linears;
  for (const ParamSpec& param : gpt_parameters(config)) {
    if (param.kind != ParamKind::BlockLinear && param.kind != ParamKind::Gate &&
        param.kind != ParamKind::LmHead) {
      continue;
    }
    const std::string name =
        param.name.substr(0, param.name.size() - std::string(".weight").size());
    linears.push_back({name, param.shape[1], param.shape[0], param.kind, param.layer});
  }
  return linears;
}

double gpt_flops_per_token(const GptConfig& config) {
  double matmul_params = 0;
  for (const LinearSpec& linear : gpt_linears(config)) {
    matmul_params += double(linear.in_features) * double(linear.out_features);
  }
  double attention = 0;
  for (int layer = 0; layer < config.n_layer; ++layer) {
    attention += 12.0 * config.n_head * config.head_dim() *
                 std::min(config.window(layer), config.sequence_len);
  }
  return 6.0 * matmul_params + attention;
}

float GptConfig::attention_scale() const {
  constexpr double kQkScale = 1.2;
  return static_cast<float>(kQkScale * kQkScale / std::sqrt(double(head_dim())));
}

void check_tensor_parallel(const GptConfig& config, int size) {
  check_splits_evenly(size, {{"query heads", config.n_head},
                             {"kv heads", config.n_kv_head},
                             {"MLP hidden features", 4 * int64_t{config.n_embd}}});
}

TensorSplit gpt_tensor_split(std::string_view linear) {
  for (const std::string_view name : {".attn.c_q", ".attn.c_k", ".attn.c_v", ".mlp.c_fc"})
    if (linear.ends_with(name)) return TensorSplit::Outputs;
  for (const std::string_view name : {".attn.c_proj", ".mlp.c_proj"})
    if (linear.ends_with(name)) return TensorSplit::Inputs;
  return TensorSplit::None;
}

TensorSplit gpt_parameter_split(const ParamSpec& spec) {
  constexpr std::string_view kWeight = ".weight";
  if (spec.kind == ParamKind::BlockLinear)
    return gpt_tensor_split(
        std::string_view(spec.name).substr(0, spec.name.size() - kWeight.size()));
  if (spec.name.ends_with(".attn.ve_gate.weight")) return TensorSplit::Outputs;
  if (spec.name.starts_with("value_embeds.")) return TensorSplit::Inputs;
  return TensorSplit::None;
}

bool gpt_sequence_split_gradient(const ParamSpec& spec) {
  return spec.kind == ParamKind::LmHead ||
         (spec.kind == ParamKind::Scalar && spec.name != "smear_lambda");
}

}  // namespace fp8t
