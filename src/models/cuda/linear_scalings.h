// The per-tensor scaling of a model's FP8 linears on the GPU path (CUDA builds only): the device
// floats each CudaLinear reads and writes (ops/cuda/linear_cuda.h: kLinearScalingFloats per
// linear) and, for delayed scaling, the host DelayedScaling objects of every linear and role,
// the CPU path's, so that the scales are bit-identical to the CPU's for the same amaxes. Once
// per optimizer step end_step() reads the step's amaxes back (one synchronization), folds them
// into the histories and uploads the new scales with the amaxes cleared.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>

#include "core/device_arena.h"
#include "models/cuda/device_tensor_parallel.h"
#include "numerics/scaling.h"
#include "ops/fp8_health.h"

namespace fp8t {

class CudaLinearScalings {
 public:
  CudaLinearScalings(const Fp8Config& config, Fp8Family family)
      : config_(config), family_(family) {}

  // The floats of `linears` FP8 linears from `arena`: once from the planning arena, once more
  // from the allocated one.
  void take(DeviceArena& arena, int linears);
  // Scales and inverse scales 1, amaxes 0 (synchronizes).
  void initialize();
  // The floats of linear `index` (0 .. linears − 1).
  float* floats(int index) const;
  // Linear `name`, whose floats are `index`; its input is cast by linear `input_index` (itself,
  // or the linear whose input cast it shares), whose floats record that amax. Delayed scaling:
  // the linear's histories too.
  void add(const std::string& name, int index, int input_index);

  // FP8 health (ops/fp8_health.h): the 3 device counters of linear `index`, by TensorRole,
  // which its casts add to while they count.
  CastHealth* health(int index) const;
  void clear_health(cudaStream_t stream);
  // Every added linear's records, in the order added (synchronizes): the counters, and the
  // amax and scale slots for the per-tensor recipes (delayed: before end_step clears the
  // amaxes). elements[index]: the values linear `index` cast per role; a shared input's
  // records are its caster's.
  std::vector<Fp8TensorHealth> read_health(const std::vector<std::array<uint64_t, 3>>& elements,
                                           cudaStream_t stream);

  // Every linear's device floats (scales, inverse scales and the step's amaxes), for data
  // parallelism: max-reduced over the ranks before end_step, every rank folds the largest amax
  // any rank saw (the scales are the same on every rank already).
  float* device_floats() const { return device_; }
  size_t float_count() const { return host_.size(); }

  // Delayed: folds the step's amaxes into the histories and uploads the new scales. Over a split
  // tensor-parallel `group` the amaxes are first max-reduced over it, so that the split tensors'
  // scales stay the same on every rank (the other floats are the same everywhere: their maximum
  // is themselves).
  void end_step(cudaStream_t stream, const DeviceTensorParallel& group = {});
  // After the histories were loaded: uploads their scales, amaxes cleared (synchronizes).
  void scalings_changed(cudaStream_t stream);
  // "<linear>.<input|weight|grad_output>" by linear name, as the CPU models name them.
  std::vector<std::pair<std::string, DelayedScaling*>> delayed_scalings();

 private:
  struct Linear {
    int index = 0;
    int input_index = 0;
    std::vector<DelayedScaling> roles;  // by TensorRole
  };

  Fp8Config config_;
  Fp8Family family_;
  size_t linears() const;
  void check_index(int index) const;

  struct Added {
    std::string name;
    int index = 0;
    int input_index = 0;
  };

  float* device_ = nullptr;
  std::vector<float> host_;
  CastHealth* health_ = nullptr;  // 3 per linear
  std::vector<Added> added_;
  std::map<std::string, Linear> delayed_;
};

}  // namespace fp8t
