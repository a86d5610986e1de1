// Where a GPU step's time goes, by kind of work, from CUDA events around each piece (CUDA
// builds only). Off unless a PhaseTimer is made active: the benchmark's --phases turns it on;
// training never does. The scopes sit in the layers (GEMMs, quantization) and the model
// (attention), which reach the timer through active_phase_timer() instead of every call
// carrying it.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

#include <cuda_runtime_api.h>

namespace fp8t {

enum class StepPhase : uint8_t {
  Gemm,          // the linears' GEMMs (cuBLASLt)
  Attention,     // cuDNN's SDPA, forward and backward
  Quantization,  // casts to FP8 (or bf16) operands, amaxes, scale layouts, dequantization
};
inline constexpr size_t kStepPhases = 3;

const char* step_phase_name(StepPhase phase);

class PhaseTimer {
 public:
  PhaseTimer() = default;
  ~PhaseTimer();
  PhaseTimer(const PhaseTimer&) = delete;
  PhaseTimer& operator=(const PhaseTimer&) = delete;

  // An interval of `phase` on `stream`, from begin() to the next end(). Events are created as
  // needed and reused after collect(), so the steps after the first create none.
  void begin(StepPhase phase, cudaStream_t stream);
  void end(cudaStream_t stream);

  // Milliseconds per phase over the intervals since the last collect(); call after the stream
  // has synchronized. Starts a new count.
  std::array<double, kStepPhases> collect();

 private:
  cudaEvent_t event(size_t index);

  std::vector<cudaEvent_t> events_;
  std::vector<StepPhase> phases_;  // of interval i: events 2i and 2i + 1
  bool open_ = false;
};

// The timer the scopes report to; null (the default) turns them into nothing.
PhaseTimer* active_phase_timer();
void set_active_phase_timer(PhaseTimer* timer);

// Times its lifetime as `phase` on `stream` when a timer is active.
class PhaseScope {
 public:
  PhaseScope(StepPhase phase, cudaStream_t stream) : timer_(active_phase_timer()), stream_(stream) {
    if (timer_ != nullptr) timer_->begin(phase, stream);
  }
  ~PhaseScope() {
    if (timer_ != nullptr) timer_->end(stream_);
  }
  PhaseScope(const PhaseScope&) = delete;
  PhaseScope& operator=(const PhaseScope&) = delete;

 private:
  PhaseTimer* timer_;
  cudaStream_t stream_;
};

}  // namespace fp8t
