#include "ops/timestep.h"

#include <gtest/gtest.h>

#include <cmath>
#include <vector>

#include "core/error.h"
#include "ops/gradient_check.h"

namespace fp8t {
namespace {

// Against the definition evaluated in double: cos in the first half, sin in the second, the
// frequencies falling geometrically from 1 to about 1 / max_period.
TEST(OpsTimestep, MatchesTheDefinition) {
  test::TestRng rng;
  SCOPED_TRACE(rng.trace());
  for (const int64_t dim : {256, 7}) {
    const std::vector<double> t = test::random_values(rng, 5, 0.0, 1.0);
    std::vector<double> out(t.size() * size_t(dim), -1.0);
    ops::timestep_embedding(out.data(), t.data(), std::ssize(t), dim);
    const int64_t half = dim / 2;
    for (size_t n = 0; n < t.size(); ++n) {
      for (int64_t i = 0; i < half; ++i) {
        const double argument =
            1000.0 * t[n] * std::exp(-std::log(10000.0) * double(i) / double(half));
        // The reference's fp32 products: relative 1e-6 of an argument up to 1000.
        const double tolerance = 1e-6 * std::max(1.0, argument);
        EXPECT_NEAR(out[n * dim + i], std::cos(argument), tolerance) << n << ", " << i;
        EXPECT_NEAR(out[n * dim + half + i], std::sin(argument), tolerance) << n << ", " << i;
      }
      if (dim % 2 != 0) {
        EXPECT_EQ(out[n * dim + dim - 1], 0.0);
      }
    }
  }
  // σ = 0: cos 1, sin 0 everywhere.
  const double zero = 0.0;
  std::vector<double> out(4);
  ops::timestep_embedding(out.data(), &zero, 1, 4);
  EXPECT_EQ(out, (std::vector<double>{1.0, 1.0, 0.0, 0.0}));
}

TEST(OpsTimestep, RejectsBadSizes) {
  std::vector<double> buffer(4);
  EXPECT_THROW(ops::timestep_embedding(buffer.data(), buffer.data(), 1, 1), Error);
  EXPECT_THROW(ops::timestep_embedding(buffer.data(), buffer.data(), -1, 4), Error);
}

}  // namespace
}  // namespace fp8t
