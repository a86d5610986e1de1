// Comparing runs: the loss of each run against the first (the reference, e.g. a BF16
// baseline), as a verdict "within X %", and a self-contained HTML report of the runs' curves
// (`fp8train compare`, `fp8train convergence`).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "io/plot.h"

namespace fp8t::train {

// One run's training loss against the reference's, at the last step both logged.
struct LossComparison {
  std::string name;
  int64_t step = 0;  // the last step both runs logged; 0: none in common
  double loss = 0.0, reference_loss = 0.0;
  double smoothed_loss = 0.0, smoothed_reference_loss = 0.0;
  double final_percent = 0.0;     // (loss / reference_loss − 1) · 100
  double smoothed_percent = 0.0;  // the same of the moving averages
  bool within = false;            // |smoothed_percent| <= tolerance
};

// Each run after the first against the first: losses (RunCurve of metric "loss"), smoothed by
// a moving average over `smooth` logged values. A run that shares no step with the reference
// is not within.
std::vector<LossComparison> compare_losses(const std::vector<io::RunCurve>& losses, int smooth,
                                           double tolerance);

// "verdict: fp8 against bf16 at step 600: final loss +0.42 %, smoothed (25 values) +0.31 %:
// within 5 %" (or "NOT within 5 %"; "no step in common").
std::string verdict_line(const LossComparison& comparison, const std::string& reference, int smooth,
                         double tolerance);

struct ComparisonReport {
  std::string html;
  std::vector<std::string> verdicts;  // one line per run after the first
  bool all_within = false;
};

// The HTML page (plots as embedded PNG pictures, no other file needed) for the run folders,
// the first the reference: the verdicts and a table of last values, then the loss (smoothed),
// validation loss, grad norm, throughput and memory curves each with the runs relative to the
// first. A metric no run logged is left out; a metric only some logged is drawn for those.
// Then for each run with an fp8_health.jsonl (FP8 runs) a section "FP8 health: RUN": the
// tensors with the highest saturated and underflow fractions, and the heat-maps of the two
// fractions over tensors × statistics steps. Throws fp8t::Error naming the folder whose
// metrics.jsonl is missing or unreadable, or the line of an fp8_health.jsonl that does not
// parse.
ComparisonReport compare_runs(const std::vector<std::filesystem::path>& run_folders, int smooth,
                              double tolerance);

}  // namespace fp8t::train
