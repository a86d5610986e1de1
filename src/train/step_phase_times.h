// log_timers_to_tensorboard on the GPU path: the device's milliseconds per kind of work (GEMMs,
// attention, quantization: core/phase_timer.h) in each training step. Off, or in a build
// without CUDA, every call does nothing and the times are empty.
#pragma once

#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace fp8t::train {

class StepPhaseTimes {
 public:
  explicit StepPhaseTimes(bool on);
  ~StepPhaseTimes();
  StepPhaseTimes(const StepPhaseTimes&) = delete;
  StepPhaseTimes& operator=(const StepPhaseTimes&) = delete;

  // Around one training step: the phase scopes report to this timer in between. end() reads the
  // events, so the step's stream must have synchronized (train_step does, for its loss).
  void begin();
  void end();
  // The last step's times, as timers "gemm", "attention", "quantization".
  const std::vector<std::pair<std::string, double>>& last() const { return last_; }

 private:
  struct Timer;
  std::unique_ptr<Timer> timer_;
  std::vector<std::pair<std::string, double>> last_;
};

}  // namespace fp8t::train
