#include "numerics/scaling.h"

#include <cmath>
#include <limits>
#include <span>
#include <utility>

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
std::string_view name_of(std::span<const std::pair<std::string_view, Enum>> values, Enum value) {
  for (const auto& [name, candidate] : values) {
    if (candidate == value) return name;
  }
  return "?";
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

}  // namespace

const char* tensor_role_name(TensorRole role) {
  switch (role) {
    case TensorRole::Input:
      return "input";
    case TensorRole::Weight:
      return "weight";
    case TensorRole::GradOutput:
      return "grad_output";
  }
  return "?";
}

std::string_view mode_name(Fp8Mode mode) {
  return name_of<Fp8Mode>(kFp8ModeNames, mode);
}
std::string_view recipe_name(ScalingRecipe recipe) {
  return name_of<ScalingRecipe>(kScalingRecipeNames, recipe);
}
std::string_view amax_algo_name(AmaxComputeAlgo algo) {
  return name_of<AmaxComputeAlgo>(kAmaxComputeAlgoNames, algo);
}
std::string_view family_setting_name(FamilySetting setting) {
  return name_of<FamilySetting>(kFamilySettingNames, setting);
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

void DelayedScaling::save_state(float* out) const {
  out[0] = scale_;
  out[1] = static_cast<float>(history_.size());
  std::fill(out + 2, out + state_size(), 0.0f);
  std::copy(history_.begin(), history_.end(), out + 2);
}

void DelayedScaling::load_state(const float* in) {
  const float entries = in[1];
  FP8T_CHECK(entries >= 0.0f && entries <= static_cast<float>(history_len_) &&
                 entries == std::floor(entries),
             "an amax history of {} entries cannot hold {}", history_len_, entries);
  set_scale(in[0]);
  history_.assign(in + 2, in + 2 + static_cast<int>(entries));
  pending_amax_ = 0.0f;
  recorded_this_step_ = false;
}

}  // namespace fp8t
