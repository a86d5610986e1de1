#include "ops/layernorm.h"

#include <gtest/gtest.h>

#include <cmath>

#include "core/error.h"
#include "ops/gradient_check.h"

namespace fp8t {
namespace {

using test::TestRng;

constexpr int64_t kRows = 5;
constexpr int64_t kDim = 7;

TEST(OpsLayerNorm, ForwardMatchesTheFormula) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  std::vector<double> x = test::random_values(rng, kRows * kDim, -2.0, 2.0);
  // A constant row far from zero: only eps keeps rstd finite, and one pass would cancel.
  std::fill(x.begin() + 2 * kDim, x.begin() + 3 * kDim, 1000.0);
  std::vector<double> y(kRows * kDim), rstd(kRows);
  ops::layernorm_forward(y.data(), rstd.data(), x.data(), kRows, kDim);
  for (int64_t r = 0; r < kRows; ++r) {
    long double mean = 0.0L, variance = 0.0L;
    for (int64_t i = 0; i < kDim; ++i)
      mean += x[r * kDim + i];
    mean /= kDim;
    for (int64_t i = 0; i < kDim; ++i)
      variance += (x[r * kDim + i] - mean) * (x[r * kDim + i] - mean);
    variance /= kDim;
    const long double expected_rstd = 1.0L / std::sqrt(variance + ops::kFluxLayerNormEps);
    EXPECT_NEAR(rstd[r], static_cast<double>(expected_rstd),
                1e-12 * static_cast<double>(expected_rstd))
        << r;
    for (int64_t i = 0; i < kDim; ++i) {
      EXPECT_NEAR(y[r * kDim + i], static_cast<double>((x[r * kDim + i] - mean) * expected_rstd),
                  1e-12)
          << r << ", " << i;
    }
  }
}

TEST(OpsLayerNorm, GradientMatchesFiniteDifferences) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  for (const double eps : {ops::kFluxLayerNormEps, 0.1}) {
    SCOPED_TRACE(::testing::Message() << "eps " << eps);
    std::vector<double> x = test::random_values(rng, kRows * kDim);
    const std::vector<double> dout = test::random_values(rng, kRows * kDim);
    std::vector<double> y(kRows * kDim), rstd(kRows);
    const auto loss = [&] {
      ops::layernorm_forward(y.data(), rstd.data(), x.data(), kRows, kDim, eps);
      return test::weighted_sum(y, dout);
    };
    loss();
    std::vector<double> dx(kRows * kDim, 0.0);
    ops::layernorm_backward(dx.data(), dout.data(), y.data(), rstd.data(), kRows, kDim);
    test::expect_gradient_matches(dx, test::numeric_gradient(x, loss), "x");
  }
}

TEST(OpsLayerNorm, BackwardAccumulatesAndFloatMatchesDouble) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  const std::vector<double> x = test::random_values(rng, kRows * kDim);
  const std::vector<double> dout = test::random_values(rng, kRows * kDim);
  std::vector<double> y(kRows * kDim), rstd(kRows), dx(kRows * kDim, 0.0);
  ops::layernorm_forward(y.data(), rstd.data(), x.data(), kRows, kDim);
  test::expect_backward_accumulates({kRows * kDim}, [&](std::vector<std::vector<double>>& g) {
    ops::layernorm_backward(g[0].data(), dout.data(), y.data(), rstd.data(), kRows, kDim);
  });
  ops::layernorm_backward(dx.data(), dout.data(), y.data(), rstd.data(), kRows, kDim);
  const std::vector<float> x_f = test::convert<float>(x), dout_f = test::convert<float>(dout);
  std::vector<float> y_f(kRows * kDim), rstd_f(kRows), dx_f(kRows * kDim, 0.0f);
  ops::layernorm_forward(y_f.data(), rstd_f.data(), x_f.data(), kRows, kDim);
  ops::layernorm_backward(dx_f.data(), dout_f.data(), y_f.data(), rstd_f.data(), kRows, kDim);
  test::expect_float_matches_double(y_f, y, "y");
  test::expect_float_matches_double(dx_f, dx, "dx");
}

TEST(OpsLayerNorm, RejectsAnEmptyRow) {
  std::vector<double> buffer(4);
  EXPECT_THROW(ops::layernorm_forward(buffer.data(), buffer.data(), buffer.data(), 2, 0), Error);
  EXPECT_THROW(
      ops::layernorm_backward(buffer.data(), buffer.data(), buffer.data(), buffer.data(), 2, 0),
      Error);
}

}  // namespace
}  // namespace fp8t
