// Whether a training job's memory plan fits where it is about to be allocated, checked before
// anything is: an error with the planned numbers and what would fit, instead of an allocation
// failure halfway through the setup.
#pragma once

#include <cstdint>
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

// The largest micro-batch whose plan fits in `available`: `fixed` bytes whatever the batch,
// plus `per_sample` bytes for each sample; 0 when not even one fits.
int64_t largest_fitting_batch(double fixed, double per_sample, double available);

}  // namespace fp8t::train
