// Learning-rate schedules, as multipliers of each group's base learning rate, and nanochat's
// Muon momentum schedule. `it` counts optimizer steps from 0.
#pragma once

#include <cstdint>

namespace fp8t::optim {

enum class LrDecayStyle : uint8_t {
  Nanochat,  // linear warmup, constant, linear warmdown to final_lr_frac
  Cosine,    // linear warmup, cosine decay to min_lr_frac at the last step
  Constant,  // linear warmup, then constant
};

struct LrSchedule {
  LrDecayStyle style = LrDecayStyle::Nanochat;
  int64_t total_iters = 1;
  int64_t warmup_iters = 40;
  double warmdown_ratio = 0.65;  // nanochat: the last 65 % of steps
  double final_lr_frac = 0.05;   // nanochat: warmdown ends at 5 % of the base lr
  double min_lr_frac = 0.0;      // cosine: min_lr / lr

  // Throws ConfigError naming the field when out of range.
  void validate() const;
};

// Warmup is (it + 1) / warmup_iters, so the first step already moves. Nanochat: 1 until
// total - round(warmdown_ratio * total), then linear to final_lr_frac at it = total.
double lr_multiplier(const LrSchedule& schedule, int64_t it);

// nanochat's Muon momentum: 0.85 -> 0.97 over the first 400 steps, 0.97 -> 0.90 over the
// warmdown.
double muon_momentum(int64_t it, int64_t total_iters, double warmdown_ratio);

}  // namespace fp8t::optim
