// The plain linear layer: fp32 forward and backward against a naive reference, and the BF16
// path against the same reference on bf16-rounded operands.
#include "ops/linear.h"

#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include <gtest/gtest.h>

#include "numerics/float_bits.h"
#include "numerics/test_util.h"

namespace fp8t {
namespace {

using ops::LinearOperands;
using ops::LinearShape;

constexpr LinearShape kShapes[] = {{1, 1, 1}, {5, 3, 7}, {17, 33, 130}, {64, 96, 48}};

std::vector<float> random_vector(test::TestRng& rng, int64_t count, double magnitude) {
  std::vector<float> values(static_cast<size_t>(count));
  for (float& value : values)
    value = static_cast<float>(rng.uniform(-magnitude, magnitude));
  return values;
}

std::vector<float> rounded_to_bf16(const std::vector<float>& values) {
  std::vector<float> rounded(values.size());
  for (size_t i = 0; i < values.size(); ++i)
    rounded[i] = bf16_to_float(float_to_bf16(values[i]));
  return rounded;
}

// The exact value of each element and the sum of the magnitudes of its terms.
struct Exact {
  std::vector<double> value, magnitude;

  explicit Exact(std::vector<double> initial) : value(std::move(initial)), magnitude(value.size()) {
    for (size_t i = 0; i < value.size(); ++i)
      magnitude[i] = std::fabs(value[i]);
  }
  void add(int64_t index, double term) {
    value[size_t(index)] += term;
    magnitude[size_t(index)] += std::fabs(term);
  }
};

// ‖out − ref‖ / ‖Σ|terms|‖: relative to the magnitudes, since a gradient added to an initial
// value may cancel to almost nothing on tiny shapes.
double relative_error(const std::vector<float>& out, const Exact& ref) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < ref.value.size(); ++i) {
    diff += (out[i] - ref.value[i]) * (out[i] - ref.value[i]);
    norm += ref.magnitude[i] * ref.magnitude[i];
  }
  return std::sqrt(diff / norm);
}

struct Reference {
  Exact y, dx, dw;
};

// Naive double loops; dx and dw start from the given values (backward adds).
Reference naive_linear(const std::vector<float>& x, const std::vector<float>& w,
                       const std::vector<float>& dy, const std::vector<float>& dx0,
                       const std::vector<float>& dw0, const LinearShape& s) {
  Reference ref{Exact(std::vector<double>(static_cast<size_t>(s.tokens * s.out_features))),
                Exact(std::vector<double>(dx0.begin(), dx0.end())),
                Exact(std::vector<double>(dw0.begin(), dw0.end()))};
  const auto at = [](const std::vector<float>& v, int64_t i) { return double(v[size_t(i)]); };
  for (int64_t t = 0; t < s.tokens; ++t) {
    for (int64_t o = 0; o < s.out_features; ++o) {
      for (int64_t i = 0; i < s.in_features; ++i) {
        const double xi = at(x, t * s.in_features + i);
        const double wi = at(w, o * s.in_features + i);
        const double dyo = at(dy, t * s.out_features + o);
        ref.y.add(t * s.out_features + o, xi * wi);
        ref.dx.add(t * s.in_features + i, dyo * wi);
        ref.dw.add(o * s.in_features + i, dyo * xi);
      }
    }
  }
  return ref;
}

struct Inputs {
  std::vector<float> x, w, dy, dx0, dw0;
};

Inputs random_inputs(test::TestRng& rng, const LinearShape& s) {
  return {random_vector(rng, s.tokens * s.in_features, 2.0),
          random_vector(rng, s.out_features * s.in_features, 0.1),
          random_vector(rng, s.tokens * s.out_features, 1e-2),
          random_vector(rng, s.tokens * s.in_features, 1e-2),
          random_vector(rng, s.out_features * s.in_features, 1e-1)};
}

void run_and_compare(const Inputs& in, const Reference& ref, const LinearShape& s,
                     LinearOperands operands, double tolerance) {
  std::vector<float> y(ref.y.value.size(), std::nanf(""));
  std::vector<float> dx = in.dx0, dw = in.dw0;
  ops::linear_forward(in.x.data(), in.w.data(), y.data(), s, operands);
  ops::linear_backward(in.dy.data(), in.x.data(), in.w.data(), dx.data(), dw.data(), s, operands);
  EXPECT_LE(relative_error(y, ref.y), tolerance);
  EXPECT_LE(relative_error(dx, ref.dx), tolerance);
  EXPECT_LE(relative_error(dw, ref.dw), tolerance);
}

TEST(Linear, Fp32MatchesNaiveAndBackwardAdds) {
  test::TestRng rng;
  SCOPED_TRACE(rng.trace());
  for (const LinearShape& s : kShapes) {
    SCOPED_TRACE(::testing::Message()
                 << "tokens=" << s.tokens << " in=" << s.in_features << " out=" << s.out_features);
    const Inputs in = random_inputs(rng, s);
    const Reference ref = naive_linear(in.x, in.w, in.dy, in.dx0, in.dw0, s);
    run_and_compare(in, ref, s, LinearOperands::Fp32, 1e-6);
  }
}

TEST(Linear, Bf16RoundsBothOperandsAndAccumulatesInFp32) {
  test::TestRng rng;
  SCOPED_TRACE(rng.trace());
  for (const LinearShape& s : kShapes) {
    SCOPED_TRACE(::testing::Message()
                 << "tokens=" << s.tokens << " in=" << s.in_features << " out=" << s.out_features);
    const Inputs in = random_inputs(rng, s);
    const Reference ref = naive_linear(rounded_to_bf16(in.x), rounded_to_bf16(in.w),
                                       rounded_to_bf16(in.dy), in.dx0, in.dw0, s);
    run_and_compare(in, ref, s, LinearOperands::Bf16, 1e-6);
    if (s.in_features >= 16) {  // and the rounding is visible against the fp32 result
      std::vector<float> y(ref.y.value.size());
      ops::linear_forward(in.x.data(), in.w.data(), y.data(), s, LinearOperands::Bf16);
      const Reference fp32 = naive_linear(in.x, in.w, in.dy, in.dx0, in.dw0, s);
      EXPECT_GT(relative_error(y, fp32.y), 1e-4);
    }
  }
}

TEST(Linear, NullGradientsAreSkipped) {
  test::TestRng rng;
  SCOPED_TRACE(rng.trace());
  const LinearShape s{9, 20, 12};
  const Inputs in = random_inputs(rng, s);
  const Reference ref = naive_linear(in.x, in.w, in.dy, in.dx0, in.dw0, s);
  std::vector<float> dx = in.dx0, dw = in.dw0;
  ops::linear_backward(in.dy.data(), nullptr, in.w.data(), dx.data(), nullptr, s,
                       LinearOperands::Fp32);
  EXPECT_LE(relative_error(dx, ref.dx), 1e-6);
  ops::linear_backward(in.dy.data(), in.x.data(), nullptr, nullptr, dw.data(), s,
                       LinearOperands::Bf16);
  const Reference bf16_ref =
      naive_linear(rounded_to_bf16(in.x), in.w, rounded_to_bf16(in.dy), in.dx0, in.dw0, s);
  EXPECT_LE(relative_error(dw, bf16_ref.dw), 1e-6);
}

}  // namespace
}  // namespace fp8t
