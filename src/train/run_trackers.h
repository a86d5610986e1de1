// The trackers a run logs to besides the terminal (the `tracker` key): the outputs of its RunLog
// and, with mlflow, the MLflow run (train/mlflow_tracker.h) that the GPT's and Flux's trainers
// start, keep in their checkpoints and end alike.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "config/train_config.h"
#include "train/mlflow_tracker.h"
#include "train/run_log.h"
#include "train/training_loop.h"

namespace fp8t::train {

// The commit this binary was built from (at configure time), or "unknown".
std::string_view build_commit();

// The resolved configuration as MLflow params: "section.key" and the value as config.yaml
// writes it, for every key of the run's model.
KeyValues config_params(const TrainConfig& config);

class TrackedRun {
 public:
  // With tracker mlflow on the leader: connects to MLFLOW_TRACKING_URI (ConfigError naming the
  // variable when it is unset; the tracker's error when the server is unusable) and starts the
  // run named `run` in `experiment`, or continues the one whose id `trainer_state` (a resumed
  // checkpoint's) holds; logs config_params and the tags fp8train.git_commit, .device,
  // .precision, .fp8_recipe and .model. Nothing to do otherwise.
  TrackedRun(const TrainConfig& config, const std::optional<nlohmann::json>& trainer_state,
             const std::string& device, const std::string& precision, bool leader);
  // Without finish(): the run ends as FAILED (an error is on its way out).
  ~TrackedRun();
  TrackedRun(const TrackedRun&) = delete;
  TrackedRun& operator=(const TrackedRun&) = delete;

  RunLogOutputs log_outputs(bool terminal) const;
  // The MLflow run's id into a checkpoint's trainer state, for a resume to continue it.
  void add_to(nlohmann::json& trainer_state) const;
  // The end of training: the summary metrics (summary/steps, summary/final_loss,
  // summary/final_val_loss) and the status, FINISHED or (stopped by a signal) KILLED; each
  // line about values that did not arrive goes to the log as an event.
  void finish(const LoopOutcome& outcome, RunLog& log);

 private:
  RunLogOutputs outputs_;
  std::unique_ptr<MlflowTracker> mlflow_;
};

}  // namespace fp8t::train
