#include "train/memory_fit.h"

#include <algorithm>
#include <cmath>

#include <fmt/format.h>

#include "core/error.h"
#include "train/run_log.h"

namespace fp8t::train {

void check_memory_plan(std::string_view where, const std::vector<PlannedBytes>& plan,
                       double available, std::string_view available_what, std::string_view advice) {
  double total = 0.0;
  std::string items;
  for (const PlannedBytes& item : plan) {
    total += item.bytes;
    items += fmt::format("{}{} {}", items.empty() ? "" : ", ", item.what, format_bytes(item.bytes));
  }
  if (available <= 0.0 || total <= available) return;
  throw ConfigError(fmt::format("{} needs {} ({}) but {} {}; {}", where, format_bytes(total), items,
                                format_bytes(available), available_what, advice));
}

void check_gpu_memory_plan(const GpuMemoryPlan& plan, int64_t batch, double free,
                           std::string_view gpu_name, std::string_view step_unit,
                           const std::function<int64_t()>& largest_fitting,
                           std::string_view when_none) {
  const std::vector<PlannedBytes> items{{"parameters", plan.parameters},
                                        {"gradients", plan.gradients},
                                        {"optimizer", plan.optimizer},
                                        {"activations", plan.activations},
                                        {"workspace", plan.workspace},
                                        {"linear copies", plan.linear_copies},
                                        {"CUDA, cuBLASLt and cuDNN", plan.runtime}};
  double total = 0.0;
  for (const PlannedBytes& item : items)
    total += item.bytes;
  if (free <= 0.0 || total <= free) return;
  const int64_t fits = largest_fitting();
  std::string advice =
      fits > 0 ? fmt::format(
                     "micro_batch_size {} would fit (gradient accumulation keeps the {} "
                     "per step); more data-parallel GPUs shard only the optimizer state, while "
                     "recompute_granularity, tensor_model_parallel_size and (with it) "
                     "sequence_parallel take activations off each GPU",
                     fits, step_unit)
               : std::string(when_none);
  if (plan.weight_transposes_saving > 0.0) {
    advice += fmt::format("; fp8_weight_transposes: in_backward takes {} off the linear copies",
                          format_bytes(plan.weight_transposes_saving));
  }
  check_memory_plan(fmt::format("the GPU path, with micro_batch_size {},", batch), items, free,
                    fmt::format("is free on {}", gpu_name), advice);
}

int64_t largest_fitting_batch(double fixed, double per_sample, double available) {
  if (per_sample <= 0.0 || available <= fixed) return 0;
  return static_cast<int64_t>(std::floor((available - fixed) / per_sample));
}

int64_t largest_fitting_batch(double fixed, double per_sample, double available,
                              double region_per_sample, double region_floor) {
  // The region is the larger of the two: each bound must hold.
  return std::min(largest_fitting_batch(fixed, per_sample + region_per_sample, available),
                  largest_fitting_batch(fixed + region_floor, per_sample, available));
}

}  // namespace fp8t::train
