// `fp8train train`: the training job, configured by a YAML file and command-line overrides.
#include <cstdio>
#include <exception>
#include <functional>
#include <optional>
#include <vector>

#include <fmt/format.h>

#include "cli/commands.h"
#include "config/train_config.h"
#include "core/error.h"
#include "distributed/communicator.h"
#include "distributed/launch.h"
#include "distributed/local_ranks.h"
#include "train/trainer.h"

namespace fp8t::cli {

namespace {

// Ranks started with different configurations would train different models: the ranks compare
// this before anything else.
uint64_t configuration_hash(const TrainConfig& config) {
  return std::hash<std::string>{}(to_yaml(config));
}

}  // namespace

int run_local_ranks(int processes, const std::vector<std::string>& arguments) {
  const distributed::LaunchInfo launch = distributed::detect_launch();
  if (launch.several()) {
    throw ConfigError(
        fmt::format("--nproc-per-node starts the ranks itself, but this process already is {}",
                    launch.describe()));
  }
  return distributed::run_local_ranks(processes, arguments);
}

int run_train(const std::vector<std::string>& args) {
  const distributed::LaunchInfo launch = distributed::detect_launch();
  // Alone, or one rank of a data-parallel job.
  std::optional<distributed::Communicator> communicator;
  try {
    const TrainConfig config = load_train_config(args);
    communicator.emplace(launch, configuration_hash(config));
    const train::TrainOutcome outcome = train::run_training(config, *communicator);
    // Interrupted: the conventional 128 + signal, so that schedulers see the stop; the
    // checkpoint is saved.
    return outcome.stop_signal != 0 ? 128 + outcome.stop_signal : kExitOk;
  } catch (const std::exception& error) {
    if (!launch.several()) throw;
    // The other ranks would wait for this one forever: end the job.
    fmt::print(stderr, "fp8train: error on {}: {}\n", launch.describe(), error.what());
    std::fflush(stderr);
    if (communicator) communicator->abort(kExitError);
    return kExitError;
  }
}

}  // namespace fp8t::cli
