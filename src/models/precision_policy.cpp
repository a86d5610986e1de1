#include "models/precision_policy.h"

#include <algorithm>
#include <cctype>
#include <map>
#include <optional>
#include <utility>
#include <vector>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/error.h"

namespace fp8t {

ops::WeightTransposes weight_transposes_named(std::string_view name, std::string_view origin) {
  std::vector<std::string_view> allowed;
  for (const auto& [each, value] : ops::kWeightTransposesNames) {
    if (each == name) return value;
    allowed.push_back(each);
  }
  throw ConfigError(
      fmt::format("{}: unknown value '{}'; allowed: {}", origin, name, fmt::join(allowed, ", ")));
}

void check_fp8_weight_transposes(ops::WeightTransposes transposes, ScalingRecipe recipe,
                                 std::string_view origin) {
  if (transposes == ops::WeightTransposes::InBackward && recipe == ScalingRecipe::Mxfp8) {
    throw ConfigError(fmt::format(
        "{}: in_backward transposes Ŵ, but an mxfp8 Ŵᵗ has 1x32 blocks of its own; expected "
        "kept with fp8_recipe: mxfp8",
        origin));
  }
}

ModelPrecision ModelPrecision::fp32_reference() {
  ModelPrecision precision;
  precision.fp8.mode = Fp8Mode::None;
  precision.policy.mode = Fp8Mode::None;
  return precision;
}

ops::AttentionFp8Formats attention_fp8_formats(const ModelPrecision& precision) {
  ops::AttentionFp8Formats formats;
  formats.forward = precision.fp8.format_for(TensorRole::Input, precision.family);
  formats.backward = precision.fp8.format_for(TensorRole::GradOutput, precision.family);
  formats.power_of_2_scales = precision.fp8.use_power_of_2_scales();
  formats.amax_epsilon = precision.fp8.amax_epsilon;
  return formats;
}

namespace {

bool in_edge_layers(int layer, int n_layer, const PrecisionOptions& options) {
  if (!options.first_last_layers_bf16 || layer < 0) return false;
  return layer < options.num_layers_at_start_in_bf16 ||
         layer >= n_layer - options.num_layers_at_end_in_bf16;
}

// Why `linear` stays in BF16, or nothing when it can run in FP8.
std::optional<std::string> bf16_reason(const LinearSpec& linear, int n_layer,
                                       const PrecisionOptions& options) {
  if (options.mode == Fp8Mode::None) return "fp8: none";
  const int64_t in = linear.in_features;
  const int64_t out = linear.out_features;
  if (std::min(in, out) < options.min_dim) return fmt::format("dims < {}", options.min_dim);
  if (in % options.require_divisible_by != 0 || out % options.require_divisible_by != 0) {
    return fmt::format("dims not divisible by {}", options.require_divisible_by);
  }
  if (linear.kind == ParamKind::Gate) return "gates stay in BF16";
  if (linear.kind != ParamKind::BlockLinear && linear.kind != ParamKind::LmHead) {
    return "not a linear layer";
  }
  if (linear.kind == ParamKind::LmHead && !options.lm_head_fp8) return "lm_head_fp8: false";
  if (in_edge_layers(linear.layer, n_layer, options)) return "first/last layers in BF16";
  if (std::find(options.bf16_linears.begin(), options.bf16_linears.end(), linear.name) !=
      options.bf16_linears.end()) {
    return "non-finite gradients (nan_remedy: bf16_layer)";
  }
  if (std::find(options.fallback_linears.begin(), options.fallback_linears.end(), linear.name) !=
      options.fallback_linears.end()) {
    return "FP8 health (fp8_auto_fallback)";
  }
  if (options.recipe == ScalingRecipe::Blockwise && (in % 128 != 0 || out % 128 != 0)) {
    return "blockwise needs dims divisible by 128";
  }
  if (options.recipe == ScalingRecipe::Mxfp8 && (in % 32 != 0 || out % 32 != 0)) {
    return "mxfp8 needs dims divisible by 32";
  }
  return std::nullopt;
}

std::vector<std::string> split_components(const std::string& name) {
  std::vector<std::string> components;
  size_t start = 0;
  while (true) {
    const size_t dot = name.find('.', start);
    components.push_back(name.substr(start, dot - start));
    if (dot == std::string::npos) break;
    start = dot + 1;
  }
  return components;
}

bool is_number(const std::string& text) {
  return !text.empty() && std::all_of(text.begin(), text.end(),
                                      [](unsigned char c) { return std::isdigit(c) != 0; });
}

// The components after the last numeric one: "transformer.h.3.attn.c_q" -> [attn, c_q].
std::vector<std::string> name_within_block(const std::string& name) {
  std::vector<std::string> components = split_components(name);
  for (size_t i = components.size(); i-- > 0;) {
    if (is_number(components[i]) && i + 1 < components.size()) {
      components.erase(components.begin(), components.begin() + static_cast<ptrdiff_t>(i) + 1);
      break;
    }
  }
  return components;
}

std::string join_last(const std::vector<std::string>& components, size_t count) {
  std::string text;
  for (size_t i = components.size() - count; i < components.size(); ++i)
    text += (text.empty() ? "" : ".") + components[i];
  return text;
}

// Short display names: the fewest trailing components that tell a name apart from every other.
std::map<std::string, std::string> display_names(const std::vector<LinearPrecision>& decisions) {
  std::map<std::string, std::vector<std::string>> by_block_name;
  for (const LinearPrecision& decision : decisions) {
    const std::vector<std::string> components = name_within_block(decision.linear.name);
    by_block_name.emplace(join_last(components, components.size()), components);
  }
  std::map<std::string, std::string> names;
  for (const auto& [block_name, components] : by_block_name) {
    size_t count = 1;
    for (; count < components.size(); ++count) {
      const std::string suffix = join_last(components, count);
      const bool shared =
          std::any_of(by_block_name.begin(), by_block_name.end(), [&](const auto& other) {
            return other.first != block_name && other.second.size() >= count &&
                   join_last(other.second, count) == suffix;
          });
      if (!shared) break;
    }
    names[block_name] = join_last(components, count);
  }
  return names;
}

}  // namespace

std::optional<std::string> tensor_parallel_share_reason(int64_t in_features, int64_t out_features,
                                                        ScalingRecipe recipe, int group) {
  const int64_t block = recipe == ScalingRecipe::Blockwise ? 128
                        : recipe == ScalingRecipe::Mxfp8   ? 32
                                                           : 1;
  if (group == 1 || (in_features % block == 0 && out_features % block == 0)) return std::nullopt;
  return fmt::format("{} needs dims divisible by {} on each of {} tensor-parallel ranks",
                     recipe_name(recipe), block, group);
}

PrecisionOptions precision_options(const Fp8Config& config) {
  PrecisionOptions options;
  options.mode = config.mode;
  options.recipe = config.recipe;
  return options;
}

std::vector<LinearPrecision> decide_precision(const std::vector<LinearSpec>& linears, int n_layer,
                                              const PrecisionOptions& options) {
  FP8T_CHECK(options.min_dim >= 0, "expected min_dim >= 0, found {}", options.min_dim);
  FP8T_CHECK(options.require_divisible_by >= 1, "expected require_divisible_by >= 1, found {}",
             options.require_divisible_by);
  FP8T_CHECK(options.num_layers_at_start_in_bf16 >= 0 && options.num_layers_at_end_in_bf16 >= 0,
             "expected non-negative num_layers_at_start_in_bf16 and num_layers_at_end_in_bf16, "
             "found {} and {}",
             options.num_layers_at_start_in_bf16, options.num_layers_at_end_in_bf16);
  std::vector<LinearPrecision> decisions;
  decisions.reserve(linears.size());
  for (const LinearSpec& linear : linears) {
    std::optional<std::string> reason = bf16_reason(linear, n_layer, options);
    decisions.push_back({linear, !reason.has_value(), reason.value_or("")});
  }
  return decisions;
}

std::vector<LinearPrecision> decide_precision(const GptConfig& config,
                                              const PrecisionOptions& options) {
  return decide_precision(gpt_linears(config), config.n_layer, options);
}

std::string precision_summary(const std::vector<LinearPrecision>& decisions) {
  const std::map<std::string, std::string> names = display_names(decisions);
  // (display name, reason) -> count, in order of first appearance.
  std::vector<std::pair<std::pair<std::string, std::string>, int>> groups;
  size_t fp8_count = 0;
  for (const LinearPrecision& decision : decisions) {
    if (decision.fp8) {
      ++fp8_count;
      continue;
    }
    const std::vector<std::string> components = name_within_block(decision.linear.name);
    const std::pair<std::string, std::string> key{
        names.at(join_last(components, components.size())), decision.reason};
    auto group = std::find_if(groups.begin(), groups.end(),
                              [&](const auto& candidate) { return candidate.first == key; });
    if (group == groups.end()) {
      groups.push_back({key, 1});
    } else {
      ++group->second;
    }
  }
  std::string text = fmt::format("FP8: {}/{} linear layers; ", fp8_count, decisions.size());
  if (groups.empty()) return text + "none kept in BF16";
  std::string listing;
  for (const auto& [key, count] : groups) {
    if (!listing.empty()) listing += "; ";
    if (count > 1) listing += fmt::format("{} × ", count);
    listing += fmt::format("{}: {}", key.first, key.second);
  }
  return text + fmt::format("{} kept in BF16 ({})", decisions.size() - fp8_count, listing);
}

}  // namespace fp8t
