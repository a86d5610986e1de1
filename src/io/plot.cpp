#include "io/plot.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <iterator>
#include <map>
#include <optional>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "io/files.h"

namespace fp8t::io {

namespace fs = std::filesystem;

namespace {

// A glyph's rows, top to bottom; bit 4 is the leftmost column. The row below the 7 of the box
// holds the descenders of g, j, p, q, y (missing rows are 0).
struct Glyph {
  char c;
  std::array<uint8_t, kGlyphHeight + 1> rows;
};

constexpr Glyph kGlyphs[] = {
    {'0', {0x0E, 0x11, 0x13, 0x15, 0x19, 0x11, 0x0E}},
    {'1', {0x04, 0x0C, 0x04, 0x04, 0x04, 0x04, 0x0E}},
    {'2', {0x0E, 0x11, 0x01, 0x02, 0x04, 0x08, 0x1F}},
    {'3', {0x1E, 0x01, 0x01, 0x0E, 0x01, 0x01, 0x1E}},
    {'4', {0x02, 0x06, 0x0A, 0x12, 0x1F, 0x02, 0x02}},
    {'5', {0x1F, 0x10, 0x1E, 0x01, 0x01, 0x11, 0x0E}},
    {'6', {0x06, 0x08, 0x10, 0x1E, 0x11, 0x11, 0x0E}},
    {'7', {0x1F, 0x01, 0x02, 0x04, 0x08, 0x08, 0x08}},
    {'8', {0x0E, 0x11, 0x11, 0x0E, 0x11, 0x11, 0x0E}},
    {'9', {0x0E, 0x11, 0x11, 0x0F, 0x01, 0x02, 0x0C}},
    {'a', {0x00, 0x00, 0x0E, 0x01, 0x0F, 0x11, 0x0F}},
    {'b', {0x10, 0x10, 0x16, 0x19, 0x11, 0x11, 0x1E}},
    {'c', {0x00, 0x00, 0x0E, 0x10, 0x10, 0x11, 0x0E}},
    {'d', {0x01, 0x01, 0x0D, 0x13, 0x11, 0x11, 0x0F}},
    {'e', {0x00, 0x00, 0x0E, 0x11, 0x1F, 0x10, 0x0E}},
    {'f', {0x06, 0x09, 0x08, 0x1C, 0x08, 0x08, 0x08}},
    {'g', {0x00, 0x00, 0x0F, 0x11, 0x11, 0x0F, 0x01, 0x0E}},
    {'h', {0x10, 0x10, 0x16, 0x19, 0x11, 0x11, 0x11}},
    {'i', {0x04, 0x00, 0x0C, 0x04, 0x04, 0x04, 0x0E}},
    {'j', {0x02, 0x00, 0x06, 0x02, 0x02, 0x02, 0x12, 0x0C}},
    {'k', {0x10, 0x10, 0x12, 0x14, 0x18, 0x14, 0x12}},
    {'l', {0x0C, 0x04, 0x04, 0x04, 0x04, 0x04, 0x0E}},
    {'m', {0x00, 0x00, 0x1A, 0x15, 0x15, 0x15, 0x15}},
    {'n', {0x00, 0x00, 0x16, 0x19, 0x11, 0x11, 0x11}},
    {'o', {0x00, 0x00, 0x0E, 0x11, 0x11, 0x11, 0x0E}},
    {'p', {0x00, 0x00, 0x1E, 0x11, 0x11, 0x1E, 0x10, 0x10}},
    {'q', {0x00, 0x00, 0x0F, 0x11, 0x11, 0x0F, 0x01, 0x01}},
    {'r', {0x00, 0x00, 0x16, 0x19, 0x10, 0x10, 0x10}},
    {'s', {0x00, 0x00, 0x0F, 0x10, 0x0E, 0x01, 0x1E}},
    {'t', {0x08, 0x08, 0x1C, 0x08, 0x08, 0x09, 0x06}},
    {'u', {0x00, 0x00, 0x11, 0x11, 0x11, 0x13, 0x0D}},
    {'v', {0x00, 0x00, 0x11, 0x11, 0x11, 0x0A, 0x04}},
    {'w', {0x00, 0x00, 0x11, 0x11, 0x15, 0x15, 0x0A}},
    {'x', {0x00, 0x00, 0x11, 0x0A, 0x04, 0x0A, 0x11}},
    {'y', {0x00, 0x00, 0x11, 0x11, 0x11, 0x0F, 0x01, 0x0E}},
    {'z', {0x00, 0x00, 0x1F, 0x02, 0x04, 0x08, 0x1F}},
    {' ', {0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x00}},
    {'.', {0x00, 0x00, 0x00, 0x00, 0x00, 0x0C, 0x0C}},
    {',', {0x00, 0x00, 0x00, 0x00, 0x0C, 0x04, 0x08}},
    {'-', {0x00, 0x00, 0x00, 0x1F, 0x00, 0x00, 0x00}},
    {'+', {0x00, 0x04, 0x04, 0x1F, 0x04, 0x04, 0x00}},
    {'%', {0x18, 0x19, 0x02, 0x04, 0x08, 0x13, 0x03}},
    {'_', {0x00, 0x00, 0x00, 0x00, 0x00, 0x00, 0x1F}},
    {':', {0x00, 0x0C, 0x0C, 0x00, 0x0C, 0x0C, 0x00}},
    {'(', {0x02, 0x04, 0x08, 0x08, 0x08, 0x04, 0x02}},
    {')', {0x08, 0x04, 0x02, 0x02, 0x02, 0x04, 0x08}},
    {'/', {0x00, 0x01, 0x02, 0x04, 0x08, 0x10, 0x00}},
    {'=', {0x00, 0x00, 0x1F, 0x00, 0x1F, 0x00, 0x00}},
    {'?', {0x0E, 0x11, 0x01, 0x02, 0x04, 0x00, 0x04}},
};

const Glyph& glyph(char c) {
  if (c >= 'A' && c <= 'Z') c = static_cast<char>(c - 'A' + 'a');
  const auto* found = std::find_if(std::begin(kGlyphs), std::end(kGlyphs),
                                   [c](const Glyph& g) { return g.c == c; });
  return found != std::end(kGlyphs) ? *found : glyph('?');
}

size_t checked_bytes(int width, int height) {
  FP8T_CHECK(width > 0 && height > 0, "expected a positive canvas size, found {}×{}", width,
             height);
  return size_t(width) * size_t(height) * 3;
}

// Colours a reader tells apart; the first, the reference, is the darkest.
constexpr Rgb kRunColors[] = {{0, 70, 180},   {230, 110, 0}, {0, 150, 60},  {200, 30, 40},
                              {120, 60, 180}, {0, 160, 170}, {150, 95, 40}, {220, 80, 170}};
constexpr Rgb kInk{40, 40, 40};
constexpr Rgb kGrid{228, 228, 228};
constexpr Rgb kGuide{140, 140, 140};

constexpr int kPlotWidth = 960;
constexpr int kPlotHeight = 540;
constexpr int kLabelMargin = 64;  // left of each panel: the y tick labels
constexpr int kRightMargin = 20;
constexpr int kCurveWidth = 2;

// A value range drawn between two pixel coordinates.
struct Axis {
  double lo, hi;
  int from, to;
  int pixel(double value) const {
    return from + static_cast<int>(std::lround((value - lo) / (hi - lo) * (to - from)));
  }
};

struct Panel {
  Axis x, y;  // y.from is the bottom row
};

// About five ticks at 1, 2 or 5 × 10^k inside [lo, hi], and the decimals their labels need.
struct Ticks {
  std::vector<double> values;
  int decimals = 0;
};

Ticks ticks(double lo, double hi) {
  const double rough = (hi - lo) / 5.0;
  const double power = std::pow(10.0, std::floor(std::log10(rough)));
  const double fraction = rough / power;
  const double step = power * (fraction < 1.5   ? 1.0
                               : fraction < 3.5 ? 2.0
                               : fraction < 7.5 ? 5.0
                                                : 10.0);
  Ticks result;
  // + 1e-9: log10 of a step of 0.1 may come out just below −1.
  result.decimals = std::max(0, -static_cast<int>(std::floor(std::log10(step) + 1e-9)));
  for (double k = std::ceil(lo / step); k * step <= hi; ++k) {
    result.values.push_back(k * step + 0.0);  // + 0.0 turns -0 into 0, so no "-0" label
  }
  return result;
}

// The data's range with 5 % to spare on each side; a flat curve gets ±1 % of its value.
std::pair<double, double> padded(double lo, double hi) {
  double margin = 0.05 * (hi - lo);
  if (margin == 0.0) margin = lo == 0.0 ? 1.0 : 0.01 * std::abs(lo);
  return {lo - margin, hi + margin};
}

std::pair<double, double> value_range(std::span<const RunCurve> curves) {
  double lo = INFINITY, hi = -INFINITY;
  for (const RunCurve& curve : curves) {
    for (const double value : curve.values) {
      lo = std::min(lo, value);
      hi = std::max(hi, value);
    }
  }
  return {lo, hi};
}

// Grid lines and labelled ticks, the frame, the title above and "step" below.
void draw_axes(Canvas& canvas, const Panel& panel, std::string_view title, bool percent) {
  const int left = panel.x.from, right = panel.x.to, top = panel.y.to, bottom = panel.y.from;
  const Ticks y_ticks = ticks(panel.y.lo, panel.y.hi);
  for (const double value : y_ticks.values) {
    const int y = panel.y.pixel(value);
    canvas.line(left, y, right, y, kGrid);
    canvas.line(left - 4, y, left, y, kInk);
    const std::string label = percent && value != 0.0
                                  ? fmt::format("{:+.{}f}", value, y_ticks.decimals)
                                  : fmt::format("{:.{}f}", value, y_ticks.decimals);
    canvas.text(left - 7 - text_width(label), y - kGlyphHeight / 2, label, kInk);
  }
  const Ticks x_ticks = ticks(panel.x.lo, panel.x.hi);
  for (const double value : x_ticks.values) {
    const int x = panel.x.pixel(value);
    canvas.line(x, top, x, bottom, kGrid);
    canvas.line(x, bottom, x, bottom + 4, kInk);
    const std::string label = fmt::format("{:.{}f}", value, x_ticks.decimals);
    canvas.text(x - text_width(label) / 2, bottom + 8, label, kInk);
  }
  canvas.line(left, top, right, top, kInk);
  canvas.line(left, bottom, right, bottom, kInk);
  canvas.line(left, top, left, bottom, kInk);
  canvas.line(right, top, right, bottom, kInk);
  canvas.text(left, top - kGlyphHeight - 6, title, kInk);
  canvas.text((left + right - text_width("step")) / 2, bottom + 22, "step", kInk);
}

// Segments between consecutive points; the first is the point itself, so one point shows.
void draw_curve(Canvas& canvas, const Panel& panel, const RunCurve& curve, Rgb color) {
  int last_x = panel.x.pixel(double(curve.steps.front()));
  int last_y = panel.y.pixel(curve.values.front());
  for (size_t i = 0; i < curve.steps.size(); ++i) {
    const int x = panel.x.pixel(double(curve.steps[i])), y = panel.y.pixel(curve.values[i]);
    canvas.line(last_x, last_y, x, y, color, kCurveWidth);
    last_x = x;
    last_y = y;
  }
}

void draw_dashed_row(Canvas& canvas, int x0, int x1, int y, Rgb color) {
  for (int x = x0; x <= x1; ++x) {
    if ((x - x0) % 8 < 5) canvas.set(x, y, color);
  }
}

// Swatches and names in the runs' colours, in rows centred under the title; returns the y
// below the last row.
int draw_legend(Canvas& canvas, std::span<const RunCurve> runs, int y) {
  constexpr int kSwatch = 10, kSpacing = 20;
  const auto entry_width = [&](size_t i) { return kSwatch + 4 + text_width(runs[i].name); };
  for (size_t first = 0; first < runs.size(); y += kGlyphHeight + 6) {
    size_t end = first + 1;
    int row_width = entry_width(first);
    while (end < runs.size() &&
           row_width + kSpacing + entry_width(end) <= kPlotWidth - 2 * kRightMargin) {
      row_width += kSpacing + entry_width(end++);
    }
    int x = (kPlotWidth - row_width) / 2;
    for (size_t i = first; i < end; ++i) {
      canvas.fill(x, y + 2, x + kSwatch, y + 5, kRunColors[i]);
      canvas.text(x + kSwatch + 4, y, runs[i].name, kRunColors[i]);
      x += entry_width(i) + kSpacing;
    }
    first = end;
  }
  return y;
}

}  // namespace

int text_width(std::string_view text, int scale) {
  return text.empty() ? 0 : (static_cast<int>(text.size()) * (kGlyphWidth + 1) - 1) * scale;
}

Canvas::Canvas(int width, int height)
    : width_(width), height_(height), rgb_(checked_bytes(width, height), 255) {}

Rgb Canvas::pixel(int x, int y) const {
  FP8T_CHECK(x >= 0 && x < width_ && y >= 0 && y < height_,
             "expected a pixel inside {}×{}, found ({}, {})", width_, height_, x, y);
  const size_t at = (size_t(y) * size_t(width_) + size_t(x)) * 3;
  return {rgb_[at], rgb_[at + 1], rgb_[at + 2]};
}

void Canvas::set(int x, int y, Rgb color) {
  if (x < 0 || x >= width_ || y < 0 || y >= height_) return;
  const size_t at = (size_t(y) * size_t(width_) + size_t(x)) * 3;
  rgb_[at] = color.r;
  rgb_[at + 1] = color.g;
  rgb_[at + 2] = color.b;
}

void Canvas::fill(int x0, int y0, int x1, int y1, Rgb color) {
  for (int y = std::max(y0, 0); y < std::min(y1, height_); ++y) {
    for (int x = std::max(x0, 0); x < std::min(x1, width_); ++x)
      set(x, y, color);
  }
}

void Canvas::line(int x0, int y0, int x1, int y1, Rgb color, int width) {
  // Bresenham: one step along the major axis each time, a minor step when the error says so.
  const int dx = std::abs(x1 - x0), dy = -std::abs(y1 - y0);
  const int step_x = x0 < x1 ? 1 : -1, step_y = y0 < y1 ? 1 : -1;
  const int offset = (width - 1) / 2;
  for (int error = dx + dy;;) {
    fill(x0 - offset, y0 - offset, x0 - offset + width, y0 - offset + width, color);
    if (x0 == x1 && y0 == y1) break;
    const int twice = 2 * error;
    if (twice >= dy) {
      error += dy;
      x0 += step_x;
    }
    if (twice <= dx) {
      error += dx;
      y0 += step_y;
    }
  }
}

void Canvas::text(int x, int y, std::string_view text, Rgb color, int scale) {
  for (const char c : text) {
    const Glyph& g = glyph(c);
    for (int row = 0; row <= kGlyphHeight; ++row) {
      for (int col = 0; col < kGlyphWidth; ++col) {
        if ((g.rows[size_t(row)] >> (kGlyphWidth - 1 - col) & 1) == 0) continue;
        fill(x + col * scale, y + row * scale, x + (col + 1) * scale, y + (row + 1) * scale, color);
      }
    }
    x += (kGlyphWidth + 1) * scale;
  }
}

RunCurve read_run_curve(const fs::path& run_folder, const std::string& metric) {
  std::optional<RunCurve> curve = read_logged_curve(run_folder, metric);
  if (!curve) {
    throw Error(fmt::format("{}: no step has a value of '{}'",
                            (run_folder / "metrics.jsonl").string(), metric));
  }
  return std::move(*curve);
}

std::optional<RunCurve> read_logged_curve(const fs::path& run_folder, const std::string& metric) {
  const fs::path path = run_folder / "metrics.jsonl";
  const std::string text = read_file(path);
  std::map<int64_t, double> by_step;  // a later line for the same step replaces the earlier one
  size_t line_number = 0;
  for (size_t begin = 0; begin < text.size();) {
    const size_t end = std::min(text.find('\n', begin), text.size());
    const std::string_view line(text.data() + begin, end - begin);
    begin = end + 1;
    ++line_number;
    if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
    nlohmann::json record;
    try {
      record = nlohmann::json::parse(line);
    } catch (const nlohmann::json::parse_error& error) {
      throw Error(fmt::format("{}:{}: not JSON: {}", path.string(), line_number, error.what()));
    }
    if (!record.is_object()) {
      throw Error(fmt::format("{}:{}: expected a JSON object, found {}", path.string(), line_number,
                              record.type_name()));
    }
    const auto value = record.find(metric);
    if (record.contains("event") || value == record.end() || value->is_null()) continue;
    const auto step = record.find("step");
    if (step == record.end() || !step->is_number_integer()) {
      throw Error(fmt::format("{}:{}: expected an integer 'step'", path.string(), line_number));
    }
    if (!value->is_number()) {
      throw Error(fmt::format("{}:{}: '{}': expected a number, found {}", path.string(),
                              line_number, metric, value->dump()));
    }
    by_step[step->get<int64_t>()] = value->get<double>();
  }
  if (by_step.empty()) return std::nullopt;
  // The folder's name, also for "runs/a/" and ".".
  fs::path folder = fs::absolute(run_folder).lexically_normal();
  if (!folder.has_filename()) folder = folder.parent_path();
  RunCurve curve{folder.filename().string(), {}, {}};
  for (const auto& [step, value] : by_step) {
    curve.steps.push_back(step);
    curve.values.push_back(value);
  }
  return curve;
}

std::vector<double> moving_average(std::span<const double> values, int window) {
  FP8T_CHECK(window >= 1, "expected a window of at least 1, found {}", window);
  const size_t size = size_t(window);
  std::vector<double> averages(values.size());
  double sum = 0.0;
  for (size_t i = 0; i < values.size(); ++i) {
    sum += values[i];
    if (i >= size) sum -= values[i - size];
    averages[i] = sum / double(std::min(i + 1, size));
  }
  return averages;
}

std::optional<double> value_at_step(const RunCurve& curve, int64_t step) {
  const std::vector<int64_t>& steps = curve.steps;
  if (steps.empty() || step < steps.front() || step > steps.back()) return std::nullopt;
  const size_t j = size_t(std::lower_bound(steps.begin(), steps.end(), step) - steps.begin());
  if (steps[j] == step) return curve.values[j];
  const double t = double(step - steps[j - 1]) / double(steps[j] - steps[j - 1]);
  return curve.values[j - 1] + t * (curve.values[j] - curve.values[j - 1]);
}

RunCurve relative_percent(const RunCurve& run, const RunCurve& reference) {
  RunCurve relative{run.name, {}, {}};
  for (size_t i = 0; i < run.steps.size(); ++i) {
    const std::optional<double> base = value_at_step(reference, run.steps[i]);
    if (!base || *base == 0.0) continue;
    relative.steps.push_back(run.steps[i]);
    relative.values.push_back(100.0 * (run.values[i] / *base - 1.0));
  }
  return relative;
}

std::span<const Rgb> run_colors() {
  return kRunColors;
}

Canvas draw_run_plot(std::span<const RunCurve> runs, std::string_view metric,
                     std::string_view title) {
  FP8T_CHECK(!runs.empty() && runs.size() <= std::size(kRunColors),
             "expected 1 to {} runs, found {}", std::size(kRunColors), runs.size());
  double x_lo = INFINITY, x_hi = -INFINITY;
  for (const RunCurve& run : runs) {
    FP8T_CHECK(!run.steps.empty() && run.steps.size() == run.values.size(),
               "{}: expected as many values as steps, at least one, found {} and {}", run.name,
               run.values.size(), run.steps.size());
    x_lo = std::min(x_lo, double(run.steps.front()));
    x_hi = std::max(x_hi, double(run.steps.back()));
  }
  if (x_lo == x_hi) {
    x_lo -= 1.0;
    x_hi += 1.0;
  }
  Canvas canvas(kPlotWidth, kPlotHeight);
  const int title_scale = text_width(title, 2) <= kPlotWidth - 2 * kRightMargin ? 2 : 1;
  canvas.text((kPlotWidth - text_width(title, title_scale)) / 2, 10, title, kInk, title_scale);
  const int top = draw_legend(canvas, runs, 18 + kGlyphHeight * title_scale) + 20;
  const int bottom = kPlotHeight - 40;
  const int panel_width = (kPlotWidth - 2 * kLabelMargin - kRightMargin) / 2;
  const auto x_axis = [&](int left) { return Axis{x_lo, x_hi, left, left + panel_width}; };

  const auto [data_lo, data_hi] = value_range(runs);
  const auto [lo, hi] = padded(data_lo, data_hi);
  const Panel values{x_axis(kLabelMargin), {lo, hi, bottom, top}};
  draw_axes(canvas, values, metric, false);
  for (size_t i = 0; i < runs.size(); ++i)
    draw_curve(canvas, values, runs[i], kRunColors[i]);

  std::vector<RunCurve> relatives;
  for (const RunCurve& run : runs.subspan(1))
    relatives.push_back(relative_percent(run, runs[0]));
  const auto [relative_lo, relative_hi] = value_range(relatives);
  const auto [percent_lo, percent_hi] =
      padded(std::min(relative_lo, -5.0), std::max(relative_hi, 5.0));
  const Panel relative{x_axis(2 * kLabelMargin + panel_width),
                       {percent_lo, percent_hi, bottom, top}};
  draw_axes(canvas, relative, fmt::format("{} / {} - 1, %", metric, runs[0].name), true);
  for (const double guide : {-5.0, 5.0}) {
    draw_dashed_row(canvas, relative.x.from, relative.x.to, relative.y.pixel(guide), kGuide);
  }
  // The 0 line is the reference, in its colour.
  const int zero = relative.y.pixel(0.0);
  canvas.line(relative.x.from, zero, relative.x.to, zero, kRunColors[0], kCurveWidth);
  for (size_t i = 0; i < relatives.size(); ++i) {
    if (!relatives[i].steps.empty()) draw_curve(canvas, relative, relatives[i], kRunColors[i + 1]);
  }
  return canvas;
}

}  // namespace fp8t::io
