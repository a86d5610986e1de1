#include "io/plot.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdlib>
#include <iterator>
#include <limits>
#include <map>
#include <numeric>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <utility>

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
    {'\'', {0x0C, 0x04, 0x08, 0x00, 0x00, 0x00, 0x00}},
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

// Calls take(record, line_number) with the JSON object on each line of the file, blank lines
// skipped.
template <typename Take>
void for_each_record(const fs::path& path, Take&& take) {
  const std::string text = read_file(path);
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
    take(record, line_number);
  }
}

int64_t integer_step(const nlohmann::json& record, const fs::path& path, size_t line_number) {
  const auto step = record.find("step");
  if (step == record.end() || !step->is_number_integer()) {
    throw Error(fmt::format("{}:{}: expected an integer 'step'", path.string(), line_number));
  }
  return step->get<int64_t>();
}

// record[key]: a number, or NaN for null (what JSON writers make of NaN and infinities).
double number_field(const nlohmann::json& record, const std::string& key, const fs::path& path,
                    size_t line_number) {
  const auto value = record.find(key);
  if (value == record.end()) {
    throw Error(fmt::format("{}:{}: expected a field '{}'", path.string(), line_number, key));
  }
  if (value->is_null()) return std::numeric_limits<double>::quiet_NaN();
  if (!value->is_number()) {
    throw Error(fmt::format("{}:{}: '{}': expected a number, found {}", path.string(), line_number,
                            key, value->dump()));
  }
  return value->get<double>();
}

std::string string_field(const nlohmann::json& record, const std::string& key, const fs::path& path,
                         size_t line_number) {
  const auto value = record.find(key);
  if (value == record.end() || !value->is_string() ||
      value->get_ref<const std::string&>().empty()) {
    throw Error(
        fmt::format("{}:{}: expected a non-empty string '{}'", path.string(), line_number, key));
  }
  return value->get<std::string>();
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
  std::map<int64_t, double> by_step;  // a later line for the same step replaces the earlier one
  for_each_record(path, [&](const nlohmann::json& record, size_t line_number) {
    const auto value = record.find(metric);
    if (record.contains("event") || value == record.end() || value->is_null()) return;
    by_step[integer_step(record, path, line_number)] =
        number_field(record, metric, path, line_number);
  });
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

std::optional<Fp8HealthLog> read_fp8_health(const fs::path& run_folder) {
  const fs::path path = run_folder / "fp8_health.jsonl";
  if (!fs::exists(path)) return std::nullopt;
  // Tensors are numbered as they first appear; their display order is settled at the end.
  std::vector<Fp8HealthTensor> seen;
  std::map<std::pair<std::string, std::string>, size_t> ids;
  std::map<std::string, size_t> layer_order;
  std::map<std::pair<size_t, int64_t>, Fp8HealthCell> cells;  // a later line replaces
  std::set<int64_t> steps;
  for_each_record(path, [&](const nlohmann::json& record, size_t line_number) {
    const int64_t step = integer_step(record, path, line_number);
    Fp8HealthTensor tensor{string_field(record, "layer", path, line_number),
                           string_field(record, "operand", path, line_number)};
    Fp8HealthCell cell;
    cell.saturated_fraction = number_field(record, "saturated_fraction", path, line_number);
    cell.underflow_fraction = number_field(record, "underflow_fraction", path, line_number);
    cell.amax = number_field(record, "amax", path, line_number);
    layer_order.try_emplace(tensor.layer, layer_order.size());
    const auto [id, added] = ids.try_emplace({tensor.layer, tensor.operand}, seen.size());
    if (added) seen.push_back(std::move(tensor));
    cells[{id->second, step}] = cell;
    steps.insert(step);
  });

  // A layer's operands in the order the linear uses them: forward (input, weight), backward.
  const auto rank = [&](size_t id) {
    constexpr std::string_view kOperands[] = {"input", "weight", "grad_output"};
    const auto* operand = std::find(std::begin(kOperands), std::end(kOperands), seen[id].operand);
    return std::tuple(layer_order.at(seen[id].layer), operand - std::begin(kOperands), id);
  };
  std::vector<size_t> order(seen.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return rank(a) < rank(b); });
  Fp8HealthLog log;
  log.steps.assign(steps.begin(), steps.end());
  log.cells.resize(seen.size() * log.steps.size());
  std::vector<size_t> row_of(seen.size());
  for (size_t row = 0; row < order.size(); ++row) {
    row_of[order[row]] = row;
    log.tensors.push_back(seen[order[row]]);
  }
  for (const auto& [key, cell] : cells) {
    const auto& [id, step] = key;
    const auto column = std::lower_bound(log.steps.begin(), log.steps.end(), step);
    log.cells[row_of[id] * log.steps.size() + size_t(column - log.steps.begin())] = cell;
  }
  return log;
}

namespace {

constexpr int kHeatMapWidth = 960;
constexpr int kMaxGridHeight = 1000;
// Rows at least this tall each get a label: a glyph and 4 pixels between labels.
constexpr int kLabelledRowHeight = kGlyphHeight + 4;
constexpr int kMaxLabelWidth = 300;

// The colour scale: log10 of the fraction from −6 (and below) to 0, through these colours at
// 1e-6, 1e-4, 1e-2 and 1; the more of a tensor a cast loses, the darker its cell.
constexpr double kLogFloor = -6.0;
constexpr Rgb kScaleColors[] = {{255, 237, 160}, {245, 150, 50}, {200, 40, 50}, {60, 10, 80}};
// Nothing lost: apart from the scale, which starts at small but non-zero fractions.
constexpr Rgb kZeroColor{236, 236, 236};
constexpr Rgb kMissingColor{185, 185, 185};
constexpr Rgb kMissingHatch{110, 110, 110};

// The colour `decades` above 1e-6 on the scale, linear between its colours.
Rgb scale_color(double decades) {
  constexpr size_t kSegments = std::size(kScaleColors) - 1;
  const double position = std::clamp(decades / -kLogFloor, 0.0, 1.0) * double(kSegments);
  const size_t segment = std::min(size_t(position), kSegments - 1);
  const double t = position - double(segment);
  const Rgb& a = kScaleColors[segment];
  const Rgb& b = kScaleColors[segment + 1];
  const auto mix = [t](uint8_t from, uint8_t to) {
    return static_cast<uint8_t>(std::lround(from + t * (to - from)));
  };
  return {mix(a.r, b.r), mix(a.g, b.g), mix(a.b, b.b)};
}

void fill_cell(Canvas& canvas, int x0, int y0, int x1, int y1, double fraction) {
  if (!std::isnan(fraction)) {
    canvas.fill(x0, y0, x1, y1,
                fraction <= 0.0 ? kZeroColor : scale_color(std::log10(fraction) - kLogFloor));
    return;
  }
  canvas.fill(x0, y0, x1, y1, kMissingColor);
  // Stripes fixed to the picture rather than the cell, so that neighbouring cells join up.
  for (int y = y0; y < y1; ++y) {
    for (int x = x0; x < x1; ++x) {
      if ((x + y) % 4 == 0) canvas.set(x, y, kMissingHatch);
    }
  }
}

// A 1-pixel frame just outside the pixels x0 <= x < x1, y0 <= y < y1.
void frame(Canvas& canvas, int x0, int y0, int x1, int y1) {
  canvas.line(x0 - 1, y0 - 1, x1, y0 - 1, kInk);
  canvas.line(x0 - 1, y1, x1, y1, kInk);
  canvas.line(x0 - 1, y0 - 1, x0 - 1, y1, kInk);
  canvas.line(x1, y0 - 1, x1, y1, kInk);
}

// The cells [first, last) that the pixels [from, to) show: with at least as many pixels as
// cells, one cell per band; with fewer, each pixel shows the next cells, every cell in one band.
struct Band {
  size_t first, last;
  int from, to;
};

std::vector<Band> bands(size_t cells, int pixels, int origin) {
  std::vector<Band> result;
  for (int p = 0; p < pixels; ++p) {
    const size_t first = size_t(p) * cells / size_t(pixels);
    const size_t last = std::max(first + 1, size_t(p + 1) * cells / size_t(pixels));
    if (!result.empty() && result.back().first == first) {
      result.back().to = origin + p + 1;
    } else {
      result.push_back({first, last, origin + p, origin + p + 1});
    }
  }
  return result;
}

// The largest value in the rows × columns of two bands, NaN only when every one is.
double largest(const FractionGrid& grid, const Band& rows, const Band& columns) {
  double result = std::numeric_limits<double>::quiet_NaN();
  for (size_t row = rows.first; row < rows.last; ++row) {
    for (size_t column = columns.first; column < columns.last; ++column) {
      const double value = grid.values[row * grid.steps.size() + column];
      if (std::isnan(result) || value > result) result = value;
    }
  }
  return result;
}

// The label, or its end after "..": the end of a layer name tells layers apart.
std::string fit_label(const std::string& label, int max_width) {
  if (text_width(label) <= max_width) return label;
  const size_t keep = size_t((max_width + 1) / (kGlyphWidth + 1)) - 2;
  return ".." + label.substr(label.size() - keep);
}

// The columns to label: those of round step numbers (about five), apart enough to read.
std::vector<size_t> labelled_columns(std::span<const int64_t> steps) {
  if (steps.front() == steps.back()) return {0};
  std::vector<size_t> columns;
  for (const double value : ticks(double(steps.front()), double(steps.back())).values) {
    if (value != std::floor(value)) continue;
    const auto at = std::lower_bound(steps.begin(), steps.end(), int64_t(value));
    const size_t column = size_t(at - steps.begin());
    if (at != steps.end() && (columns.empty() || columns.back() != column)) {
      columns.push_back(column);
    }
  }
  return columns;
}

// The legend's height: the colour bar, and under it two rows of tick labels ("1e-6", "or less").
constexpr int kBarHeight = 12;
constexpr int kLegendHeight = kBarHeight + 6 + 2 * kGlyphHeight + 4;

// "fraction, log scale:", the colour bar with 1e-6 to 1 under it, and swatches for exactly 0
// and no value, centred in a row from y.
void draw_scale_legend(Canvas& canvas, int y) {
  constexpr int kBarWidth = 301;  // 100 pixels per two decades: the ticks fall on pixels
  constexpr int kSwatch = 12, kSpacing = 24;
  constexpr std::string_view kCaption = "fraction, log scale:", kZero = "exactly 0",
                             kMissing = "not logged";
  const int width = text_width(kCaption) + 8 + kBarWidth + kSpacing + kSwatch + 4 +
                    text_width(kZero) + kSpacing + kSwatch + 4 + text_width(kMissing);
  int x = (kHeatMapWidth - width) / 2;
  canvas.text(x, y + (kBarHeight - kGlyphHeight) / 2, kCaption, kInk);
  x += text_width(kCaption) + 8;
  for (int i = 0; i < kBarWidth; ++i) {
    canvas.fill(x + i, y, x + i + 1, y + kBarHeight,
                scale_color(-kLogFloor * double(i) / double(kBarWidth - 1)));
  }
  frame(canvas, x, y, x + kBarWidth, y + kBarHeight);
  constexpr std::string_view kTicks[] = {"1e-6", "1e-4", "1e-2", "1"};
  for (size_t i = 0; i < std::size(kTicks); ++i) {
    const int tick = x + int(i) * (kBarWidth - 1) / int(std::size(kTicks) - 1);
    canvas.line(tick, y + kBarHeight, tick, y + kBarHeight + 3, kInk);
    canvas.text(tick - text_width(kTicks[i]) / 2, y + kBarHeight + 6, kTicks[i], kInk);
  }
  canvas.text(x - text_width("or less") / 2, y + kBarHeight + 6 + kGlyphHeight + 4, "or less",
              kInk);
  x += kBarWidth + kSpacing;
  for (const auto& [name, fraction] :
       {std::pair{kZero, 0.0}, std::pair{kMissing, std::numeric_limits<double>::quiet_NaN()}}) {
    fill_cell(canvas, x, y, x + kSwatch, y + kBarHeight, fraction);
    frame(canvas, x, y, x + kSwatch, y + kBarHeight);
    canvas.text(x + kSwatch + 4, y + (kBarHeight - kGlyphHeight) / 2, name, kInk);
    x += kSwatch + 4 + text_width(name) + kSpacing;
  }
}

}  // namespace

Canvas draw_fraction_heat_map(const FractionGrid& grid, std::string_view title,
                              std::string_view row_title) {
  const size_t rows = grid.row_labels.size(), columns = grid.steps.size();
  FP8T_CHECK(rows > 0 && columns > 0 && grid.values.size() == rows * columns,
             "expected a value for each of {} rows × {} steps, at least one, found {}", rows,
             columns, grid.values.size());
  // Rows tall enough for a label each while they fit, else thinner down to 1 pixel; beyond
  // kMaxGridHeight rows a pixel row shows several.
  const size_t max_height = kMaxGridHeight;
  const size_t row_height = std::clamp(max_height / rows, size_t(1), size_t(kLabelledRowHeight));
  const int grid_height = int(std::min(rows * row_height, max_height));
  const double row_pitch = double(grid_height) / double(rows);
  const size_t label_every = size_t(std::ceil(kLabelledRowHeight / row_pitch - 1e-9));
  int label_width = 0;
  for (size_t row = 0; row < rows; row += label_every) {
    label_width =
        std::max(label_width, text_width(fit_label(grid.row_labels[row], kMaxLabelWidth)));
  }
  const int grid_left = 10 + label_width + 8;
  const size_t room = size_t(kHeatMapWidth - kRightMargin - grid_left);
  // As many whole pixels per step as fit, so that every column is as wide as the others.
  const int grid_width = int(columns <= room ? room / columns * columns : room);

  const int title_scale = text_width(title, 2) <= kHeatMapWidth - 2 * kRightMargin ? 2 : 1;
  const int legend_top = 10 + kGlyphHeight * title_scale + 14;
  const int row_title_top = legend_top + kLegendHeight + 14;
  const int grid_top = row_title_top + kGlyphHeight + 8;
  const int grid_bottom = grid_top + grid_height;
  Canvas canvas(kHeatMapWidth, grid_bottom + 22 + kGlyphHeight + 12);
  canvas.text((kHeatMapWidth - text_width(title, title_scale)) / 2, 10, title, kInk, title_scale);
  draw_scale_legend(canvas, legend_top);

  for (const Band& row_band : bands(rows, grid_height, grid_top)) {
    for (const Band& column_band : bands(columns, grid_width, grid_left)) {
      fill_cell(canvas, column_band.from, row_band.from, column_band.to, row_band.to,
                largest(grid, row_band, column_band));
    }
  }
  frame(canvas, grid_left, grid_top, grid_left + grid_width, grid_bottom);

  const std::string rows_title = label_every == 1
                                     ? std::string(row_title)
                                     : fmt::format("{}, 1 in {} labelled", row_title, label_every);
  canvas.text(10, row_title_top, rows_title, kInk);
  for (size_t row = 0; row < rows; row += label_every) {
    const int y = grid_top + int((double(row) + 0.5) * row_pitch);
    const std::string label = fit_label(grid.row_labels[row], kMaxLabelWidth);
    canvas.line(grid_left - 5, y, grid_left - 2, y, kInk);
    canvas.text(grid_left - 8 - text_width(label), y - kGlyphHeight / 2, label, kInk);
  }
  int labels_end = 0;  // where the last step label ends: the next must start beyond it
  for (const size_t column : labelled_columns(grid.steps)) {
    const int x = grid_left + int((double(column) + 0.5) * grid_width / double(columns));
    const std::string label = fmt::format("{}", grid.steps[column]);
    const int label_left = x - text_width(label) / 2;
    if (label_left < labels_end + 8) continue;
    canvas.line(x, grid_bottom + 1, x, grid_bottom + 4, kInk);
    canvas.text(label_left, grid_bottom + 8, label, kInk);
    labels_end = label_left + text_width(label);
  }
  canvas.text(grid_left + (grid_width - text_width("training step")) / 2, grid_bottom + 22,
              "training step", kInk);
  return canvas;
}

}  // namespace fp8t::io
