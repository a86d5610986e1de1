#include "ops/flux_rope.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/error.h"
#include "ops/gradient_check.h"

namespace fp8t {
namespace {

constexpr std::array<int, 3> kAxes = {4, 6, 6};  // head_dim 16: 2 + 3 + 3 pairs
constexpr int64_t kHeadDim = 16;
constexpr int64_t kHeads = 3;
constexpr int64_t kTokens = 5;

std::vector<float> sample_ids() {
  // A text token (all zero), then image tokens at (0, row, col).
  return {0, 0, 0, 0, 0, 1, 0, 2, 3, 0, 7, 1, 5, 4, 9};
}

TEST(OpsFluxRope, TablesFollowTheAxes) {
  const std::vector<float> ids = sample_ids();
  std::vector<float> cos(kTokens * kHeadDim / 2), sin(cos.size());
  ops::flux_rope_tables(cos.data(), sin.data(), ids.data(), kTokens, kAxes, 10000.0);
  const int64_t pairs = kHeadDim / 2;
  for (int64_t n = 0; n < kTokens; ++n) {
    int64_t pair = 0;
    for (size_t axis = 0; axis < 3; ++axis) {
      for (int j = 0; j < kAxes[axis] / 2; ++j, ++pair) {
        const double angle =
            ids[n * 3 + int64_t(axis)] * std::pow(10000.0, -2.0 * j / double(kAxes[axis]));
        EXPECT_EQ(cos[n * pairs + pair], static_cast<float>(std::cos(angle))) << n << ", " << pair;
        EXPECT_EQ(sin[n * pairs + pair], static_cast<float>(std::sin(angle))) << n << ", " << pair;
      }
    }
  }
  // The text token does not turn.
  for (int64_t i = 0; i < pairs; ++i) {
    EXPECT_EQ(cos[i], 1.0f);
    EXPECT_EQ(sin[i], 0.0f);
  }
}

TEST(OpsFluxRope, RotatesAdjacentPairsAndInvertsExactly) {
  test::TestRng rng;
  SCOPED_TRACE(rng.trace());
  const std::vector<float> ids = sample_ids();
  std::vector<float> cos(kTokens * kHeadDim / 2), sin(cos.size());
  ops::flux_rope_tables(cos.data(), sin.data(), ids.data(), kTokens, kAxes, 10000.0);
  const std::vector<double> x = test::random_values(rng, kTokens * kHeads * kHeadDim);
  std::vector<double> y(x.size());
  ops::flux_rope_forward(y.data(), x.data(), cos.data(), sin.data(), kTokens, kHeads, kHeadDim);
  // Pair (x0, x1) of token n, head 1, pair 4 (the middle axis).
  const int64_t n = 3, h = 1, i = 4, base = (n * kHeads + h) * kHeadDim;
  const double c = cos[n * kHeadDim / 2 + i], s = sin[n * kHeadDim / 2 + i];
  EXPECT_NEAR(y[base + 2 * i], x[base + 2 * i] * c - x[base + 2 * i + 1] * s, 1e-15);
  EXPECT_NEAR(y[base + 2 * i + 1], x[base + 2 * i] * s + x[base + 2 * i + 1] * c, 1e-15);
  // A rotation keeps norms, and the backward of an identity loss undoes it.
  std::vector<double> back(x.size(), 0.0);
  ops::flux_rope_backward(back.data(), y.data(), cos.data(), sin.data(), kTokens, kHeads, kHeadDim);
  test::expect_near_relative(back, x, 1e-6, 1e-3, "inverse rotation");
}

TEST(OpsFluxRope, GradientMatchesFiniteDifferences) {
  test::TestRng rng;
  SCOPED_TRACE(rng.trace());
  const std::vector<float> ids = sample_ids();
  std::vector<float> cos(kTokens * kHeadDim / 2), sin(cos.size());
  ops::flux_rope_tables(cos.data(), sin.data(), ids.data(), kTokens, kAxes, 10000.0);
  std::vector<double> x = test::random_values(rng, kTokens * kHeads * kHeadDim);
  const std::vector<double> dout = test::random_values(rng, x.size());
  std::vector<double> y(x.size());
  const auto loss = [&] {
    ops::flux_rope_forward(y.data(), x.data(), cos.data(), sin.data(), kTokens, kHeads, kHeadDim);
    return test::weighted_sum(y, dout);
  };
  loss();
  std::vector<double> dx(x.size(), 0.0);
  ops::flux_rope_backward(dx.data(), dout.data(), cos.data(), sin.data(), kTokens, kHeads,
                          kHeadDim);
  test::expect_gradient_matches(dx, test::numeric_gradient(x, loss), "x");
}

TEST(OpsFluxRope, RejectsOddSizes) {
  std::vector<float> buffer(16);
  EXPECT_THROW(
      ops::flux_rope_tables(buffer.data(), buffer.data(), buffer.data(), 1, {4, 5, 6}, 10000.0),
      Error);
  EXPECT_THROW(
      ops::flux_rope_forward(buffer.data(), buffer.data(), buffer.data(), buffer.data(), 1, 1, 3),
      Error);
}

}  // namespace
}  // namespace fp8t
