#include "train/fp8_health_monitor.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "train/run_log.h"

namespace fp8t::train {

namespace {

std::string percent(double fraction) {
  return fmt::format("{:.3g} %", 100.0 * fraction);
}

std::string tensor_key(const Fp8TensorHealth& record) {
  return record.layer + "." + tensor_role_name(record.role);
}

// A JSON number, or null for NaN and infinities (JSON has neither).
nlohmann::json number_or_null(float value) {
  return std::isfinite(value) ? nlohmann::json(value) : nlohmann::json(nullptr);
}

}  // namespace

void to_json(nlohmann::json& json, const Fp8HealthState& state) {
  nlohmann::json fallbacks = nlohmann::json::array();
  for (const Fp8Fallback& fallback : state.fallbacks) {
    fallbacks.push_back(
        {{"linear", fallback.linear}, {"step", fallback.step}, {"evidence", fallback.evidence}});
  }
  json = {{"trips_in_a_row", state.trips_in_a_row},
          {"recent_warnings", state.recent_warnings},
          {"last_amax", state.last_amax},
          {"fallbacks", fallbacks}};
}

void from_json(const nlohmann::json& json, Fp8HealthState& state) {
  state = Fp8HealthState{};
  if (json.contains("trips_in_a_row")) json.at("trips_in_a_row").get_to(state.trips_in_a_row);
  if (json.contains("recent_warnings")) json.at("recent_warnings").get_to(state.recent_warnings);
  if (json.contains("last_amax")) json.at("last_amax").get_to(state.last_amax);
  for (const nlohmann::json& item : json.value("fallbacks", nlohmann::json::array())) {
    Fp8Fallback fallback;
    item.at("linear").get_to(fallback.linear);
    item.at("step").get_to(fallback.step);
    fallback.evidence = item.value("evidence", "");
    state.fallbacks.push_back(std::move(fallback));
  }
}

Fp8HealthMonitor::Fp8HealthMonitor(const Fp8Section& settings, bool fp8)
    : settings_(settings), fp8_(fp8) {}

bool Fp8HealthMonitor::due(int64_t step) const {
  return fp8_ && settings_.health_every > 0 && step % settings_.health_every == 0;
}

std::vector<std::string> Fp8HealthMonitor::trips(const Fp8TensorHealth& record) const {
  std::vector<std::string> reasons;
  const Fp8OperandHealth& health = record.health;
  if (health.elements == 0) return reasons;
  if (health.saturated_fraction() > settings_.saturation_threshold) {
    reasons.push_back(fmt::format("{} of {} values saturated at ±max (threshold {})",
                                  percent(health.saturated_fraction()), health.elements,
                                  percent(settings_.saturation_threshold)));
  }
  if (health.underflow_fraction() > settings_.underflow_threshold) {
    reasons.push_back(fmt::format("{} of {} values underflowed to zero (threshold {})",
                                  percent(health.underflow_fraction()), health.elements,
                                  percent(settings_.underflow_threshold)));
  }
  if (health.per_tensor() && !std::isfinite(health.amax)) {
    reasons.push_back(fmt::format("amax {}", health.amax));
  } else if (settings_.scaling.recipe == ScalingRecipe::Delayed) {
    // Only delayed scaling lags behind the amax: its scale comes from the history.
    const auto last = state_.last_amax.find(tensor_key(record));
    if (last != state_.last_amax.end() && last->second > 0.0f &&
        health.amax > settings_.amax_jump_threshold * last->second) {
      reasons.push_back(fmt::format("amax jumped {:.3g}x, {:.4g} -> {:.4g} (threshold {:.3g}x)",
                                    health.amax / last->second, last->second, health.amax,
                                    settings_.amax_jump_threshold));
    }
  }
  return reasons;
}

Fp8HealthVerdict Fp8HealthMonitor::check(int64_t step,
                                         const std::vector<Fp8TensorHealth>& records) {
  Fp8HealthVerdict verdict;
  std::map<std::string, std::vector<std::string>> layer_warnings;  // this step's, by linear
  std::vector<std::string> layers;                                 // in the records' order
  for (const Fp8TensorHealth& record : records) {
    if (std::find(layers.begin(), layers.end(), record.layer) == layers.end()) {
      layers.push_back(record.layer);
    }
    const std::vector<std::string> reasons = trips(record);
    if (!reasons.empty()) {
      std::string warning = fmt::format("FP8 health, step {}: {} {}: {}", step, record.layer,
                                        tensor_role_name(record.role), fmt::join(reasons, "; "));
      if (record.health.per_tensor()) {
        warning +=
            fmt::format(" (amax {:.4g}, scale {:.4g})", record.health.amax, record.health.scale);
      }
      layer_warnings[record.layer].push_back(warning);
      verdict.warnings.push_back(std::move(warning));
    }
    if (record.health.per_tensor() && std::isfinite(record.health.amax)) {
      state_.last_amax[tensor_key(record)] = record.health.amax;
    }
  }
  for (const std::string& layer : layers) {
    const auto tripped = layer_warnings.find(layer);
    if (tripped == layer_warnings.end()) {
      state_.trips_in_a_row.erase(layer);
      state_.recent_warnings.erase(layer);
      continue;
    }
    const int64_t in_a_row = ++state_.trips_in_a_row[layer];
    std::vector<std::string>& recent = state_.recent_warnings[layer];
    recent.insert(recent.end(), tripped->second.begin(), tripped->second.end());
    if (!settings_.auto_fallback || in_a_row < settings_.fallback_after) continue;
    Fp8Fallback fallback;
    fallback.linear = layer;
    fallback.step = step;
    fallback.evidence = fmt::format("{} statistics step(s) in a row tripped: {}", in_a_row,
                                    fmt::join(recent, " | "));
    state_.trips_in_a_row.erase(layer);
    state_.recent_warnings.erase(layer);
    state_.fallbacks.push_back(fallback);
    verdict.fallbacks.push_back(std::move(fallback));
  }
  return verdict;
}

ModelPrecision Fp8HealthMonitor::precision(ModelPrecision configured) const {
  std::vector<std::string>& bf16 = configured.policy.fallback_linears;
  for (const Fp8Fallback& fallback : state_.fallbacks) {
    if (std::find(bf16.begin(), bf16.end(), fallback.linear) == bf16.end()) {
      bf16.push_back(fallback.linear);
    }
  }
  return configured;
}

std::string Fp8HealthMonitor::describe_fallbacks() const {
  if (state_.fallbacks.empty()) return "none";
  std::vector<std::string> items;
  for (const Fp8Fallback& fallback : state_.fallbacks)
    items.push_back(fmt::format("{} (step {})", fallback.linear, fallback.step));
  return fmt::format("{}", fmt::join(items, ", "));
}

void sum_over_ranks(std::vector<Fp8TensorHealth>& records,
                    distributed::Communicator& communicator) {
  std::vector<double> counts;
  std::vector<float> amaxes;
  for (const Fp8TensorHealth& record : records) {
    counts.push_back(double(record.health.elements));
    counts.push_back(double(record.health.counts.saturated));
    counts.push_back(double(record.health.counts.underflow));
    amaxes.push_back(record.health.amax);
  }
  communicator.sum(counts.data(), counts.size());
  communicator.max(amaxes.data(), amaxes.size());
  for (size_t i = 0; i < records.size(); ++i) {
    Fp8OperandHealth& health = records[i].health;
    // Counts stay exact in doubles up to 2^53 values.
    health.elements = static_cast<uint64_t>(counts[3 * i]);
    health.counts.saturated = static_cast<uint64_t>(counts[3 * i + 1]);
    health.counts.underflow = static_cast<uint64_t>(counts[3 * i + 2]);
    health.amax = amaxes[i];
  }
}

std::vector<Fp8Fallback> judge_fp8_health(int64_t step, std::vector<Fp8TensorHealth> records,
                                          Fp8HealthMonitor& monitor, RunLog& log,
                                          distributed::Communicator* communicator) {
  if (communicator != nullptr) sum_over_ranks(records, *communicator);
  log.fp8_health(step, records);
  Fp8HealthVerdict verdict = monitor.check(step, records);
  for (const std::string& warning : verdict.warnings)
    log.event("fp8_warning", warning);
  return std::move(verdict.fallbacks);
}

void log_fp8_fallbacks(const std::vector<Fp8Fallback>& fallbacks, RunLog& log) {
  for (const Fp8Fallback& fallback : fallbacks) {
    log.event("fp8_fallback",
              fmt::format("FP8 health: {} moves to BF16 after step {} (fp8_auto_fallback): {}",
                          fallback.linear, fallback.step, fallback.evidence));
  }
}

nlohmann::json health_line(int64_t step, const Fp8TensorHealth& record) {
  const Fp8OperandHealth& health = record.health;
  return {{"step", step},
          {"layer", record.layer},
          {"operand", tensor_role_name(record.role)},
          {"amax", number_or_null(health.amax)},
          {"scale", number_or_null(health.scale)},
          {"elements", health.elements},
          {"saturated", health.counts.saturated},
          {"underflow", health.counts.underflow},
          {"saturated_fraction", health.saturated_fraction()},
          {"underflow_fraction", health.underflow_fraction()}};
}

std::vector<std::pair<std::string, float>> health_scalars(const Fp8TensorHealth& record) {
  const std::string prefix = fmt::format("fp8/{}/{}/", record.layer, tensor_role_name(record.role));
  std::vector<std::pair<std::string, float>> scalars = {
      {prefix + "saturated_fraction", float(record.health.saturated_fraction())},
      {prefix + "underflow_fraction", float(record.health.underflow_fraction())}};
  if (record.health.per_tensor()) {
    scalars.emplace_back(prefix + "amax", record.health.amax);
    scalars.emplace_back(prefix + "scale", record.health.scale);
  }
  return scalars;
}

}  // namespace fp8t::train
