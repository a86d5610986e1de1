#include "train/step_phase_times.h"

#if FP8TRAIN_WITH_CUDA
#include <iterator>

#include "core/phase_timer.h"
#endif

namespace fp8t::train {

#if FP8TRAIN_WITH_CUDA
namespace {
// Timer names for the tags, in StepPhase order.
constexpr const char* kPhaseTimers[] = {"gemm", "attention", "quantization"};
static_assert(std::size(kPhaseTimers) == kStepPhases);
}  // namespace

struct StepPhaseTimes::Timer {
  PhaseTimer phases;
};

StepPhaseTimes::StepPhaseTimes(bool on) : timer_(on ? std::make_unique<Timer>() : nullptr) {}

StepPhaseTimes::~StepPhaseTimes() {
  if (timer_ && active_phase_timer() == &timer_->phases) set_active_phase_timer(nullptr);
}

void StepPhaseTimes::begin() {
  if (timer_) set_active_phase_timer(&timer_->phases);
}

void StepPhaseTimes::end() {
  if (!timer_) return;
  set_active_phase_timer(nullptr);
  const std::array<double, kStepPhases> totals = timer_->phases.collect();
  last_.clear();
  for (size_t phase = 0; phase < kStepPhases; ++phase)
    last_.emplace_back(kPhaseTimers[phase], totals[phase]);
}
#else
struct StepPhaseTimes::Timer {};

StepPhaseTimes::StepPhaseTimes(bool /*on*/) {}
StepPhaseTimes::~StepPhaseTimes() = default;
void StepPhaseTimes::begin() {}
void StepPhaseTimes::end() {}
#endif

}  // namespace fp8t::train
