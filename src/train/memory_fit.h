// Whether a training job's memory plan fits where it is about to be allocated, checked before
// anything is: an error with the planned numbers and what would fit, instead of an allocation
// failure halfway through the setup.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <string_view>
#include <vector>

namespace fp8t::train {

struct PlannedBytes {
  std::string what;
  double bytes = 0.0;
};

// Throws ConfigError when the items' total exceeds `available` (0: unknown, nothing checked):
// "<where> needs <total> (<what> <bytes>, ...) but <available> <available_what>; <advice>".
void check_memory_plan(std::string_view where, const std::vector<PlannedBytes>& plan,
                       double available, std::string_view available_what, std::string_view advice);

// What a GPU path takes, by kind, for one micro-batch size.
struct GpuMemoryPlan {
  double parameters = 0.0;
  double gradients = 0.0;
  double optimizer = 0.0;
  double activations = 0.0;
  double workspace = 0.0;
  double linear_copies = 0.0;
  double runtime = 0.0;  // the CUDA context, cuBLASLt's and cuDNN's workspaces, NCCL's buffers
  // What fp8_weight_transposes: in_backward would take off the linear copies (0: nothing, or
  // not asked), named in the advice when the plan does not fit.
  double weight_transposes_saving = 0.0;
};

// check_memory_plan for a GPU path at micro_batch_size `batch` against the `free` bytes of the
// GPU `gpu_name`. Only when it does not fit is `largest_fitting` called: the error names the
// micro-batch it returns (gradient accumulation keeps the `step_unit`s, tokens or samples, per
// step), or says `when_none` when it returns 0; then what fp8_weight_transposes: in_backward
// would save, when plan.weight_transposes_saving says.
void check_gpu_memory_plan(const GpuMemoryPlan& plan, int64_t batch, double free,
                           std::string_view gpu_name, std::string_view step_unit,
                           const std::function<int64_t()>& largest_fitting,
                           std::string_view when_none);

// The largest micro-batch whose plan fits in `available`: `fixed` bytes whatever the batch,
// plus `per_sample` bytes for each sample; 0 when not even one fits.
int64_t largest_fitting_batch(double fixed, double per_sample, double available);
// The same with a region besides that grows by `region_per_sample` bytes a sample but holds
// `region_floor` bytes at the least (memory lent between steps to work of a fixed size).
int64_t largest_fitting_batch(double fixed, double per_sample, double available,
                              double region_per_sample, double region_floor);

}  // namespace fp8t::train
