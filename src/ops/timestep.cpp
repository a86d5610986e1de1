#include "ops/timestep.h"

#include <cmath>

#include "core/error.h"

namespace fp8t::ops {

template <typename T>
void timestep_embedding(T* out, const T* t, int64_t count, int64_t dim, double time_factor,
                        double max_period) {
  FP8T_CHECK(count >= 0, "expected count >= 0, found {}", count);
  FP8T_CHECK(dim >= 2, "expected dim >= 2, found {}", dim);
  FP8T_CHECK(max_period > 1.0, "expected max_period > 1, found {}", max_period);
  const int64_t half = dim / 2;
  const auto log_period = static_cast<float>(std::log(max_period));
  for (int64_t n = 0; n < count; ++n) {
    const auto scaled = static_cast<float>(time_factor * double(t[n]));
    T* row = out + n * dim;
    for (int64_t i = 0; i < half; ++i) {
      const float frequency =
          std::exp(-log_period * static_cast<float>(i) / static_cast<float>(half));
      const T argument = static_cast<T>(scaled * frequency);
      row[i] = std::cos(argument);
      row[half + i] = std::sin(argument);
    }
    if (dim % 2 != 0) row[dim - 1] = T(0);
  }
}

template void timestep_embedding<float>(float*, const float*, int64_t, int64_t, double, double);
template void timestep_embedding<double>(double*, const double*, int64_t, int64_t, double, double);

}  // namespace fp8t::ops
