// The sinusoidal embedding of Flux's timestep and guidance inputs (BFL flux1's
// timestep_embedding): for t scaled by time_factor and half = dim / 2 frequencies
// f_i = exp(-ln(max_period) · i / half), out = [cos(t·f_0 .. t·f_{half-1}), sin(...)], and a
// zero in the last column when dim is odd. No backward: its input is not trained.
#pragma once

#include <cstdint>

namespace fp8t::ops {

inline constexpr double kTimestepMaxPeriod = 10000.0;
inline constexpr double kTimestepFactor = 1000.0;  // σ in [0, 1] becomes 0 .. 1000

// out [count, dim] from t [count]. The frequencies and the products are fp32, as the reference
// computes them, whatever T is; cos and sin run in T.
template <typename T>
void timestep_embedding(T* out, const T* t, int64_t count, int64_t dim,
                        double time_factor = kTimestepFactor,
                        double max_period = kTimestepMaxPeriod);

}  // namespace fp8t::ops
