#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "core/error.h"
#include "optim/adamw.h"
#include "optim/clip.h"
#include "optim/schedule.h"

namespace fp8t::optim {
namespace {

// AdamW written out in double from PyTorch's documented update, step by step.
struct ReferenceAdamW {
  double p, m = 0, v = 0;
  void step(double g, int64_t t, const AdamWHyperparameters& h) {
    p *= 1 - h.lr * h.weight_decay;
    m = h.beta1 * m + (1 - h.beta1) * g;
    v = h.beta2 * v + (1 - h.beta2) * g * g;
    const double m_hat = m / (1 - std::pow(h.beta1, double(t)));
    const double v_hat = v / (1 - std::pow(h.beta2, double(t)));
    p -= h.lr * m_hat / (std::sqrt(v_hat) + h.eps);
  }
};

TEST(OptimAdamW, FollowsTheReferenceOverManySteps) {
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 generator(seed);
  std::normal_distribution<float> normal;
  const AdamWHyperparameters hyper{0.01, 0.8, 0.95, 1e-10, 0.05};  // nanochat-like groups
  constexpr int kCount = 33;
  std::vector<float> param(kCount), grad(kCount), m(kCount, 0.0f), v(kCount, 0.0f);
  std::vector<ReferenceAdamW> reference;
  for (float& p : param) {
    p = normal(generator);
    reference.push_back({p});
  }
  for (int64_t t = 1; t <= 50; ++t) {
    for (int i = 0; i < kCount; ++i)
      grad[i] = normal(generator);
    adamw_step(param.data(), grad.data(), m.data(), v.data(), kCount, t, hyper);
    for (int i = 0; i < kCount; ++i)
      reference[i].step(grad[i], t, hyper);
  }
  for (int i = 0; i < kCount; ++i)
    EXPECT_NEAR(param[i], reference[i].p, 1e-5 * (1 + std::abs(reference[i].p))) << i;
}

TEST(OptimAdamW, FirstStepMovesEachParameterByAboutLr) {
  // With bias correction the first update is lr * g / (|g| + eps): a step of lr against the sign.
  std::vector<float> param = {1.0f, -2.0f}, grad = {3.0f, -0.5f}, m(2, 0.0f), v(2, 0.0f);
  adamw_step(param.data(), grad.data(), m.data(), v.data(), 2, 1, {0.1, 0.9, 0.999, 1e-8, 0.0});
  EXPECT_NEAR(param[0], 0.9f, 1e-6);
  EXPECT_NEAR(param[1], -1.9f, 1e-6);
}

TEST(OptimAdamW, WeightDecayIsDecoupled) {
  // A zero gradient still shrinks the parameter by lr * wd, and nothing else moves it.
  std::vector<float> param = {2.0f}, grad = {0.0f}, m(1, 0.0f), v(1, 0.0f);
  adamw_step(param.data(), grad.data(), m.data(), v.data(), 1, 1, {0.1, 0.9, 0.999, 1e-8, 0.5});
  EXPECT_FLOAT_EQ(param[0], 2.0f * (1.0f - 0.05f));
}

TEST(OptimAdamW, RejectsBadArguments) {
  float x = 0;
  EXPECT_THROW(adamw_step(&x, &x, &x, &x, 1, 0, {}), Error);
  EXPECT_THROW(adamw_step(&x, &x, &x, &x, 1, 1, {0.1, 1.0, 0.9, 1e-8, 0}), Error);
}

TEST(OptimAdamWOptimizer, DecaysMatricesOnlyAndNamesItsState) {
  // Zero gradients: only the decay moves a parameter, and only the matrix's.
  AdamWOptimizer optimizer({{"w", {2, 2}}, {"b", {2}}}, {0.1, 0.9, 0.999, 1e-8, 0.5});
  std::vector<float> w(4, 2.0f), b(2, 2.0f), zeros(4, 0.0f);
  const std::vector<float*> parameters = {w.data(), b.data()};
  const std::vector<const float*> gradients = {zeros.data(), zeros.data()};
  optimizer.step(parameters, gradients, 0.5);
  EXPECT_DOUBLE_EQ(optimizer.lr(), 0.05);
  EXPECT_FLOAT_EQ(w[0], 2.0f * (1.0f - 0.025f));
  EXPECT_EQ(b[0], 2.0f);
  std::vector<std::string> names;
  for (const NamedTensor& buffer : optimizer.state())
    names.push_back(buffer.name);
  EXPECT_EQ(names, (std::vector<std::string>{"w.exp_avg", "w.exp_avg_sq", "b.exp_avg",
                                             "b.exp_avg_sq", "optimizer.step"}));
  EXPECT_EQ(*optimizer.state().back().view.data<int64_t>(), 1);
}

// ZeRO-1 over 3 ranks: each tensor is updated by one rank only, whose values and moments are
// the unsharded optimizer's bit for bit; the other ranks leave the tensor and its moments alone.
TEST(OptimAdamWOptimizer, ShardedStepsUpdateEachTensorOnItsOwnerOnly) {
  const std::vector<AdamWOptimizer::Parameter> shapes = {
      {"a", {8, 4}}, {"b", {4}}, {"c", {16, 4}}, {"d", {3}}, {"e", {2, 2}}};
  const AdamWHyperparameters hyper{0.1, 0.9, 0.999, 1e-8, 0.5};
  std::mt19937 generator(11);
  std::normal_distribution<float> normal;
  std::vector<std::vector<float>> start, grads;
  for (const auto& parameter : shapes) {
    const auto numel = static_cast<size_t>(std::accumulate(
        parameter.shape.begin(), parameter.shape.end(), int64_t{1}, std::multiplies<>()));
    start.emplace_back(numel);
    grads.emplace_back(numel);
    for (size_t i = 0; i < numel; ++i) {
      start.back()[i] = normal(generator);
      grads.back()[i] = normal(generator);
    }
  }
  const auto run = [&](AdamWOptimizer& optimizer) {
    std::vector<std::vector<float>> params = start;
    std::vector<float*> p;
    std::vector<const float*> g;
    for (size_t i = 0; i < params.size(); ++i) {
      p.push_back(params[i].data());
      g.push_back(grads[i].data());
    }
    for (int step = 0; step < 3; ++step)
      optimizer.step(p, g, 1.0 - 0.1 * step);
    return params;
  };
  AdamWOptimizer whole(shapes, hyper);
  const std::vector<std::vector<float>> expected = run(whole);
  const std::vector<NamedTensor> expected_state = whole.state();
  std::vector<int> owned(shapes.size(), 0);
  for (int rank = 0; rank < 3; ++rank) {
    AdamWOptimizer part(shapes, hyper, rank, 3);
    const std::vector<std::vector<float>> params = run(part);
    const std::vector<NamedTensor> state = part.state();
    for (size_t i = 0; i < shapes.size(); ++i) {
      const bool owns = part.shard().owns(shapes[i].name);
      owned[i] += owns ? 1 : 0;
      EXPECT_EQ(params[i], owns ? expected[i] : start[i]) << shapes[i].name << ", rank " << rank;
      for (const size_t b : {2 * i, 2 * i + 1}) {
        const float* values = state[b].view.data<float>();
        const float* reference = expected_state[b].view.data<float>();
        for (int64_t k = 0; k < state[b].view.numel(); ++k)
          EXPECT_EQ(values[k], owns ? reference[k] : 0.0f) << state[b].name << ", rank " << rank;
      }
    }
  }
  for (size_t i = 0; i < shapes.size(); ++i)
    EXPECT_EQ(owned[i], 1) << shapes[i].name;
}

TEST(OptimSchedule, NanochatWarmupConstantWarmdown) {
  const LrSchedule schedule{LrDecayStyle::Nanochat, 100, 10, 0.5, 0.05, 0.0};
  EXPECT_DOUBLE_EQ(lr_multiplier(schedule, 0), 0.1);
  EXPECT_DOUBLE_EQ(lr_multiplier(schedule, 9), 1.0);
  EXPECT_DOUBLE_EQ(lr_multiplier(schedule, 50), 1.0);  // warmdown starts after 100 - 50
  EXPECT_DOUBLE_EQ(lr_multiplier(schedule, 75), 0.5 + 0.5 * 0.05);
  EXPECT_DOUBLE_EQ(lr_multiplier(schedule, 100), 0.05);
}

TEST(OptimSchedule, CosineEndsAtMinAndConstantStays) {
  const LrSchedule cosine{LrDecayStyle::Cosine, 101, 0, 0.0, 0.0, 0.1};
  EXPECT_DOUBLE_EQ(lr_multiplier(cosine, 0), 1.0);
  EXPECT_NEAR(lr_multiplier(cosine, 50), 0.55, 1e-12);
  EXPECT_NEAR(lr_multiplier(cosine, 100), 0.1, 1e-12);
  const LrSchedule constant{LrDecayStyle::Constant, 10, 2, 0.0, 0.0, 0.0};
  EXPECT_DOUBLE_EQ(lr_multiplier(constant, 0), 0.5);
  EXPECT_DOUBLE_EQ(lr_multiplier(constant, 9), 1.0);
}

TEST(OptimSchedule, MuonMomentumFollowsNanochat) {
  EXPECT_DOUBLE_EQ(muon_momentum(0, 10000, 0.65), 0.85);
  EXPECT_DOUBLE_EQ(muon_momentum(200, 10000, 0.65), 0.91);
  EXPECT_DOUBLE_EQ(muon_momentum(1000, 10000, 0.65), 0.97);
  EXPECT_NEAR(muon_momentum(3500 + 3250, 10000, 0.65), 0.935, 1e-12);  // halfway into warmdown
}

TEST(OptimSchedule, ValidateNamesTheKey) {
  LrSchedule schedule;
  schedule.total_iters = 0;
  try {
    schedule.validate();
    FAIL() << "train_iters 0 must be rejected";
  } catch (const ConfigError& error) {
    EXPECT_NE(std::string(error.what()).find("train_iters"), std::string::npos);
  }
  schedule.total_iters = 10;
  schedule.warmdown_ratio = 1.5;
  EXPECT_THROW(schedule.validate(), ConfigError);
}

TEST(OptimClip, ScalesToTheMaxNormOnlyAboveIt) {
  std::vector<float> a = {3.0f, 0.0f}, b = {4.0f};
  const GradientSpan gradients[] = {{a.data(), 2}, {b.data(), 1}};
  EXPECT_DOUBLE_EQ(global_norm(gradients), 5.0);
  EXPECT_DOUBLE_EQ(clip_gradients(gradients, 10.0), 5.0);
  EXPECT_EQ(a[0], 3.0f);  // under the limit: untouched
  EXPECT_DOUBLE_EQ(clip_gradients(gradients, 1.0), 5.0);
  EXPECT_NEAR(global_norm(gradients), 1.0, 1e-6);
  EXPECT_NEAR(b[0] / a[0], 4.0 / 3.0, 1e-6);  // direction kept
}

TEST(OptimClip, NonFiniteNormLeavesGradientsAlone) {
  std::vector<float> a = {1.0f, std::numeric_limits<float>::quiet_NaN(), 2.0f};
  const GradientSpan gradients[] = {{a.data(), 3}};
  EXPECT_TRUE(std::isnan(clip_gradients(gradients, 1.0)));
  EXPECT_EQ(a[0], 1.0f);
  EXPECT_EQ(a[2], 2.0f);
  EXPECT_THROW(clip_gradients(gradients, 0.0), Error);
}

}  // namespace
}  // namespace fp8t::optim
