#include "train/run_log.h"

#include <algorithm>
#include <cmath>
#include <iostream>
#include <numeric>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "train/fp8_health_monitor.h"
#include "train/mlflow_tracker.h"

namespace fp8t::train {

namespace {

// MLflow takes the TensorBoard scalars, under the same names.
std::vector<std::pair<std::string, double>> as_metrics(
    const std::vector<std::pair<std::string, float>>& scalars) {
  return {scalars.begin(), scalars.end()};
}

// A "Field:   123 kB" line of a /proc file, in bytes.
double proc_kib(const char* file, const std::string& field) {
  std::ifstream status(file);
  std::string line;
  while (std::getline(status, line)) {
    if (line.starts_with(field + ":")) return std::stod(line.substr(field.size() + 1)) * 1024.0;
  }
  return 0.0;
}

nlohmann::json optional_number(const std::optional<double>& value) {
  return value ? nlohmann::json(*value) : nlohmann::json(nullptr);
}

}  // namespace

void StepTimer::add(double seconds) {
  recent_.push_back(seconds);
  if (recent_.size() > kWindow) recent_.pop_front();
}

double StepTimer::seconds_per_step() const {
  if (recent_.empty()) return 0.0;
  return std::accumulate(recent_.begin(), recent_.end(), 0.0) / double(recent_.size());
}

std::string format_duration(double seconds) {
  const auto total = static_cast<int64_t>(std::llround(std::max(0.0, seconds)));
  const int64_t hours = total / 3600, minutes = total / 60 % 60, secs = total % 60;
  if (hours > 0) return fmt::format("{}h{:02d}m", hours, minutes);
  if (minutes > 0) return fmt::format("{}m{:02d}s", minutes, secs);
  return fmt::format("{}s", secs);
}

std::string format_bytes(double bytes) {
  if (bytes >= 1024.0 * 1024.0 * 1024.0) return fmt::format("{:.1f} GiB", bytes / (1 << 30));
  return fmt::format("{:.1f} MiB", bytes / (1 << 20));
}

double resident_memory_bytes() {
  return proc_kib("/proc/self/status", "VmRSS");
}
double peak_resident_memory_bytes() {
  return proc_kib("/proc/self/status", "VmHWM");
}
double available_memory_bytes() {
  return proc_kib("/proc/meminfo", "MemAvailable");
}

RunLog::RunLog(const std::filesystem::path& run_folder, const RunLogOutputs& outputs)
    : jsonl_path_(run_folder / "metrics.jsonl"),
      health_path_(run_folder / "fp8_health.jsonl"),
      mlflow_(outputs.writes ? outputs.mlflow : nullptr),
      terminal_(outputs.terminal && outputs.writes),
      writes_(outputs.writes),
      jsonl_on_(outputs.jsonl && outputs.writes) {
  if (!writes_) return;
  if (jsonl_on_) {
    jsonl_.open(jsonl_path_, std::ios::app);
    if (!jsonl_) throw Error(fmt::format("{}: cannot open for writing", jsonl_path_.string()));
  }
  if (outputs.tensorboard) tensorboard_ = std::make_unique<io::TfEventsWriter>(run_folder);
}

std::vector<std::pair<std::string, float>> RunLog::tensorboard_scalars(const StepMetrics& m) {
  std::vector<std::pair<std::string, float>> values = {
      {"train/loss", static_cast<float>(m.loss)},
      {"train/lr", static_cast<float>(m.lr)},
      {"train/lr_multiplier", static_cast<float>(m.lr_multiplier)},
      {"train/grad_norm", static_cast<float>(m.grad_norm)},
      {"perf/step_seconds", static_cast<float>(m.step_seconds)},
      {"perf/flops_per_second", static_cast<float>(m.flops_per_second)},
      {"memory/bytes", static_cast<float>(m.memory_bytes)}};
  if (m.samples_per_second) {
    values.emplace_back("perf/samples_per_second", static_cast<float>(*m.samples_per_second));
  } else {
    values.emplace_back("perf/tokens_per_second", static_cast<float>(m.tokens_per_second));
  }
  if (m.mfu) values.emplace_back("perf/mfu", static_cast<float>(*m.mfu));
  if (m.val_loss) values.emplace_back("val/loss", static_cast<float>(*m.val_loss));
  for (const auto& [name, milliseconds] : m.timers_ms)
    values.emplace_back("timers/" + name + "_ms", static_cast<float>(milliseconds));
  return values;
}

RunLog::~RunLog() {
  clear_bar();
}

std::string RunLog::step_line(const StepMetrics& m) {
  const int width = static_cast<int>(std::to_string(m.total_steps).size());
  std::string line = fmt::format("step {:{}d}/{} | loss {:.4f} | lr {:.2e} | grad norm {:.3f} | ",
                                 m.step, width, m.total_steps, m.loss, m.lr, m.grad_norm);
  if (m.samples_per_second) {
    line += fmt::format("{:.1f} samples/s | ", *m.samples_per_second);
  } else {
    line += fmt::format("{:.0f} tok/s | ", m.tokens_per_second);
  }
  if (m.mfu) {
    line += fmt::format("MFU {:.1f}% | ", 100.0 * *m.mfu);
  } else {
    line += fmt::format("{:.1f} GFLOP/s | ", m.flops_per_second / 1e9);
  }
  line += fmt::format("mem {} | {:.0f} ms | ETA {}", format_bytes(m.memory_bytes),
                      1e3 * m.step_seconds, format_duration(m.eta_seconds));
  if (m.val_loss) line += fmt::format(" | val loss {:.4f}", *m.val_loss);
  return line;
}

void RunLog::step(const StepMetrics& m, bool print) {
  if (!writes_) return;
  nlohmann::json record = {
      {"step", m.step},
      {"total_steps", m.total_steps},
      {"loss", m.loss},
      {"lr", m.lr},
      {"lr_multiplier", m.lr_multiplier},
      {"grad_norm", std::isfinite(m.grad_norm) ? nlohmann::json(m.grad_norm) : nullptr},
      {"step_seconds", m.step_seconds},
      {"tokens_per_second", m.tokens_per_second},
      {"flops_per_second", m.flops_per_second},
      {"mfu", optional_number(m.mfu)},
      {"memory_bytes", m.memory_bytes},
      {"eta_seconds", m.eta_seconds},
      {"val_loss", optional_number(m.val_loss)},
  };
  if (m.samples_per_second) record["samples_per_second"] = *m.samples_per_second;
  if (!m.timers_ms.empty()) {
    nlohmann::json timers = nlohmann::json::object();
    for (const auto& [name, milliseconds] : m.timers_ms)
      timers[name] = milliseconds;
    record["timers_ms"] = timers;
  }
  if (jsonl_on_) {
    jsonl_ << record.dump() << '\n' << std::flush;
    if (!jsonl_) throw Error(fmt::format("{}: cannot write", jsonl_path_.string()));
  }
  if (tensorboard_ || mlflow_) {
    const std::vector<std::pair<std::string, float>> scalars = tensorboard_scalars(m);
    if (tensorboard_) tensorboard_->scalars(m.step, scalars);
    if (mlflow_) mlflow_->log_metrics(m.step, as_metrics(scalars));
  }
  if (print) {
    clear_bar();
    fmt::print("{}\n", step_line(m));
    std::fflush(stdout);
  }
  if (terminal_) draw_bar(m);
}

void RunLog::event(const std::string& kind, const std::string& message) {
  if (!writes_) return;
  if (jsonl_on_) {
    // Generated text can end inside a multi-byte character: store U+FFFD for broken bytes.
    jsonl_ << nlohmann::json{{"event", kind}, {"message", message}}.dump(
                  -1, ' ', false, nlohmann::json::error_handler_t::replace)
           << '\n'
           << std::flush;
  }
  clear_bar();
  fmt::print("{}\n", message);
  std::fflush(stdout);
}

void RunLog::fp8_health(int64_t step, const std::vector<Fp8TensorHealth>& records) {
  if (!writes_ || records.empty()) return;  // no linear in FP8
  if (jsonl_on_ && !health_.is_open()) {
    health_.open(health_path_, std::ios::app);
    if (!health_) throw Error(fmt::format("{}: cannot open for writing", health_path_.string()));
  }
  std::vector<std::pair<std::string, float>> scalars;
  for (const Fp8TensorHealth& record : records) {
    if (jsonl_on_) health_ << health_line(step, record).dump() << '\n';
    const auto more = health_scalars(record);
    scalars.insert(scalars.end(), more.begin(), more.end());
  }
  if (jsonl_on_) {
    health_ << std::flush;
    if (!health_) throw Error(fmt::format("{}: cannot write", health_path_.string()));
  }
  if (tensorboard_) tensorboard_->scalars(step, scalars);
  if (mlflow_) mlflow_->log_metrics(step, as_metrics(scalars));
}

void RunLog::clear_bar() {
  if (!bar_drawn_) return;
  std::fputs("\r\033[K", stderr);
  bar_drawn_ = false;
}

void RunLog::draw_bar(const StepMetrics& m) {
  constexpr int kWidth = 30;
  const double done = m.total_steps > 0 ? double(m.step) / double(m.total_steps) : 1.0;
  const int filled = static_cast<int>(done * kWidth);
  fmt::print(stderr, "\r\033[K[{}{}] {:3.0f}% step {}/{} ETA {}", std::string(filled, '#'),
             std::string(kWidth - filled, '.'), 100.0 * done, m.step, m.total_steps,
             format_duration(m.eta_seconds));
  std::fflush(stderr);
  bar_drawn_ = true;
}

}  // namespace fp8t::train
