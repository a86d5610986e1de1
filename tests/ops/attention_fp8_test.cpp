#include "ops/attention_fp8.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "ops/attention_test_util.h"
#include "ops/gradient_check.h"

namespace fp8t {
namespace {

using ops::AttentionFp8Amaxes;
using ops::AttentionFp8Formats;
using ops::AttentionFp8Scales;
using ops::AttentionShape;
using test::TestRng;

// Causal over the whole sequence, sliding windows and no mask; kv heads shared by all query
// heads, by pairs (GQA, 4 over 2) and by none; sequences of one and of two 64-query blocks.
const AttentionShape kShapes[] = {
    {2, 9, 2, 2, 16, 100}, {2, 11, 3, 1, 8, 3},       {1, 70, 4, 2, 8, 20},
    {2, 10, 4, 2, 8, 9},   {2, 9, 2, 2, 8, 0, false}, {1, 70, 4, 2, 8, 0, false},
};

// Hybrid (E4M3 forward, E5M2 backward, scales as computed), and E4M3 throughout with
// power-of-2 scales.
const AttentionFp8Formats kFormats[] = {
    {Fp8Format::E4M3, Fp8Format::E5M2, false, 0.0f},
    {Fp8Format::E4M3, Fp8Format::E4M3, true, 0.0f},
};

std::string describe(const AttentionFp8Formats& f) {
  return fmt::format("forward {} backward {}{}", format_name(f.forward), format_name(f.backward),
                     f.power_of_2_scales ? " power-of-2 scales" : "");
}

// 1/√D rounded to float, so that float and double runs use the same value.
double default_scale(const AttentionShape& s) {
  return static_cast<float>(1.0 / std::sqrt(double(s.head_dim)));
}

float max_abs(const std::vector<double>& x) {
  double amax = 0.0;
  for (const double value : x)
    amax = std::max(amax, std::fabs(value));
  return static_cast<float>(amax);
}

struct Inputs {
  std::vector<double> q, k, v, dout;
};

Inputs random_inputs(TestRng& rng, const AttentionShape& s) {
  // q and k up to 2 make the softmax far from uniform; dout of a loss's size, far from 1, so
  // that a missing scale shows.
  return {test::random_values(rng, test::q_size(s), -2.0, 2.0),
          test::random_values(rng, test::kv_size(s), -2.0, 2.0),
          test::random_values(rng, test::kv_size(s)),
          test::random_values(rng, test::q_size(s), -1e-3, 1e-3)};
}

// The forward's scales from the inputs, the backward's from dout and `previous`.
AttentionFp8Scales scales_for(const Inputs& in, const AttentionFp8Amaxes& previous,
                              const AttentionFp8Formats& formats) {
  AttentionFp8Scales scales;
  ops::attention_fp8_forward_scales(scales, max_abs(in.q), max_abs(in.k), max_abs(in.v), formats);
  ops::attention_fp8_backward_scales(scales, max_abs(in.dout), previous, formats);
  return scales;
}

// The emulation of the test: the quantization points of ops/attention_fp8.h on the
// materialized [seq_len, seq_len] matrices of each (batch, head), with the format model of
// numerics/test_util.h; with fp8 false, the same computation without quantization (exact
// attention, computed the same way).
struct Emulation {
  const AttentionShape& s;
  double scale;
  const AttentionFp8Formats& formats;
  const AttentionFp8Scales& scales;
  bool fp8 = true;

  double read_back(double x, float x_scale, Fp8Format format) const {
    if (!fp8) return x;
    const uint8_t code =
        test::reference_encode(static_cast<float>(x * x_scale), format, Saturation::Saturate);
    return test::expected_value(code, format) / x_scale;
  }
  std::vector<double> read_back(const std::vector<double>& x, float x_scale,
                                Fp8Format format) const {
    std::vector<double> result(x.size());
    for (size_t i = 0; i < x.size(); ++i)
      result[i] = read_back(x[i], x_scale, format);
    return result;
  }

  size_t q_index(int64_t b, int64_t t, int64_t h) const {
    return static_cast<size_t>(((b * s.seq_len + t) * s.heads + h) * s.head_dim);
  }
  size_t kv_index(int64_t b, int64_t t, int64_t h) const {
    const int64_t kv_head = h / (s.heads / s.kv_heads);
    return static_cast<size_t>(((b * s.seq_len + t) * s.kv_heads + kv_head) * s.head_dim);
  }
  bool visible(int64_t t, int64_t j) const { return !s.causal || (j <= t && t - j <= s.window); }

  // The scores [seq_len, seq_len] of (b, h) from the read-back q and k: -inf where masked.
  std::vector<double> scores(const std::vector<double>& q, const std::vector<double>& k, int64_t b,
                             int64_t h) const {
    const int64_t T = s.seq_len;
    std::vector<double> result(static_cast<size_t>(T * T),
                               -std::numeric_limits<double>::infinity());
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t j = 0; j < T; ++j) {
        if (!visible(t, j)) continue;
        double dot = 0.0;
        for (int64_t d = 0; d < s.head_dim; ++d)
          dot += q[q_index(b, t, h) + d] * k[kv_index(b, j, h) + d];
        result[t * T + j] = scale * dot;
      }
    }
    return result;
  }
  // In place: scores to probabilities, given each row's log-sum-exp.
  void to_probabilities(std::vector<double>& scores, const double* lse) const {
    const int64_t T = s.seq_len;
    for (int64_t t = 0; t < T; ++t) {
      for (int64_t j = 0; j < T; ++j)
        scores[t * T + j] = std::exp(scores[t * T + j] - lse[t]);
    }
  }

  void forward(std::vector<double>& out, std::vector<double>& lse, AttentionFp8Amaxes& amaxes,
               const Inputs& in) const {
    const Fp8Format format = formats.forward;
    const std::vector<double> q = read_back(in.q, scales.q, format);
    const std::vector<double> k = read_back(in.k, scales.k, format);
    const std::vector<double> v = read_back(in.v, scales.v, format);
    const int64_t T = s.seq_len;
    std::vector<double> o(test::q_size(s));
    double amax_p = 0.0;
    for (int64_t b = 0; b < s.batch; ++b) {
      for (int64_t h = 0; h < s.heads; ++h) {
        std::vector<double> p = scores(q, k, b, h);
        double* row_lse = lse.data() + (b * s.heads + h) * T;
        for (int64_t t = 0; t < T; ++t) {
          const auto row = p.begin() + t * T;
          const double max_score = *std::max_element(row, row + T);
          double sum = 0.0;
          for (int64_t j = 0; j < T; ++j)
            sum += std::exp(row[j] - max_score);
          row_lse[t] = max_score + std::log(sum);
        }
        to_probabilities(p, row_lse);
        for (double& value : p) {
          amax_p = std::max(amax_p, value);
          value = read_back(value, scales.p, format);
        }
        for (int64_t t = 0; t < T; ++t) {
          for (int64_t d = 0; d < s.head_dim; ++d) {
            double sum = 0.0;
            for (int64_t j = 0; j < T; ++j)
              sum += p[t * T + j] * v[kv_index(b, j, h) + d];
            o[q_index(b, t, h) + d] = sum;
          }
        }
      }
    }
    amaxes.p = static_cast<float>(amax_p);
    amaxes.o = max_abs(o);
    out = read_back(o, scales.o, format);
  }

  // dq, dk, dv are written (not added to); out and lse are the forward's.
  void backward(std::vector<double>& dq, std::vector<double>& dk, std::vector<double>& dv,
                AttentionFp8Amaxes& amaxes, const Inputs& in, const std::vector<double>& out,
                const std::vector<double>& lse) const {
    const std::vector<double> q = read_back(in.q, scales.q, formats.forward);
    const std::vector<double> k = read_back(in.k, scales.k, formats.forward);
    const std::vector<double> v = read_back(in.v, scales.v, formats.forward);
    const std::vector<double> o = read_back(out, scales.o, formats.forward);
    const std::vector<double> dout = read_back(in.dout, scales.dout, formats.backward);
    std::vector<double> dq_full(test::q_size(s), 0.0), dk_full(test::kv_size(s), 0.0),
        dv_full(test::kv_size(s), 0.0);
    const int64_t T = s.seq_len, D = s.head_dim;
    double amax_ds = 0.0;
    for (int64_t b = 0; b < s.batch; ++b) {
      for (int64_t h = 0; h < s.heads; ++h) {
        std::vector<double> p = scores(q, k, b, h);
        to_probabilities(p, lse.data() + (b * s.heads + h) * T);
        for (int64_t t = 0; t < T; ++t) {
          const size_t row = q_index(b, t, h);
          double delta = 0.0;
          for (int64_t d = 0; d < D; ++d)
            delta += dout[row + d] * o[row + d];
          for (int64_t j = 0; j < T; ++j) {
            const size_t key = kv_index(b, j, h);
            double dp = 0.0;
            for (int64_t d = 0; d < D; ++d)
              dp += dout[row + d] * v[key + d];
            const double ds = p[t * T + j] * (dp - delta) * scale;
            amax_ds = std::max(amax_ds, std::fabs(ds));
            const double ds_fp8 = read_back(ds, scales.ds, formats.backward);
            const double p_fp8 = read_back(p[t * T + j], scales.p, formats.forward);
            for (int64_t d = 0; d < D; ++d) {
              dv_full[key + d] += p_fp8 * dout[row + d];
              dq_full[row + d] += ds_fp8 * k[key + d];
              dk_full[key + d] += ds_fp8 * q[row + d];
            }
          }
        }
      }
    }
    amaxes.ds = static_cast<float>(amax_ds);
    amaxes.dq = max_abs(dq_full);
    amaxes.dk = max_abs(dk_full);
    amaxes.dv = max_abs(dv_full);
    dq = read_back(dq_full, scales.dq, formats.backward);
    dk = read_back(dk_full, scales.dk, formats.backward);
    dv = read_back(dv_full, scales.dv, formats.backward);
  }
};

// The op's results on one input, in T.
template <typename T>
struct Fp8Run {
  std::vector<T> out, lse, dq, dk, dv;
  AttentionFp8Amaxes forward_amaxes, backward_amaxes;
};

template <typename T>
Fp8Run<T> run_fp8(const Inputs& in, const AttentionShape& s, double scale,
                  const AttentionFp8Formats& formats, const AttentionFp8Scales& scales) {
  const std::vector<T> q = test::convert<T>(in.q), k = test::convert<T>(in.k),
                       v = test::convert<T>(in.v), dout = test::convert<T>(in.dout);
  Fp8Run<T> run{std::vector<T>(test::q_size(s)),
                std::vector<T>(test::lse_size(s)),
                std::vector<T>(test::q_size(s), T(0)),
                std::vector<T>(test::kv_size(s), T(0)),
                std::vector<T>(test::kv_size(s), T(0)),
                {},
                {}};
  ops::attention_fp8_forward(run.out.data(), run.lse.data(), q.data(), k.data(), v.data(), s,
                             static_cast<T>(scale), formats, scales, &run.forward_amaxes);
  ops::attention_fp8_backward(run.dq.data(), run.dk.data(), run.dv.data(), dout.data(), q.data(),
                              k.data(), v.data(), run.out.data(), run.lse.data(), s,
                              static_cast<T>(scale), formats, scales, &run.backward_amaxes);
  return run;
}

// Random inputs, the attention scale and the FP8 scales as a model sets them: the backward's
// from what a first backward measured.
struct Case {
  Inputs in;
  double scale;
  AttentionFp8Scales scales;
};

Case random_case(TestRng& rng, const AttentionShape& s, const AttentionFp8Formats& formats) {
  Case c{random_inputs(rng, s), default_scale(s), {}};
  const AttentionFp8Scales first = scales_for(c.in, {}, formats);
  const Fp8Run<double> measuring = run_fp8<double>(c.in, s, c.scale, formats, first);
  c.scales = scales_for(c.in, measuring.backward_amaxes, formats);
  return c;
}

// Every element within one step of the format (at its magnitude, in read-back units) of the
// emulation's, and at most 1 % of them different at all: the two round their sums in different
// orders, which can carry a value across a rounding midpoint of the last quantization, but not
// often.
template <typename T>
void expect_within_one_step(const std::vector<T>& actual, const std::vector<double>& expected,
                            float scale, Fp8Format format, const std::string& what) {
  ASSERT_EQ(actual.size(), expected.size()) << what;
  size_t different = 0;
  int reported = 0;
  for (size_t i = 0; i < expected.size(); ++i) {
    const double a = static_cast<double>(actual[i]), e = expected[i];
    if (a == e) continue;
    ++different;
    const double step = 2.0 * test::half_ulp(format, std::fabs(e) * scale) / scale;
    if (!(std::fabs(a - e) <= step * (1.0 + 1e-9)) && reported++ < 5) {
      ADD_FAILURE() << what << "[" << i << "]: " << a << " vs " << e << ", more than one step ("
                    << step << ") apart";
    }
  }
  EXPECT_LE(different, expected.size() / 100) << what << ": elements that differ";
}

void expect_relative(float actual, float expected, double tolerance, const std::string& what) {
  EXPECT_NEAR(actual, expected, tolerance * std::fabs(expected)) << what;
}

TEST(OpsAttentionFp8, MatchesTheEmulationOnTheScoreMatrix) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  for (const AttentionFp8Formats& formats : kFormats) {
    SCOPED_TRACE(describe(formats));
    for (const AttentionShape& s : kShapes) {
      SCOPED_TRACE(test::describe(s));
      const auto [in, scale, scales] = random_case(rng, s, formats);
      const Fp8Run<double> run = run_fp8<double>(in, s, scale, formats, scales);

      const Emulation emulation{s, scale, formats, scales};
      std::vector<double> out, lse(test::lse_size(s)), dq, dk, dv;
      AttentionFp8Amaxes forward, backward;
      emulation.forward(out, lse, forward, in);
      test::expect_near_relative(run.lse, lse, 1e-12, 1e-3, "lse");
      expect_relative(run.forward_amaxes.p, forward.p, 1e-6, "amax p");
      expect_relative(run.forward_amaxes.o, forward.o, 1e-6, "amax o");
      expect_within_one_step(run.out, out, scales.o, formats.forward, "out");

      // The backward from the op's own forward results, so that both start from the same codes.
      emulation.backward(dq, dk, dv, backward, in, run.out, run.lse);
      expect_relative(run.backward_amaxes.ds, backward.ds, 1e-6, "amax ds");
      expect_relative(run.backward_amaxes.dq, backward.dq, 1e-6, "amax dq");
      expect_relative(run.backward_amaxes.dk, backward.dk, 1e-6, "amax dk");
      expect_relative(run.backward_amaxes.dv, backward.dv, 1e-6, "amax dv");
      expect_within_one_step(run.dq, dq, scales.dq, formats.backward, "dq");
      expect_within_one_step(run.dk, dk, scales.dk, formats.backward, "dk");
      expect_within_one_step(run.dv, dv, scales.dv, formats.backward, "dv");
    }
  }
}

// The emulation without quantization is exact attention: a check of the emulation itself.
TEST(OpsAttentionFp8, EmulationWithoutQuantizationIsExactAttention) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  const AttentionFp8Formats formats;
  for (const AttentionShape& s : kShapes) {
    SCOPED_TRACE(test::describe(s));
    const Inputs in = random_inputs(rng, s);
    const double scale = default_scale(s);
    const AttentionFp8Scales scales = scales_for(in, {}, formats);
    const Emulation exact{s, scale, formats, scales, false};
    std::vector<double> out, lse(test::lse_size(s)), dq, dk, dv;
    AttentionFp8Amaxes amaxes;
    exact.forward(out, lse, amaxes, in);
    exact.backward(dq, dk, dv, amaxes, in, out, lse);

    std::vector<double> expected_out(test::q_size(s)), expected_lse(test::lse_size(s));
    std::vector<double> expected_dq(test::q_size(s), 0.0), expected_dk(test::kv_size(s), 0.0),
        expected_dv(test::kv_size(s), 0.0);
    ops::attention_forward(expected_out.data(), expected_lse.data(), in.q.data(), in.k.data(),
                           in.v.data(), s, scale);
    ops::attention_backward(expected_dq.data(), expected_dk.data(), expected_dv.data(),
                            in.dout.data(), in.q.data(), in.k.data(), in.v.data(),
                            expected_lse.data(), s, scale);
    test::expect_near_relative(out, expected_out, 1e-12, 1e-3, "out");
    test::expect_near_relative(lse, expected_lse, 1e-12, 1e-3, "lse");
    test::expect_near_relative(dq, expected_dq, 1e-10, 1e-3, "dq");
    test::expect_near_relative(dk, expected_dk, 1e-10, 1e-3, "dk");
    test::expect_near_relative(dv, expected_dv, 1e-10, 1e-3, "dv");
  }
}

// Against exact attention on the unquantized inputs: errors of FP8's size, and the amaxes the
// op measures near the exact tensors' amaxes. The relative rounding of E4M3 is up to 2^-4, of
// E5M2 2^-3, and each row of dS sums to zero, so dQ and dK cancel: over 100 seeds the worst
// errors were 0.074 (out), 0.10 (dV), 0.17 (dQ, dK), and of the amaxes 0.11 (forward) and
// 0.17 (backward). A missing or inverted scale anywhere gives errors of order 1 or more.
TEST(OpsAttentionFp8, IsExactAttentionToFp8Rounding) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  const AttentionFp8Formats formats;  // hybrid
  for (const AttentionShape& s : kShapes) {
    SCOPED_TRACE(test::describe(s));
    const auto [in, scale, scales] = random_case(rng, s, formats);
    const Fp8Run<double> run = run_fp8<double>(in, s, scale, formats, scales);

    const Emulation exact{s, scale, formats, scales, false};
    std::vector<double> out, lse(test::lse_size(s)), dq, dk, dv;
    AttentionFp8Amaxes forward, backward;
    exact.forward(out, lse, forward, in);
    exact.backward(dq, dk, dv, backward, in, out, lse);
    EXPECT_LT(test::relative_error(run.out, out), 0.1) << "out";
    EXPECT_LT(test::relative_error(run.dq, dq), 0.25) << "dq";
    EXPECT_LT(test::relative_error(run.dk, dk), 0.25) << "dk";
    EXPECT_LT(test::relative_error(run.dv, dv), 0.15) << "dv";

    expect_relative(run.forward_amaxes.p, forward.p, 0.15, "amax p");
    expect_relative(run.forward_amaxes.o, forward.o, 0.15, "amax o");
    expect_relative(run.backward_amaxes.ds, backward.ds, 0.25, "amax ds");
    expect_relative(run.backward_amaxes.dq, backward.dq, 0.25, "amax dq");
    expect_relative(run.backward_amaxes.dk, backward.dk, 0.25, "amax dk");
    expect_relative(run.backward_amaxes.dv, backward.dv, 0.25, "amax dv");
  }
}

// A scale far too large clips at the format's maximum: finite values of magnitude
// format_max / scale, never inf (E5M2 has it) or NaN.
TEST(OpsAttentionFp8, ScalesTooLargeSaturateAtTheFormatMaximum) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  const AttentionShape s = kShapes[2];
  const AttentionFp8Formats formats;
  auto [in, scale, scales] = random_case(rng, s, formats);
  for (float* too_large : {&scales.o, &scales.dq, &scales.dk, &scales.dv})
    *too_large *= 1e6f;
  const Fp8Run<double> run = run_fp8<double>(in, s, scale, formats, scales);
  const auto expect_clipped = [](const std::vector<double>& values, float x_scale, Fp8Format format,
                                 const std::string& what) {
    const double clip = format_max(format) / double(x_scale);
    size_t at_clip = 0;
    for (const double value : values) {
      ASSERT_TRUE(std::isfinite(value)) << what;
      EXPECT_LE(std::fabs(value), clip) << what;
      if (std::fabs(value) == clip) ++at_clip;
    }
    EXPECT_GT(at_clip, values.size() / 2) << what;
  };
  expect_clipped(run.out, scales.o, formats.forward, "out");
  expect_clipped(run.dq, scales.dq, formats.backward, "dq");
  expect_clipped(run.dk, scales.dk, formats.backward, "dk");
  expect_clipped(run.dv, scales.dv, formats.backward, "dv");
}

// Float and double differ in the last bits before each quantization, which now and then moves a
// value to the neighbouring code (more often in dS, where dP − Δ cancels): over 100 seeds at
// most 0.007 (out, dV) and 0.031 (dQ, dK), below FP8's own error.
TEST(OpsAttentionFp8, FloatMatchesDouble) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  const AttentionFp8Formats formats;
  for (const AttentionShape& s : {kShapes[2], kShapes[5]}) {
    SCOPED_TRACE(test::describe(s));
    const auto [in, scale, scales] = random_case(rng, s, formats);
    const Fp8Run<double> run = run_fp8<double>(in, s, scale, formats, scales);
    const Fp8Run<float> run_f = run_fp8<float>(in, s, scale, formats, scales);
    EXPECT_LT(test::relative_error(run_f.out, run.out), 0.02) << "out";
    EXPECT_LT(test::relative_error(run_f.dq, run.dq), 0.06) << "dq";
    EXPECT_LT(test::relative_error(run_f.dk, run.dk), 0.06) << "dk";
    EXPECT_LT(test::relative_error(run_f.dv, run.dv), 0.02) << "dv";
  }
}

TEST(OpsAttentionFp8, BackwardAddsAndAmaxesAreOptional) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  const AttentionShape s = kShapes[1];
  const AttentionFp8Formats formats;
  const auto [in, scale, scales] = random_case(rng, s, formats);
  const Fp8Run<double> once = run_fp8<double>(in, s, scale, formats, scales);
  std::vector<double> out(test::q_size(s)), lse(test::lse_size(s));
  ops::attention_fp8_forward(out.data(), lse.data(), in.q.data(), in.k.data(), in.v.data(), s,
                             scale, formats, scales, nullptr);
  EXPECT_EQ(out, once.out);
  std::vector<double> dq = once.dq, dk = once.dk, dv = once.dv;
  ops::attention_fp8_backward(dq.data(), dk.data(), dv.data(), in.dout.data(), in.q.data(),
                              in.k.data(), in.v.data(), out.data(), lse.data(), s, scale, formats,
                              scales, nullptr);
  for (auto [twice, single] : {std::pair{&dq, &once.dq}, {&dk, &once.dk}, {&dv, &once.dv}}) {
    for (size_t i = 0; i < single->size(); ++i)
      ASSERT_EQ((*twice)[i], 2.0 * (*single)[i]) << i;
  }
}

TEST(OpsAttentionFp8, ScalePolicy) {
  AttentionFp8Formats formats;  // E4M3 forward (max 448), E5M2 backward (max 57344)
  AttentionFp8Scales scales;
  ops::attention_fp8_forward_scales(scales, 3.0f, 0.5f, 7.0f, formats);
  EXPECT_FLOAT_EQ(scales.q, 448.0f / 3.0f);
  EXPECT_FLOAT_EQ(scales.k, 448.0f / 0.5f);
  EXPECT_FLOAT_EQ(scales.v, 448.0f / 7.0f);
  EXPECT_FLOAT_EQ(scales.p, 448.0f);                  // probabilities are at most 1
  EXPECT_FLOAT_EQ(scales.o, 448.0f / (2.0f * 7.0f));  // O from 2 · amax(V)
  EXPECT_EQ(scales.dout, 1.0f);                       // the forward leaves the backward's alone

  AttentionFp8Amaxes previous;
  previous.ds = 1e-3f;
  previous.dq = 2.0f;
  previous.dk = 0.25f;
  previous.dv = 0.0f;
  ops::attention_fp8_backward_scales(scales, 1e-2f, previous, formats);
  const float headroom = ops::kAttentionGradientHeadroom;
  EXPECT_EQ(headroom, 4.0f);
  EXPECT_FLOAT_EQ(scales.dout, 57344.0f / 1e-2f);  // current scaling
  EXPECT_FLOAT_EQ(scales.ds, 57344.0f / (headroom * 1e-3f));
  EXPECT_FLOAT_EQ(scales.dq, 57344.0f / (headroom * 2.0f));
  EXPECT_FLOAT_EQ(scales.dk, 57344.0f / (headroom * 0.25f));
  EXPECT_EQ(scales.dv, 1.0f);                // nothing measured: amax 0 gives scale 1
  EXPECT_FLOAT_EQ(scales.q, 448.0f / 3.0f);  // and the backward leaves the forward's alone

  ops::attention_fp8_forward_scales(scales, 0.0f, 0.0f, 0.0f, formats);
  EXPECT_EQ(scales.q, 1.0f);
  EXPECT_EQ(scales.v, 1.0f);
  EXPECT_EQ(scales.o, 1.0f);

  // Power-of-2 scales: rounded down to a power of two, so amax · scale still fits.
  formats.power_of_2_scales = true;
  ops::attention_fp8_forward_scales(scales, 3.0f, 0.5f, 7.0f, formats);
  EXPECT_EQ(scales.q, 128.0f);  // 448 / 3 = 149.3
  EXPECT_EQ(scales.k, 512.0f);  // 896
  EXPECT_EQ(scales.p, 256.0f);  // 448
  EXPECT_EQ(scales.o, 32.0f);   // 448 / 14 = 32
  ops::attention_fp8_backward_scales(scales, 1e-2f, previous, formats);
  EXPECT_EQ(scales.dq, 4096.0f);  // 57344 / 8 = 7168
  EXPECT_EQ(scales.dv, 1.0f);

  // The recipe's amax epsilon floors the amax.
  formats.power_of_2_scales = false;
  formats.amax_epsilon = 0.5f;
  ops::attention_fp8_forward_scales(scales, 0.0f, 0.1f, 1.0f, formats);
  EXPECT_FLOAT_EQ(scales.q, 448.0f / 0.5f);
  EXPECT_FLOAT_EQ(scales.k, 448.0f / 0.5f);
  EXPECT_FLOAT_EQ(scales.v, 448.0f);
}

// What one backward gives: the gradients (added to zeros) and, from the op, its amaxes.
struct Fp8Gradients {
  std::vector<float> dq, dk, dv;
  AttentionFp8Amaxes amaxes;
};

void expect_same_bits(const Fp8Gradients& actual, const Fp8Gradients& expected) {
  EXPECT_EQ(actual.dq, expected.dq) << "dq";
  EXPECT_EQ(actual.dk, expected.dk) << "dk";
  EXPECT_EQ(actual.dv, expected.dv) << "dv";
}

// ops::AttentionFp8 after a forward on the float copies of `in`, and the op's backward on the
// same tensors with scales given by hand, to replay the class's rule.
struct Fp8AttentionCase {
  AttentionShape s;
  AttentionFp8Formats formats;
  ops::AttentionFp8 attention{formats};
  std::vector<float> q, k, v, out, lse;
  float scale;

  Fp8AttentionCase(const Inputs& in, const AttentionShape& shape)
      : s(shape),
        q(test::convert<float>(in.q)),
        k(test::convert<float>(in.k)),
        v(test::convert<float>(in.v)),
        out(test::q_size(s)),
        lse(test::lse_size(s)),
        scale(static_cast<float>(default_scale(s))) {
    attention.forward(out.data(), lse.data(), q.data(), k.data(), v.data(), s, scale);
  }

  Fp8Gradients zeros() const {
    return {std::vector<float>(test::q_size(s), 0.0f),
            std::vector<float>(test::kv_size(s), 0.0f),
            std::vector<float>(test::kv_size(s), 0.0f),
            {}};
  }
  Fp8Gradients backward(const std::vector<float>& dout) {
    Fp8Gradients g = zeros();
    attention.backward(g.dq.data(), g.dk.data(), g.dv.data(), dout.data(), q.data(), k.data(),
                       v.data(), out.data(), lse.data(), s, scale);
    g.amaxes = attention.gradient_amaxes();
    return g;
  }
  // The op with the forward's scales and the backward's from dO and `previous`.
  Fp8Gradients op_backward(const std::vector<float>& dout, const AttentionFp8Amaxes& previous) {
    AttentionFp8Scales scales = attention.scales();
    ops::attention_fp8_backward_scales(scales, max_abs(test::convert<double>(dout)), previous,
                                       formats);
    Fp8Gradients g = zeros();
    ops::attention_fp8_backward(g.dq.data(), g.dk.data(), g.dv.data(), dout.data(), q.data(),
                                k.data(), v.data(), out.data(), lse.data(), s, scale, formats,
                                scales, &g.amaxes);
    return g;
  }
};

// At a model's first step the zero-initialized projections after attention make dO zero: the
// backward measures only zeros and must measure again next time.
TEST(OpsAttentionFp8Class, AZeroDoutLeavesItUnmeasured) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  const Inputs in = random_inputs(rng, kShapes[2]);
  Fp8AttentionCase c(in, kShapes[2]);
  EXPECT_FALSE(c.attention.measured());
  const Fp8Gradients zero_dout = c.backward(std::vector<float>(test::q_size(c.s), 0.0f));
  EXPECT_FALSE(c.attention.measured());
  expect_same_bits(zero_dout, c.zeros());
  c.backward(test::convert<float>(in.dout));
  EXPECT_TRUE(c.attention.measured());
}

// Gradients so small that scale 1 flushes dS to zero in E5M2 (smallest value 2^-16): dO of
// 1e-6 gives dS of 2e-7 to 4e-7. A single measuring pass then measures dS but dQ and dK as zero,
// and the real pass flushes them too; the second measuring pass finds them. The first backward
// follows the rule of ops/attention_fp8.h bit for bit, and lands near the emulation with ideal
// scales (from the exact amaxes): over 200 seeds at most 0.13 (dq), 0.12 (dk), 0.09 (dv).
TEST(OpsAttentionFp8Class, TheFirstBackwardMeasuresTwice) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  const AttentionShape& s = kShapes[2];
  Inputs in = random_inputs(rng, s);
  in.dout = test::random_values(rng, test::q_size(s), -1e-6, 1e-6);
  const std::vector<float> dout = test::convert<float>(in.dout);
  Fp8AttentionCase c(in, s);
  const Fp8Gradients first = c.backward(dout);
  EXPECT_TRUE(c.attention.measured());

  const Fp8Gradients pass1 = c.op_backward(dout, {});
  ASSERT_GT(pass1.amaxes.ds, 0.0f);

  ASSERT_EQ(pass1.amaxes.dq, 0.0f) << "dS did not underflow at scale 1: dO is not small enough";
  const Fp8Gradients pass2 = c.op_backward(dout, pass1.amaxes);
  ASSERT_GT(pass2.amaxes.dq, 0.0f);
  const Fp8Gradients expected = c.op_backward(dout, pass2.amaxes);
  expect_same_bits(first, expected);
  EXPECT_EQ(first.amaxes.dq, expected.amaxes.dq);

  // Ideal scales: the exact tensors' amaxes × the headroom.
  const double scale = default_scale(s);
  std::vector<double> out, lse(test::lse_size(s)), dq, dk, dv;
  AttentionFp8Amaxes forward_amaxes, exact_amaxes, ideal_amaxes;
  const Emulation exact{s, scale, c.formats, c.attention.scales(), false};
  exact.forward(out, lse, forward_amaxes, in);
  exact.backward(dq, dk, dv, exact_amaxes, in, out, lse);
  AttentionFp8Scales ideal_scales = c.attention.scales();
  ops::attention_fp8_backward_scales(ideal_scales, max_abs(in.dout), exact_amaxes, c.formats);
  const Emulation ideal{s, scale, c.formats, ideal_scales};
  ideal.forward(out, lse, forward_amaxes, in);
  ideal.backward(dq, dk, dv, ideal_amaxes, in, out, lse);
  EXPECT_LT(test::relative_error(first.dq, dq), 0.25) << "dq";
  EXPECT_LT(test::relative_error(first.dk, dk), 0.25) << "dk";
  EXPECT_LT(test::relative_error(first.dv, dv), 0.15) << "dv";
}

// Once measured, a backward scales from the previous one's amaxes and measures no more.
TEST(OpsAttentionFp8Class, LaterBackwardsScaleFromThePreviousOne) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  const AttentionShape& s = kShapes[2];
  const Inputs in = random_inputs(rng, s);
  Fp8AttentionCase c(in, s);
  const Fp8Gradients first = c.backward(test::convert<float>(in.dout));
  ASSERT_TRUE(c.attention.measured());
  const std::vector<float> dout =
      test::convert<float>(test::random_values(rng, test::q_size(s), -2e-3, 2e-3));
  const Fp8Gradients second = c.backward(dout);
  const Fp8Gradients expected = c.op_backward(dout, first.amaxes);
  expect_same_bits(second, expected);
  EXPECT_EQ(second.amaxes.ds, expected.amaxes.ds);
  EXPECT_EQ(second.amaxes.dq, expected.amaxes.dq);
  EXPECT_EQ(second.amaxes.dk, expected.amaxes.dk);
  EXPECT_EQ(second.amaxes.dv, expected.amaxes.dv);
}

}  // namespace
}  // namespace fp8t
