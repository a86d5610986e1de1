// What every trainer (the GPT's, Flux's) shares: the run folder, the model precision from the
// fp8 keys, resuming from a checkpoint, and the step loop itself: timing, the step lines and
// metrics.jsonl, validation, checkpoints on schedule and on SIGINT / SIGTERM, the summary.
#pragma once

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "config/train_config.h"
#include "models/precision_policy.h"
#include "train/checkpoint.h"
#include "train/run_log.h"

namespace fp8t::train {

struct StepResult {
  double loss = 0.0;       // mean over the micro-batches (and the ranks)
  double grad_norm = 0.0;  // before clipping

  // A bad step (a non-finite loss or gradient norm) is not applied. Both are reduced over the
  // ranks before the check, so every rank skips the same steps.
  bool finite() const { return std::isfinite(loss) && std::isfinite(grad_norm); }
};

// Prints the run's name, folder and resolved configuration, creates the folder and saves the
// configuration in it. A fresh run refuses a folder with checkpoints unless run.overwrite, which
// deletes them and the metrics (resume: auto continues from them instead).
std::filesystem::path open_run_folder(const TrainConfig& config);

// The precision of the model's linears from the fp8 keys; the other linears run on bf16
// operands, as on the GPU. `cuda`: the formats of GPU 0, else the CPU's.
ModelPrecision model_precision(const TrainConfig& config, bool cuda);

// Prints, for a GPU run with fp8_recipe: mxfp8, that the recipe is emulated (Hopper has no MX
// GEMM); nothing otherwise.
void print_emulation_note(const ModelPrecision& precision, bool cuda);

// Reads checkpoint `step` of the run folder into the contents' buffers and the delayed-scaling
// state (when the checkpoint has it) and says so; returns trainer_state.json. The caller then
// restores its own position from it and refreshes the model (weights_changed / from_host).
nlohmann::json resume_from_checkpoint(const std::filesystem::path& run_folder, int64_t step,
                                      const CheckpointContents& contents,
                                      ScalingStateBuffers& scaling);

// Reads the newest of `steps` (ascending, as saved_steps lists them) that loads, as
// resume_from_checkpoint does; each one that does not is named with the reason after `who`, then
// the next older is tried, and the oldest's error is thrown. Nothing when `steps` is empty.
std::optional<nlohmann::json> load_newest_checkpoint(const std::filesystem::path& run_folder,
                                                     const std::vector<int64_t>& steps,
                                                     const CheckpointContents& contents,
                                                     ScalingStateBuffers& scaling,
                                                     std::string_view who);

// What a run continues from: checkpoint resume_from_step, or with `resume: auto` the newest
// checkpoint of the run folder that loads (each one that does not is named with the reason,
// then the next older is tried), read as resume_from_checkpoint does; its trainer_state.json,
// or nothing for a fresh run.
std::optional<nlohmann::json> resume_run(const TrainConfig& config,
                                         const std::filesystem::path& run_folder,
                                         const CheckpointContents& contents,
                                         ScalingStateBuffers& scaling);

// Writes checkpoint `step` of the run folder: the contents' views as they are (the engine's
// host copies brought up to date first), the delayed-scaling state, `trainer_state` and the
// configuration.
void save_run_checkpoint(const std::filesystem::path& run_folder, const TrainConfig& config,
                         int64_t step, nlohmann::json trainer_state, ScalingStateBuffers& scaling,
                         CheckpointContents& contents);

// One optimizer step as the loop shows it.
struct StepReport {
  StepResult result;
  double lr = 0.0;  // the main group's, after the schedule
  double lr_multiplier = 0.0;
  std::string bad_step_note = {};  // a bad step: appended to the log's line about it
};

struct TrainingLoop {
  int64_t total_steps = 0;
  int64_t log_every = 1;
  int64_t eval_every = 0;  // <= 0: never
  int64_t save_every = 0;  // <= 0: only at the end
  double tokens_per_step = 0.0;
  std::optional<double> samples_per_step;  // Flux: the line shows samples/s
  double flops_per_token = 0.0;
  std::optional<double> peak_flops;  // the GPU path: the MFU against it
  std::function<double()> memory_bytes;
  std::function<double()> peak_memory_bytes;
  // Step `step` (counting from 0).
  std::function<StepReport(int64_t step)> train_step;
  std::function<std::optional<double>()> validation_loss;
  std::function<void(int64_t steps_done, double train_seconds)> save;
  // After each step's log line and checkpoint, with the training time so far; may be empty.
  std::function<void(int64_t steps_done, double train_seconds)> after_step;
  // After a bad step's log line and checkpoint: the steps done to go on from (a restored
  // checkpoint's), or nothing to go on as before. May be empty.
  std::function<std::optional<int64_t>(int64_t steps_done)> after_bad_step;
  // log_timers_to_tensorboard: each step's metrics carry its timers (the step, validation and,
  // from phase_times when set, the device's milliseconds per kind of work since its last call).
  bool timers = false;
  std::function<std::vector<std::pair<std::string, double>>()> phase_times;
  // The stop signal received so far (0: none); empty: this process's. Several ranks must agree
  // on it, so that all stop after the same step.
  std::function<int()> stop_signal;
};

// The loop's settings from the run keys (train_iters, log_every, eval_every, save_every).
TrainingLoop training_loop_for(const TrainConfig& config);

struct LoopOutcome {
  int64_t steps_done = 0;
  double last_loss = 0.0;
  std::optional<double> last_val_loss;
  int stop_signal = 0;  // SIGINT or SIGTERM when interrupted, else 0
};

// Runs the steps after `steps_done` up to loop.total_steps; `seconds_before`: the training time
// of the steps before a resume. Ends with the summary line, or after a stop signal with a
// checkpoint of the last step and how to continue.
LoopOutcome run_training_loop(const TrainingLoop& loop, int64_t steps_done, double seconds_before,
                              RunLog& log, const std::filesystem::path& run_folder);

}  // namespace fp8t::train
