// Charts as RGB pictures, for comparing runs without a plotting or font library: a canvas with
// lines and a built-in 5×7 bitmap font; the curves read from run folders' metrics.jsonl and the
// two-panel run plot that `fp8train plot` writes; the FP8 health read from fp8_health.jsonl and
// the heat-map of a fraction over tensors × steps that `fp8train compare` shows.
#pragma once

#include <cstdint>
#include <filesystem>
#include <limits>
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
// . , - + % _ : ( ) / = ? '; any other character is drawn as '?'. A glyph fills a 5 × 7 box; the
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

// What the FP8 casts of one tensor did at one statistics step: the fractions of its values that
// saturated at ±max and that underflowed to zero, and the largest |value| cast. NaN: not logged
// (no line for the tensor at that step, or null, as the amax of the block recipes is).
struct Fp8HealthCell {
  double saturated_fraction = std::numeric_limits<double>::quiet_NaN();
  double underflow_fraction = std::numeric_limits<double>::quiet_NaN();
  double amax = std::numeric_limits<double>::quiet_NaN();
};

// A quantized tensor: a linear and one of its operands.
struct Fp8HealthTensor {
  std::string layer;    // "transformer.h.0.attn.c_q"
  std::string operand;  // "input", "weight" or "grad_output"
  bool operator==(const Fp8HealthTensor&) const = default;
};

// One run's FP8 health over its statistics steps.
struct Fp8HealthLog {
  // The layers in the order they first appear (the model's), each layer's operands as input,
  // weight, grad_output (any other after them, as they appear).
  std::vector<Fp8HealthTensor> tensors;
  std::vector<int64_t> steps;        // every step some tensor was logged at, ascending
  std::vector<Fp8HealthCell> cells;  // [tensor][step]

  const Fp8HealthCell& cell(size_t tensor, size_t step) const {
    return cells[tensor * steps.size() + step];
  }
};

// Reads RUN/fp8_health.jsonl (docs/cli.md, `fp8train compare`): one object per tensor per
// statistics step with `step`, `layer`, `operand`, `amax`, `saturated_fraction` and
// `underflow_fraction` (other fields are ignored); a tensor logged twice at a step (a resumed
// run) keeps its later line. Nothing when the file does not exist (BF16 runs write none).
// Throws fp8t::Error naming FILE:LINE for a line that does not parse or lacks a field.
std::optional<Fp8HealthLog> read_fp8_health(const std::filesystem::path& run_folder);

// Fractions (0 to 1) over rows × steps, as draw_fraction_heat_map draws them.
struct FractionGrid {
  std::vector<std::string> row_labels;
  std::vector<int64_t> steps;  // the columns, ascending
  std::vector<double> values;  // [row][column]; NaN: no value
};

// A heat-map 960 pixels wide: the title and a legend, then a cell per row and step whose colour
// is the fraction on a log scale (1e-6 and below the lightest, 1 the darkest), exactly 0 light
// grey, no value hatched grey; the rows labelled at the left under `row_title` (every k-th when
// too many to label each), steps below. A row gets at least 1 pixel and the grid at most 1000;
// beyond that (or more steps than pixels) a pixel shows the largest of the cells it covers, so
// that a single bad cell stays visible. Throws fp8t::Error for an empty grid or values whose
// count is not rows × steps.
Canvas draw_fraction_heat_map(const FractionGrid& grid, std::string_view title,
                              std::string_view row_title);

}  // namespace fp8t::io
