#include "ops/cross_entropy.h"

#include <gtest/gtest.h>

#include <cmath>

#include "core/error.h"
#include "ops/gradient_check.h"

namespace fp8t {
namespace {

using ops::CrossEntropyShape;
using ops::kIgnoreTarget;
using test::TestRng;

// Odd rows, a vocab that is not a multiple of anything, padding columns.
const CrossEntropyShape kShape{7, 11, 16};
const size_t kLogits = static_cast<size_t>(kShape.rows * kShape.padded_vocab);

// Raw logits up to +-40 reach the flat part of the cap (15 tanh(40 / 15) = 14.8).
std::vector<double> random_logits(TestRng& rng) {
  return test::random_values(rng, kLogits, -40.0, 40.0);
}

// Rows 2 and 5 ignored; the rest random real-vocab ids.
std::vector<int32_t> random_targets(TestRng& rng) {
  std::vector<int32_t> targets(static_cast<size_t>(kShape.rows));
  for (int32_t& target : targets)
    target = rng.uniform_int(0, static_cast<int>(kShape.vocab) - 1);
  targets[2] = kIgnoreTarget;
  targets[5] = kIgnoreTarget;
  return targets;
}

// Each row's loss from its definition, in long double: log(sum exp(capped)) - capped[target]
// over the real vocab.
std::vector<long double> reference_losses(const std::vector<double>& logits,
                                          const std::vector<int32_t>& targets) {
  std::vector<long double> losses(targets.size(), 0.0L);
  for (size_t r = 0; r < targets.size(); ++r) {
    if (targets[r] == kIgnoreTarget) continue;
    const auto capped = [&](int64_t j) {
      return 15.0L *
             std::tanh(static_cast<long double>(logits[r * kShape.padded_vocab + j]) / 15.0L);
    };
    long double sum = 0.0L;
    for (int64_t j = 0; j < kShape.vocab; ++j)
      sum += std::exp(capped(j));  // capped logits are at most 15: no overflow
    losses[r] = std::log(sum) - capped(targets[r]);
  }
  return losses;
}

TEST(OpsCrossEntropy, LossMatchesALongDoubleLogSumExp) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  const std::vector<double> logits = random_logits(rng);
  const std::vector<int32_t> targets = random_targets(rng);
  std::vector<double> token_losses(static_cast<size_t>(kShape.rows), -1.0);
  const double loss =
      ops::softcap_cross_entropy(logits.data(), targets.data(), kShape, token_losses.data());
  const std::vector<long double> expected = reference_losses(logits, targets);
  long double sum = 0.0L;
  for (size_t r = 0; r < expected.size(); ++r) {
    sum += expected[r];
    EXPECT_NEAR(token_losses[r], static_cast<double>(expected[r]), 1e-13) << r;
  }
  EXPECT_EQ(token_losses[2], 0.0);  // ignored rows
  EXPECT_EQ(token_losses[5], 0.0);
  EXPECT_NEAR(loss, static_cast<double>(sum / 5.0L), 1e-13);  // mean over the 5 valid rows
  // Without per-token losses, and the logits stay as they were.
  const std::vector<double> before = logits;
  EXPECT_EQ(ops::softcap_cross_entropy(logits.data(), targets.data(), kShape), loss);
  EXPECT_EQ(logits, before);
}

TEST(OpsCrossEntropy, PaddingColumnsDoNotCount) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  std::vector<double> logits = random_logits(rng);
  const std::vector<int32_t> targets = random_targets(rng);
  const double loss = ops::softcap_cross_entropy(logits.data(), targets.data(), kShape);
  for (int64_t r = 0; r < kShape.rows; ++r) {
    for (int64_t j = kShape.vocab; j < kShape.padded_vocab; ++j)
      logits[r * kShape.padded_vocab + j] = 1e3;  // would dominate if counted
  }
  EXPECT_EQ(ops::softcap_cross_entropy(logits.data(), targets.data(), kShape), loss);
}

TEST(OpsCrossEntropy, GradientReplacesTheLogitsAndMatchesFiniteDifferences) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  std::vector<double> logits = random_logits(rng);
  const std::vector<int32_t> targets = random_targets(rng);
  const double dloss = 0.75;
  const auto loss = [&] {
    return dloss * ops::softcap_cross_entropy(logits.data(), targets.data(), kShape);
  };
  std::vector<double> gradient = logits;
  std::vector<double> token_losses(static_cast<size_t>(kShape.rows));
  const double value = ops::softcap_cross_entropy_with_gradient(gradient.data(), targets.data(),
                                                                kShape, dloss, token_losses.data());
  EXPECT_EQ(value, ops::softcap_cross_entropy(logits.data(), targets.data(), kShape));
  test::expect_gradient_matches(gradient, test::numeric_gradient(logits, loss), "logits");
  for (int64_t r = 0; r < kShape.rows; ++r) {
    for (int64_t j = 0; j < kShape.padded_vocab; ++j) {
      const double g = gradient[r * kShape.padded_vocab + j];
      if (targets[r] == kIgnoreTarget || j >= kShape.vocab) {
        EXPECT_EQ(g, 0.0) << r << ", " << j;
      }
    }
  }
}

TEST(OpsCrossEntropy, EveryTargetIgnoredGivesZeroLossAndGradient) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  std::vector<double> logits = random_logits(rng);
  const std::vector<int32_t> targets(static_cast<size_t>(kShape.rows), kIgnoreTarget);
  std::vector<double> token_losses(static_cast<size_t>(kShape.rows), -1.0);
  EXPECT_EQ(ops::softcap_cross_entropy_with_gradient(logits.data(), targets.data(), kShape, 1.0,
                                                     token_losses.data()),
            0.0);
  EXPECT_EQ(logits, std::vector<double>(kLogits, 0.0));
  EXPECT_EQ(token_losses, std::vector<double>(static_cast<size_t>(kShape.rows), 0.0));
}

TEST(OpsCrossEntropy, FloatMatchesDouble) {
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  // Logits of a size the model sees; far out in the cap a target's softmax - 1 cancels in float.
  const std::vector<double> logits = test::random_values(rng, kLogits, -8.0, 8.0);
  const std::vector<int32_t> targets = random_targets(rng);
  std::vector<double> gradient = logits;
  std::vector<double> token_losses(static_cast<size_t>(kShape.rows));
  const double loss = ops::softcap_cross_entropy_with_gradient(gradient.data(), targets.data(),
                                                               kShape, 1.0, token_losses.data());
  std::vector<float> gradient_f = test::convert<float>(logits);
  std::vector<float> token_losses_f(static_cast<size_t>(kShape.rows));
  const double loss_f = ops::softcap_cross_entropy_with_gradient(
      gradient_f.data(), targets.data(), kShape, 1.0f, token_losses_f.data());
  test::expect_float_matches_double(std::vector<double>{loss_f}, {loss}, "loss");
  test::expect_float_matches_double(token_losses_f, token_losses, "token_losses");
  // Each gradient entry is (softmax - onehot) / valid_rows times a factor <= 1, and float
  // rounds softmax - onehot to about 1e-7 of 1, so 1 / valid_rows is the terms' magnitude.
  test::expect_float_matches_double(gradient_f, gradient, "gradient", 1.0 / 5.0);
}

TEST(OpsCrossEntropy, RejectsBadTargetsBeforeWriting) {
  std::vector<double> logits(kLogits, 0.5);
  for (int32_t bad : {-2, static_cast<int32_t>(kShape.vocab)}) {
    std::vector<int32_t> targets(static_cast<size_t>(kShape.rows), 0);
    targets.back() = bad;
    try {
      ops::softcap_cross_entropy_with_gradient(logits.data(), targets.data(), kShape, 1.0);
      ADD_FAILURE() << "no error for target " << bad;
    } catch (const Error& error) {
      EXPECT_NE(std::string(error.what()).find(fmt::format("found {} at row 6", bad)),
                std::string::npos)
          << error.what();
    }
    EXPECT_EQ(logits, std::vector<double>(kLogits, 0.5));
  }
  const std::vector<int32_t> targets(static_cast<size_t>(kShape.rows), 0);
  EXPECT_THROW(
      ops::softcap_cross_entropy(logits.data(), targets.data(), CrossEntropyShape{7, 17, 16}),
      Error);
}

}  // namespace
}  // namespace fp8t
