// SIGINT, SIGTERM and SIGUSR1 (what Slurm's --signal sends before a job's time runs out) during
// training: the handler only records the signal; the training loop sees it after the current
// step, saves a checkpoint and returns.
#pragma once

namespace fp8t::train {

// Installs the handlers for the lifetime of the object and restores the previous ones after.
class StopSignal {
 public:
  StopSignal();
  ~StopSignal();
  StopSignal(const StopSignal&) = delete;
  StopSignal& operator=(const StopSignal&) = delete;

  // The signal received (SIGINT, SIGTERM or SIGUSR1), or 0.
  static int received();
};

}  // namespace fp8t::train
