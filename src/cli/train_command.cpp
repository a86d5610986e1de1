// `fp8train train`: the training job, configured by a YAML file and command-line overrides.
#include <cstdio>
#include <exception>
#include <vector>

#include <fmt/format.h>

#include "cli/commands.h"
#include "config/train_config.h"
#include "distributed/launch.h"
#include "train/trainer.h"

namespace fp8t::cli {

int run_train(const std::vector<std::string>& args) {
  // Alone, or one rank of a data-parallel job started by mpirun or srun.
  distributed::Communicator communicator(distributed::detect_launch());
  try {
    const TrainConfig config = load_train_config(args);
    const train::TrainOutcome outcome = train::run_training(config, communicator);
    // Interrupted: the conventional 128 + signal, so that schedulers see the stop; the
    // checkpoint is saved.
    return outcome.stop_signal != 0 ? 128 + outcome.stop_signal : kExitOk;
  } catch (const std::exception& error) {
    if (!communicator.several()) throw;
    // The other ranks would wait for this one forever: end the job.
    fmt::print(stderr, "fp8train: error on {}: {}\n", communicator.launch().describe(),
               error.what());
    std::fflush(stderr);
    communicator.abort(kExitError);
  }
}

}  // namespace fp8t::cli
