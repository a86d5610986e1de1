// The verdict of `fp8train compare`: a run's loss against the reference's at the last step both
// logged (the reference interpolated between its steps), raw and smoothed, against the
// tolerance.
#include "train/run_comparison.h"

#include <cstdint>
#include <filesystem>
#include <regex>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "io/base64.h"
#include "io/files.h"
#include "io/png_reader.h"
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

// The embedded pictures of a page: their alt texts and PNG bytes.
std::vector<std::pair<std::string, std::string>> pictures(const std::string& html) {
  const std::regex image("<img alt=\"([^\"]*)\" src=\"data:image/png;base64,([^\"]*)\">");
  std::vector<std::pair<std::string, std::string>> found;
  for (auto it = std::sregex_iterator(html.begin(), html.end(), image);
       it != std::sregex_iterator(); ++it) {
    std::string png;
    EXPECT_TRUE(io::base64_decode((*it)[2].str(), png));
    found.emplace_back((*it)[1].str(), png);
  }
  return found;
}

std::string health_line(int step, const std::string& layer, const std::string& operand,
                        double saturated, double underflow, double amax) {
  return fmt::format(
      "{{\"step\": {}, \"layer\": \"{}\", \"operand\": \"{}\", \"amax\": {}, \"scale\": 1.0, "
      "\"elements\": 1000, \"saturated\": 0, \"underflow\": 0, \"saturated_fraction\": {}, "
      "\"underflow_fraction\": {}}}\n",
      step, layer, operand, amax, saturated, underflow);
}

TEST(RunComparison, TheReportHasAnFp8HealthSectionForEachRunThatLoggedOne) {
  const test::TempFolder folder;
  for (const char* run : {"bf16", "fp8"}) {
    std::filesystem::create_directories(folder / run);
    io::write_file_atomically(folder / run / "metrics.jsonl",
                              "{\"step\":1,\"loss\":5.0}\n{\"step\":2,\"loss\":4.0}\n");
  }
  const std::vector<std::filesystem::path> runs = {folder / "bf16", folder / "fp8"};
  const ComparisonReport without = compare_runs(runs, 1, 5.0);
  EXPECT_TRUE(test::Contains(without.html, "FP8 health: no run logged fp8_health.jsonl"));

  std::string health;
  for (const int step : {1, 2}) {
    for (const char* layer : {"transformer.h.0.attn.c_q", "transformer.h.0.mlp.c_fc"}) {
      for (const char* operand : {"input", "weight", "grad_output"}) {
        const bool worst = step == 2 && std::string(layer).ends_with("c_fc");
        health += health_line(step, layer, operand,
                              worst && std::string(operand) == "grad_output" ? 0.25 : 0.0,
                              worst && std::string(operand) == "input" ? 0.03 : 1e-5, 448.0);
      }
    }
  }
  io::write_file_atomically(folder / "fp8" / "fp8_health.jsonl", health);
  const ComparisonReport report = compare_runs(runs, 1, 5.0);
  EXPECT_TRUE(test::Contains(report.html, "<h2>FP8 health: fp8</h2>"));
  EXPECT_FALSE(test::Contains(report.html, "FP8 health: bf16"));
  EXPECT_FALSE(test::Contains(report.html, "no run logged"));
  EXPECT_TRUE(test::Contains(
      report.html,
      "<p>highest saturation: transformer.h.0.mlp.c_fc grad_output at step 2, 0.25 of its values "
      "(amax 448); highest underflow: transformer.h.0.mlp.c_fc input at step 2, 0.03 of its "
      "values (amax 448).</p>"));

  const auto before = pictures(without.html), after = pictures(report.html);
  ASSERT_EQ(after.size(), before.size() + 2);
  for (size_t i = 0; i < 2; ++i) {
    const auto& [alt, png] = after[before.size() + i];
    EXPECT_TRUE(test::Contains(alt, i == 0
                                        ? "fp8: underflow to zero, fraction of the tensor's values"
                                        : "fp8: saturated at the FP8 maximum"));
    io::write_file_atomically(folder / "map.png", png);
    const test::ReadPicture picture = test::read_png(folder / "map.png");
    EXPECT_EQ(picture.width, 960);
    EXPECT_GT(picture.height, 150);  // title, legend, 6 labelled rows, steps
    EXPECT_LT(picture.height, 400);
  }
  // The summary and the heat-maps follow the section's heading.
  EXPECT_LT(report.html.find("<h2>FP8 health: fp8</h2>"),
            report.html.find("<p>highest saturation"));
  EXPECT_LT(report.html.find("<p>highest saturation"), report.html.find("alt=\"fp8: underflow"));
}

TEST(RunComparison, ABadFp8HealthLineNamesItsFileAndLine) {
  const test::TempFolder folder;
  for (const char* run : {"bf16", "fp8"}) {
    std::filesystem::create_directories(folder / run);
    io::write_file_atomically(folder / run / "metrics.jsonl", "{\"step\":1,\"loss\":5.0}\n");
  }
  io::write_file_atomically(folder / "fp8" / "fp8_health.jsonl",
                            health_line(1, "h.0.c_q", "input", 0.0, 0.0, 1.0) + "{\"step\": 1,\n");
  EXPECT_TRUE(test::Contains(test::error_message([&] {
                               compare_runs({folder / "bf16", folder / "fp8"}, 1, 5.0);
                             }),
                             "fp8/fp8_health.jsonl:2: not JSON"));
}

}  // namespace
}  // namespace fp8t::train
