// `fp8train model`: the GPT of a given depth, or a Flux preset, without allocating it.
#include <map>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include "cli/commands.h"
#include "models/flux_config.h"
#include "models/flux_memory.h"
#include "models/flux_model.h"
#include "models/gpt_config.h"
#include "models/gpt_memory.h"
#include "models/precision_policy.h"
#include "models/recompute.h"
#include "models/tensor_parallel.h"
#include "numerics/scaling.h"

namespace fp8t::cli {

namespace {

std::string count_text(int64_t count) {
  return fmt::format("{:>14} ({:.1f}M)", count, double(count) / 1e6);
}
double in_gib(size_t bytes) {
  return double(bytes) / double(1 << 30);
}
std::string gibibytes(size_t bytes) {
  return fmt::format("{:>9.2f} GiB", in_gib(bytes));
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

PrecisionOptions precision_policy(const ModelSummaryOptions& options) {
  PrecisionOptions precision = precision_options(fp8_config(options));
  precision.lm_head_fp8 = options.lm_head_fp8;
  precision.first_last_layers_bf16 = options.first_last_layers_bf16;
  precision.num_layers_at_start_in_bf16 = options.layers_at_start_in_bf16;
  precision.num_layers_at_end_in_bf16 = options.layers_at_end_in_bf16;
  return precision;
}

std::string blocks_text(const FluxConfig& config) {
  return fmt::format("{} double + {} single blocks", config.double_blocks, config.single_blocks);
}

// The Flux preset: shape, parameters by BFL group, FLOPs, FP8 layers, and the GPU memory plan
// per data-parallel GPU count.
int run_flux_summary(const ModelSummaryOptions& options) {
  const FluxConfig config = flux_config_of(options.flux);
  const int tensor = options.tensor_parallel;
  for (const int gpus : options.gpus) {
    if (gpus % tensor != 0) {
      throw ConfigError(fmt::format(
          "--tensor-parallel {} must divide each --gpus count, and {} GPUs are no groups of {}",
          tensor, gpus, tensor));
    }
  }
  check_flux_tensor_parallel(config, tensor);
  if (options.sequence_parallel)
    check_flux_sequence_parallel(tensor, options.img_tokens, options.txt_tokens);
  FluxPrecision precision;
  precision.fp8 = fp8_config(options);
  precision.policy = precision_policy(options);
  precision.fp8_weight_transposes =
      weight_transposes_named(options.fp8_weight_transposes, "--fp8-weight-transposes");
  check_fp8_weight_transposes(precision.fp8_weight_transposes, precision.fp8.recipe,
                              "--fp8-weight-transposes");
  const FluxConfig preset = FluxConfig::preset(options.flux.preset);
  const bool reduced =
      config.double_blocks != preset.double_blocks || config.single_blocks != preset.single_blocks;
  fmt::print("model: Flux {}{}: {}, hidden {}, {} heads x {}, MLP {}{}\n", options.flux.preset,
             reduced ? fmt::format(" with {} (the preset has {})", blocks_text(config),
                                   blocks_text(preset))
                     : "",
             blocks_text(config), config.hidden_size, config.num_heads, config.head_dim(),
             config.mlp_hidden(), config.guidance_embed ? ", guidance embedder" : "");

  // Groups: the first component of the BFL names, in checkpoint order.
  std::vector<std::pair<std::string, int64_t>> groups;
  int64_t total = 0;
  for (const FluxParam& param : flux_parameters(config)) {
    const std::string group = param.name.substr(0, param.name.find('.'));
    if (groups.empty() || groups.back().first != group) groups.emplace_back(group, 0);
    groups.back().second += param.numel();
    total += param.numel();
  }
  fmt::print("\nparameters: {} ({:.3f}B)\n", total, double(total) / 1e9);
  for (const auto& [group, count] : groups) {
    const int blocks = group == "double_blocks"   ? config.double_blocks
                       : group == "single_blocks" ? config.single_blocks
                                                  : 0;
    const std::string label = blocks > 0 ? fmt::format("{} x {}", group, blocks) : group;
    fmt::print("  {:<24}{}\n", label, count_text(count));
  }
  const FluxMicroBatch micro_batch{options.batch, options.img_tokens, options.txt_tokens};
  fmt::print("FLOPs per sample (forward + backward) of {} image + {} text tokens: {:.4g}\n",
             micro_batch.img_tokens, micro_batch.txt_tokens,
             flux_flops_per_sample(config, micro_batch.img_tokens, micro_batch.txt_tokens));

  fmt::print("\nfp8: {}, recipe {}, weight transposes {}\n{}\n", options.fp8, options.fp8_recipe,
             options.fp8_weight_transposes,
             flux_precision_summary(decide_flux_precision(config, precision.policy)));

  const double capacity_gib = options.gpu_memory_gib.value_or(kH200MemoryGib);
  const auto capacity = static_cast<size_t>(capacity_gib * double(1 << 30));
  const size_t reserve = flux_runtime_reserve_bytes(config, micro_batch);
  const size_t host_mirror = FluxParameterSet::planned_bytes(config, DType::F32) +
                             2 * sizeof(float) * static_cast<size_t>(flux_parameter_count(config));
  fmt::print(
      "\nmemory per GPU (GiB), GPU path, micro-batch {} x ({} image + {} text tokens):\n"
      "  data parallel with ZeRO-1: the AdamW moments sharded over the GPUs; parameters, "
      "gradients and activations whole on each (shard_optimizer_state){}\n"
      "  fits: the total and {:.2f} GiB for the CUDA context and library workspaces within "
      "{:.1f} GiB\n"
      "  host memory for checkpoints: {:.2f} GiB per process (the fp32 weights and AdamW "
      "moments, whole){}\n",
      micro_batch.batch, micro_batch.img_tokens, micro_batch.txt_tokens,
      tensor == 1 ? ""
                  : fmt::format("\n  tensor parallel over groups of {} GPUs: each holds its "
                                "shares of the split weights with their gradients and moments "
                                "(ZeRO-1 over the GPUs holding the same shares), and its heads' "
                                "and MLP share's activations and weight copies (the first of a "
                                "group's, with the row-parallel biases, planned){}",
                                tensor,
                                options.sequence_parallel
                                    ? "; sequence parallel: its tokens of the residual streams"
                                    : ""),
      in_gib(reserve), capacity_gib, in_gib(host_mirror),
      tensor == 1 ? ""
                  : "; under tensor parallelism only each group's first process keeps it, "
                    "unless ZeRO-1 spans several groups");
  const auto print_table = [&](const RecomputeOptions& recompute) {
    fmt::print(
        "| GPUs | parameters | gradients | AdamW moments | activations | workspace | linear copies "
        "| total | fits |\n|---|---|---|---|---|---|---|---|---|\n");
    for (const int gpus : options.gpus) {
      const FluxMemoryPlan plan = plan_flux_memory(config, micro_batch, precision, gpus, recompute,
                                                   tensor, options.sequence_parallel);
      std::string fits;
      if (flux_fits(config, micro_batch, plan, capacity)) {
        fits = fmt::format("yes, {:.2f} free", in_gib(capacity - plan.total() - reserve));
      } else {
        const std::optional<FluxConfig> largest =
            largest_fitting_flux(config, micro_batch, precision, gpus, capacity, recompute, tensor,
                                 options.sequence_parallel);
        fits =
            largest ? fmt::format("no; {} fit", blocks_text(*largest)) : "no; not one block fits";
      }
      fmt::print("| {} | {:.2f} | {:.2f} | {:.2f} | {:.2f} | {:.2f} | {:.2f} | {:.2f} | {} |\n",
                 gpus, in_gib(plan.parameters), in_gib(plan.gradients),
                 in_gib(plan.optimizer_state), in_gib(plan.activations), in_gib(plan.workspace),
                 in_gib(plan.linear_copies), in_gib(plan.total()), fits);
    }
  };
  print_table({});
  fmt::print(
      "\nwith recompute_granularity: selective (GELU's outputs computed again in the backward, "
      "one buffer for every block; model.md#activation-recompute):\n");
  print_table({RecomputeGranularity::Selective});
  fmt::print(
      "\nwith recompute_granularity: full, recompute_method: uniform, recompute_num_layers: 1 "
      "(each block saves only its input; model.md#activation-recompute):\n");
  print_table({RecomputeGranularity::Full, RecomputeMethod::Uniform, 1});
  if (!options.sequence_parallel) return kExitOk;
  // The CPU path's plan too, against the same rank's without sequence parallelism.
  fmt::print(
      "\nactivations per rank, CPU path (f32), one rank of a tensor-parallel group of {}, "
      "without and with sequence parallelism (sequence_parallel: its tokens of the residual "
      "streams):\n| recompute_granularity | without | with |\n|---|---|---|\n",
      tensor);
  for (const auto& [name, recompute] :
       {std::pair{"none", RecomputeOptions{}},
        std::pair{"selective", RecomputeOptions{RecomputeGranularity::Selective}},
        std::pair{"full, uniform, 1",
                  RecomputeOptions{RecomputeGranularity::Full, RecomputeMethod::Uniform, 1}}}) {
    const auto planned = [&](bool sequence) {
      return in_gib(
          FluxModel::planned_activation_bytes(config, micro_batch.batch, micro_batch.img_tokens,
                                              micro_batch.txt_tokens, recompute, tensor, sequence));
    };
    fmt::print("| {} | {:.2f} | {:.2f} |\n", name, planned(false), planned(true));
  }
  return kExitOk;
}

}  // namespace

FluxConfig flux_config_of(const FluxModelOptions& options) {
  FluxConfig config = FluxConfig::preset(options.preset);
  config.double_blocks = options.double_blocks.value_or(config.double_blocks);
  config.single_blocks = options.single_blocks.value_or(config.single_blocks);
  config.validate();
  return config;
}

int run_model_summary(const ModelSummaryOptions& options) {
  if (!options.flux.preset.empty()) return run_flux_summary(options);
  GptConfig config = GptConfig::from_depth(options.depth);
  config.vocab_size = options.vocab_size;
  config.sequence_len = options.sequence_len;
  config.window_pattern = options.window_pattern;
  config.validate();
  const int tensor = options.tensor_parallel;
  check_tensor_parallel(config, tensor);
  const bool sequence = options.sequence_parallel;
  if (sequence) check_sequence_parallel(tensor, options.batch, config.sequence_len);

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

  fmt::print("\nfp8: {}, recipe {}\n{}\n", options.fp8, options.fp8_recipe,
             precision_summary(decide_precision(config, precision_policy(options))));

  const GptMemoryPlan plan =
      plan_gpt_memory(config, options.batch, config.sequence_len, {}, tensor, sequence);
  fmt::print("\nmemory plan, CPU path (f32), micro-batch {} x {} tokens{}{}:\n", options.batch,
             config.sequence_len,
             tensor == 1 ? ""
                         : fmt::format(", one rank of a tensor-parallel group of {} (its heads' "
                                       "and MLP share's activations and workspace)",
                                       tensor),
             sequence ? ", sequence parallel (its tokens' residual stream)" : "");
  fmt::print("  {:<18}{}\n", "parameters", gibibytes(plan.parameters));
  fmt::print("  {:<18}{}\n", "gradients", gibibytes(plan.gradients));
  fmt::print("  {:<18}{}\n", "optimizer state", gibibytes(plan.optimizer_state));
  fmt::print("  {:<18}{}\n", "activations", gibibytes(plan.activations));
  fmt::print("  {:<18}{}\n", "workspace", gibibytes(plan.workspace));
  fmt::print("  {:<18}{}\n", "total", gibibytes(plan.total()));
  fmt::print("activations with recompute_granularity (model.md#activation-recompute):\n");
  const RecomputeOptions full_per_block{RecomputeGranularity::Full, RecomputeMethod::Uniform, 1};
  for (const auto& [name, recompute] :
       {std::pair{"none", RecomputeOptions{}},
        std::pair{"selective",
                  RecomputeOptions{RecomputeGranularity::Selective, RecomputeMethod::Uniform, 1}},
        std::pair{"full, uniform, 1", full_per_block}}) {
    fmt::print("  {:<18}{}\n", name,
               gibibytes(GptActivations::planned_bytes(config, options.batch, config.sequence_len,
                                                       DType::F32, recompute, tensor, sequence)));
  }
  return kExitOk;
}

}  // namespace fp8t::cli
