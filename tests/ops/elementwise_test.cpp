#include "ops/elementwise.h"

#include <gtest/gtest.h>

#include <cmath>

#include "core/error.h"
#include "ops/gradient_check.h"

namespace fp8t {
namespace {

using test::TestRng;
using Gradients = std::vector<std::vector<double>>;

long double sigmoid(long double z) {
  return 1.0L / (1.0L + std::exp(-z));
}

// ---- relu^2 ----

constexpr int64_t kCount = 37;

// Away from 0, where relu^2 has no second derivative and central differences lose accuracy.
std::vector<double> relu_inputs(TestRng& rng) {
  std::vector<double> x = test::random_values(rng, kCount, -2.0, 2.0);
  for (double& value : x) {
    if (std::fabs(value) < 1e-2) value = 0.5;
  }
  return x;
}

TEST(OpsRelu2, ForwardSquaresThePositivePart) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  const std::vector<double> x = relu_inputs(rng);
  std::vector<double> y(kCount);
  ops::relu2_forward(y.data(), x.data(), kCount);
  for (int64_t i = 0; i < kCount; ++i)
    EXPECT_EQ(y[i], x[i] > 0.0 ? x[i] * x[i] : 0.0) << x[i];
}

TEST(OpsRelu2, GradientMatchesFiniteDifferences) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  std::vector<double> x = relu_inputs(rng);
  const std::vector<double> dout = test::random_values(rng, kCount);
  std::vector<double> y(kCount);
  const auto loss = [&] {
    ops::relu2_forward(y.data(), x.data(), kCount);
    return test::weighted_sum(y, dout);
  };
  std::vector<double> dx(kCount, 0.0);
  ops::relu2_backward(dx.data(), dout.data(), x.data(), kCount);
  test::expect_gradient_matches(dx, test::numeric_gradient(x, loss), "x");
}

TEST(OpsRelu2, BackwardAccumulates) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  const std::vector<double> x = relu_inputs(rng);
  const std::vector<double> dout = test::random_values(rng, kCount);
  test::expect_backward_accumulates({kCount}, [&](Gradients& g) {
    ops::relu2_backward(g[0].data(), dout.data(), x.data(), kCount);
  });
}

TEST(OpsRelu2, FloatMatchesDouble) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  const std::vector<double> x = relu_inputs(rng);
  const std::vector<double> dout = test::random_values(rng, kCount);
  std::vector<double> y(kCount), dx(kCount, 0.0);
  ops::relu2_forward(y.data(), x.data(), kCount);
  ops::relu2_backward(dx.data(), dout.data(), x.data(), kCount);
  const std::vector<float> x_f = test::convert<float>(x), dout_f = test::convert<float>(dout);
  std::vector<float> y_f(kCount), dx_f(kCount, 0.0f);
  ops::relu2_forward(y_f.data(), x_f.data(), kCount);
  ops::relu2_backward(dx_f.data(), dout_f.data(), x_f.data(), kCount);
  test::expect_float_matches_double(y_f, y, "y");
  test::expect_float_matches_double(dx_f, dx, "dx");
}

// ---- value-embedding gate ----

// B = 2, T = 7 tokens; x_norm rows longer than the 12 gate channels.
const ops::ValueGateShape kGate{14, 15, 3, 2, 12};
const size_t kGateX = static_cast<size_t>(kGate.tokens * kGate.channels);
const size_t kGateV = static_cast<size_t>(kGate.tokens * kGate.kv_heads * kGate.head_dim);
const size_t kGateW = static_cast<size_t>(kGate.kv_heads * kGate.gate_channels);
const size_t kGateG = static_cast<size_t>(kGate.tokens * kGate.kv_heads);

struct GateInputs {
  std::vector<double> v, x_norm, value_embed, weight, dout;
};

GateInputs gate_inputs(TestRng& rng) {
  return {test::random_values(rng, kGateV), test::random_values(rng, kGateX),
          test::random_values(rng, kGateV), test::random_values(rng, kGateW),
          test::random_values(rng, kGateV)};
}

TEST(OpsValueGate, ForwardAddsTheGatedValueEmbedding) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  const GateInputs in = gate_inputs(rng);
  std::vector<double> v = in.v, gate(kGateG);
  ops::value_gate_forward(v.data(), gate.data(), in.x_norm.data(), in.value_embed.data(),
                          in.weight.data(), kGate);
  for (int64_t n = 0; n < kGate.tokens; ++n) {
    for (int64_t h = 0; h < kGate.kv_heads; ++h) {
      long double z = 0.0L;
      for (int64_t c = 0; c < 12; ++c)
        z += static_cast<long double>(in.x_norm[n * kGate.channels + c]) * in.weight[h * 12 + c];
      const long double expected_gate = 3.0L * sigmoid(z);
      EXPECT_NEAR(gate[n * kGate.kv_heads + h], static_cast<double>(expected_gate), 1e-15);
      for (int64_t d = 0; d < kGate.head_dim; ++d) {
        const int64_t i = (n * kGate.kv_heads + h) * kGate.head_dim + d;
        EXPECT_NEAR(v[i], static_cast<double>(in.v[i] + expected_gate * in.value_embed[i]), 1e-15);
      }
    }
  }
}

TEST(OpsValueGate, GradientMatchesFiniteDifferences) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  GateInputs in = gate_inputs(rng);
  std::vector<double> v(kGateV), gate(kGateG);
  const auto loss = [&] {
    v = in.v;
    ops::value_gate_forward(v.data(), gate.data(), in.x_norm.data(), in.value_embed.data(),
                            in.weight.data(), kGate);
    return test::weighted_sum(v, in.dout);
  };
  loss();
  std::vector<double> dx(kGateX, 0.0), dweight(kGateW, 0.0), dvalue_embed(kGateV, 0.0);
  ops::value_gate_backward(dx.data(), dweight.data(), dvalue_embed.data(), in.dout.data(),
                           in.x_norm.data(), in.value_embed.data(), in.weight.data(), gate.data(),
                           kGate);
  test::expect_gradient_matches(dx, test::numeric_gradient(in.x_norm, loss), "x_norm");
  test::expect_gradient_matches(dweight, test::numeric_gradient(in.weight, loss), "gate_weight");
  test::expect_gradient_matches(dvalue_embed, test::numeric_gradient(in.value_embed, loss),
                                "value_embed");
  // v before the gate: the gradient is dout itself, which the caller passes on.
  test::expect_gradient_matches(in.dout, test::numeric_gradient(in.v, loss), "v");
  for (int64_t n = 0; n < kGate.tokens; ++n) {
    for (int64_t c = kGate.gate_channels; c < kGate.channels; ++c)
      EXPECT_EQ(dx[n * kGate.channels + c], 0.0) << "channel " << c << " is not read";
  }
}

TEST(OpsValueGate, BackwardAccumulates) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  const GateInputs in = gate_inputs(rng);
  std::vector<double> v = in.v, gate(kGateG);
  ops::value_gate_forward(v.data(), gate.data(), in.x_norm.data(), in.value_embed.data(),
                          in.weight.data(), kGate);
  test::expect_backward_accumulates({kGateX, kGateW, kGateV}, [&](Gradients& g) {
    ops::value_gate_backward(g[0].data(), g[1].data(), g[2].data(), in.dout.data(),
                             in.x_norm.data(), in.value_embed.data(), in.weight.data(), gate.data(),
                             kGate);
  });
}

TEST(OpsValueGate, FloatMatchesDouble) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  const GateInputs in = gate_inputs(rng);
  std::vector<double> v = in.v, gate(kGateG);
  std::vector<double> dx(kGateX, 0.0), dweight(kGateW, 0.0), dvalue_embed(kGateV, 0.0);
  ops::value_gate_forward(v.data(), gate.data(), in.x_norm.data(), in.value_embed.data(),
                          in.weight.data(), kGate);
  ops::value_gate_backward(dx.data(), dweight.data(), dvalue_embed.data(), in.dout.data(),
                           in.x_norm.data(), in.value_embed.data(), in.weight.data(), gate.data(),
                           kGate);
  std::vector<float> v_f = test::convert<float>(in.v), gate_f(kGateG);
  const std::vector<float> x_f = test::convert<float>(in.x_norm),
                           ve_f = test::convert<float>(in.value_embed),
                           w_f = test::convert<float>(in.weight),
                           dout_f = test::convert<float>(in.dout);
  std::vector<float> dx_f(kGateX, 0.0f), dweight_f(kGateW, 0.0f), dvalue_embed_f(kGateV, 0.0f);
  ops::value_gate_forward(v_f.data(), gate_f.data(), x_f.data(), ve_f.data(), w_f.data(), kGate);
  ops::value_gate_backward(dx_f.data(), dweight_f.data(), dvalue_embed_f.data(), dout_f.data(),
                           x_f.data(), ve_f.data(), w_f.data(), gate_f.data(), kGate);
  test::expect_float_matches_double(v_f, v, "v");
  test::expect_float_matches_double(gate_f, gate, "gate");
  test::expect_float_matches_double(dx_f, dx, "dx_norm");
  test::expect_float_matches_double(dweight_f, dweight, "dgate_weight");
  test::expect_float_matches_double(dvalue_embed_f, dvalue_embed, "dvalue_embed");
}

TEST(OpsValueGate, RejectsMoreGateChannelsThanChannels) {
  std::vector<double> buffer(64);
  double* p = buffer.data();
  const ops::ValueGateShape shape{1, 8, 1, 2, 12};
  EXPECT_THROW(ops::value_gate_forward(p, p, p, p, p, shape), Error);
  EXPECT_THROW(ops::value_gate_backward(p, p, p, p, p, p, p, p, shape), Error);
}

// ---- smear ----

// Rows longer than the 24 gate channels.
const ops::SmearShape kSmear{2, 5, 26, 24};
const size_t kSmearX = static_cast<size_t>(kSmear.batch * kSmear.seq_len * kSmear.channels);
const size_t kSmearG = static_cast<size_t>(kSmear.batch * kSmear.seq_len);
const size_t kSmearW = static_cast<size_t>(kSmear.gate_channels);

struct SmearInputs {
  std::vector<double> x, weight, lambda, dout;
};

SmearInputs smear_inputs(TestRng& rng) {
  return {test::random_values(rng, kSmearX), test::random_values(rng, kSmearW, -0.5, 0.5),
          test::random_values(rng, 1, 0.5, 1.5), test::random_values(rng, kSmearX)};
}

TEST(OpsSmear, ForwardMixesThePreviousTokenIn) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  const SmearInputs in = smear_inputs(rng);
  std::vector<double> y(kSmearX), gate(kSmearG, -1.0);
  ops::smear_forward(y.data(), gate.data(), in.x.data(), in.weight.data(), in.lambda[0], kSmear);
  const int64_t C = kSmear.channels;
  for (int64_t b = 0; b < kSmear.batch; ++b) {
    const int64_t row0 = b * kSmear.seq_len;
    EXPECT_EQ(gate[row0], 0.0);
    for (int64_t c = 0; c < C; ++c)
      EXPECT_EQ(y[row0 * C + c], in.x[row0 * C + c]);  // t = 0 untouched
    for (int64_t t = 1; t < kSmear.seq_len; ++t) {
      const int64_t row = row0 + t;
      long double z = 0.0L;
      for (int64_t c = 0; c < 24; ++c)
        z += static_cast<long double>(in.x[row * C + c]) * in.weight[c];
      EXPECT_NEAR(gate[row], static_cast<double>(sigmoid(z)), 1e-15);
      const long double mix = in.lambda[0] * sigmoid(z);
      for (int64_t c = 0; c < C; ++c) {
        EXPECT_NEAR(y[row * C + c],
                    static_cast<double>(in.x[row * C + c] + mix * in.x[(row - 1) * C + c]), 1e-15);
      }
    }
  }
  std::vector<double> in_place = in.x;
  ops::smear_forward(in_place.data(), gate.data(), in_place.data(), in.weight.data(), in.lambda[0],
                     kSmear);
  EXPECT_EQ(in_place, y);
}

TEST(OpsSmear, GradientMatchesFiniteDifferences) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  SmearInputs in = smear_inputs(rng);
  std::vector<double> y(kSmearX), gate(kSmearG);
  const auto loss = [&] {
    ops::smear_forward(y.data(), gate.data(), in.x.data(), in.weight.data(), in.lambda[0], kSmear);
    return test::weighted_sum(y, in.dout);
  };
  loss();
  std::vector<double> dx(kSmearX, 0.0), dweight(kSmearW, 0.0), dlambda(1, 0.0);
  ops::smear_backward(dx.data(), dweight.data(), dlambda.data(), in.dout.data(), in.x.data(),
                      gate.data(), in.weight.data(), in.lambda[0], kSmear);
  test::expect_gradient_matches(dx, test::numeric_gradient(in.x, loss), "x");
  test::expect_gradient_matches(dweight, test::numeric_gradient(in.weight, loss), "gate_weight");
  test::expect_gradient_matches(dlambda, test::numeric_gradient(in.lambda, loss), "lambda");
}

TEST(OpsSmear, BackwardAccumulates) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  const SmearInputs in = smear_inputs(rng);
  std::vector<double> y(kSmearX), gate(kSmearG);
  ops::smear_forward(y.data(), gate.data(), in.x.data(), in.weight.data(), in.lambda[0], kSmear);
  test::expect_backward_accumulates({kSmearX, kSmearW, 1}, [&](Gradients& g) {
    ops::smear_backward(g[0].data(), g[1].data(), g[2].data(), in.dout.data(), in.x.data(),
                        gate.data(), in.weight.data(), in.lambda[0], kSmear);
  });
}

TEST(OpsSmear, FloatMatchesDouble) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  const SmearInputs in = smear_inputs(rng);
  std::vector<double> y(kSmearX), gate(kSmearG);
  std::vector<double> dx(kSmearX, 0.0), dweight(kSmearW, 0.0), dlambda(1, 0.0);
  ops::smear_forward(y.data(), gate.data(), in.x.data(), in.weight.data(), in.lambda[0], kSmear);
  ops::smear_backward(dx.data(), dweight.data(), dlambda.data(), in.dout.data(), in.x.data(),
                      gate.data(), in.weight.data(), in.lambda[0], kSmear);
  const std::vector<float> x_f = test::convert<float>(in.x), w_f = test::convert<float>(in.weight),
                           dout_f = test::convert<float>(in.dout);
  const float lambda_f = static_cast<float>(in.lambda[0]);
  std::vector<float> y_f(kSmearX), gate_f(kSmearG);
  std::vector<float> dx_f(kSmearX, 0.0f), dweight_f(kSmearW, 0.0f), dlambda_f(1, 0.0f);
  ops::smear_forward(y_f.data(), gate_f.data(), x_f.data(), w_f.data(), lambda_f, kSmear);
  ops::smear_backward(dx_f.data(), dweight_f.data(), dlambda_f.data(), dout_f.data(), x_f.data(),
                      gate_f.data(), w_f.data(), lambda_f, kSmear);
  test::expect_float_matches_double(y_f, y, "y");
  test::expect_float_matches_double(gate_f, gate, "gate");
  test::expect_float_matches_double(dx_f, dx, "dx");
  test::expect_float_matches_double(dweight_f, dweight, "dgate_weight");
  double terms_magnitude = 0.0;  // bounds sum over t of gate * |dout[t] . x[t - 1]|
  for (size_t i = 0; i < kSmearX; ++i)
    terms_magnitude += std::fabs(in.dout[i] * in.x[i]);
  test::expect_float_matches_double(dlambda_f, dlambda, "dsmear_lambda", terms_magnitude);
}

// ---- residual mix, scale, backout ----

TEST(OpsResidualMix, ForwardAndGradients) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  std::vector<double> x = test::random_values(rng, kCount), x0 = test::random_values(rng, kCount);
  // Away from 0: a tiny x0_lambda would make all of dx0 tiny, down in the numeric noise.
  std::vector<double> lambdas = test::random_values(rng, 2, 0.2, 1.5);
  const std::vector<double> dout = test::random_values(rng, kCount);
  std::vector<double> y(kCount);
  const auto loss = [&] {
    ops::residual_mix_forward(y.data(), x.data(), x0.data(), lambdas[0], lambdas[1], kCount);
    return test::weighted_sum(y, dout);
  };
  loss();
  for (int64_t i = 0; i < kCount; ++i)
    EXPECT_DOUBLE_EQ(y[i], lambdas[0] * x[i] + lambdas[1] * x0[i]);
  std::vector<double> in_place = x;
  ops::residual_mix_forward(in_place.data(), in_place.data(), x0.data(), lambdas[0], lambdas[1],
                            kCount);
  EXPECT_EQ(in_place, y);

  std::vector<double> dx(kCount, 0.0), dx0(kCount, 0.0), dresid(1, 0.0), dx0_lambda(1, 0.0);
  ops::residual_mix_backward(dx.data(), dx0.data(), dresid.data(), dx0_lambda.data(), dout.data(),
                             x.data(), x0.data(), lambdas[0], lambdas[1], kCount);
  test::expect_gradient_matches(dx, test::numeric_gradient(x, loss), "x");
  test::expect_gradient_matches(dx0, test::numeric_gradient(x0, loss), "x0");
  const std::vector<double> dlambdas = {dresid[0], dx0_lambda[0]};
  test::expect_gradient_matches(dlambdas, test::numeric_gradient(lambdas, loss), "lambdas");

  test::expect_backward_accumulates({kCount, kCount, 1, 1}, [&](Gradients& g) {
    ops::residual_mix_backward(g[0].data(), g[1].data(), g[2].data(), g[3].data(), dout.data(),
                               x.data(), x0.data(), lambdas[0], lambdas[1], kCount);
  });
}

TEST(OpsResidualMix, FloatMatchesDouble) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  const std::vector<double> x = test::random_values(rng, kCount),
                            x0 = test::random_values(rng, kCount),
                            dout = test::random_values(rng, kCount);
  const float a = 1.15f, b = 0.2f;
  std::vector<double> y(kCount), dx(kCount, 0.0), dx0(kCount, 0.0), dl(2, 0.0);
  ops::residual_mix_forward(y.data(), x.data(), x0.data(), a, b, kCount);
  ops::residual_mix_backward(dx.data(), dx0.data(), &dl[0], &dl[1], dout.data(), x.data(),
                             x0.data(), a, b, kCount);
  const std::vector<float> x_f = test::convert<float>(x), x0_f = test::convert<float>(x0),
                           dout_f = test::convert<float>(dout);
  std::vector<float> y_f(kCount), dx_f(kCount, 0.0f), dx0_f(kCount, 0.0f), dl_f(2, 0.0f);
  ops::residual_mix_forward(y_f.data(), x_f.data(), x0_f.data(), a, b, kCount);
  ops::residual_mix_backward(dx_f.data(), dx0_f.data(), &dl_f[0], &dl_f[1], dout_f.data(),
                             x_f.data(), x0_f.data(), a, b, kCount);
  test::expect_float_matches_double(y_f, y, "y");
  test::expect_float_matches_double(dx_f, dx, "dx");
  test::expect_float_matches_double(dx0_f, dx0, "dx0");
  test::expect_float_matches_double(dl_f, dl, "dlambdas");
}

TEST(OpsBackout, ForwardAndGradients) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  std::vector<double> x = test::random_values(rng, kCount);
  std::vector<double> x_backout = test::random_values(rng, kCount);
  std::vector<double> lambda = {0.2};
  const std::vector<double> dout = test::random_values(rng, kCount);
  std::vector<double> y(kCount);
  const auto loss = [&] {
    ops::backout_forward(y.data(), x.data(), x_backout.data(), lambda[0], kCount);
    return test::weighted_sum(y, dout);
  };
  loss();
  for (int64_t i = 0; i < kCount; ++i)
    EXPECT_DOUBLE_EQ(y[i], x[i] - 0.2 * x_backout[i]);
  std::vector<double> dx(kCount, 0.0), dx_backout(kCount, 0.0), dlambda(1, 0.0);
  ops::backout_backward(dx.data(), dx_backout.data(), dlambda.data(), dout.data(), x_backout.data(),
                        lambda[0], kCount);
  test::expect_gradient_matches(dx, test::numeric_gradient(x, loss), "x");
  test::expect_gradient_matches(dx_backout, test::numeric_gradient(x_backout, loss), "x_backout");
  test::expect_gradient_matches(dlambda, test::numeric_gradient(lambda, loss), "lambda");
  test::expect_backward_accumulates({kCount, kCount, 1}, [&](Gradients& g) {
    ops::backout_backward(g[0].data(), g[1].data(), g[2].data(), dout.data(), x_backout.data(),
                          lambda[0], kCount);
  });
  const std::vector<float> x_f = test::convert<float>(x), xb_f = test::convert<float>(x_backout),
                           dout_f = test::convert<float>(dout);
  std::vector<float> y_f(kCount), dx_f(kCount, 0.0f), dxb_f(kCount, 0.0f), dlambda_f(1, 0.0f);
  ops::backout_forward(y_f.data(), x_f.data(), xb_f.data(), 0.2f, kCount);
  ops::backout_backward(dx_f.data(), dxb_f.data(), dlambda_f.data(), dout_f.data(), xb_f.data(),
                        0.2f, kCount);
  // The double run used the double 0.2; the float one rounds it (relative 1.5e-8).
  test::expect_float_matches_double(y_f, y, "y");
  test::expect_float_matches_double(dx_f, dx, "dx");
  test::expect_float_matches_double(dxb_f, dx_backout, "dx_backout");
  test::expect_float_matches_double(dlambda_f, dlambda, "dlambda");
}

TEST(OpsElementwise, RejectsNegativeCounts) {
  std::vector<double> buffer(4);
  double* p = buffer.data();
  EXPECT_THROW(ops::relu2_forward(p, p, -1), Error);
  EXPECT_THROW(ops::residual_mix_forward(p, p, p, 1.0, 1.0, -1), Error);
  EXPECT_THROW(ops::backout_backward(p, p, p, p, p, 1.0, -1), Error);
}

}  // namespace
}  // namespace fp8t
