#include "train/memory_fit.h"

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

int64_t largest_fitting_batch(double fixed, double per_sample, double available) {
  if (per_sample <= 0.0 || available <= fixed) return 0;
  return static_cast<int64_t>(std::floor((available - fixed) / per_sample));
}

}  // namespace fp8t::train
