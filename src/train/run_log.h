// What a run shows while it trains: a line per logged step, a progress bar on a terminal, the
// same metrics as JSON lines in the run folder (and as TensorBoard scalars), and a summary at
// the end.
#pragma once

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <deque>
#include <filesystem>
#include <fstream>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "io/tfevents.h"
#include "ops/fp8_health.h"

namespace fp8t::train {

struct StepMetrics {
  int64_t step = 0;  // steps done, counting from 1
  int64_t total_steps = 0;
  double loss = 0.0;
  double lr_multiplier = 0.0;
  double lr = 0.0;  // the main group's learning rate
  double grad_norm = 0.0;
  double step_seconds = 0.0;
  double tokens_per_second = 0.0;
  std::optional<double> samples_per_second;  // Flux: pictures per second, shown instead of tok/s
  double flops_per_second = 0.0;
  std::optional<double> mfu;  // against the GPU's BF16 peak; none on the CPU
  double memory_bytes = 0.0;  // resident (CPU) or allocated (GPU)
  double eta_seconds = 0.0;
  std::optional<double> val_loss;
  // log_timers_to_tensorboard: milliseconds by timer ("step", "validation", "gemm", ...), as
  // TensorBoard's timers/<name>_ms and the JSON line's timers_ms.
  std::vector<std::pair<std::string, double>> timers_ms;
};

// Seconds per step from the recent steps (the first steps are slower and fade out).
class StepTimer {
 public:
  void add(double seconds);
  double seconds_per_step() const;
  double eta_seconds(int64_t steps_left) const { return seconds_per_step() * double(steps_left); }

 private:
  static constexpr size_t kWindow = 20;
  std::deque<double> recent_;
};

// "1h02m", "3m05s", "12s".
std::string format_duration(double seconds);
// "1.2 GiB", "300.0 MiB".
std::string format_bytes(double bytes);

// The resident set size of this process, and its peak, from /proc/self/status; 0 when unknown.
double resident_memory_bytes();
double peak_resident_memory_bytes();
// MemAvailable of /proc/meminfo; 0 when unknown.
double available_memory_bytes();

class MlflowTracker;

// Where a run's log goes besides the terminal (the `tracker` key).
struct RunLogOutputs {
  bool writes = true;     // false: a silent log, for the ranks of a data-parallel job but 0
  bool terminal = false;  // a progress bar on stderr between the step lines
  // RUN/metrics.jsonl (and fp8_health.jsonl), appended to: a resumed run continues them.
  bool jsonl = true;
  // A new TensorBoard event file in RUN (a resumed run adds one; TensorBoard reads them as one
  // run), with the scalars of tensorboard_scalars() at each step.
  bool tensorboard = false;
  // The same values as metrics of an MLflow run (train/mlflow_tracker.h); not owned.
  MlflowTracker* mlflow = nullptr;
};

class RunLog {
 public:
  RunLog(const std::filesystem::path& run_folder, const RunLogOutputs& outputs);
  ~RunLog();
  RunLog(const RunLog&) = delete;
  RunLog& operator=(const RunLog&) = delete;

  // The step line goes to stdout when `print` (every log_every steps, and the last); the JSON
  // line is always written.
  void step(const StepMetrics& metrics, bool print);
  // Any other message: printed without breaking the progress bar, and kept in the JSONL as
  // {"event": ...}.
  void event(const std::string& kind, const std::string& message);
  // A statistics step's FP8 health records: lines of RUN/fp8_health.jsonl (appended, as
  // metrics.jsonl) and TensorBoard scalars (train/fp8_health_monitor.h).
  void fp8_health(int64_t step, const std::vector<Fp8TensorHealth>& records);

  static std::string step_line(const StepMetrics& metrics);
  // The TensorBoard scalars of a step, by tag: train/loss, train/lr, train/lr_multiplier,
  // train/grad_norm, val/loss (steps that evaluate), perf/tokens_per_second or (Flux)
  // perf/samples_per_second, perf/step_seconds, perf/flops_per_second, perf/mfu (GPUs),
  // memory/bytes, and timers/<name>_ms for the step's timers.
  static std::vector<std::pair<std::string, float>> tensorboard_scalars(const StepMetrics& metrics);

 private:
  void clear_bar();
  void draw_bar(const StepMetrics& metrics);

  std::ofstream jsonl_;
  std::filesystem::path jsonl_path_;
  std::ofstream health_;  // opened at the first statistics step
  std::filesystem::path health_path_;
  std::unique_ptr<io::TfEventsWriter> tensorboard_;
  MlflowTracker* mlflow_;
  bool terminal_;
  bool writes_;
  bool jsonl_on_;
  bool bar_drawn_ = false;
};

}  // namespace fp8t::train
