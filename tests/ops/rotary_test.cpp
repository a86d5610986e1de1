#include "ops/rotary.h"

#include <gtest/gtest.h>

#include <cmath>

#include "core/error.h"
#include "ops/gradient_check.h"

namespace fp8t {
namespace {

using test::TestRng;

struct RotaryCase {
  int64_t batch, seq_len, heads, head_dim;
  int64_t size() const { return batch * seq_len * heads * head_dim; }
};

const RotaryCase kCases[] = {{2, 5, 3, 6}, {2, 7, 2, 8}, {1, 3, 1, 2}};

struct Tables {
  std::vector<float> cos, sin;
};

Tables make_tables(int64_t seq_len, int64_t head_dim) {
  Tables tables{std::vector<float>(seq_len * head_dim / 2),
                std::vector<float>(seq_len * head_dim / 2)};
  ops::rotary_tables(tables.cos.data(), tables.sin.data(), seq_len, head_dim);
  return tables;
}

TEST(OpsRotary, TablesFollowTorchsFloatSteps) {
  constexpr int64_t kSeqLen = 40;
  constexpr int64_t kHeadDim = 10;
  const Tables tables = make_tables(kSeqLen, kHeadDim);
  for (int64_t t = 0; t < kSeqLen; ++t) {
    for (int64_t j = 0; j < kHeadDim / 2; ++j) {
      // torch: channel_range = arange(0, D, 2, float32); inv_freq = 1.0 / (100000 **
      // (channel_range / D)); freqs = outer(arange(T, float32), inv_freq); cos, sin.
      const float channel = static_cast<float>(2 * j);
      const float inv_freq = 1.0f / std::pow(100000.0f, channel / static_cast<float>(kHeadDim));
      const float angle = static_cast<float>(t) * inv_freq;
      EXPECT_EQ(tables.cos[t * kHeadDim / 2 + j], std::cos(angle)) << t << ", " << j;
      EXPECT_EQ(tables.sin[t * kHeadDim / 2 + j], std::sin(angle)) << t << ", " << j;
      // And the exact math it approximates: only the float rounding of the angle differs.
      const double exact_angle =
          static_cast<double>(t) / std::pow(100000.0, 2.0 * static_cast<double>(j) / kHeadDim);
      const double tolerance = 1e-6 * (1.0 + exact_angle);
      EXPECT_NEAR(tables.cos[t * kHeadDim / 2 + j], std::cos(exact_angle), tolerance);
      EXPECT_NEAR(tables.sin[t * kHeadDim / 2 + j], std::sin(exact_angle), tolerance);
    }
  }
  // Position 0 is the identity; channel pair 0 turns by one radian per position.
  EXPECT_EQ(tables.cos[0], 1.0f);
  EXPECT_EQ(tables.sin[kHeadDim / 2 - 1], 0.0f);
  EXPECT_EQ(tables.cos[3 * kHeadDim / 2], std::cos(3.0f));
}

TEST(OpsRotary, ForwardMatchesTheExplicitFormula) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  for (const RotaryCase& c : kCases) {
    SCOPED_TRACE(::testing::Message()
                 << "T " << c.seq_len << " H " << c.heads << " D " << c.head_dim);
    const Tables tables = make_tables(c.seq_len + 3, c.head_dim);  // longer than needed
    const std::vector<double> x = test::random_values(rng, static_cast<size_t>(c.size()));
    std::vector<double> y(x.size());
    ops::rotary_forward(y.data(), x.data(), tables.cos.data(), tables.sin.data(), c.batch,
                        c.seq_len, c.heads, c.head_dim);
    const int64_t d = c.head_dim / 2;
    for (int64_t i = 0; i < c.size(); ++i) {
      const int64_t channel = i % c.head_dim;
      const int64_t t = (i / (c.head_dim * c.heads)) % c.seq_len;
      const int64_t pair = channel % d;
      const double cos_value = tables.cos[t * d + pair];
      const double sin_value = tables.sin[t * d + pair];
      const double expected = channel < d ? x[i] * cos_value + x[i + d] * sin_value
                                          : -x[i - d] * sin_value + x[i] * cos_value;
      EXPECT_NEAR(y[i], expected, 1e-15) << i;
    }
    std::vector<double> in_place = x;
    ops::rotary_forward(in_place.data(), in_place.data(), tables.cos.data(), tables.sin.data(),
                        c.batch, c.seq_len, c.heads, c.head_dim);
    EXPECT_EQ(in_place, y);
  }
}

TEST(OpsRotary, GradientMatchesFiniteDifferences) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  for (const RotaryCase& c : kCases) {
    SCOPED_TRACE(::testing::Message()
                 << "T " << c.seq_len << " H " << c.heads << " D " << c.head_dim);
    const Tables tables = make_tables(c.seq_len, c.head_dim);
    std::vector<double> x = test::random_values(rng, static_cast<size_t>(c.size()));
    const std::vector<double> dout = test::random_values(rng, x.size());
    std::vector<double> y(x.size());
    const auto loss = [&] {
      ops::rotary_forward(y.data(), x.data(), tables.cos.data(), tables.sin.data(), c.batch,
                          c.seq_len, c.heads, c.head_dim);
      return test::weighted_sum(y, dout);
    };
    std::vector<double> dx(x.size(), 0.0);
    ops::rotary_backward(dx.data(), dout.data(), tables.cos.data(), tables.sin.data(), c.batch,
                         c.seq_len, c.heads, c.head_dim);
    test::expect_gradient_matches(dx, test::numeric_gradient(x, loss), "x");
  }
}

TEST(OpsRotary, BackwardAccumulates) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  const RotaryCase c = kCases[0];
  const Tables tables = make_tables(c.seq_len, c.head_dim);
  const std::vector<double> dout = test::random_values(rng, static_cast<size_t>(c.size()));
  test::expect_backward_accumulates({dout.size()}, [&](std::vector<std::vector<double>>& g) {
    ops::rotary_backward(g[0].data(), dout.data(), tables.cos.data(), tables.sin.data(), c.batch,
                         c.seq_len, c.heads, c.head_dim);
  });
}

TEST(OpsRotary, FloatMatchesDouble) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  const RotaryCase c = kCases[1];
  const Tables tables = make_tables(c.seq_len, c.head_dim);
  const std::vector<double> x = test::random_values(rng, static_cast<size_t>(c.size()));
  const std::vector<double> dout = test::random_values(rng, x.size());
  std::vector<double> y(x.size());
  std::vector<double> dx(x.size(), 0.0);
  ops::rotary_forward(y.data(), x.data(), tables.cos.data(), tables.sin.data(), c.batch, c.seq_len,
                      c.heads, c.head_dim);
  ops::rotary_backward(dx.data(), dout.data(), tables.cos.data(), tables.sin.data(), c.batch,
                       c.seq_len, c.heads, c.head_dim);
  const std::vector<float> x_f = test::convert<float>(x);
  const std::vector<float> dout_f = test::convert<float>(dout);
  std::vector<float> y_f(x.size());
  std::vector<float> dx_f(x.size(), 0.0f);
  ops::rotary_forward(y_f.data(), x_f.data(), tables.cos.data(), tables.sin.data(), c.batch,
                      c.seq_len, c.heads, c.head_dim);
  ops::rotary_backward(dx_f.data(), dout_f.data(), tables.cos.data(), tables.sin.data(), c.batch,
                       c.seq_len, c.heads, c.head_dim);
  test::expect_float_matches_double(y_f, y, "y");
  test::expect_float_matches_double(dx_f, dx, "dx");
}

TEST(OpsRotary, RejectsAnOddHeadDim) {
  std::vector<float> table(8);
  std::vector<double> x(2 * 3);
  EXPECT_THROW(ops::rotary_tables(table.data(), table.data(), 2, 3), Error);
  EXPECT_THROW(ops::rotary_forward(x.data(), x.data(), table.data(), table.data(), 1, 2, 1, 3),
               Error);
  EXPECT_THROW(ops::rotary_backward(x.data(), x.data(), table.data(), table.data(), 1, 2, 1, 3),
               Error);
}

}  // namespace
}  // namespace fp8t
