// Line charts as RGB pictures, for comparing runs' loss curves without a plotting or font
// library: a canvas with lines and a built-in 5×7 bitmap font, the curves read from run folders'
// metrics.jsonl, and the two-panel run plot that `fp8train plot` writes.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace fp8t::io {

struct Rgb {
  uint8_t r = 0, g = 0, b = 0;
  bool operator==(const Rgb&) const = default;
};

// The font: digits, lowercase letters (uppercase is drawn as lowercase), space and
// . , - + % _ : ( ) / = ?; any other character is drawn as '?'. A glyph fills a 5 × 7 box; the
// descenders of g, j, p, q and y reach one row below it.
inline constexpr int kGlyphWidth = 5;
inline constexpr int kGlyphHeight = 7;

// Pixels that `text` spans horizontally: a glyph and one blank column per character, the last
// column excepted.
int text_width(std::string_view text, int scale = 1);

// A width × height picture, white to start with. Drawing outside it is skipped, so callers
// need not clip.
class Canvas {
 public:
  Canvas(int width, int height);

  int width() const { return width_; }
  int height() const { return height_; }
  // [height, width, 3] bytes, as write_png takes them.
  std::span<const uint8_t> rgb() const { return rgb_; }
  Rgb pixel(int x, int y) const;

  void set(int x, int y, Rgb color);
  // The pixels with x0 <= x < x1 and y0 <= y < y1.
  void fill(int x0, int y0, int x1, int y1, Rgb color);
  // From (x0, y0) to (x1, y1), both ends included; each point is a width × width square.
  void line(int x0, int y0, int x1, int y1, Rgb color, int width = 1);
  // `text` with its top-left corner at (x, y), each font pixel drawn as scale × scale.
  void text(int x, int y, std::string_view text, Rgb color, int scale = 1);

 private:
  int width_;
  int height_;
  std::vector<uint8_t> rgb_;
};

// One run's metric against the step, steps increasing.
struct RunCurve {
  std::string name;
  std::vector<int64_t> steps;
  std::vector<double> values;
};

// Reads RUN/metrics.jsonl (docs/training.md): `metric` of every step record where it is a
// number (null: not evaluated at that step); events are skipped, and a step logged twice (a
// resumed run) keeps its later value. The curve is named after the folder. Throws fp8t::Error
// naming the file: missing, a line that does not parse (FILE:LINE), or no record with `metric`.
RunCurve read_run_curve(const std::filesystem::path& run_folder, const std::string& metric);
// The same, with nothing instead of the error when no record holds `metric` (a metric the run
// never logs, such as samples_per_second of a GPT run).
std::optional<RunCurve> read_logged_curve(const std::filesystem::path& run_folder,
                                          const std::string& metric);

// The mean of each value and the `window` − 1 before it (fewer at the start).
std::vector<double> moving_average(std::span<const double> values, int window);

// The curve's value at `step`, linearly interpolated between its logged steps; nothing outside
// them.
std::optional<double> value_at_step(const RunCurve& curve, int64_t step);

// (run / reference − 1) in percent at each of the run's steps that the reference's steps span,
// the reference linearly interpolated between its steps; steps where the reference is 0 are
// left out. Named after the run.
RunCurve relative_percent(const RunCurve& run, const RunCurve& reference);

// The run colours, in the order of the runs: the first run is the reference.
std::span<const Rgb> run_colors();

// 960 × 540 pixels: the title, a legend, then side by side the runs' curves of `metric` (the
// y range from the data) and each run relative to the first in percent, with a 0 line and ±5 %
// guides; steps on the x axes. At most run_colors().size() runs, each with at least one point.
Canvas draw_run_plot(std::span<const RunCurve> runs, std::string_view metric,
                     std::string_view title);

}  // namespace fp8t::io
