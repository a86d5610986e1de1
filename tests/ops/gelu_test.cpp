#include "ops/gelu.h"

#include <gtest/gtest.h>

#include <cmath>

#include "core/error.h"
#include "ops/gradient_check.h"

namespace fp8t {
namespace {

using test::TestRng;

constexpr int64_t kCount = 41;

TEST(OpsGelu, ForwardIsTheTanhApproximation) {
  // The formula at 1 and -2, evaluated independently in float64.
  double x[] = {1.0, -2.0, 0.0};
  double y[3];
  ops::gelu_tanh_forward(y, x, 3);
  EXPECT_NEAR(y[0], 0.8411919906082768, 1e-15);
  EXPECT_NEAR(y[1], -0.04540230591222, 1e-13);
  EXPECT_EQ(y[2], 0.0);
}

TEST(OpsGelu, GradientMatchesFiniteDifferences) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  std::vector<double> x = test::random_values(rng, kCount, -4.0, 4.0);
  const std::vector<double> dout = test::random_values(rng, kCount);
  std::vector<double> y(kCount);
  const auto loss = [&] {
    ops::gelu_tanh_forward(y.data(), x.data(), kCount);
    return test::weighted_sum(y, dout);
  };
  loss();
  std::vector<double> dx(kCount, 0.0);
  ops::gelu_tanh_backward(dx.data(), dout.data(), x.data(), kCount);
  test::expect_gradient_matches(dx, test::numeric_gradient(x, loss), "x");
  test::expect_backward_accumulates({kCount}, [&](std::vector<std::vector<double>>& g) {
    ops::gelu_tanh_backward(g[0].data(), dout.data(), x.data(), kCount);
  });
}

TEST(OpsGelu, FloatMatchesDoubleAndRunsInPlace) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  const std::vector<double> x = test::random_values(rng, kCount, -4.0, 4.0);
  std::vector<double> y(kCount);
  ops::gelu_tanh_forward(y.data(), x.data(), kCount);
  std::vector<float> x_f = test::convert<float>(x), y_f(kCount);
  ops::gelu_tanh_forward(y_f.data(), x_f.data(), kCount);
  test::expect_float_matches_double(y_f, y, "y");
  ops::gelu_tanh_forward(x_f.data(), x_f.data(), kCount);
  EXPECT_EQ(x_f, y_f);
  EXPECT_THROW(ops::gelu_tanh_forward(y.data(), x.data(), -1), Error);
}

}  // namespace
}  // namespace fp8t
