#include "train/run_trackers.h"

#include <cstdlib>

#include <fmt/format.h>

#include "config/config_keys.h"
#include "core/error.h"

namespace fp8t::train {

std::string_view build_commit() {
#ifdef FP8TRAIN_GIT_COMMIT
  return FP8TRAIN_GIT_COMMIT;
#else
  return "unknown";
#endif
}

KeyValues config_params(const TrainConfig& config) {
  KeyValues params;
  for (const ConfigKey& key : config_keys()) {
    if (!key.applies_to(config)) continue;
    params.emplace_back(fmt::format("{}.{}", section_name(key.section), key.name), key.get(config));
  }
  return params;
}

TrackedRun::TrackedRun(const TrainConfig& config,
                       const std::optional<nlohmann::json>& trainer_state,
                       const std::string& device, const std::string& precision, bool leader) {
  outputs_.writes = leader;
  outputs_.jsonl = config.run.tracks(Tracker::Jsonl);
  outputs_.tensorboard = config.run.tracks(Tracker::Tensorboard);
  if (!leader || !config.run.tracks(Tracker::Mlflow)) return;
  const char* uri = std::getenv("MLFLOW_TRACKING_URI");
  if (uri == nullptr || std::string_view(uri).empty()) {
    throw ConfigError(
        "tracker: mlflow needs the environment variable MLFLOW_TRACKING_URI, the address of an "
        "MLflow tracking server (e.g. http://127.0.0.1:5000; docs/tracking.md)");
  }
  MlflowSettings settings;
  settings.tracking_uri = uri;
  settings.experiment = config.run.experiment;
  settings.run_name = config.run.name;
  if (trainer_state) settings.resume_run_id = trainer_state->value("mlflow_run_id", "");
  mlflow_ = std::make_unique<MlflowTracker>(settings);
  fmt::print("MLflow: run {} in experiment '{}' at {}{}\n", mlflow_->run_id(),
             config.run.experiment, uri, settings.resume_run_id.empty() ? "" : " (continued)");
  mlflow_->log_params(config_params(config));
  mlflow_->set_tags(
      {{"fp8train.git_commit", std::string(build_commit())},
       {"fp8train.device", device},
       {"fp8train.precision", precision},
       {"fp8train.fp8_recipe", config.fp8.scaling.mode == Fp8Mode::None
                                   ? std::string("none")
                                   : std::string(recipe_name(config.fp8.scaling.recipe))},
       {"fp8train.model", config.model.name}});
  outputs_.mlflow = mlflow_.get();
}

TrackedRun::~TrackedRun() {
  if (!mlflow_) return;
  for (const std::string& line : mlflow_->finish(MlflowRunStatus::Failed))
    fmt::print(stderr, "{}\n", line);
}

RunLogOutputs TrackedRun::log_outputs(bool terminal) const {
  RunLogOutputs outputs = outputs_;
  outputs.terminal = terminal;
  return outputs;
}

void TrackedRun::add_to(nlohmann::json& trainer_state) const {
  if (mlflow_) trainer_state["mlflow_run_id"] = mlflow_->run_id();
}

void TrackedRun::finish(const LoopOutcome& outcome, RunLog& log) {
  if (!mlflow_) return;
  std::vector<std::pair<std::string, double>> summary = {
      {"summary/steps", double(outcome.steps_done)}, {"summary/final_loss", outcome.last_loss}};
  if (outcome.last_val_loss) summary.emplace_back("summary/final_val_loss", *outcome.last_val_loss);
  mlflow_->log_metrics(outcome.steps_done, summary);
  const MlflowRunStatus status =
      outcome.stop_signal != 0 ? MlflowRunStatus::Killed : MlflowRunStatus::Finished;
  const std::vector<std::string> lines = mlflow_->finish(status);
  mlflow_.reset();
  for (const std::string& line : lines)
    log.event("mlflow", line);
}

}  // namespace fp8t::train
