#include "ops/modulation.h"

#include <gtest/gtest.h>

#include <vector>

#include "core/error.h"
#include "ops/gradient_check.h"

namespace fp8t {
namespace {

// Two samples of three tokens; the modulation vectors sit in rows of stride 11 > dim 4, as the
// chunks of one modulation output do.
constexpr ops::ModulationShape kShape{2, 3, 4};
constexpr int64_t kStride = 11;
constexpr size_t kActivations = 2 * 3 * 4;
constexpr size_t kVectors = 2 * kStride;

TEST(OpsModulation, ModulateMatchesTheFormulaAndItsGradient) {
  test::TestRng rng;
  SCOPED_TRACE(rng.trace());
  std::vector<double> x = test::random_values(rng, kActivations);
  std::vector<double> scale = test::random_values(rng, kVectors);
  std::vector<double> shift = test::random_values(rng, kVectors);
  const std::vector<double> dout = test::random_values(rng, kActivations);
  std::vector<double> y(kActivations);
  ops::modulate_forward(y.data(), x.data(), scale.data(), shift.data(), kStride, kShape);
  // Sample 1, token 2, channel 3.
  const size_t row = (1 * 3 + 2) * 4;
  EXPECT_DOUBLE_EQ(y[row + 3], x[row + 3] * (1 + scale[kStride + 3]) + shift[kStride + 3]);

  const auto loss = [&] {
    ops::modulate_forward(y.data(), x.data(), scale.data(), shift.data(), kStride, kShape);
    return test::weighted_sum(y, dout);
  };
  std::vector<double> dx(kActivations, 0.0), dscale(kVectors, 0.0), dshift(kVectors, 0.0);
  ops::modulate_backward(dx.data(), dscale.data(), dshift.data(), dout.data(), x.data(),
                         scale.data(), kStride, kShape);
  test::expect_gradient_matches(dx, test::numeric_gradient(x, loss), "x");
  test::expect_gradient_matches(dscale, test::numeric_gradient(scale, loss), "scale");
  test::expect_gradient_matches(dshift, test::numeric_gradient(shift, loss), "shift");
  test::expect_backward_accumulates(
      {kActivations, kVectors, kVectors}, [&](std::vector<std::vector<double>>& g) {
        ops::modulate_backward(g[0].data(), g[1].data(), g[2].data(), dout.data(), x.data(),
                               scale.data(), kStride, kShape);
      });
}

TEST(OpsModulation, GatedResidualMatchesItsGradient) {
  test::TestRng rng;
  SCOPED_TRACE(rng.trace());
  const std::vector<double> start = test::random_values(rng, kActivations);
  std::vector<double> branch = test::random_values(rng, kActivations);
  std::vector<double> gate = test::random_values(rng, kVectors);
  const std::vector<double> dout = test::random_values(rng, kActivations);
  std::vector<double> residual(kActivations);
  const auto loss = [&] {
    residual = start;
    ops::gated_residual_forward(residual.data(), branch.data(), gate.data(), kStride, kShape);
    return test::weighted_sum(residual, dout);
  };
  loss();
  EXPECT_DOUBLE_EQ(residual[5], start[5] + gate[1] * branch[5]);  // sample 0, token 1, channel 1
  std::vector<double> dbranch(kActivations, 0.0), dgate(kVectors, 0.0);
  ops::gated_residual_backward(dbranch.data(), dgate.data(), dout.data(), branch.data(),
                               gate.data(), kStride, kShape);
  test::expect_gradient_matches(dbranch, test::numeric_gradient(branch, loss), "branch");
  test::expect_gradient_matches(dgate, test::numeric_gradient(gate, loss), "gate");
}

TEST(OpsModulation, RejectsAStrideBelowDim) {
  std::vector<double> buffer(64);
  EXPECT_THROW(
      ops::modulate_forward(buffer.data(), buffer.data(), buffer.data(), buffer.data(), 3, kShape),
      Error);
}

}  // namespace
}  // namespace fp8t
