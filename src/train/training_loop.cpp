#include "train/training_loop.h"

#include <chrono>
#include <system_error>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"
#include "numerics/formats.h"
#include "platform/device_info.h"
#include "train/stop_signal.h"

namespace fp8t::train {

namespace fs = std::filesystem;

using Clock = std::chrono::steady_clock;

fs::path open_run_folder(const TrainConfig& config) {
  const fs::path run_folder = config.run_dir();
  fmt::print("fp8train {}: run '{}' in {}\n", FP8TRAIN_VERSION, config.run.name,
             run_folder.string());
  fmt::print("--- resolved configuration ---\n{}------------------------------\n", to_yaml(config));
  // The run folder must exist and take files before any time is spent training.
  std::error_code error;
  fs::create_directories(run_folder, error);
  if (error) {
    throw Error(
        fmt::format("{}: cannot create the run folder: {}", run_folder.string(), error.message()));
  }
  const std::vector<int64_t> steps = saved_steps(run_folder);
  const bool resuming = config.run.resume_from_step >= 0 || config.run.resume == ResumeChoice::Auto;
  if (!resuming && !steps.empty()) {
    if (!config.run.overwrite) {
      throw Error(
          fmt::format("{}: the run folder already holds checkpoints (last step {}); resume with "
                      "--resume-from-step={} or --resume=auto, pick another --run, or start over "
                      "with --overwrite",
                      run_folder.string(), steps.back(), steps.back()));
    }
    fs::remove_all(run_folder / "checkpoints", error);
    // The logs of the run given up, which a new start would otherwise append to.
    fs::remove(run_folder / "metrics.jsonl", error);
    fs::remove(run_folder / "fp8_health.jsonl", error);
    for (const fs::directory_entry& entry : fs::directory_iterator(run_folder, error)) {
      if (entry.path().filename().string().starts_with("events.out.tfevents.")) {
        fs::remove(entry.path(), error);
      }
    }
  }
  save_train_config(config, run_folder / "config.yaml");
  return run_folder;
}

ModelPrecision model_precision(const TrainConfig& config, bool cuda) {
  ModelPrecision precision;
  precision.fp8 = config.fp8_config();
  precision.family =
      resolve_family(precision.fp8.dtype_family, cuda ? fp8_architecture(query_gpus()) : "cpu");
  precision.policy = config.precision_options();
  precision.fp8_wgrad = config.fp8.wgrad;
  precision.fp8_weight_transposes = config.fp8.weight_transposes;
  precision.fp8_attention = config.fp8.dot_product_attention && precision.fp8.mode != Fp8Mode::None;
  precision.other_linears = ops::LinearOperands::Bf16;
  return precision;
}

void print_emulation_note(const ModelPrecision& precision, bool cuda) {
  if (!cuda || precision.fp8.mode == Fp8Mode::None ||
      precision.fp8.recipe != ScalingRecipe::Mxfp8) {
    return;
  }
  fmt::print(
      "precision: mxfp8 is emulated on this GPU (no MX GEMM before Blackwell): operands are "
      "quantized to MXFP8, dequantized to bf16 and multiplied by BF16 GEMMs\n");
}

nlohmann::json resume_from_checkpoint(const fs::path& run_folder, int64_t step,
                                      const CheckpointContents& contents,
                                      ScalingStateBuffers& scaling) {
  // A tensor whose state the checkpoint lacks then keeps its own.
  scaling.copy_from_scalings();
  const LoadedCheckpoint loaded = load_checkpoint(run_folder, step, contents);
  if (!scaling.empty() && loaded.had_fp8_scaling) scaling.copy_to_scalings();
  std::string note;
  if (!scaling.empty() && !loaded.had_fp8_scaling) {
    note = " (no FP8 scaling state in the checkpoint: delayed scaling starts afresh)";
  } else if (!loaded.fp8_scaling_missing.empty() || !loaded.fp8_scaling_ignored.empty()) {
    note = fmt::format(
        " (the FP8 linears changed: {} delayed-scaling state(s) start afresh, {} of linears no "
        "longer in FP8 are dropped)",
        loaded.fp8_scaling_missing.size(), loaded.fp8_scaling_ignored.size());
  }
  fmt::print("resumed from step {} of {}{}\n", loaded.trainer_state.at("step").get<int64_t>(),
             run_folder.string(), note);
  return loaded.trainer_state;
}

std::optional<nlohmann::json> load_newest_checkpoint(const fs::path& run_folder,
                                                     const std::vector<int64_t>& steps,
                                                     const CheckpointContents& contents,
                                                     ScalingStateBuffers& scaling,
                                                     std::string_view who) {
  for (auto step = steps.rbegin(); step != steps.rend(); ++step) {
    try {
      return resume_from_checkpoint(run_folder, *step, contents, scaling);
    } catch (const Error& error) {
      if (std::next(step) == steps.rend()) throw;
      fmt::print("{}: cannot resume from step {}: {}; trying step {}\n", who, *step, error.what(),
                 *std::next(step));
    }
  }
  return std::nullopt;
}

std::optional<nlohmann::json> resume_run(const TrainConfig& config, const fs::path& run_folder,
                                         const CheckpointContents& contents,
                                         ScalingStateBuffers& scaling) {
  if (config.run.resume_from_step >= 0) {
    return resume_from_checkpoint(run_folder, config.run.resume_from_step, contents, scaling);
  }
  if (config.run.resume != ResumeChoice::Auto) return std::nullopt;
  const std::vector<int64_t> steps = saved_steps(run_folder);
  if (steps.empty()) {
    fmt::print("resume: auto: no checkpoint in {}, starting fresh\n", run_folder.string());
    return std::nullopt;
  }
  return load_newest_checkpoint(run_folder, steps, contents, scaling, "resume: auto");
}

void save_run_checkpoint(const fs::path& run_folder, const TrainConfig& config, int64_t step,
                         nlohmann::json trainer_state, ScalingStateBuffers& scaling,
                         CheckpointContents& contents) {
  scaling.copy_from_scalings();
  contents.step = step;
  contents.trainer_state = std::move(trainer_state);
  contents.config_yaml = to_yaml(config);
  save_checkpoint(run_folder, contents);
  prune_checkpoints(run_folder, config.run.keep_checkpoints);
}

TrainingLoop training_loop_for(const TrainConfig& config) {
  TrainingLoop loop;
  loop.total_steps = config.training.train_iters;
  loop.log_every = config.run.log_every;
  loop.eval_every = config.run.eval_every;
  loop.save_every = config.run.save_every;
  return loop;
}

LoopOutcome run_training_loop(const TrainingLoop& loop, int64_t steps_done, double seconds_before,
                              RunLog& log, const fs::path& run_folder) {
  StopSignal stop_signal;
  StepTimer timer;
  LoopOutcome outcome;
  double train_seconds = seconds_before;
  int64_t step = steps_done;
  const auto saved_on_schedule = [&](int64_t at) {
    return at == loop.total_steps || (loop.save_every > 0 && at % loop.save_every == 0);
  };

  while (step < loop.total_steps) {
    const Clock::time_point start = Clock::now();
    const StepReport report = loop.train_step(step);
    const bool bad = !report.result.finite();
    if (bad) {
      log.event(
          "skipped_step",
          fmt::format("step {}: loss {:.4f}, gradient norm {:.4g}; the update is skipped{}",
                      step + 1, report.result.loss, report.result.grad_norm, report.bad_step_note));
    }
    ++step;
    const double seconds = std::chrono::duration<double>(Clock::now() - start).count();
    train_seconds += seconds;
    timer.add(seconds);

    StepMetrics metrics;
    metrics.step = step;
    metrics.total_steps = loop.total_steps;
    metrics.loss = report.result.loss;
    metrics.lr_multiplier = report.lr_multiplier;
    metrics.lr = report.lr;
    metrics.grad_norm = report.result.grad_norm;
    metrics.step_seconds = seconds;
    metrics.tokens_per_second = loop.tokens_per_step / seconds;
    if (loop.samples_per_step) metrics.samples_per_second = *loop.samples_per_step / seconds;
    metrics.flops_per_second = metrics.tokens_per_second * loop.flops_per_token;
    if (loop.peak_flops) metrics.mfu = metrics.flops_per_second / *loop.peak_flops;
    metrics.memory_bytes = loop.memory_bytes();
    metrics.eta_seconds = timer.eta_seconds(loop.total_steps - step);
    const bool last = step == loop.total_steps;
    if (loop.timers) {
      metrics.timers_ms.emplace_back("step", 1e3 * seconds);
      if (loop.phase_times) {
        for (const auto& phase : loop.phase_times())
          metrics.timers_ms.push_back(phase);
      }
    }
    if (loop.eval_every > 0 && (step % loop.eval_every == 0 || last)) {
      const Clock::time_point validation_start = Clock::now();
      metrics.val_loss = loop.validation_loss();
      if (loop.timers) {
        metrics.timers_ms.emplace_back(
            "validation",
            1e3 * std::chrono::duration<double>(Clock::now() - validation_start).count());
      }
    }
    log.step(metrics, step % loop.log_every == 0 || last || metrics.val_loss);
    outcome.last_loss = report.result.loss;
    if (metrics.val_loss) outcome.last_val_loss = metrics.val_loss;

    if (saved_on_schedule(step)) loop.save(step, train_seconds);
    if (loop.after_step) loop.after_step(step, train_seconds);
    if (bad && loop.after_bad_step) step = loop.after_bad_step(step).value_or(step);
    const int stop = loop.stop_signal ? loop.stop_signal() : StopSignal::received();
    if (stop != 0) {
      if (!saved_on_schedule(step)) loop.save(step, train_seconds);
      outcome.stop_signal = stop;
      log.event("interrupted",
                fmt::format("stopped by signal {} after step {}; checkpoint saved "
                            "in {}; continue with --resume-from-step={} or --resume=auto",
                            outcome.stop_signal, step, checkpoint_folder(run_folder, step).string(),
                            step));
      break;
    }
  }
  outcome.steps_done = step;

  if (outcome.stop_signal == 0) {
    log.event("summary",
              fmt::format("done: {} steps, final loss {:.4f}{}, {} of training, peak memory {}; "
                          "checkpoint in {}",
                          step, outcome.last_loss,
                          outcome.last_val_loss
                              ? fmt::format(" (validation {:.4f})", *outcome.last_val_loss)
                              : "",
                          format_duration(train_seconds), format_bytes(loop.peak_memory_bytes()),
                          checkpoint_folder(run_folder, step).string()));
  }
  return outcome;
}

}  // namespace fp8t::train
