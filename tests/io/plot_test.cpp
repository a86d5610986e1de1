#include "io/plot.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdint>
#include <limits>
#include <set>
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

TEST(Fp8Health, ReadsTensorsInModelOrderAndTheLaterLineOfAStep) {
  const test::TempFolder folder;
  const auto line = [](int step, const char* layer, const char* operand, double underflow,
                       const char* amax = "2.5") {
    return fmt::format(
        "{{\"step\": {}, \"layer\": \"{}\", \"operand\": \"{}\", \"amax\": {}, \"scale\": 1.0, "
        "\"elements\": 100, \"saturated\": 0, \"underflow\": 0, \"saturated_fraction\": 0.0, "
        "\"underflow_fraction\": {}}}\n",
        step, layer, operand, amax, underflow);
  };
  // h.0's backward comes first in the file, and h.1's input only at step 20; step 10 of h.0's
  // input is logged again by a resumed run, whose value counts. Block recipes log no amax.
  write_file_atomically(folder / "fp8_health.jsonl",
                        line(10, "transformer.h.0.attn.c_q", "grad_output", 0.5) +
                            line(10, "transformer.h.0.attn.c_q", "weight", 0.25) +
                            line(10, "transformer.h.0.attn.c_q", "input", 0.125) + "\n" +
                            line(20, "transformer.h.1.attn.c_q", "input", 1e-3, "null") +
                            line(20, "transformer.h.0.attn.c_q", "input", 0.0) +
                            line(10, "transformer.h.0.attn.c_q", "input", 0.75));
  const std::optional<Fp8HealthLog> log = read_fp8_health(folder.path());
  ASSERT_TRUE(log.has_value());
  EXPECT_EQ(log->tensors, (std::vector<Fp8HealthTensor>{{"transformer.h.0.attn.c_q", "input"},
                                                        {"transformer.h.0.attn.c_q", "weight"},
                                                        {"transformer.h.0.attn.c_q", "grad_output"},
                                                        {"transformer.h.1.attn.c_q", "input"}}));
  EXPECT_EQ(log->steps, (std::vector<int64_t>{10, 20}));
  ASSERT_EQ(log->cells.size(), 8u);
  EXPECT_EQ(log->cell(0, 0).underflow_fraction, 0.75);
  EXPECT_EQ(log->cell(0, 1).underflow_fraction, 0.0);
  EXPECT_EQ(log->cell(1, 0).underflow_fraction, 0.25);
  EXPECT_EQ(log->cell(2, 0).underflow_fraction, 0.5);
  EXPECT_EQ(log->cell(2, 0).saturated_fraction, 0.0);
  EXPECT_EQ(log->cell(2, 0).amax, 2.5);
  EXPECT_EQ(log->cell(3, 1).underflow_fraction, 1e-3);
  EXPECT_TRUE(std::isnan(log->cell(3, 1).amax));
  // Not logged: h.0's weight and backward at step 20, h.1 at step 10.
  for (const auto& [tensor, step] : {std::pair{1, 1}, std::pair{2, 1}, std::pair{3, 0}}) {
    EXPECT_TRUE(std::isnan(log->cell(size_t(tensor), size_t(step)).underflow_fraction));
    EXPECT_TRUE(std::isnan(log->cell(size_t(tensor), size_t(step)).saturated_fraction));
  }
}

TEST(Fp8Health, NoFileIsNothingAndABadLineNamesFileAndLine) {
  const test::TempFolder folder;
  EXPECT_FALSE(read_fp8_health(folder.path()).has_value());  // a BF16 run
  const std::string good =
      "{\"step\":1,\"layer\":\"h.0.c_q\",\"operand\":\"input\",\"amax\":1.0,"
      "\"saturated_fraction\":0.0,\"underflow_fraction\":0.0}\n";
  const auto error = [&](const std::string& second_line) {
    write_file_atomically(folder / "fp8_health.jsonl", good + second_line + "\n");
    return test::error_message([&] { read_fp8_health(folder.path()); });
  };
  EXPECT_TRUE(test::Contains(error("{\"step\":2,\"layer\""), "fp8_health.jsonl:2: not JSON: "));
  EXPECT_TRUE(
      test::Contains(error("{\"step\":2,\"layer\":\"h.0.c_q\",\"operand\":\"input\",\"amax\":1.0,"
                           "\"saturated_fraction\":0.0}"),
                     "fp8_health.jsonl:2: expected a field 'underflow_fraction'"));
  EXPECT_TRUE(test::Contains(
      error("{\"step\":2,\"operand\":\"input\",\"amax\":1.0,\"saturated_fraction\":0.0,"
            "\"underflow_fraction\":0.0}"),
      "fp8_health.jsonl:2: expected a non-empty string 'layer'"));
  EXPECT_TRUE(test::Contains(
      error("{\"step\":\"two\",\"layer\":\"h.0.c_q\",\"operand\":\"input\",\"amax\":1.0,"
            "\"saturated_fraction\":0.0,\"underflow_fraction\":0.0}"),
      "fp8_health.jsonl:2: expected an integer 'step'"));
  EXPECT_TRUE(test::Contains(
      error("{\"step\":2,\"layer\":\"h.0.c_q\",\"operand\":\"input\",\"amax\":\"big\","
            "\"saturated_fraction\":0.0,\"underflow_fraction\":0.0}"),
      "fp8_health.jsonl:2: 'amax': expected a number, found \"big\""));
}

constexpr double kNotLogged = std::numeric_limits<double>::quiet_NaN();

FractionGrid grid_of(size_t rows, std::vector<int64_t> steps, double value) {
  FractionGrid grid;
  for (size_t row = 0; row < rows; ++row)
    grid.row_labels.push_back(fmt::format("h.{}.attn.c_q input", row));
  grid.values.assign(rows * steps.size(), value);
  grid.steps = std::move(steps);
  return grid;
}

// Where two pictures of one size differ: the bounding box [x0, x1) × [y0, y1), how many pixels
// differ, and the colours the second has there.
struct Difference {
  int x0 = std::numeric_limits<int>::max(), y0 = std::numeric_limits<int>::max(), x1 = 0, y1 = 0;
  int pixels = 0;
  std::set<std::tuple<int, int, int>> colors;
  int area() const { return (x1 - x0) * (y1 - y0); }
};

Difference difference(const Canvas& before, const Canvas& after) {
  EXPECT_EQ(before.width(), after.width());
  EXPECT_EQ(before.height(), after.height());
  Difference d;
  for (int y = 0; y < after.height(); ++y) {
    for (int x = 0; x < after.width(); ++x) {
      const Rgb color = after.pixel(x, y);
      if (before.pixel(x, y) == color) continue;
      d.x0 = std::min(d.x0, x);
      d.y0 = std::min(d.y0, y);
      d.x1 = std::max(d.x1, x + 1);
      d.y1 = std::max(d.y1, y + 1);
      ++d.pixels;
      d.colors.insert({color.r, color.g, color.b});
    }
  }
  return d;
}

Canvas heat_map(const FractionGrid& grid, std::string_view title = "fp8: underflow") {
  return draw_fraction_heat_map(grid, title, "tensor (layer, operand)");
}

// Pixels of `color` in the rows [y0, y1).
int count_color(const Canvas& canvas, Rgb color, int y0, int y1) {
  int found = 0;
  for (int y = y0; y < y1; ++y) {
    for (int x = 0; x < canvas.width(); ++x)
      found += canvas.pixel(x, y) == color;
  }
  return found;
}

TEST(FractionHeatMap, CellsTakeTheirColourFromTheLogScale) {
  const FractionGrid empty = grid_of(2, {10, 20, 30, 40}, kNotLogged);
  const Canvas blank = heat_map(empty);
  EXPECT_EQ(blank.width(), 960);
  // A cell set in the grid of cells not logged: exactly its box changes, to one colour.
  const auto cell = [&](size_t row, size_t column, double value) {
    FractionGrid grid = empty;
    grid.values[row * grid.steps.size() + column] = value;
    const Difference d = difference(blank, heat_map(grid));
    EXPECT_EQ(d.pixels, d.area()) << value;
    EXPECT_EQ(d.colors.size(), 1u) << value;
    return d;
  };
  const auto color_of = [&](double value) {
    const Difference d = cell(0, 1, value);
    const auto [r, g, b] = *d.colors.begin();
    return Rgb{uint8_t(r), uint8_t(g), uint8_t(b)};
  };
  const Rgb zero = color_of(0.0), micro = color_of(1e-6), ten_thousandth = color_of(1e-4),
            hundredth = color_of(1e-2), all = color_of(1.0);
  const std::vector<Rgb> distinct = {zero, micro, ten_thousandth, hundredth, all};
  for (size_t i = 0; i < distinct.size(); ++i) {
    EXPECT_NE(distinct[i], kWhite) << i;  // a cell stands out from the page
    for (size_t j = 0; j < i; ++j)
      EXPECT_NE(distinct[i], distinct[j]) << i << " " << j;
  }
  // The larger the fraction, the darker; below 1e-6 as 1e-6, above 1 as 1.
  const auto brightness = [](Rgb c) { return int(c.r) + int(c.g) + int(c.b); };
  EXPECT_GT(brightness(micro), brightness(ten_thousandth));
  EXPECT_GT(brightness(ten_thousandth), brightness(hundredth));
  EXPECT_GT(brightness(hundredth), brightness(all));
  EXPECT_EQ(color_of(1e-9), micro);
  EXPECT_EQ(color_of(3.0), all);
  EXPECT_NE(color_of(3e-3), hundredth);

  // Rows top to bottom, steps left to right, cells of one size side by side.
  const Difference first = cell(0, 0, 1.0), second = cell(0, 1, 1.0), below = cell(1, 0, 1.0);
  EXPECT_EQ(first.x1, second.x0);
  EXPECT_EQ(first.y0, second.y0);
  EXPECT_EQ(first.y1, below.y0);
  EXPECT_EQ(first.x0, below.x0);
  EXPECT_EQ(first.area(), second.area());
  EXPECT_GE(first.y1 - first.y0, kGlyphHeight);  // two rows: tall enough to label

  // Above the grid: the colour bar passes through the scale's colours at 1e-6 to 1, and the
  // legend's swatches show exactly 0 and a cell not logged (the blank grid's two colours).
  for (const Rgb color : {micro, ten_thousandth, hundredth, all, zero})
    EXPECT_GT(count_color(blank, color, 0, first.y0), 5);
  std::set<std::tuple<int, int, int>> hatch;
  for (int y = first.y0; y < first.y1; ++y) {
    for (int x = first.x0; x < first.x1; ++x) {
      const Rgb color = blank.pixel(x, y);
      hatch.insert({color.r, color.g, color.b});
    }
  }
  EXPECT_EQ(hatch.size(), 2u);  // stripes on grey
  for (const auto& [r, g, b] : hatch)
    EXPECT_GT(count_color(blank, Rgb{uint8_t(r), uint8_t(g), uint8_t(b)}, 0, first.y0), 5);
}

TEST(FractionHeatMap, DrawsTitleRowLabelsAndSteps) {
  const FractionGrid grid = grid_of(3, {100, 200, 300}, 1e-3);
  const Canvas canvas = heat_map(grid);
  // The grid: where a cell of the last row changes.
  FractionGrid changed = grid;
  changed.values.back() = 1.0;
  const Difference last = difference(canvas, heat_map(changed));
  ASSERT_GT(last.pixels, 0);
  const int grid_left = last.x0 - 2 * (last.x1 - last.x0);
  const int grid_top = last.y1 - 3 * (last.y1 - last.y0), grid_bottom = last.y1;

  // The title lies above the legend, the topmost rows.
  const Difference title = difference(heat_map(grid, ""), canvas);
  EXPECT_GT(title.pixels, 50);
  EXPECT_LT(title.y1, grid_top - 40);
  // A row's label lies left of the grid, beside its row.
  FractionGrid relabelled = grid;
  relabelled.row_labels[1] = "h.7.attn.c_q input";
  const Difference label = difference(canvas, heat_map(relabelled));
  EXPECT_GT(label.pixels, 5);
  EXPECT_LT(label.x1, grid_left);
  EXPECT_GE(label.y0, grid_top + (last.y1 - last.y0));
  EXPECT_LE(label.y1, grid_top + 2 * (last.y1 - last.y0));
  // The step labels and the axis title lie below it.
  const Difference steps = difference(heat_map(grid_of(3, {100, 200, 700}, 1e-3)), canvas);
  EXPECT_GT(steps.pixels, 5);
  EXPECT_GT(steps.y0, grid_bottom);
  int ink_below = 0;
  for (int y = grid_bottom + 1; y < canvas.height(); ++y) {
    for (int x = 0; x < canvas.width(); ++x)
      ink_below += canvas.pixel(x, y) != kWhite;
  }
  EXPECT_GT(ink_below, 100);  // "100", "200", "300", "training step"
}

TEST(FractionHeatMap, ManyRowsAndStepsKeepEveryCellVisible) {
  // A d24 GPT: 24 layers × 6 linears × 3 operands.
  const FractionGrid d24 = grid_of(432, {10, 20, 30}, 0.0);
  const Canvas canvas = heat_map(d24);
  EXPECT_EQ(canvas.width(), 960);
  EXPECT_LE(canvas.height(), 1200);
  FractionGrid first = d24, second = d24;
  first.values[0] = 1.0;
  second.values[3] = 1.0;  // the next row
  const Difference a = difference(canvas, heat_map(first)),
                   b = difference(canvas, heat_map(second));
  EXPECT_GE(a.y1 - a.y0, 1);
  EXPECT_LE(a.y1, b.y0);  // rows of their own
  FractionGrid last = d24;
  last.values.back() = 1.0;
  EXPECT_GE(difference(canvas, heat_map(last)).y0 - a.y0, 431);

  // More steps than pixels: one step at 1 among zeros still shows, in the darkest colour.
  std::vector<int64_t> steps;
  for (int64_t step = 1; step <= 5000; ++step)
    steps.push_back(step);
  FractionGrid wide = grid_of(2, steps, 0.0), spike = wide;
  spike.values[1234] = 1.0;
  const Difference shown = difference(heat_map(wide), heat_map(spike));
  EXPECT_GT(shown.pixels, 0);
  EXPECT_EQ(shown.colors.size(), 1u);
  EXPECT_EQ(shown.colors, difference(heat_map(wide), heat_map(grid_of(2, steps, 1.0))).colors);
}

TEST(FractionHeatMap, RefusesAGridWithoutCellsOrWithTheWrongCount) {
  EXPECT_TRUE(test::Contains(test::error_message([] { heat_map(grid_of(0, {1}, 0.0)); }),
                             "expected a value for each of 0 rows × 1 steps"));
  FractionGrid short_grid = grid_of(2, {1, 2}, 0.0);
  short_grid.values.pop_back();
  EXPECT_TRUE(test::Contains(test::error_message([&] { heat_map(short_grid); }), "found 3"));
}

}  // namespace
}  // namespace fp8t::io
