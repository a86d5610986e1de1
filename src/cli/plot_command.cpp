// `fp8train plot`: runs' loss curves side by side in a PNG, for loss parity between precisions.
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "cli/commands.h"
#include "core/error.h"
#include "io/plot.h"
#include "io/png.h"

namespace fp8t::cli {

int run_plot(const PlotOptions& options) {
  if (options.run_folders.size() > io::run_colors().size()) {
    throw Error(fmt::format("plot: at most {} run folders (one colour each), found {}",
                            io::run_colors().size(), options.run_folders.size()));
  }
  std::vector<io::RunCurve> runs;
  for (const std::string& folder : options.run_folders) {
    io::RunCurve run = io::read_run_curve(folder, options.metric);
    run.values = io::moving_average(run.values, options.smooth);
    runs.push_back(std::move(run));
  }
  const std::string smoothing =
      options.smooth > 1 ? fmt::format(", moving average of {} values", options.smooth) : "";
  const std::string title =
      options.title.empty() ? fmt::format("{}{}", options.metric, smoothing) : options.title;
  const io::Canvas canvas = io::draw_run_plot(runs, options.metric, title);
  io::write_png(options.output, canvas.width(), canvas.height(), canvas.rgb());

  const io::RunCurve& reference = runs.front();
  fmt::print("{}{}; reference: {}\n", options.metric, smoothing, reference.name);
  fmt::print("| run | last step | {} | vs {} |\n|---|---|---|---|\n", options.metric,
             reference.name);
  for (const io::RunCurve& run : runs) {
    // The relative value at the last step both runs cover, named when it is not the run's last.
    const io::RunCurve relative = io::relative_percent(run, reference);
    std::string versus = "no common steps";
    if (&run == &reference) {
      versus = "reference";
    } else if (!relative.steps.empty()) {
      versus = fmt::format("{:+.2f} %", relative.values.back());
      if (relative.steps.back() != run.steps.back())
        versus += fmt::format(" at step {}", relative.steps.back());
    }
    fmt::print("| {} | {} | {:.4f} | {} |\n", run.name, run.steps.back(), run.values.back(),
               versus);
  }
  fmt::print("wrote {}: {}x{} pixels\n", options.output, canvas.width(), canvas.height());
  return kExitOk;
}

}  // namespace fp8t::cli
