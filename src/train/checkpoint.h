// Checkpoints of a training run: one folder per saved step inside the run folder,
//
//   RUN/checkpoints/step_000300/
//     model.safetensors        weights under nanochat's state_dict names (fp32 masters)
//     optimizer.safetensors    every optimizer state buffer and the step counters
//     fp8_scaling.safetensors  delayed scaling's scales and amax histories (delayed recipe only)
//     trainer_state.json       step, data position, RNG and run totals
//     config.yaml              the resolved configuration the run was saved with
//     manifest.json            every other file's size and CRC-32, checked before a load
//
// A checkpoint is written into a temporary folder and renamed into place only when every file
// is on disk, so a crash or a full disk during a save never damages an earlier checkpoint; the
// manifest finds a file damaged afterwards (a bad disk, a copy cut short).
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/tensor.h"
#include "numerics/scaling.h"

namespace fp8t::train {

struct CheckpointContents {
  int64_t step = 0;
  std::vector<NamedTensor> model;
  std::vector<NamedTensor> optimizer;
  std::vector<NamedTensor> fp8_scaling;  // empty unless the recipe keeps state
  // false: a rank that keeps no copy of the model and optimizer tensors (they reach it from
  // another rank); a load reads everything else.
  bool with_tensors = true;
  nlohmann::json trainer_state = nlohmann::json::object();
  std::string config_yaml;
};

// The delayed-scaling state of a model's FP8 linears as checkpoint tensors
// "<linear>.<role>.state" (a model's delayed_scalings()): copied out of the scalings before a
// save, into them after a load.
class ScalingStateBuffers {
 public:
  explicit ScalingStateBuffers(std::vector<std::pair<std::string, DelayedScaling*>> scalings);

  bool empty() const { return scalings_.empty(); }
  // Views of the buffers, for CheckpointContents::fp8_scaling.
  std::vector<NamedTensor> tensors();
  void copy_from_scalings();
  void copy_to_scalings() const;

 private:
  std::vector<std::pair<std::string, DelayedScaling*>> scalings_;
  std::vector<std::vector<float>> state_;
};

std::filesystem::path checkpoint_folder(const std::filesystem::path& run_folder, int64_t step);

// Steps that have a complete checkpoint in the run folder, ascending.
std::vector<int64_t> saved_steps(const std::filesystem::path& run_folder);

// Writes the checkpoint of contents.step. Replaces an existing checkpoint of the same step only
// once the new one is complete. Throws fp8t::Error naming the file that could not be written.
void save_checkpoint(const std::filesystem::path& run_folder, const CheckpointContents& contents);

// Fills every buffer from a safetensors file, which must hold exactly these tensors (a missing,
// extra or misshapen tensor is an error naming the file and the tensor); F32 buffers also read
// BF16 tensors. For a checkpoint's model.safetensors outside training (sampling).
void read_checkpoint_tensors(const std::filesystem::path& path,
                             const std::vector<NamedTensor>& buffers);

struct LoadedCheckpoint {
  nlohmann::json trainer_state;
  std::string config_yaml;
  bool had_fp8_scaling = false;  // false: the run that saved it kept no FP8 scaling state
  // When the FP8 linears differ from the saving run's: the delayed-scaling states the
  // checkpoint lacks (their buffers are left as they are) and those it has for linears no
  // longer in FP8 (not read).
  std::vector<std::string> fp8_scaling_missing;
  std::vector<std::string> fp8_scaling_ignored;
};

// A checkpoint folder's files against its manifest.
struct FileCheck {
  std::string file;     // its name in the folder
  std::string problem;  // empty: as the manifest says
};
struct CheckpointCheck {
  bool has_manifest = false;  // false: saved before manifests; its files cannot be checked
  std::vector<FileCheck> files;
  uint64_t bytes = 0;  // of the files checked
  // The first damaged file as "folder/file: problem", or empty.
  std::string first_problem(const std::filesystem::path& folder) const;
};
CheckpointCheck verify_checkpoint(const std::filesystem::path& folder);

// Deletes the run folder's checkpoints older than its newest complete `keep` (0: keeps all),
// and any older folder a crash left half deleted.
void prune_checkpoints(const std::filesystem::path& run_folder, int64_t keep);

// Deletes the run folder's checkpoints after `step`: a run restored to `step` abandons them.
void discard_checkpoints_after(const std::filesystem::path& run_folder, int64_t step);

// Reads the checkpoint of `step` into the buffers of `contents` (names and shapes must match:
// a missing, extra or misshapen tensor is an error naming the file and the tensor; without
// with_tensors, the model and optimizer files are checked but not read), after
// checking its files against the manifest (a damaged file is an error naming it). The
// fp8_scaling buffers are filled by name from what the checkpoint has and left alone otherwise
// (a BF16 checkpoint resumed with FP8, a linear that was not FP8 when it was saved). Throws
// fp8t::Error listing the saved steps when there is no checkpoint of `step`.
LoadedCheckpoint load_checkpoint(const std::filesystem::path& run_folder, int64_t step,
                                 const CheckpointContents& contents);

}  // namespace fp8t::train
