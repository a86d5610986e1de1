// The verdict of `fp8train compare`: a run's loss against the reference's at the last step both
// logged (the reference interpolated between its steps), raw and smoothed, against the
// tolerance.
#include "train/run_comparison.h"

#include <cstdint>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "test_files.h"

namespace fp8t::train {
namespace {

io::RunCurve curve(std::string name, std::vector<int64_t> steps, std::vector<double> values) {
  return {std::move(name), std::move(steps), std::move(values)};
}

TEST(RunComparison, SmoothedLossDecidesAgainstTheTolerance) {
  const io::RunCurve reference = curve("bf16", {1, 2, 3, 4}, {4.0, 3.0, 2.0, 2.0});
  // +3 % at the end, but a spike of +30 % at step 3 that the 2-value average halves.
  const io::RunCurve close = curve("fp8", {1, 2, 3, 4}, {4.0, 3.0, 2.6, 2.06});
  const std::vector<LossComparison> results = compare_losses({reference, close}, 2, 5.0);
  ASSERT_EQ(results.size(), 1u);
  const LossComparison& c = results[0];
  EXPECT_EQ(c.name, "fp8");
  EXPECT_EQ(c.step, 4);
  EXPECT_DOUBLE_EQ(c.loss, 2.06);
  EXPECT_DOUBLE_EQ(c.reference_loss, 2.0);
  EXPECT_NEAR(c.final_percent, 3.0, 1e-9);
  EXPECT_NEAR(c.smoothed_percent, 100.0 * ((2.6 + 2.06) / 2 / 2.0 - 1.0), 1e-9);  // +16.5 %
  EXPECT_FALSE(c.within);
  EXPECT_TRUE(compare_losses({reference, close}, 1, 5.0)[0].within);  // unsmoothed: +3 %
  EXPECT_TRUE(test::Contains(verdict_line(c, "bf16", 2, 5.0),
                             "verdict: fp8 against bf16 at step 4: final loss +3.00 % (2.0600 "
                             "against 2.0000), smoothed (2 values) +16.50 %: NOT within 5 %"));
}

TEST(RunComparison, TheReferenceIsInterpolatedAndALongerRunIsCutToIt) {
  const io::RunCurve reference = curve("bf16", {10, 20}, {3.0, 2.0});
  // Steps 15 (between the reference's) and 30 (beyond them): 15 is the last common one.
  const io::RunCurve run = curve("fp8", {15, 30}, {2.5, 1.0});
  const LossComparison c = compare_losses({reference, run}, 1, 1.0)[0];
  EXPECT_EQ(c.step, 15);
  EXPECT_DOUBLE_EQ(c.reference_loss, 2.5);
  EXPECT_DOUBLE_EQ(c.final_percent, 0.0);
  EXPECT_TRUE(c.within);
}

TEST(RunComparison, NoStepInCommonIsNeverWithin) {
  const LossComparison c = compare_losses(
      {curve("bf16", {1, 2}, {3.0, 2.0}), curve("late", {50, 60}, {2.0, 2.0})}, 1, 100.0)[0];
  EXPECT_EQ(c.step, 0);
  EXPECT_FALSE(c.within);
  EXPECT_TRUE(test::Contains(verdict_line(c, "bf16", 1, 100.0),
                             "late against bf16: no step in common: NOT within 100 %"));
}

}  // namespace
}  // namespace fp8t::train
