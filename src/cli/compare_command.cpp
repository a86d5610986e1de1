// `fp8train compare` and `fp8train convergence`: runs against a reference run, as a verdict and
// an HTML report.
#include <filesystem>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "cli/commands.h"
#include "config/train_config.h"
#include "core/error.h"
#include "io/files.h"
#include "numerics/scaling.h"
#include "train/run_comparison.h"

namespace fp8t::cli {

namespace {

int write_report(const std::vector<std::filesystem::path>& folders, const std::string& output,
                 int smooth, double tolerance) {
  const train::ComparisonReport report = train::compare_runs(folders, smooth, tolerance);
  io::write_file_atomically(output, report.html);
  for (const std::string& verdict : report.verdicts)
    fmt::print("{}\n", verdict);
  fmt::print("wrote {}\n", output);
  return report.all_within ? kExitOk : kExitProblemFound;
}

}  // namespace

int run_compare(const CompareOptions& options) {
  const std::vector<std::filesystem::path> folders(options.run_folders.begin(),
                                                   options.run_folders.end());
  return write_report(folders, options.output, options.smooth, options.tolerance);
}

int run_convergence(const ConvergenceOptions& options) {
  const TrainConfig config = load_train_config(options.config_args);
  if (config.fp8_config().mode == Fp8Mode::None) {
    throw ConfigError(
        "convergence: the configuration trains in BF16 (fp8: none); set fp8 (hybrid or e4m3) "
        "to compare an FP8 run with its BF16 baseline");
  }
  const std::string steps = fmt::format(
      "--train-iters={}", options.steps > 0 ? options.steps : config.training.train_iters);
  const auto arguments = [&](const std::string& run, bool bf16) {
    std::vector<std::string> args = options.config_args;
    args.push_back(steps);
    args.push_back("--run=" + run);
    if (bf16) args.push_back("--fp8=none");
    return args;
  };
  const std::string bf16_run = config.run.name + "-bf16", fp8_run = config.run.name + "-fp8";
  for (const auto& [run, bf16] : {std::pair{bf16_run, true}, std::pair{fp8_run, false}}) {
    fmt::print("convergence: training {} ({})\n", run, bf16 ? "fp8: none" : "as configured");
    const int status = run_train(arguments(run, bf16));
    if (status != kExitOk) return status;  // interrupted: the run says how to resume
  }
  const std::filesystem::path output_dir(config.run.output_dir);
  return write_report({output_dir / bf16_run, output_dir / fp8_run},
                      (output_dir / (config.run.name + "-convergence.html")).string(),
                      options.smooth, options.tolerance);
}

}  // namespace fp8t::cli
