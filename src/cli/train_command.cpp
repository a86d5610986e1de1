// `fp8train train`: the training job, configured by a YAML file and command-line overrides.
#include <vector>

#include <fmt/format.h>

#include "cli/commands.h"
#include "config/train_config.h"
#include "core/error.h"
#include "distributed/launch.h"
#include "train/trainer.h"

namespace fp8t::cli {

int run_train(const std::vector<std::string>& args) {
  // Several processes would each train the same model into the same run folder.
  const distributed::LaunchInfo launch = distributed::detect_launch();
  if (launch.several()) {
    throw ConfigError(fmt::format(
        "this process is {}: training over several processes (data parallelism) is not built "
        "yet; start one process",
        launch.describe()));
  }
  const TrainConfig config = load_train_config(args);
  const train::TrainOutcome outcome = train::run_training(config);
  // Interrupted: the conventional 128 + signal, so that schedulers see the stop; the
  // checkpoint is saved.
  return outcome.stop_signal != 0 ? 128 + outcome.stop_signal : kExitOk;
}

}  // namespace fp8t::cli
