#if FP8TRAIN_WITH_CUDA

#include "core/phase_timer.h"

#include "core/cuda_check.h"
#include "core/error.h"

namespace fp8t {

namespace {

PhaseTimer* active_timer = nullptr;

}  // namespace

const char* step_phase_name(StepPhase phase) {
  switch (phase) {
    case StepPhase::Gemm:
      return "GEMMs";
    case StepPhase::Attention:
      return "attention";
    case StepPhase::Quantization:
      return "quantization";
  }
  return "?";
}

PhaseTimer::~PhaseTimer() {
  for (cudaEvent_t created : events_)
    cudaEventDestroy(created);
}

cudaEvent_t PhaseTimer::event(size_t index) {
  while (events_.size() <= index) {
    cudaEvent_t created = nullptr;
    FP8T_CUDA_CHECK(cudaEventCreate(&created));
    events_.push_back(created);
  }
  return events_[index];
}

void PhaseTimer::begin(StepPhase phase, cudaStream_t stream) {
  FP8T_CHECK(!open_, "phase timer: {} began inside another phase", step_phase_name(phase));
  FP8T_CUDA_CHECK(cudaEventRecord(event(2 * phases_.size()), stream));
  phases_.push_back(phase);
  open_ = true;
}

// Called from ~PhaseScope: a failure here is a broken CUDA context, which ends the program.
void PhaseTimer::end(cudaStream_t stream) {
  FP8T_CUDA_CHECK(cudaEventRecord(event(2 * phases_.size() - 1), stream));
  open_ = false;
}

std::array<double, kStepPhases> PhaseTimer::collect() {
  FP8T_CHECK(!open_, "phase timer: collected inside a phase");
  std::array<double, kStepPhases> totals{};
  for (size_t i = 0; i < phases_.size(); ++i) {
    float elapsed = 0.0f;
    FP8T_CUDA_CHECK(cudaEventElapsedTime(&elapsed, events_[2 * i], events_[2 * i + 1]));
    totals[static_cast<size_t>(phases_[i])] += elapsed;
  }
  phases_.clear();
  return totals;
}

PhaseTimer* active_phase_timer() {
  return active_timer;
}

void set_active_phase_timer(PhaseTimer* timer) {
  active_timer = timer;
}

}  // namespace fp8t

#endif  // FP8TRAIN_WITH_CUDA
