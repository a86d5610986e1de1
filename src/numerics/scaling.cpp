#include "numerics/scaling.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <span>
#include <utility>

#include <yaml-cpp/yaml.h>

#include "core/error.h"

namespace fp8t {

bool Fp8Config::use_power_of_2_scales() const {
  return power_of_2_scales.value_or(recipe == ScalingRecipe::Blockwise);
}

Fp8Format Fp8Config::format_for(TensorRole role, Fp8Family family) const {
  if (role == TensorRole::GradOutput && mode == Fp8Mode::Hybrid) return e5m2_format(family);
  return e4m3_format(family);
}

namespace {

template <typename Enum>
using NamedValues = std::span<const std::pair<std::string_view, Enum>>;

constexpr std::pair<std::string_view, Fp8Mode> kModes[] = {
    {"none", Fp8Mode::None}, {"e4m3", Fp8Mode::E4M3}, {"hybrid", Fp8Mode::Hybrid}};
constexpr std::pair<std::string_view, ScalingRecipe> kRecipes[] = {
    {"delayed", ScalingRecipe::Delayed},
    {"tensorwise", ScalingRecipe::Tensorwise},
    {"blockwise", ScalingRecipe::Blockwise},
    {"mxfp8", ScalingRecipe::Mxfp8}};
constexpr std::pair<std::string_view, AmaxComputeAlgo> kAmaxAlgos[] = {
    {"max", AmaxComputeAlgo::Max}, {"most_recent", AmaxComputeAlgo::MostRecent}};
constexpr std::pair<std::string_view, FamilySetting> kFamilies[] = {
    {"auto", FamilySetting::Auto}, {"ocp", FamilySetting::Ocp}, {"fnuz", FamilySetting::Fnuz}};

template <typename Enum>
std::string_view name_of(NamedValues<Enum> values, Enum value) {
  for (const auto& [name, candidate] : values) {
    if (candidate == value) return name;
  }
  return "?";
}

template <typename Enum>
std::string allowed_names(NamedValues<Enum> values) {
  std::string names;
  for (const auto& [name, value] : values) {
    names += names.empty() ? "" : ", ";
    names += name;
  }
  return names;
}

// "file:line: key" for messages.
std::string where(std::string_view source, const YAML::Node& node, std::string_view key) {
  const YAML::Mark mark = node.Mark();
  if (mark.line >= 0) return fmt::format("{}:{}: {}", source, mark.line + 1, key);
  return fmt::format("{}: {}", source, key);
}

std::string scalar_text(const YAML::Node& node) {
  return node.IsScalar() ? node.Scalar() : std::string("(not a scalar)");
}

template <typename Enum>
Enum read_enum(const YAML::Node& node, std::string_view source, std::string_view key,
               NamedValues<Enum> values) {
  const std::string text = scalar_text(node);
  for (const auto& [name, value] : values) {
    if (name == text) return value;
  }
  throw ConfigError(fmt::format("{}: unknown value '{}'; allowed: {}", where(source, node, key),
                                text, allowed_names(values)));
}

template <typename Number>
Number read_number(const YAML::Node& node, std::string_view source, std::string_view key,
                   std::string_view expected) {
  Number value{};
  if (!node.IsScalar() || !YAML::convert<Number>::decode(node, value)) {
    throw ConfigError(fmt::format("{}: expected {}, found '{}'", where(source, node, key), expected,
                                  scalar_text(node)));
  }
  return value;
}

void check_history_len(int value, const std::string& location) {
  if (value < 1)
    throw ConfigError(fmt::format("{}: must be at least 1, found {}", location, value));
}

void check_non_negative_finite(float value, const std::string& location) {
  if (!std::isfinite(value) || value < 0.0f) {
    throw ConfigError(fmt::format("{}: must be a finite number >= 0, found {}", location, value));
  }
}

constexpr std::string_view kKnownKeys[] = {
    "fp8",        "fp8_recipe",       "fp8_amax_history_len",  "fp8_amax_compute_algo",
    "fp8_margin", "fp8_dtype_family", "fp8_power_of_2_scales", "fp8_amax_epsilon",
    "fp8_wgrad",  // owned by the linear layer's configuration
};

}  // namespace

std::string_view mode_name(Fp8Mode mode) {
  return name_of<Fp8Mode>(kModes, mode);
}
std::string_view recipe_name(ScalingRecipe recipe) {
  return name_of<ScalingRecipe>(kRecipes, recipe);
}
std::string_view amax_algo_name(AmaxComputeAlgo algo) {
  return name_of<AmaxComputeAlgo>(kAmaxAlgos, algo);
}
std::string_view family_setting_name(FamilySetting setting) {
  return name_of<FamilySetting>(kFamilies, setting);
}

void validate(const Fp8Config& config, std::string_view source) {
  check_history_len(config.amax_history_len, fmt::format("{}: fp8_amax_history_len", source));
  check_non_negative_finite(config.margin, fmt::format("{}: fp8_margin", source));
  check_non_negative_finite(config.amax_epsilon, fmt::format("{}: fp8_amax_epsilon", source));
  const bool current_scaling =
      config.recipe == ScalingRecipe::Tensorwise || config.recipe == ScalingRecipe::Blockwise;
  if (config.recipe == ScalingRecipe::Mxfp8 && config.power_of_2_scales == false) {
    throw ConfigError(fmt::format(
        "{}: fp8_power_of_2_scales: mxfp8 scales are E8M0 powers of two; false is not possible",
        source));
  }
  if (config.recipe == ScalingRecipe::Delayed && config.power_of_2_scales.has_value()) {
    throw ConfigError(fmt::format(
        "{}: fp8_power_of_2_scales: applies to tensorwise and blockwise (and is implied by mxfp8); "
        "delayed scaling takes its scale from the amax history",
        source));
  }
  if (!current_scaling && config.amax_epsilon != 0.0f) {
    throw ConfigError(
        fmt::format("{}: fp8_amax_epsilon: applies to tensorwise and blockwise only, found {} with "
                    "fp8_recipe: {}",
                    source, config.amax_epsilon, recipe_name(config.recipe)));
  }
}

Fp8Config fp8_config_from_yaml(const YAML::Node& root, std::string_view source) {
  Fp8Config config;
  if (!root || root.IsNull()) return config;
  if (!root.IsMap()) {
    throw ConfigError(
        fmt::format("{}: expected a mapping of keys to values at the top level", source));
  }
  for (const auto& entry : root) {
    const std::string key = entry.first.as<std::string>();
    if (!key.starts_with("fp8")) continue;
    if (std::find(std::begin(kKnownKeys), std::end(kKnownKeys), key) == std::end(kKnownKeys)) {
      std::string known;
      for (std::string_view name : kKnownKeys)
        known += fmt::format("{}{}", known.empty() ? "" : ", ", name);
      throw ConfigError(
          fmt::format("{}: unknown key; fp8 keys are: {}", where(source, entry.first, key), known));
    }
    const YAML::Node& value = entry.second;
    if (key == "fp8") {
      config.mode = read_enum<Fp8Mode>(value, source, key, kModes);
    } else if (key == "fp8_recipe") {
      config.recipe = read_enum<ScalingRecipe>(value, source, key, kRecipes);
    } else if (key == "fp8_amax_history_len") {
      config.amax_history_len = read_number<int>(value, source, key, "an integer >= 1");
      check_history_len(config.amax_history_len, where(source, value, key));
    } else if (key == "fp8_amax_compute_algo") {
      config.amax_compute_algo = read_enum<AmaxComputeAlgo>(value, source, key, kAmaxAlgos);
    } else if (key == "fp8_margin") {
      config.margin = read_number<float>(value, source, key, "a finite number >= 0");
      check_non_negative_finite(config.margin, where(source, value, key));
    } else if (key == "fp8_dtype_family") {
      config.dtype_family = read_enum<FamilySetting>(value, source, key, kFamilies);
    } else if (key == "fp8_power_of_2_scales") {
      config.power_of_2_scales = read_number<bool>(value, source, key, "true or false");
    } else if (key == "fp8_amax_epsilon") {
      config.amax_epsilon = read_number<float>(value, source, key, "a finite number >= 0");
      check_non_negative_finite(config.amax_epsilon, where(source, value, key));
    }
  }
  validate(config, source);
  return config;
}

std::string describe(const Fp8Config& config) {
  if (config.mode == Fp8Mode::None) return "fp8: none (BF16)";
  std::string text =
      fmt::format("fp8: {}, recipe: {}", mode_name(config.mode), recipe_name(config.recipe));
  if (config.recipe == ScalingRecipe::Delayed) {
    text += fmt::format(", amax history {} ({}), margin {}", config.amax_history_len,
                        amax_algo_name(config.amax_compute_algo), config.margin);
  }
  if (config.recipe == ScalingRecipe::Tensorwise || config.recipe == ScalingRecipe::Blockwise) {
    text += fmt::format(", power-of-2 scales {}", config.use_power_of_2_scales() ? "on" : "off");
  }
  text += fmt::format(", family {}", family_setting_name(config.dtype_family));
  return text;
}

DelayedScaling::DelayedScaling(int history_len, AmaxComputeAlgo algo, float margin,
                               float format_max, TensorRole role)
    : history_len_(history_len),
      algo_(algo),
      role_(role),
      scaled_max_(format_max * std::pow(2.0f, -margin)) {
  FP8T_CHECK(history_len >= 1, "amax history length must be at least 1, found {}", history_len);
  FP8T_CHECK(std::isfinite(margin), "margin must be finite, found {}", margin);
}

void DelayedScaling::record_amax(float amax) {
  if (role_ == TensorRole::Weight && recorded_this_step_) return;
  recorded_this_step_ = true;
  // A NaN, once seen, stays for the step, as with the GPU's max over float bit patterns.
  if (std::isnan(pending_amax_)) return;
  if (std::isnan(amax) || amax > pending_amax_) pending_amax_ = amax;
}

void DelayedScaling::update() {
  const float last = pending_amax_;
  pending_amax_ = 0.0f;
  recorded_this_step_ = false;
  if (last != 0.0f) {
    history_.push_back(last);
    if (static_cast<int>(history_.size()) > history_len_) history_.pop_front();
  }
  float amax = 0.0f;
  if (algo_ == AmaxComputeAlgo::MostRecent) {
    amax = last;
  } else {
    for (float entry : history_)
      amax = std::fmax(amax, entry);  // fmax skips NaN entries
  }
  if (!std::isfinite(amax) || amax <= 0.0f) return;  // keep the previous scale
  float scale = scaled_max_ / amax;
  if (std::isinf(scale)) scale = std::numeric_limits<float>::max();
  set_scale(scale);
}

void DelayedScaling::set_scale(float scale) {
  FP8T_CHECK(std::isfinite(scale) && scale > 0.0f, "a scale must be finite and positive, found {}",
             scale);
  scale_ = scale;
  scale_inv_ = 1.0f / scale;
}

}  // namespace fp8t
