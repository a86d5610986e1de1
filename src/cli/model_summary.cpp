// `fp8train model`: the GPT of a given depth, without allocating it.
#include <map>
#include <string>

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include "cli/commands.h"
#include "models/gpt_config.h"
#include "models/gpt_memory.h"
#include "models/precision_policy.h"
#include "numerics/scaling.h"

namespace fp8t::cli {

namespace {

std::string count_text(int64_t count) {
  return fmt::format("{:>14} ({:.1f}M)", count, double(count) / 1e6);
}
std::string gibibytes(size_t bytes) {
  return fmt::format("{:>9.2f} GiB", double(bytes) / double(1 << 30));
}

// nanochat's parameter groups, as its optimizer and its own summary name them.
std::string group_of(const ParamSpec& spec) {
  if (spec.name == "transformer.wte.weight") return "wte";
  if (spec.name.starts_with("value_embeds.")) return "value_embeds";
  if (spec.name == "lm_head.weight") return "lm_head";
  if (spec.layer >= 0) return "blocks";
  return "scalars and smear gate";
}

Fp8Config fp8_config(const ModelSummaryOptions& options) {
  // The same reader as configuration files, so names and errors agree.
  YAML::Node node;
  node["fp8"] = options.fp8;
  node["fp8_recipe"] = options.fp8_recipe;
  return fp8_config_from_yaml(node, "command line");
}

}  // namespace

int run_model_summary(const ModelSummaryOptions& options) {
  GptConfig config = GptConfig::from_depth(options.depth);
  config.vocab_size = options.vocab_size;
  config.sequence_len = options.sequence_len;
  config.window_pattern = options.window_pattern;
  config.validate();

  fmt::print(
      "model: nanochat GPT, depth {}: {} layers, dim {}, {} heads x {} ({} kv), vocab {} (padded "
      "{}), "
      "sequence {}\n",
      options.depth, config.n_layer, config.n_embd, config.n_head, config.head_dim(),
      config.n_kv_head, config.vocab_size, config.padded_vocab(), config.sequence_len);
  std::string windows;
  for (int layer = 0; layer < config.n_layer; ++layer) {
    windows += fmt::format("{}{}", layer == 0 ? "" : " ", config.window(layer));
  }
  fmt::print("attention windows (pattern {}): {}\n", config.window_pattern, windows);

  std::map<std::string, int64_t> groups;
  int64_t total = 0;
  for (const ParamSpec& spec : gpt_parameters(config)) {
    groups[group_of(spec)] += spec.numel();
    total += spec.numel();
  }
  fmt::print("\nparameters: {} ({:.3f}B)\n", total, double(total) / 1e9);
  for (const char* group : {"wte", "value_embeds", "blocks", "lm_head", "scalars and smear gate"}) {
    fmt::print("  {:<24}{}\n", group, count_text(groups[group]));
  }
  const double flops = gpt_flops_per_token(config);
  fmt::print("FLOPs per token (forward + backward): {:.4g}\n", flops);

  PrecisionOptions precision = precision_options(fp8_config(options));
  precision.lm_head_fp8 = options.lm_head_fp8;
  precision.first_last_layers_bf16 = options.first_last_layers_bf16;
  precision.num_layers_at_start_in_bf16 = options.layers_at_start_in_bf16;
  precision.num_layers_at_end_in_bf16 = options.layers_at_end_in_bf16;
  fmt::print("\nfp8: {}, recipe {}\n{}\n", options.fp8, options.fp8_recipe,
             precision_summary(decide_precision(config, precision)));

  const GptMemoryPlan plan = plan_gpt_memory(config, options.batch, config.sequence_len);
  fmt::print("\nmemory plan, CPU path (f32), micro-batch {} x {} tokens:\n", options.batch,
             config.sequence_len);
  fmt::print("  {:<18}{}\n", "parameters", gibibytes(plan.parameters));
  fmt::print("  {:<18}{}\n", "gradients", gibibytes(plan.gradients));
  fmt::print("  {:<18}{}\n", "optimizer state", gibibytes(plan.optimizer_state));
  fmt::print("  {:<18}{}\n", "activations", gibibytes(plan.activations));
  fmt::print("  {:<18}{}\n", "workspace", gibibytes(plan.workspace));
  fmt::print("  {:<18}{}\n", "total", gibibytes(plan.total()));
  return kExitOk;
}

}  // namespace fp8t::cli
