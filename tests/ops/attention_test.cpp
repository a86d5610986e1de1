#include "ops/attention.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>

#include "core/error.h"
#include "ops/attention_test_util.h"
#include "ops/gradient_check.h"

namespace fp8t {
namespace {

using ops::AttentionShape;
using test::TestRng;

// Odd sizes; kv heads shared by all query heads, by none, and by pairs (4 over 2, where
// h / group and h % kv_heads differ); windows 0, 1, 2, seq_len - 1 and past seq_len; and
// without the causal mask (where the window of 0 must not matter).
const AttentionShape kShapes[] = {
    {2, 5, 3, 1, 8, 0}, {2, 7, 2, 2, 6, 1},        {2, 7, 3, 3, 6, 2},
    {2, 5, 2, 1, 8, 4}, {2, 7, 3, 1, 6, 100},      {2, 7, 4, 2, 6, 2},
    {1, 1, 2, 1, 4, 0}, {2, 5, 3, 3, 8, 0, false}, {2, 7, 4, 2, 6, 0, false},
};

double default_scale(const AttentionShape& s) {
  return 1.0 / std::sqrt(double(s.head_dim));
}

struct Inputs {
  std::vector<double> q, k, v, dout;
};

Inputs random_inputs(TestRng& rng, const AttentionShape& s) {
  // Inputs up to 2 make the softmax far from uniform.
  return {test::random_values(rng, test::q_size(s), -2.0, 2.0),
          test::random_values(rng, test::kv_size(s), -2.0, 2.0),
          test::random_values(rng, test::kv_size(s)), test::random_values(rng, test::q_size(s))};
}

// The textbook computation: the full [seq_len, seq_len] score matrix of each (batch, head)
// with the mask as -inf, a softmax in long double, then P V.
void naive_attention(std::vector<double>& out, std::vector<double>& lse, const Inputs& in,
                     const AttentionShape& s, double scale) {
  const int64_t T = s.seq_len, D = s.head_dim, group = s.heads / s.kv_heads;
  std::vector<long double> scores(static_cast<size_t>(T * T));
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t h = 0; h < s.heads; ++h) {
      const int64_t kv_head = h / group;
      for (int64_t t = 0; t < T; ++t) {
        for (int64_t j = 0; j < T; ++j) {
          const bool visible = !s.causal || (j <= t && t - j <= s.window);
          long double score = -std::numeric_limits<long double>::infinity();
          if (visible) {
            score = 0.0L;
            for (int64_t d = 0; d < D; ++d) {
              score += static_cast<long double>(in.q[((b * T + t) * s.heads + h) * D + d]) *
                       in.k[((b * T + j) * s.kv_heads + kv_head) * D + d];
            }
            score *= scale;
          }
          scores[t * T + j] = score;
        }
      }
      for (int64_t t = 0; t < T; ++t) {
        long double max_score = -std::numeric_limits<long double>::infinity();
        for (int64_t j = 0; j < T; ++j)
          max_score = std::max(max_score, scores[t * T + j]);
        long double sum = 0.0L;
        for (int64_t j = 0; j < T; ++j)
          sum += std::exp(scores[t * T + j] - max_score);
        lse[(b * s.heads + h) * T + t] = static_cast<double>(max_score + std::log(sum));
        for (int64_t d = 0; d < D; ++d) {
          long double value = 0.0L;
          for (int64_t j = 0; j < T; ++j) {
            value += std::exp(scores[t * T + j] - max_score) / sum *
                     in.v[((b * T + j) * s.kv_heads + kv_head) * D + d];
          }
          out[((b * T + t) * s.heads + h) * D + d] = static_cast<double>(value);
        }
      }
    }
  }
}

TEST(OpsAttention, ForwardMatchesTheMaskedScoreMatrix) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  for (const AttentionShape& s : kShapes) {
    SCOPED_TRACE(test::describe(s));
    const Inputs in = random_inputs(rng, s);
    const double scale = default_scale(s);
    std::vector<double> out(test::q_size(s)), lse(test::lse_size(s));
    ops::attention_forward(out.data(), lse.data(), in.q.data(), in.k.data(), in.v.data(), s, scale);
    std::vector<double> expected_out(test::q_size(s)), expected_lse(test::lse_size(s));
    naive_attention(expected_out, expected_lse, in, s, scale);
    test::expect_near_relative(out, expected_out, 1e-12, 1e-3, "out");
    test::expect_near_relative(lse, expected_lse, 1e-12, 1e-3, "lse");
  }
}

TEST(OpsAttention, WindowZeroSeesOnlyItselfAndWindowsPastTheSequenceAreFullCausal) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  AttentionShape s{2, 6, 4, 2, 6, 0};
  const Inputs in = random_inputs(rng, s);
  std::vector<double> out(test::q_size(s)), lse(test::lse_size(s));
  ops::attention_forward(out.data(), lse.data(), in.q.data(), in.k.data(), in.v.data(), s, 0.5);
  for (int64_t b = 0; b < s.batch; ++b) {
    for (int64_t t = 0; t < s.seq_len; ++t) {
      for (int64_t h = 0; h < s.heads; ++h) {
        for (int64_t d = 0; d < s.head_dim; ++d) {
          // Query head h reads kv head h / (heads / kv_heads): heads 0, 1 -> 0 and 2, 3 -> 1.
          const int64_t kv_head = h / 2;
          EXPECT_DOUBLE_EQ(out[((b * s.seq_len + t) * s.heads + h) * s.head_dim + d],
                           in.v[((b * s.seq_len + t) * s.kv_heads + kv_head) * s.head_dim + d]);
        }
      }
    }
  }
  s.window = s.seq_len - 1;
  std::vector<double> full(test::q_size(s)), full_lse(test::lse_size(s));
  ops::attention_forward(full.data(), full_lse.data(), in.q.data(), in.k.data(), in.v.data(), s,
                         0.5);
  for (const int64_t window : {s.seq_len, int64_t{1} << 40}) {
    s.window = window;
    ops::attention_forward(out.data(), lse.data(), in.q.data(), in.k.data(), in.v.data(), s, 0.5);
    EXPECT_EQ(out, full) << window;
    EXPECT_EQ(lse, full_lse) << window;
  }
}

// Without the mask, over two query tiles (the tiles of a causal pass see only their own
// keys and those before): every query sees every key, whatever the window, and the first
// query is no longer its own value.
TEST(OpsAttention, NotCausalSeesEveryKeyAcrossQueryTiles) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  AttentionShape s{2, 70, 2, 1, 4, 0, false};
  const Inputs in = random_inputs(rng, s);
  const double scale = default_scale(s);
  std::vector<double> out(test::q_size(s)), lse(test::lse_size(s));
  ops::attention_forward(out.data(), lse.data(), in.q.data(), in.k.data(), in.v.data(), s, scale);
  std::vector<double> expected_out(test::q_size(s)), expected_lse(test::lse_size(s));
  naive_attention(expected_out, expected_lse, in, s, scale);
  test::expect_near_relative(out, expected_out, 1e-12, 1e-3, "out");
  test::expect_near_relative(lse, expected_lse, 1e-12, 1e-3, "lse");
  EXPECT_NE(out[0], in.v[0]);

  s.window = 3;
  std::vector<double> windowed(test::q_size(s)), windowed_lse(test::lse_size(s));
  ops::attention_forward(windowed.data(), windowed_lse.data(), in.q.data(), in.k.data(),
                         in.v.data(), s, scale);
  EXPECT_EQ(windowed, out);
  EXPECT_EQ(windowed_lse, lse);
}

TEST(OpsAttention, GradientMatchesFiniteDifferences) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  for (const AttentionShape& s : kShapes) {
    SCOPED_TRACE(test::describe(s));
    Inputs in = random_inputs(rng, s);
    const double scale = default_scale(s);
    std::vector<double> out(test::q_size(s)), lse(test::lse_size(s));
    const auto loss = [&] {
      ops::attention_forward(out.data(), lse.data(), in.q.data(), in.k.data(), in.v.data(), s,
                             scale);
      return test::weighted_sum(out, in.dout);
    };
    loss();
    std::vector<double> dq(test::q_size(s), 0.0), dk(test::kv_size(s), 0.0),
        dv(test::kv_size(s), 0.0);
    ops::attention_backward(dq.data(), dk.data(), dv.data(), in.dout.data(), in.q.data(),
                            in.k.data(), in.v.data(), lse.data(), s, scale);
    test::expect_gradient_matches(dq, test::numeric_gradient(in.q, loss), "q");
    test::expect_gradient_matches(dk, test::numeric_gradient(in.k, loss), "k");
    test::expect_gradient_matches(dv, test::numeric_gradient(in.v, loss), "v");
  }
}

TEST(OpsAttention, BackwardAccumulates) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  const AttentionShape s = kShapes[1];
  const Inputs in = random_inputs(rng, s);
  std::vector<double> out(test::q_size(s)), lse(test::lse_size(s));
  ops::attention_forward(out.data(), lse.data(), in.q.data(), in.k.data(), in.v.data(), s, 0.4);
  test::expect_backward_accumulates(
      {test::q_size(s), test::kv_size(s), test::kv_size(s)},
      [&](std::vector<std::vector<double>>& g) {
        ops::attention_backward(g[0].data(), g[1].data(), g[2].data(), in.dout.data(), in.q.data(),
                                in.k.data(), in.v.data(), lse.data(), s, 0.4);
      });
}

TEST(OpsAttention, FloatMatchesDouble) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  for (const AttentionShape& s : {kShapes[0], kShapes[4], kShapes[8]}) {
    SCOPED_TRACE(test::describe(s));
    const Inputs in = random_inputs(rng, s);
    const float scale = static_cast<float>(default_scale(s));  // the same value in both runs
    std::vector<double> out(test::q_size(s)), lse(test::lse_size(s));
    std::vector<double> dq(test::q_size(s), 0.0), dk(test::kv_size(s), 0.0),
        dv(test::kv_size(s), 0.0);
    ops::attention_forward(out.data(), lse.data(), in.q.data(), in.k.data(), in.v.data(), s, scale);
    ops::attention_backward(dq.data(), dk.data(), dv.data(), in.dout.data(), in.q.data(),
                            in.k.data(), in.v.data(), lse.data(), s, scale);
    const std::vector<float> q = test::convert<float>(in.q), k = test::convert<float>(in.k),
                             v = test::convert<float>(in.v), dout = test::convert<float>(in.dout);
    std::vector<float> out_f(test::q_size(s)), lse_f(test::lse_size(s));
    std::vector<float> dq_f(test::q_size(s), 0.0f), dk_f(test::kv_size(s), 0.0f),
        dv_f(test::kv_size(s), 0.0f);
    ops::attention_forward(out_f.data(), lse_f.data(), q.data(), k.data(), v.data(), s, scale);
    ops::attention_backward(dq_f.data(), dk_f.data(), dv_f.data(), dout.data(), q.data(), k.data(),
                            v.data(), lse_f.data(), s, scale);
    test::expect_float_matches_double(out_f, out, "out");
    test::expect_float_matches_double(lse_f, lse, "lse");
    test::expect_float_matches_double(dq_f, dq, "dq");
    test::expect_float_matches_double(dk_f, dk, "dk");
    test::expect_float_matches_double(dv_f, dv, "dv");
  }
}

TEST(OpsAttention, RejectsBadShapes) {
  std::vector<double> buffer(512);
  double* p = buffer.data();
  // heads not a multiple of kv_heads
  EXPECT_THROW(ops::attention_forward(p, p, p, p, p, AttentionShape{1, 2, 3, 2, 4, 1}, 1.0), Error);
  EXPECT_THROW(
      ops::attention_backward(p, p, p, p, p, p, p, p, AttentionShape{1, 2, 3, 2, 4, 1}, 1.0),
      Error);
  // a negative window
  try {
    ops::attention_forward(p, p, p, p, p, AttentionShape{1, 2, 2, 1, 4, -1}, 1.0);
    ADD_FAILURE() << "no error for window -1";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find("found -1"), std::string::npos) << error.what();
  }
}

}  // namespace
}  // namespace fp8t
