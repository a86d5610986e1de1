#include "train/nan_guard.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/error.h"
#include "io/files.h"
#include "train/checkpoint.h"

namespace fp8t::train {

namespace fs = std::filesystem;

namespace {

// The linears of the layer `parameter` sits in: its block's, or lm_head; none outside them.
std::vector<std::string> linears_of_layer(const GptConfig& config, const std::string& parameter) {
  const std::vector<ParamSpec> specs = gpt_parameters(config);
  const ParamSpec* spec = find_parameter(specs, parameter);
  std::vector<std::string> names;
  if (spec == nullptr || (spec->kind != ParamKind::LmHead && spec->layer < 0)) return names;
  for (const LinearSpec& linear : gpt_linears(config)) {
    if (spec->kind == ParamKind::LmHead ? linear.kind == ParamKind::LmHead
                                        : linear.layer == spec->layer) {
      names.push_back(linear.name);
    }
  }
  return names;
}

bool contains(const std::vector<std::string>& names, const std::string& name) {
  return std::find(names.begin(), names.end(), name) != names.end();
}

}  // namespace

std::vector<std::string> gradient_scan_order(const GptConfig& config) {
  std::vector<ParamSpec> specs = gpt_parameters(config);
  std::reverse(specs.begin(), specs.end());
  // By group; within a group, in the reversed order.
  std::vector<std::pair<int, size_t>> keys;
  keys.reserve(specs.size());
  for (size_t i = 0; i < specs.size(); ++i)
    keys.emplace_back(backward_gradient_group(specs[i], config.n_layer), i);
  std::sort(keys.begin(), keys.end());
  std::vector<std::string> names;
  names.reserve(specs.size());
  for (const auto& [group, index] : keys)
    names.push_back(specs[index].name);
  return names;
}

bool all_finite(std::span<const float> values) {
  return std::all_of(values.begin(), values.end(),
                     [](float value) { return std::isfinite(value); });
}

std::string layer_of(const GptConfig& config, const std::string& parameter) {
  const std::vector<ParamSpec> specs = gpt_parameters(config);
  const ParamSpec* spec = find_parameter(specs, parameter);
  FP8T_CHECK(spec != nullptr, "the GPT has no parameter named '{}'", parameter);
  if (spec->kind == ParamKind::LmHead) return "lm_head";
  if (spec->layer >= 0) return fmt::format("block {}", spec->layer);
  return "outside the blocks";
}

void to_json(nlohmann::json& json, const NanGuardState& state) {
  json = {{"bad_steps", state.bad_steps},      {"bad_in_a_row", state.bad_in_a_row},
          {"restores", state.restores},        {"streak_gradients", state.streak_gradients},
          {"lr_scale", state.lr_scale},        {"fp8_margin_added", state.fp8_margin_added},
          {"bf16_linears", state.bf16_linears}};
}

void from_json(const nlohmann::json& json, NanGuardState& state) {
  const NanGuardState fresh;
  state.bad_steps = json.value("bad_steps", fresh.bad_steps);
  state.bad_in_a_row = json.value("bad_in_a_row", fresh.bad_in_a_row);
  state.restores = json.value("restores", fresh.restores);
  state.streak_gradients = json.value("streak_gradients", fresh.streak_gradients);
  state.lr_scale = json.value("lr_scale", fresh.lr_scale);
  state.fp8_margin_added = json.value("fp8_margin_added", fresh.fp8_margin_added);
  state.bf16_linears = json.value("bf16_linears", fresh.bf16_linears);
}

NanGuard::NanGuard(const RunSection& settings, GptConfig model)
    : restore_after_(settings.nan_restore_after),
      max_restores_(settings.nan_max_restores),
      remedies_(settings.nan_remedy),
      lr_factor_(settings.nan_lr_factor),
      model_(std::move(model)) {}

void NanGuard::good_step() {
  state_.bad_in_a_row = 0;
  state_.streak_gradients.clear();
}

std::string NanGuard::bad_step(const std::optional<std::string>& gradient) {
  ++state_.bad_steps;
  ++state_.bad_in_a_row;
  state_.streak_gradients.push_back(gradient.value_or(""));
  const std::string where = gradient ? fmt::format("first non-finite gradient: {} ({})", *gradient,
                                                   layer_of(model_, *gradient))
                                     : std::string("every gradient is finite (the loss is not)");
  return fmt::format("; {}; bad steps: {} in a row, {} in the run", where, state_.bad_in_a_row,
                     state_.bad_steps);
}

bool NanGuard::restore_due() const {
  return restore_after_ > 0 && state_.bad_in_a_row >= restore_after_;
}

std::string NanGuard::describe_streak() const {
  std::vector<std::string> gradients;
  for (const std::string& gradient : state_.streak_gradients) {
    if (!gradient.empty() && !contains(gradients, gradient)) gradients.push_back(gradient);
  }
  return fmt::format("{} bad steps in a row ({})", state_.bad_in_a_row,
                     gradients.empty() ? std::string("non-finite losses, every gradient finite")
                                       : fmt::format("first non-finite gradients: {}",
                                                     fmt::join(gradients, ", ")));
}

RemedyChange NanGuard::begin_restore() {
  if (state_.restores >= max_restores_) {
    throw Error(fmt::format(
        "NaN guard: {} after {} restore(s) of the last good checkpoint (nan_max_restores: {}); "
        "stopping. The remedies in force: {}",
        describe_streak(), state_.restores, max_restores_, describe_remedies()));
  }
  ++state_.restores;
  RemedyChange change;
  std::vector<std::string> done;
  const auto wanted = [&](NanRemedy remedy) {
    return std::find(remedies_.begin(), remedies_.end(), remedy) != remedies_.end();
  };
  if (wanted(NanRemedy::LowerLr)) {
    state_.lr_scale *= lr_factor_;
    done.push_back(fmt::format("lr × {}", lr_factor_));
  }
  if (wanted(NanRemedy::Fp8Margin)) {
    ++state_.fp8_margin_added;
    change.precision_changed = true;
    done.push_back("fp8_margin + 1");
  }
  if (wanted(NanRemedy::Bf16Layer)) {
    std::vector<std::string> layers;  // each layer the streak named once
    for (const std::string& gradient : state_.streak_gradients) {
      if (gradient.empty()) continue;
      const std::vector<std::string> linears = linears_of_layer(model_, gradient);
      if (linears.empty()) continue;
      const std::string layer = layer_of(model_, gradient);
      if (contains(layers, layer)) continue;
      layers.push_back(layer);
      for (const std::string& linear : linears) {
        if (contains(state_.bf16_linears, linear)) continue;
        state_.bf16_linears.push_back(linear);
        change.precision_changed = true;
      }
    }
    done.push_back(layers.empty()
                       ? std::string("bf16_layer: no non-finite gradient in a block or lm_head")
                       : fmt::format("the linears of {} in BF16", fmt::join(layers, ", ")));
  }
  state_.bad_in_a_row = 0;
  state_.streak_gradients.clear();
  change.description = done.empty() ? std::string("no remedy (nan_remedy: [])")
                                    : fmt::format("{}", fmt::join(done, ", "));
  return change;
}

ModelPrecision NanGuard::precision(ModelPrecision configured) const {
  configured.fp8.margin += float(state_.fp8_margin_added);
  std::vector<std::string>& bf16 = configured.policy.bf16_linears;
  for (const std::string& linear : state_.bf16_linears) {
    if (!contains(bf16, linear)) bf16.push_back(linear);
  }
  return configured;
}

bool NanGuard::changes_precision() const {
  return state_.fp8_margin_added > 0 || !state_.bf16_linears.empty();
}

std::string NanGuard::describe_remedies() const {
  std::vector<std::string> parts;
  if (state_.lr_scale != 1.0) parts.push_back(fmt::format("lr × {}", state_.lr_scale));
  if (state_.fp8_margin_added > 0) {
    parts.push_back(fmt::format("fp8_margin + {}", state_.fp8_margin_added));
  }
  if (!state_.bf16_linears.empty()) {
    parts.push_back(fmt::format("{} linear(s) kept in BF16 ({})", state_.bf16_linears.size(),
                                fmt::join(state_.bf16_linears, ", ")));
  }
  return parts.empty() ? std::string("none") : fmt::format("{}", fmt::join(parts, ", "));
}

std::vector<int64_t> good_checkpoint_steps(const fs::path& run_folder) {
  std::vector<int64_t> steps = saved_steps(run_folder);
  std::erase_if(steps, [&](int64_t step) {
    try {
      const nlohmann::json state = nlohmann::json::parse(
          io::read_file(checkpoint_folder(run_folder, step) / "trainer_state.json"));
      return state.value("nan_guard", nlohmann::json::object()).value("bad_in_a_row", 0) > 0;
    } catch (const std::exception&) {
      return false;
    }
  });
  return steps;
}

}  // namespace fp8t::train
