#include "optim/schedule.h"

#include <cmath>
#include <numbers>

#include <fmt/format.h>

#include "core/error.h"

namespace fp8t::optim {

namespace {

int64_t warmdown_iters(int64_t total_iters, double warmdown_ratio) {
  return static_cast<int64_t>(std::llround(warmdown_ratio * double(total_iters)));
}

}  // namespace

void LrSchedule::validate() const {
  const auto fail = [](const std::string& message) { throw ConfigError(message); };
  if (total_iters < 1) fail(fmt::format("train_iters: must be at least 1, found {}", total_iters));
  if (warmup_iters < 0) fail(fmt::format("lr_warmup_iters: must be >= 0, found {}", warmup_iters));
  if (!(warmdown_ratio >= 0 && warmdown_ratio <= 1)) {
    fail(fmt::format("warmdown_ratio: must be in [0, 1], found {}", warmdown_ratio));
  }
  if (!(final_lr_frac >= 0 && final_lr_frac <= 1)) {
    fail(fmt::format("final_lr_frac: must be in [0, 1], found {}", final_lr_frac));
  }
  if (!(min_lr_frac >= 0 && min_lr_frac <= 1)) {
    fail(fmt::format("min_lr: must be between 0 and lr, found a ratio of {}", min_lr_frac));
  }
}

double lr_multiplier(const LrSchedule& schedule, int64_t it) {
  FP8T_CHECK(it >= 0, "expected a step >= 0, found {}", it);
  if (it < schedule.warmup_iters) return double(it + 1) / double(schedule.warmup_iters);
  switch (schedule.style) {
    case LrDecayStyle::Constant:
      return 1.0;
    case LrDecayStyle::Nanochat: {
      const int64_t warmdown = warmdown_iters(schedule.total_iters, schedule.warmdown_ratio);
      if (it <= schedule.total_iters - warmdown) return 1.0;
      const double progress = double(schedule.total_iters - it) / double(warmdown);
      return progress + (1.0 - progress) * schedule.final_lr_frac;
    }
    case LrDecayStyle::Cosine: {
      const int64_t decay = std::max<int64_t>(1, schedule.total_iters - 1 - schedule.warmup_iters);
      const double progress = std::min(1.0, double(it - schedule.warmup_iters) / double(decay));
      return schedule.min_lr_frac +
             0.5 * (1.0 - schedule.min_lr_frac) * (1.0 + std::cos(std::numbers::pi * progress));
    }
  }
  return 1.0;
}

double muon_momentum(int64_t it, int64_t total_iters, double warmdown_ratio) {
  const int64_t warmdown = warmdown_iters(total_iters, warmdown_ratio);
  const int64_t warmdown_start = total_iters - warmdown;
  if (it < 400) {
    const double fraction = double(it) / 400.0;
    return (1.0 - fraction) * 0.85 + fraction * 0.97;
  }
  if (it >= warmdown_start && warmdown > 0) {
    const double progress = double(it - warmdown_start) / double(warmdown);
    return 0.97 * (1.0 - progress) + 0.90 * progress;
  }
  return 0.97;
}

}  // namespace fp8t::optim
