#include "ops/rmsnorm.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "core/error.h"
#include "ops/gradient_check.h"

namespace fp8t {
namespace {

using test::TestRng;

constexpr int64_t kRows = 5;
constexpr int64_t kDim = 7;

TEST(OpsRmsNorm, DefaultEpsIsTheFloatMachineEpsilon) {
  EXPECT_EQ(ops::kRmsNormEps, 1.1920928955078125e-07);
  EXPECT_EQ(ops::kRmsNormEps, static_cast<double>(std::numeric_limits<float>::epsilon()));
}

TEST(OpsRmsNorm, ForwardMatchesTheFormula) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  std::vector<double> x = test::random_values(rng, kRows * kDim, -2.0, 2.0);
  // A row of zeros: only eps keeps rstd finite.
  std::fill(x.begin() + 2 * kDim, x.begin() + 3 * kDim, 0.0);
  std::vector<double> y(kRows * kDim);
  std::vector<double> rstd(kRows);
  const double eps = 1e-3;  // large enough to matter in the comparison
  ops::rmsnorm_forward(y.data(), rstd.data(), x.data(), kRows, kDim, eps);
  for (int64_t r = 0; r < kRows; ++r) {
    long double mean_square = 0.0L;
    for (int64_t i = 0; i < kDim; ++i)
      mean_square += static_cast<long double>(x[r * kDim + i]) * x[r * kDim + i];
    mean_square /= kDim;
    const long double expected_rstd = 1.0L / std::sqrt(mean_square + eps);
    EXPECT_NEAR(rstd[r], static_cast<double>(expected_rstd),
                1e-14 * static_cast<double>(expected_rstd))
        << r;
    for (int64_t i = 0; i < kDim; ++i) {
      const double expected = static_cast<double>(x[r * kDim + i] * expected_rstd);
      EXPECT_NEAR(y[r * kDim + i], expected, 1e-14) << r << ", " << i;
    }
  }
}

TEST(OpsRmsNorm, RunsInPlace) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  std::vector<double> x = test::random_values(rng, kRows * kDim);
  std::vector<double> y(kRows * kDim);
  std::vector<double> rstd(kRows);
  ops::rmsnorm_forward(y.data(), rstd.data(), x.data(), kRows, kDim);
  ops::rmsnorm_forward(x.data(), rstd.data(), x.data(), kRows, kDim);
  EXPECT_EQ(x, y);
}

TEST(OpsRmsNorm, GradientMatchesFiniteDifferences) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  for (const double eps : {ops::kRmsNormEps, 0.1}) {
    SCOPED_TRACE(::testing::Message() << "eps " << eps);
    std::vector<double> x = test::random_values(rng, kRows * kDim);
    const std::vector<double> dout = test::random_values(rng, kRows * kDim);
    std::vector<double> y(kRows * kDim);
    std::vector<double> rstd(kRows);
    const auto loss = [&] {
      ops::rmsnorm_forward(y.data(), rstd.data(), x.data(), kRows, kDim, eps);
      return test::weighted_sum(y, dout);
    };
    loss();
    std::vector<double> dx(kRows * kDim, 0.0);
    ops::rmsnorm_backward(dx.data(), dout.data(), y.data(), rstd.data(), kRows, kDim);
    test::expect_gradient_matches(dx, test::numeric_gradient(x, loss), "x");
  }
}

TEST(OpsRmsNorm, BackwardAccumulates) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  const std::vector<double> x = test::random_values(rng, kRows * kDim);
  const std::vector<double> dout = test::random_values(rng, kRows * kDim);
  std::vector<double> y(kRows * kDim);
  std::vector<double> rstd(kRows);
  ops::rmsnorm_forward(y.data(), rstd.data(), x.data(), kRows, kDim);
  test::expect_backward_accumulates({kRows * kDim}, [&](std::vector<std::vector<double>>& g) {
    ops::rmsnorm_backward(g[0].data(), dout.data(), y.data(), rstd.data(), kRows, kDim);
  });
}

TEST(OpsRmsNorm, FloatMatchesDouble) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  const std::vector<double> x = test::random_values(rng, kRows * kDim);
  const std::vector<double> dout = test::random_values(rng, kRows * kDim);
  std::vector<double> y(kRows * kDim);
  std::vector<double> rstd(kRows);
  std::vector<double> dx(kRows * kDim, 0.0);
  ops::rmsnorm_forward(y.data(), rstd.data(), x.data(), kRows, kDim);
  ops::rmsnorm_backward(dx.data(), dout.data(), y.data(), rstd.data(), kRows, kDim);
  const std::vector<float> x_f = test::convert<float>(x);
  const std::vector<float> dout_f = test::convert<float>(dout);
  std::vector<float> y_f(kRows * kDim);
  std::vector<float> rstd_f(kRows);
  std::vector<float> dx_f(kRows * kDim, 0.0f);
  ops::rmsnorm_forward(y_f.data(), rstd_f.data(), x_f.data(), kRows, kDim);
  ops::rmsnorm_backward(dx_f.data(), dout_f.data(), y_f.data(), rstd_f.data(), kRows, kDim);
  test::expect_float_matches_double(y_f, y, "y");
  test::expect_float_matches_double(rstd_f, rstd, "rstd");
  test::expect_float_matches_double(dx_f, dx, "dx");
}

TEST(OpsRmsNorm, RejectsAnEmptyRow) {
  std::vector<double> buffer(4);
  EXPECT_THROW(ops::rmsnorm_forward(buffer.data(), buffer.data(), buffer.data(), 2, 0), Error);
  EXPECT_THROW(
      ops::rmsnorm_backward(buffer.data(), buffer.data(), buffer.data(), buffer.data(), 2, 0),
      Error);
}

}  // namespace
}  // namespace fp8t
