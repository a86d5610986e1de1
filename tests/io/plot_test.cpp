#include "io/plot.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

#include "core/error.h"
#include "io/files.h"
#include "io/png.h"
#include "io/png_reader.h"
#include "test_files.h"

namespace fp8t::io {
namespace {

constexpr Rgb kWhite{255, 255, 255};
constexpr Rgb kRed{255, 0, 0};

int count_set(const Canvas& canvas, int x0, int y0, int x1, int y1) {
  int set = 0;
  for (int y = y0; y < y1; ++y) {
    for (int x = x0; x < x1; ++x)
      set += canvas.pixel(x, y) != kWhite;
  }
  return set;
}

TEST(Canvas, DrawsALineBetweenTwoPoints) {
  Canvas canvas(20, 12);
  canvas.line(2, 3, 12, 3, kRed);
  for (int x = 2; x <= 12; ++x)
    EXPECT_EQ(canvas.pixel(x, 3), kRed) << x;
  EXPECT_EQ(count_set(canvas, 0, 0, 20, 12), 11);  // nothing beyond the ends or beside

  Canvas diagonal(20, 12);
  diagonal.line(5, 5, 0, 0, kRed);  // drawn backwards: the same pixels
  for (int i = 0; i <= 5; ++i)
    EXPECT_EQ(diagonal.pixel(i, i), kRed) << i;
  EXPECT_EQ(count_set(diagonal, 0, 0, 20, 12), 6);

  Canvas steep(20, 12);
  steep.line(3, 0, 5, 11, kRed);  // one pixel per row, x moving from 3 to 5
  for (int y = 0; y < 12; ++y)
    EXPECT_EQ(count_set(steep, 0, y, 20, y + 1), 1) << y;
  EXPECT_EQ(steep.pixel(3, 0), kRed);
  EXPECT_EQ(steep.pixel(5, 11), kRed);

  Canvas wide(20, 12);
  wide.line(2, 5, 6, 5, kRed, 2);  // two rows thick
  EXPECT_EQ(count_set(wide, 2, 5, 8, 7), 12);
  EXPECT_EQ(count_set(wide, 0, 0, 20, 12), 12);

  Canvas clipped(20, 12);
  clipped.line(-5, 2, 30, 2, kRed);  // outside the canvas: skipped, no error
  EXPECT_EQ(count_set(clipped, 0, 0, 20, 12), 20);
}

TEST(Canvas, RendersTextInTheGlyphBox) {
  Canvas zero(20, 12), one(20, 12);
  zero.text(3, 2, "0", kRed);
  one.text(3, 2, "1", kRed);
  const int inside = count_set(zero, 3, 2, 3 + kGlyphWidth, 2 + kGlyphHeight);
  EXPECT_GT(inside, 8);
  EXPECT_EQ(count_set(zero, 0, 0, 20, 12), inside);  // nothing outside the 5×7 box
  EXPECT_GT(count_set(one, 3, 2, 3 + kGlyphWidth, 2 + kGlyphHeight), 4);
  EXPECT_NE(std::vector<uint8_t>(zero.rgb().begin(), zero.rgb().end()),
            std::vector<uint8_t>(one.rgb().begin(), one.rgb().end()));

  // Uppercase is drawn as lowercase; a scale of 2 doubles every font pixel.
  Canvas upper(20, 12), lower(20, 12), big(20, 20);
  upper.text(0, 0, "Ab", kRed);
  lower.text(0, 0, "ab", kRed);
  big.text(0, 0, "0", kRed, 2);
  EXPECT_EQ(std::vector<uint8_t>(upper.rgb().begin(), upper.rgb().end()),
            std::vector<uint8_t>(lower.rgb().begin(), lower.rgb().end()));
  EXPECT_EQ(count_set(big, 0, 0, 20, 20), 4 * inside);
  EXPECT_EQ(text_width("10"), 11);
  EXPECT_EQ(text_width("10", 2), 22);
}

TEST(RunCurves, RelativeIsTenPercentForARunAtOnePointOneTimesTheReference) {
  RunCurve reference{"bf16", {}, {}}, run{"fp8", {}, {}};
  for (int64_t step = 1; step <= 50; ++step) {
    reference.steps.push_back(step);
    reference.values.push_back(2.0 + 8.0 / double(step));
    run.steps.push_back(step);
    run.values.push_back(1.1 * reference.values.back());
  }
  const RunCurve relative = relative_percent(run, reference);
  EXPECT_EQ(relative.name, "fp8");
  EXPECT_EQ(relative.steps, run.steps);
  for (const double value : relative.values)
    EXPECT_NEAR(value, 10.0, 1e-9);
  for (const double value : relative_percent(reference, reference).values)
    EXPECT_EQ(value, 0.0);
}

TEST(RunCurves, RelativeInterpolatesTheReferenceBetweenItsSteps) {
  const RunCurve reference{"ref", {10, 20, 40}, {4.0, 2.0, 3.0}};
  // Step 5 and 50 lie outside the reference's steps; 15 and 30 fall between two of them.
  const RunCurve run{"run", {5, 15, 20, 30, 50}, {1.0, 3.3, 2.0, 2.25, 1.0}};
  const RunCurve relative = relative_percent(run, reference);
  EXPECT_EQ(relative.steps, (std::vector<int64_t>{15, 20, 30}));
  ASSERT_EQ(relative.values.size(), 3u);
  EXPECT_NEAR(relative.values[0], 10.0, 1e-9);  // the reference is 3 at step 15
  EXPECT_NEAR(relative.values[1], 0.0, 1e-9);
  EXPECT_NEAR(relative.values[2], -10.0, 1e-9);  // 2.5 at step 30
}

TEST(RunCurves, MovingAverageUsesTheValuesSoFarAtTheStart) {
  const std::vector<double> values = {1.0, 2.0, 3.0, 4.0, 5.0};
  EXPECT_EQ(moving_average(values, 1), values);
  EXPECT_EQ(moving_average(values, 3), (std::vector<double>{1.0, 1.5, 2.0, 3.0, 4.0}));
}

TEST(RunCurves, ReadsAMetricFromARunFolder) {
  const test::TempFolder folder;
  std::filesystem::create_directories(folder / "fp8_run");
  // A resumed run logs step 2 again: the later line counts. Events and nulls are skipped.
  write_file_atomically(folder / "fp8_run" / "metrics.jsonl",
                        "{\"step\":1,\"loss\":5.0,\"val_loss\":null}\n"
                        "{\"step\":2,\"loss\":4.5,\"val_loss\":4.9}\n"
                        "{\"event\":\"interrupted\",\"message\":\"stopped\"}\n"
                        "\n"
                        "{\"step\":2,\"loss\":4.0,\"val_loss\":4.7}\n"
                        "{\"step\":3,\"loss\":3.5,\"val_loss\":null}\n");
  const RunCurve loss = read_run_curve(folder / "fp8_run/", "loss");
  EXPECT_EQ(loss.name, "fp8_run");
  EXPECT_EQ(loss.steps, (std::vector<int64_t>{1, 2, 3}));
  EXPECT_EQ(loss.values, (std::vector<double>{5.0, 4.0, 3.5}));
  const RunCurve val_loss = read_run_curve(folder / "fp8_run", "val_loss");
  EXPECT_EQ(val_loss.steps, (std::vector<int64_t>{2}));
  EXPECT_EQ(val_loss.values, (std::vector<double>{4.7}));
}

TEST(RunCurves, ErrorsNameTheFile) {
  const test::TempFolder folder;
  EXPECT_TRUE(test::Contains(test::error_message([&] { read_run_curve(folder / "none", "loss"); }),
                             "none/metrics.jsonl: no such file"));
  write_file_atomically(folder / "metrics.jsonl",
                        "{\"step\":1,\"loss\":5.0}\n{\"step\":2,\"loss\":4.\n");
  EXPECT_TRUE(test::Contains(test::error_message([&] { read_run_curve(folder.path(), "loss"); }),
                             "metrics.jsonl:2: not JSON: "));
  write_file_atomically(folder / "metrics.jsonl", "{\"step\":1,\"loss\":5.0}\n");
  EXPECT_TRUE(
      test::Contains(test::error_message([&] { read_run_curve(folder.path(), "val_loss"); }),
                     "metrics.jsonl: no step has a value of 'val_loss'"));
  write_file_atomically(folder / "metrics.jsonl", "{\"step\":1,\"loss\":\"low\"}\n");
  EXPECT_TRUE(test::Contains(test::error_message([&] { read_run_curve(folder.path(), "loss"); }),
                             "metrics.jsonl:1: 'loss': expected a number, found \"low\""));
}

TEST(RunPlot, DrawsBothPanelsInTheRunsColours) {
  RunCurve bf16{"bf16", {}, {}}, fp8{"fp8", {}, {}};
  for (int64_t step = 1; step <= 200; ++step) {
    bf16.steps.push_back(step);
    bf16.values.push_back(3.0 + 5.0 / double(step));
    fp8.steps.push_back(step);
    fp8.values.push_back(bf16.values.back() * (1.0 + 0.02 * double(step) / 200.0));
  }
  const std::vector<RunCurve> runs = {bf16, fp8};
  const test::TempFolder folder;
  const Canvas canvas = draw_run_plot(runs, "loss", "loss: bf16 vs fp8");
  write_png(folder / "curves.png", canvas.width(), canvas.height(), canvas.rgb());

  const test::ReadPicture picture = test::read_png(folder / "curves.png");
  const int width = picture.width, height = picture.height;
  const std::vector<uint8_t>& rgb = picture.rgb;
  ASSERT_EQ(width, 960);
  ASSERT_EQ(height, 540);
  // Pixels of a colour in the columns [x0, x1), below the title and legend rows.
  const auto count = [&](Rgb color, int x0, int x1) {
    int found = 0;
    for (int y = height / 4; y < height; ++y) {
      for (int x = x0; x < x1; ++x) {
        const size_t at = (size_t(y) * size_t(width) + size_t(x)) * 3;
        found += Rgb{rgb[at], rgb[at + 1], rgb[at + 2]} == color;
      }
    }
    return found;
  };
  const Rgb reference = run_colors()[0], other = run_colors()[1];
  EXPECT_GT(count(reference, 0, width / 2), 200);  // the curves: 2 pixels wide
  EXPECT_GT(count(other, 0, width / 2), 200);
  EXPECT_GT(count(reference, width / 2, width), 200);  // the 0 line
  EXPECT_GT(count(other, width / 2, width), 200);      // fp8 relative to bf16
}

}  // namespace
}  // namespace fp8t::io
