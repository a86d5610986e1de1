// FP8 health on the GPU path (CUDA builds only): what the GPT's and the Flux's CUDA models do
// over their map from linear name to layer (a struct with `std::unique_ptr<CudaLinear> layer`
// and `int fp8_index`, -1 outside FP8) to count a statistics step and read it back.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <vector>

#include <cuda_runtime_api.h>

#include "models/cuda/linear_scalings.h"
#include "ops/fp8_health.h"

namespace fp8t {

// A model's recording: whether its casts count, and what end_step read before the
// delayed-scaling update cleared the amaxes.
struct CudaFp8HealthRecording {
  bool on = false;
  std::optional<std::vector<Fp8TensorHealth>> at_step_end;
};

// The casts count from now on (counters cleared) or stop counting.
template <typename LinearMap>
void record_cuda_fp8_health(LinearMap& linears, CudaLinearScalings& scalings,
                            CudaFp8HealthRecording& recording, bool record, cudaStream_t stream) {
  if (record == recording.on) return;
  recording.on = record;
  if (record) {
    scalings.clear_health(stream);
    recording.at_step_end.reset();
  }
  for (auto& [name, linear] : linears) {
    if (record) linear.layer->clear_health_elements();
    linear.layer->set_record_health(record);
  }
}

// A recompute's rerun of a forward counts nothing: while paused the casts stop counting, then
// they count again as `recording` says, the counters kept.
template <typename LinearMap>
void pause_cuda_fp8_health(LinearMap& linears, const CudaFp8HealthRecording& recording,
                           bool paused) {
  for (auto& [name, linear] : linears)
    linear.layer->set_record_health(recording.on && !paused);
}

// The records counted so far, read from the device (synchronizes).
template <typename LinearMap>
std::vector<Fp8TensorHealth> read_cuda_fp8_health(LinearMap& linears, CudaLinearScalings& scalings,
                                                  cudaStream_t stream) {
  std::vector<std::array<uint64_t, 3>> elements;
  for (auto& [name, linear] : linears) {
    if (linear.fp8_index < 0) continue;
    const auto index = static_cast<size_t>(linear.fp8_index);
    if (elements.size() <= index) elements.resize(index + 1);
    elements[index] = linear.layer->health_elements();
  }
  return scalings.read_health(elements, stream);
}

// At end_step, before the delayed-scaling update: the step's records, while counting.
template <typename LinearMap>
void keep_cuda_fp8_health(LinearMap& linears, CudaLinearScalings& scalings,
                          CudaFp8HealthRecording& recording, cudaStream_t stream) {
  if (recording.on) recording.at_step_end = read_cuda_fp8_health(linears, scalings, stream);
}

// What the last counted step gave: end_step's records, or (a step not applied, whose end_step
// did not run) the counters as they are.
template <typename LinearMap>
std::vector<Fp8TensorHealth> take_cuda_fp8_health(LinearMap& linears, CudaLinearScalings& scalings,
                                                  CudaFp8HealthRecording& recording,
                                                  cudaStream_t stream) {
  if (recording.at_step_end) {
    std::vector<Fp8TensorHealth> records = std::move(*recording.at_step_end);
    recording.at_step_end.reset();
    return records;
  }
  return read_cuda_fp8_health(linears, scalings, stream);
}

}  // namespace fp8t
