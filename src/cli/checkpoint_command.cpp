// `fp8train checkpoint verify`: checks checkpoints' files against their manifests
// (train/checkpoint.h).
#include <filesystem>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "cli/commands.h"
#include "core/error.h"
#include "train/checkpoint.h"
#include "train/run_log.h"

namespace fp8t::cli {

namespace fs = std::filesystem;

namespace {

// The checkpoint folders a path names: itself, or a run folder's checkpoints.
std::vector<fs::path> checkpoint_folders(const fs::path& path) {
  if (fs::exists(path / "trainer_state.json")) return {path};
  if (fs::is_directory(path / "checkpoints")) {
    std::vector<fs::path> folders;
    for (const int64_t step : train::saved_steps(path))
      folders.push_back(train::checkpoint_folder(path, step));
    if (!folders.empty()) return folders;
    throw Error(fmt::format("{}: the run folder holds no complete checkpoint", path.string()));
  }
  throw Error(fmt::format(
      "{}: neither a checkpoint folder (no trainer_state.json) nor a run folder (no checkpoints/)",
      path.string()));
}

}  // namespace

int run_checkpoint_verify(const CheckpointVerifyOptions& options) {
  int checked = 0, intact = 0;
  for (const std::string& path : options.paths) {
    for (const fs::path& folder : checkpoint_folders(path)) {
      ++checked;
      const train::CheckpointCheck check = train::verify_checkpoint(folder);
      if (!check.has_manifest) {
        fmt::print("FAIL {}: no manifest.json (saved by an earlier version): cannot be verified\n",
                   folder.string());
        continue;
      }
      bool damaged = false;
      for (const train::FileCheck& file : check.files) {
        if (file.problem.empty()) continue;
        damaged = true;
        fmt::print("FAIL {}: {}\n", (folder / file.file).string(), file.problem);
      }
      if (damaged) continue;
      ++intact;
      fmt::print("ok   {}: {} files, {}\n", folder.string(), check.files.size(),
                 train::format_bytes(double(check.bytes)));
    }
  }
  fmt::print("{} of {} checkpoints intact\n", intact, checked);
  return intact == checked ? kExitOk : kExitProblemFound;
}

}  // namespace fp8t::cli
