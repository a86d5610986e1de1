// optim::AdamWOptimizer on the GPU (CUDA builds only): AdamW over every tensor of a device
// parameter layout, weight decay on the matrices and none on 1-D tensors (biases, norm scales),
// with the gradient norm and clipping. One launch per step for all tensors (the multi-tensor
// kernel of optim/cuda/gpu_optimizer.h), the fp32 arithmetic of optim/adamw.h's adamw_step.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>

#include "optim/adamw.h"
#include "optim/cuda/device_parameters.h"
#include "optim/optimizer_shard.h"

namespace fp8t::optim {

// Under tensor parallelism, a layout whose first `elements` are this rank's shares of split
// tensors (and the rest replicated tensors, the same on every rank of the group): the shares'
// sum of squares is summed over the group (group_sum, in place on the device, on the stream)
// before the gradient norm adds the rest once.
struct GradientShares {
  int64_t elements = 0;
  std::function<void(float* values, size_t count, cudaStream_t stream)> group_sum;
};

// How a tensor's moments travel between the device, laid out as the layout says, and the host
// optimizer's whole tensors: unset, a plain copy; a model whose layout holds shares of tensors
// gathers them from the group (download) and cuts its share out (upload).
struct StateTransfer {
  std::function<void(const std::string& parameter, const float* device, float* host)> download;
  std::function<void(const std::string& parameter, const float* host, float* device)> upload;
};

// A tensor of the layout and a device float that takes its largest magnitude after each step:
// an FP8 weight cast's amax, so that the cast need not read the weight once more to find it.
struct TensorAmaxSlot {
  std::string parameter;
  float* amax = nullptr;
};

class CudaAdamW {
 public:
  // Allocates exp_avg and exp_avg_sq (zero) for the layout's tensors; with a shard of several
  // ranks (ZeRO-1), for the tensors this rank owns only, which are all that step() updates.
  CudaAdamW(const DeviceParameterLayout& layout, const AdamWHyperparameters& hyperparameters,
            const OptimizerShard* shard = nullptr, GradientShares shares = {});
  ~CudaAdamW();
  CudaAdamW(const CudaAdamW&) = delete;
  CudaAdamW& operator=(const CudaAdamW&) = delete;

  // *norm (device fp32) = the l2 norm of the gradients; then, when max_norm > 0, the gradients
  // are scaled down to it (on the device: no synchronization).
  void clip(float* grads, float* norm, float max_norm, cudaStream_t stream);
  // One step at lr = the hyperparameters' lr × lr_multiplier; the first step's bias correction
  // uses 1.
  void step(float* params, const float* grads, double lr_multiplier, cudaStream_t stream);

  // From the next step on, each step also writes into every slot the largest |value| of its
  // tensor's new values (NaN when one is NaN), in the same launch as the update and one more for
  // all slots. Throws, naming the tensor, for one the layout lacks or this rank does not update
  // (another rank's under a shard). Replaces the slots of an earlier call.
  void measure_amaxes(const std::vector<TensorAmaxSlot>& slots);

  int64_t steps_taken() const { return steps_; }
  size_t device_bytes() const;

  // Copies the moments and the step count to and from a host AdamWOptimizer over the same
  // tensors (its state names them; synchronizes), for checkpoints: with a shard, the moments of
  // this rank's tensors only, in the layout's order. With a transfer, every rank of its group
  // together; a rank without a host copy (null) then takes part in the transfers alone, and an
  // upload leaves its step count to set_steps_taken().
  void download_state(AdamWOptimizer* host, const StateTransfer& transfer = {}) const;
  void upload_state(AdamWOptimizer* host, const StateTransfer& transfer = {});
  void set_steps_taken(int64_t steps) { steps_ = steps; }

 private:
  struct State;
  std::unique_ptr<State> state_;
  int64_t steps_ = 0;
};

}  // namespace fp8t::optim
