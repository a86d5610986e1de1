// Helpers of the GPU tests: bf16 test data, and the comparison of GPU results with the CPU
// reference (the norm of the error relative to the reference's, and a bound on every element,
// so that one wrong row cannot hide in a norm). C++17 (CUDA tests include it).
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "numerics/float_bits.h"
#include "numerics/test_util.h"

namespace fp8t::test {

// ‖gpu − cpu‖ / ‖cpu‖ ≤ norm, and every |gpu − cpu| ≤ relative·|cpu| + floor·max|cpu|.
struct Tolerance {
  double norm;
  double relative;
  double floor;
};

// Uniform in [lo, hi), rounded to bf16.
inline std::vector<bf16> random_bf16(TestRng& rng, size_t count, double lo = -1.0,
                                     double hi = 1.0) {
  std::vector<bf16> values(count);
  for (bf16& value : values)
    value = float_to_bf16(static_cast<float>(rng.uniform(lo, hi)));
  return values;
}

// GPU results as doubles, for expect_close.
inline std::vector<double> widen(const std::vector<bf16>& values) {
  std::vector<double> wide(values.size());
  for (size_t i = 0; i < values.size(); ++i)
    wide[i] = bf16_to_float(values[i]);
  return wide;
}

inline std::vector<double> widen(const std::vector<float>& values) {
  return std::vector<double>(values.begin(), values.end());
}

// FP8T_TEST_VERBOSE=1 prints every comparison's error.
inline bool verbose() {
  const char* text = std::getenv("FP8T_TEST_VERBOSE");
  return text != nullptr && std::strcmp(text, "0") != 0;
}

// cpu NaN means "must be NaN" (a deliberately invalid input); otherwise a NaN or inf from the
// GPU fails, and its index is reported.
inline void expect_close(const std::vector<double>& gpu, const std::vector<double>& cpu,
                         const Tolerance& tolerance, const std::string& what) {
  ASSERT_EQ(gpu.size(), cpu.size()) << what;
  double largest = 0.0;
  for (double value : cpu)
    if (std::isfinite(value)) largest = std::max(largest, std::fabs(value));
  double difference_squares = 0.0, reference_squares = 0.0, worst_ratio = 0.0;
  int64_t bad_elements = 0, nonfinite = 0, first_nonfinite = -1, worst = -1;
  std::string examples;
  for (size_t i = 0; i < cpu.size(); ++i) {
    if (std::isnan(cpu[i])) {
      if (!std::isnan(gpu[i]) && ++bad_elements <= 5)
        examples += fmt::format("\n  [{}] gpu {} where NaN was expected", i, gpu[i]);
      continue;
    }
    if (!std::isfinite(gpu[i])) {
      if (nonfinite++ == 0) first_nonfinite = static_cast<int64_t>(i);
      continue;
    }
    const double error = std::fabs(gpu[i] - cpu[i]);
    difference_squares += error * error;
    reference_squares += cpu[i] * cpu[i];
    const double allowed = tolerance.relative * std::fabs(cpu[i]) + tolerance.floor * largest;
    const double ratio = allowed > 0.0 ? error / allowed : (error > 0.0 ? INFINITY : 0.0);
    if (ratio > worst_ratio) worst_ratio = ratio, worst = static_cast<int64_t>(i);
    if (ratio > 1.0 && ++bad_elements <= 5) {
      examples += fmt::format("\n  [{}] gpu {:.8g} cpu {:.8g} error {:.3g} > allowed {:.3g}", i,
                              gpu[i], cpu[i], error, allowed);
    }
  }
  const double norm_error = reference_squares > 0.0
                                ? std::sqrt(difference_squares / reference_squares)
                                : std::sqrt(difference_squares);
  if (verbose()) {
    std::printf("[ compare  ] %s: relative error %.3g (tolerance %.3g), worst element at %lld\n",
                what.c_str(), norm_error, tolerance.norm, static_cast<long long>(worst));
  }
  EXPECT_TRUE(nonfinite == 0 && bad_elements == 0 && norm_error <= tolerance.norm)
      << what << ": |gpu - cpu| / |cpu| = " << norm_error << " (tolerance " << tolerance.norm
      << "); " << nonfinite << " NaN/inf from the GPU (first at " << first_nonfinite << "); "
      << bad_elements << " of " << cpu.size() << " elements beyond " << tolerance.relative
      << " |cpu| + " << tolerance.floor << " max|cpu| (max|cpu| = " << largest << ")" << examples;
}

}  // namespace fp8t::test
