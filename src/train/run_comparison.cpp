#include "train/run_comparison.h"

#include <cmath>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"
#include "io/base64.h"
#include "io/png.h"

namespace fp8t::train {
namespace {

double percent(double value, double reference) {
  return 100.0 * (value / reference - 1.0);
}

std::string escape_html(const std::string& text) {
  std::string out;
  for (const char c : text) {
    switch (c) {
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '&':
        out += "&amp;";
        break;
      case '"':
        out += "&quot;";
        break;
      default:
        out.push_back(c);
    }
  }
  return out;
}

// The metrics the report draws: metrics.jsonl's field, and what the plot's title says.
struct Metric {
  const char* field;
  const char* title;
  bool smoothed;
};
constexpr Metric kMetrics[] = {
    {"loss", "training loss", true},
    {"val_loss", "validation loss", false},
    {"grad_norm", "gradient norm", true},
    {"tokens_per_second", "throughput, tokens/s", true},
    {"samples_per_second", "throughput, samples/s", true},
    {"memory_bytes", "memory, bytes", false},
};

// The runs' curves of a metric, smoothed when asked; runs that never logged it are left out.
std::vector<io::RunCurve> curves_of(const std::vector<std::filesystem::path>& folders,
                                    const Metric& metric, int smooth) {
  std::vector<io::RunCurve> curves;
  for (const std::filesystem::path& folder : folders) {
    std::optional<io::RunCurve> curve = io::read_logged_curve(folder, metric.field);
    if (!curve) continue;
    if (metric.smoothed) curve->values = io::moving_average(curve->values, smooth);
    curves.push_back(std::move(*curve));
  }
  return curves;
}

std::string image_of(const io::Canvas& canvas, const std::string& what) {
  return fmt::format(
      "<img alt=\"{}\" src=\"data:image/png;base64,{}\">", escape_html(what),
      io::base64_encode(io::encode_png(canvas.width(), canvas.height(), canvas.rgb(), what)));
}

// The FP8 health fractions the report shows: which, the picture's title, and the summary's
// words for its peak and for none at all.
struct HealthFraction {
  double io::Fp8HealthCell::*field;
  const char* title;
  const char* peak;
  const char* none;
};
constexpr HealthFraction kSaturated{&io::Fp8HealthCell::saturated_fraction,
                                    "saturated at the FP8 maximum, fraction of the tensor's values",
                                    "highest saturation", "no value saturated"};
constexpr HealthFraction kUnderflow{&io::Fp8HealthCell::underflow_fraction,
                                    "underflow to zero, fraction of the tensor's values",
                                    "highest underflow", "no value underflowed"};

// "h.0.attn.c_q input": the first part of the dotted layer names left out when they all share
// it (the GPT's "transformer.", beside its "lm_head"), so that the labels start where the
// layers differ.
std::vector<std::string> row_labels(const std::vector<io::Fp8HealthTensor>& tensors) {
  std::string shared;
  for (const io::Fp8HealthTensor& tensor : tensors) {
    const size_t dot = tensor.layer.find('.');
    if (dot == std::string::npos) continue;
    const std::string_view first(tensor.layer.data(), dot + 1);
    if (shared.empty()) shared = first;
    if (first != shared || tensor.layer.size() == first.size()) {
      shared.clear();
      break;
    }
  }
  std::vector<std::string> labels;
  for (const io::Fp8HealthTensor& tensor : tensors) {
    const bool shortened = !shared.empty() && tensor.layer.starts_with(shared);
    labels.push_back(
        fmt::format("{} {}", tensor.layer.substr(shortened ? shared.size() : 0), tensor.operand));
  }
  return labels;
}

io::FractionGrid fraction_grid(const io::Fp8HealthLog& log, const HealthFraction& fraction) {
  io::FractionGrid grid{row_labels(log.tensors), log.steps, {}};
  for (const io::Fp8HealthCell& cell : log.cells)
    grid.values.push_back(cell.*fraction.field);
  return grid;
}

// "highest saturation: transformer.h.3.mlp.c_proj grad_output at step 40, 0.00123 of its
// values (amax 812)": the largest fraction, at its earliest step, of the first tensor there.
std::string peak_line(const io::Fp8HealthLog& log, const HealthFraction& fraction) {
  double peak = 0.0;
  size_t peak_tensor = 0, peak_step = 0;
  for (size_t step = 0; step < log.steps.size(); ++step) {
    for (size_t tensor = 0; tensor < log.tensors.size(); ++tensor) {
      const double value = log.cell(tensor, step).*fraction.field;
      if (value > peak) {  // false for NaN: not logged
        peak = value;
        peak_tensor = tensor;
        peak_step = step;
      }
    }
  }
  if (peak == 0.0) return fmt::format("{} at any logged step", fraction.none);
  const double amax = log.cell(peak_tensor, peak_step).amax;
  return fmt::format("{}: {} {} at step {}, {:.3g} of its values{}", fraction.peak,
                     log.tensors[peak_tensor].layer, log.tensors[peak_tensor].operand,
                     log.steps[peak_step], peak,
                     std::isnan(amax) ? "" : fmt::format(" (amax {:.3g})", amax));
}

// "FP8 health: RUN" with the peaks and the heat-maps of underflow and saturation.
std::string health_section(const std::string& run, const io::Fp8HealthLog& log) {
  std::string html = fmt::format("<h2>FP8 health: {}</h2>\n", escape_html(run));
  if (log.tensors.empty()) return html + "<p>fp8_health.jsonl holds no statistics yet.</p>\n";
  html += fmt::format("<p>{}; {}.</p>\n", escape_html(peak_line(log, kSaturated)),
                      escape_html(peak_line(log, kUnderflow)));
  for (const HealthFraction& fraction : {kUnderflow, kSaturated}) {
    const std::string title = fmt::format("{}: {}", run, fraction.title);
    const io::Canvas heat_map =
        io::draw_fraction_heat_map(fraction_grid(log, fraction), title, "tensor (layer, operand)");
    html += image_of(heat_map, title) + "\n";
  }
  return html;
}

}  // namespace

std::vector<LossComparison> compare_losses(const std::vector<io::RunCurve>& losses, int smooth,
                                           double tolerance) {
  std::vector<LossComparison> comparisons;
  if (losses.empty()) return comparisons;
  const io::RunCurve& reference = losses.front();
  io::RunCurve smoothed_reference = reference;
  smoothed_reference.values = io::moving_average(reference.values, smooth);
  for (size_t r = 1; r < losses.size(); ++r) {
    const io::RunCurve& run = losses[r];
    LossComparison comparison{.name = run.name};
    const std::vector<double> smoothed = io::moving_average(run.values, smooth);
    for (size_t i = run.steps.size(); i-- > 0;) {
      const std::optional<double> at = io::value_at_step(reference, run.steps[i]);
      if (!at) continue;
      comparison.step = run.steps[i];
      comparison.loss = run.values[i];
      comparison.reference_loss = *at;
      comparison.smoothed_loss = smoothed[i];
      comparison.smoothed_reference_loss = *io::value_at_step(smoothed_reference, run.steps[i]);
      comparison.final_percent = percent(comparison.loss, comparison.reference_loss);
      comparison.smoothed_percent =
          percent(comparison.smoothed_loss, comparison.smoothed_reference_loss);
      comparison.within = std::fabs(comparison.smoothed_percent) <= tolerance;
      break;
    }
    comparisons.push_back(comparison);
  }
  return comparisons;
}

std::string verdict_line(const LossComparison& c, const std::string& reference, int smooth,
                         double tolerance) {
  if (c.step == 0) {
    return fmt::format("verdict: {} against {}: no step in common: NOT within {:g} %", c.name,
                       reference, tolerance);
  }
  return fmt::format(
      "verdict: {} against {} at step {}: final loss {:+.2f} % ({:.4f} against {:.4f}), smoothed "
      "({} values) {:+.2f} %: {}within {:g} %",
      c.name, reference, c.step, c.final_percent, c.loss, c.reference_loss, smooth,
      c.smoothed_percent, c.within ? "" : "NOT ", tolerance);
}

ComparisonReport compare_runs(const std::vector<std::filesystem::path>& run_folders, int smooth,
                              double tolerance) {
  FP8T_CHECK(run_folders.size() >= 2 && run_folders.size() <= io::run_colors().size(),
             "compare: expected 2 to {} run folders, found {}", io::run_colors().size(),
             run_folders.size());
  std::vector<io::RunCurve> losses;
  for (const std::filesystem::path& folder : run_folders)
    losses.push_back(io::read_run_curve(folder, "loss"));
  const std::string reference = losses.front().name;
  ComparisonReport report;
  report.all_within = true;
  const std::vector<LossComparison> comparisons = compare_losses(losses, smooth, tolerance);
  for (const LossComparison& comparison : comparisons) {
    report.verdicts.push_back(verdict_line(comparison, reference, smooth, tolerance));
    report.all_within = report.all_within && comparison.within;
  }

  std::string html = fmt::format(
      "<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>fp8train: {} runs against "
      "{}</title>\n<style>body{{font-family:sans-serif;max-width:1000px;margin:2em auto}}"
      "table{{border-collapse:collapse}}td,th{{border:1px solid #ccc;padding:4px 8px;"
      "text-align:right}}.no{{color:#b00}}.yes{{color:#070}}img{{max-width:100%}}</style>"
      "</head><body>\n<h1>{} runs against {}</h1>\n",
      run_folders.size(), escape_html(reference), run_folders.size(), escape_html(reference));
  html += fmt::format(
      "<p>Reference: <b>{}</b>. Tolerance: the smoothed training loss (moving average of {} "
      "logged values) within {:g} % of the reference's at the last step both logged.</p>\n",
      escape_html(reference), smooth, tolerance);
  for (size_t i = 0; i < comparisons.size(); ++i) {
    html += fmt::format("<p class=\"{}\"><b>{}</b></p>\n", comparisons[i].within ? "yes" : "no",
                        escape_html(report.verdicts[i]));
  }
  html += "<table><tr><th>run</th><th>folder</th><th>last step</th><th>loss</th></tr>\n";
  for (size_t i = 0; i < losses.size(); ++i) {
    html += fmt::format("<tr><td>{}</td><td>{}</td><td>{}</td><td>{:.4f}</td></tr>\n",
                        escape_html(losses[i].name), escape_html(run_folders[i].string()),
                        losses[i].steps.back(), losses[i].values.back());
  }
  html += "</table>\n";
  for (const Metric& metric : kMetrics) {
    const std::vector<io::RunCurve> curves = curves_of(run_folders, metric, smooth);
    if (curves.empty()) continue;
    const std::string title =
        metric.smoothed && smooth > 1
            ? fmt::format("{}, moving average of {} values", metric.title, smooth)
            : std::string(metric.title);
    html += fmt::format("<h2>{}</h2>\n{}\n", escape_html(title),
                        image_of(io::draw_run_plot(curves, metric.field, title), title));
  }
  bool any_health = false;
  for (size_t i = 0; i < run_folders.size(); ++i) {
    const std::optional<io::Fp8HealthLog> health = io::read_fp8_health(run_folders[i]);
    if (!health) continue;
    html += health_section(losses[i].name, *health);
    any_health = true;
  }
  if (!any_health) html += "<p>FP8 health: no run logged fp8_health.jsonl.</p>\n";
  html += "</body></html>\n";
  report.html = std::move(html);
  return report;
}

}  // namespace fp8t::train
