// Helpers shared by the ops tests: random inputs, central-difference gradients and
// comparisons with a relative tolerance. Seeds come from TestRng (numerics/test_util.h):
// every test puts rng.trace() in a SCOPED_TRACE so a failure can be replayed.
#pragma once

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <string>
#include <vector>

#include "numerics/test_util.h"

namespace fp8t::test {

// Uniform in [lo, hi), rounded to float so that float and double runs see the same inputs.
inline std::vector<double> random_values(TestRng& rng, size_t n, double lo = -1.0,
                                         double hi = 1.0) {
  std::vector<double> values(n);
  for (double& value : values)
    value = static_cast<float>(rng.uniform(lo, hi));
  return values;
}

template <typename To, typename From>
std::vector<To> convert(const std::vector<From>& values) {
  return std::vector<To>(values.begin(), values.end());
}

// ‖actual − expected‖ / ‖expected‖, in double.
template <typename A>
double relative_error(const std::vector<A>& actual, const std::vector<double>& expected) {
  double error = 0.0, norm = 0.0;
  for (size_t i = 0; i < expected.size(); ++i) {
    const double difference = static_cast<double>(actual[i]) - expected[i];
    error += difference * difference;
    norm += expected[i] * expected[i];
  }
  return std::sqrt(error / norm);
}

// sum(values * weights): a scalar loss whose gradient with respect to values is weights,
// which is what the tests hand to a backward as dout.
inline double weighted_sum(const std::vector<double>& values, const std::vector<double>& weights) {
  double sum = 0.0;
  for (size_t i = 0; i < values.size(); ++i)
    sum += values[i] * weights[i];
  return sum;
}

// d(loss)/d(values[i]) by fourth-order central differences,
// (8 (f(x + h) - f(x - h)) - (f(x + 2h) - f(x - 2h))) / 12h: with h = 1e-3 on inputs of order
// 1 the truncation error (h^4) and the cancellation error (1e-16 / h) both stay near 1e-12,
// where the plain two-point difference cannot get below about 1e-8 at any h. loss() reads
// values, which are perturbed one at a time and restored; it is called once more at the end,
// so what it writes is left as at the unperturbed values.
template <typename Loss>
std::vector<double> numeric_gradient(std::vector<double>& values, const Loss& loss,
                                     double step = 1e-3) {
  std::vector<double> gradient(values.size());
  const auto loss_at = [&](size_t i, double value) {
    values[i] = value;
    return loss();
  };
  for (size_t i = 0; i < values.size(); ++i) {
    const double saved = values[i];
    const double near = loss_at(i, saved + step) - loss_at(i, saved - step);
    const double far = loss_at(i, saved + 2.0 * step) - loss_at(i, saved - 2.0 * step);
    values[i] = saved;
    gradient[i] = (8.0 * near - far) / (12.0 * step);
  }
  loss();
  return gradient;
}

// Expects |actual - expected| <= tolerance * scale elementwise, where scale is the largest of
// |actual|, |expected|, floor_fraction * max|expected| and floor: relative, except that entries
// far smaller than the largest (true zeros above all) are measured against a fraction of it.
// Reports the first few offenders and the worst relative error.
template <typename A>
void expect_near_relative(const std::vector<A>& actual, const std::vector<double>& expected,
                          double tolerance, double floor_fraction, const std::string& what,
                          double floor = 0.0) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  double largest = 0.0;
  for (double value : expected)
    largest = std::max(largest, std::fabs(value));
  double worst = 0.0;
  int reported = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    const double a = static_cast<double>(actual[i]);
    const double scale =
        std::max({std::fabs(a), std::fabs(expected[i]), floor_fraction * largest, floor});
    const double error = scale > 0.0 ? std::fabs(a - expected[i]) / scale : 0.0;
    worst = std::max(worst, error);
    if (!(error <= tolerance) && reported++ < 5) {
      ADD_FAILURE() << what << "[" << i << "]: " << a << " vs " << expected[i]
                    << ", relative error " << error << " > " << tolerance;
    }
  }
  EXPECT_LE(worst, tolerance) << what << ": worst relative error";
}

// backward(gradients) must add into its buffers: called twice on zeroed buffers of the given
// sizes, it gives twice what one call gives (up to the rounding of the repeated sums).
template <typename Backward>
void expect_backward_accumulates(const std::vector<size_t>& sizes, const Backward& backward) {
  const auto zeros = [&] {
    std::vector<std::vector<double>> gradients;
    for (size_t size : sizes)
      gradients.emplace_back(size, 0.0);
    return gradients;
  };
  std::vector<std::vector<double>> once = zeros();
  backward(once);
  std::vector<std::vector<double>> twice = zeros();
  backward(twice);
  backward(twice);
  for (size_t k = 0; k < sizes.size(); ++k) {
    std::vector<double> doubled = once[k];
    for (double& value : doubled)
      value *= 2.0;
    expect_near_relative(twice[k], doubled, 1e-12, 1e-3, "gradient " + std::to_string(k));
  }
}

// Gradient checks: the analytic gradient against central differences, relative 1e-6.
inline void expect_gradient_matches(const std::vector<double>& analytic,
                                    const std::vector<double>& numeric, const std::string& what) {
  expect_near_relative(analytic, numeric, 1e-6, 1e-3, "d/d" + what);
}

// Float runs against double runs on the same (float-representable) inputs, relative 1e-5;
// entries under a tenth of the largest are measured against that tenth. A float sum that
// cancels (a scalar gradient summed over tokens) errs relative to its terms, not to itself:
// terms_magnitude, the sum of their magnitudes, then sets the floor.
template <typename A>
void expect_float_matches_double(const std::vector<A>& float_values,
                                 const std::vector<double>& double_values, const std::string& what,
                                 double terms_magnitude = 0.0) {
  expect_near_relative(float_values, double_values, 1e-5, 0.1, what + " (float vs double)",
                       terms_magnitude);
}

}  // namespace fp8t::test
