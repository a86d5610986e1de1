#include "train/checkpoint.h"

#include <algorithm>
#include <charconv>
#include <cstring>
#include <functional>
#include <set>
#include <system_error>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/error.h"
#include "io/files.h"
#include "io/safetensors.h"

namespace fp8t::train {

namespace fs = std::filesystem;

namespace {

constexpr std::string_view kStepPrefix = "step_";
constexpr int kFormatVersion = 1;
constexpr std::string_view kManifestName = "manifest.json";
constexpr std::string_view kManifestFormat = "fp8train-checkpoint-manifest";

std::string crc32_text(uint32_t crc) {
  return fmt::format("{:08x}", crc);
}

// "100, 200", or "none".
std::string steps_text(const std::vector<int64_t>& steps) {
  return steps.empty() ? "none" : fmt::format("{}", fmt::join(steps, ", "));
}

std::vector<int64_t> shape_of(const TensorView& view) {
  std::vector<int64_t> shape(static_cast<size_t>(view.rank()));
  for (int i = 0; i < view.rank(); ++i)
    shape[static_cast<size_t>(i)] = view.dim(i);
  return shape;
}

io::DType file_dtype(const NamedTensor& buffer) {
  switch (buffer.view.dtype()) {
    case DType::F32:
      return io::DType::F32;
    case DType::I64:
      return io::DType::I64;
    default:
      throw Error(fmt::format("state buffer '{}': dtype {} cannot be checkpointed", buffer.name,
                              dtype_name(buffer.view.dtype())));
  }
}

io::FileDigest write_tensors(const fs::path& path, const std::vector<NamedTensor>& buffers) {
  std::vector<io::TensorToWrite> tensors;
  tensors.reserve(buffers.size());
  for (const NamedTensor& buffer : buffers) {
    const auto* bytes = static_cast<const std::byte*>(buffer.view.raw());
    tensors.push_back({buffer.name, file_dtype(buffer), shape_of(buffer.view),
                       std::span<const std::byte>(bytes, buffer.view.bytes())});
  }
  return io::write_safetensors(path, tensors, {{"format", "pt"}});
}

// F32 buffers also read BF16 tensors: nanochat stores its embeddings in bf16.
void read_tensor(const io::SafetensorsFile& file, const fs::path& path, const NamedTensor& buffer) {
  const io::TensorInfo& info = file.info(buffer.name);
  const std::vector<int64_t> shape = shape_of(buffer.view);
  if (info.shape != shape) {
    throw Error(fmt::format("{}: tensor '{}' has shape [{}], expected [{}]", path.string(),
                            buffer.name, fmt::join(info.shape, ", "), fmt::join(shape, ", ")));
  }
  const io::DType wanted = file_dtype(buffer);
  if (info.dtype == wanted) {
    const io::RawTensor raw = file.raw(buffer.name);
    std::memcpy(buffer.view.raw(), raw.bytes.data(), raw.bytes.size());
  } else if (wanted == io::DType::F32 && info.dtype == io::DType::BF16) {
    const std::vector<bf16> values = file.tensor<bf16>(buffer.name).data;
    std::transform(values.begin(), values.end(), buffer.view.data<float>(),
                   [](bf16 value) { return bf16_to_float(value); });
  } else {
    throw Error(fmt::format("{}: tensor '{}' has dtype {}, expected {}", path.string(), buffer.name,
                            io::dtype_name(info.dtype), io::dtype_name(wanted)));
  }
}

// Reads each buffer from the file's tensor of its name, in order; calls on_missing for a buffer
// the file has no tensor for (left as it is), then on_unexpected for each tensor of the file no
// buffer names (not read).
void read_tensors_by_name(const fs::path& path, const std::vector<NamedTensor>& buffers,
                          const std::function<void(const std::string&)>& on_missing,
                          const std::function<void(const std::string&)>& on_unexpected) {
  const io::SafetensorsFile file(path);
  std::set<std::string> expected;
  for (const NamedTensor& buffer : buffers) {
    expected.insert(buffer.name);
    if (file.contains(buffer.name)) {
      read_tensor(file, path, buffer);
    } else {
      on_missing(buffer.name);
    }
  }
  for (const std::string& name : file.names()) {
    if (!expected.contains(name)) on_unexpected(name);
  }
}

}  // namespace

void read_checkpoint_tensors(const fs::path& path, const std::vector<NamedTensor>& buffers) {
  read_tensors_by_name(
      path, buffers,
      [&](const std::string& name) {
        throw Error(fmt::format("{}: tensor '{}' is missing", path.string(), name));
      },
      [&](const std::string& name) {
        throw Error(fmt::format("{}: unexpected tensor '{}' (not part of this model)",
                                path.string(), name));
      });
}

namespace {

// Parses "step_000300" into 300; nothing for other names (temporary folders among them).
std::optional<int64_t> step_of(const std::string& name) {
  if (!name.starts_with(kStepPrefix)) return std::nullopt;
  const std::string_view digits = std::string_view(name).substr(kStepPrefix.size());
  int64_t step = 0;
  const auto [end, error] = std::from_chars(digits.data(), digits.data() + digits.size(), step);
  if (error != std::errc() || end != digits.data() + digits.size() || digits.empty()) {
    return std::nullopt;
  }
  return step;
}

}  // namespace

ScalingStateBuffers::ScalingStateBuffers(
    std::vector<std::pair<std::string, DelayedScaling*>> scalings)
    : scalings_(std::move(scalings)), state_(scalings_.size()) {
  for (size_t i = 0; i < scalings_.size(); ++i)
    state_[i].resize(size_t(scalings_[i].second->state_size()));
}

std::vector<NamedTensor> ScalingStateBuffers::tensors() {
  std::vector<NamedTensor> tensors;
  for (size_t i = 0; i < scalings_.size(); ++i) {
    tensors.push_back({scalings_[i].first + ".state",
                       TensorView(state_[i].data(), DType::F32, {int64_t(state_[i].size())})});
  }
  return tensors;
}

void ScalingStateBuffers::copy_from_scalings() {
  for (size_t i = 0; i < scalings_.size(); ++i)
    scalings_[i].second->save_state(state_[i].data());
}

void ScalingStateBuffers::copy_to_scalings() const {
  for (size_t i = 0; i < scalings_.size(); ++i)
    scalings_[i].second->load_state(state_[i].data());
}

fs::path checkpoint_folder(const fs::path& run_folder, int64_t step) {
  return run_folder / "checkpoints" / fmt::format("{}{:06d}", kStepPrefix, step);
}

std::vector<int64_t> saved_steps(const fs::path& run_folder) {
  std::vector<int64_t> steps;
  std::error_code error;
  for (const fs::directory_entry& entry :
       fs::directory_iterator(run_folder / "checkpoints", error)) {
    const std::optional<int64_t> step = step_of(entry.path().filename().string());
    if (step && fs::exists(entry.path() / "trainer_state.json")) steps.push_back(*step);
  }
  std::sort(steps.begin(), steps.end());
  return steps;
}

void save_checkpoint(const fs::path& run_folder, const CheckpointContents& contents) {
  const fs::path final_folder = checkpoint_folder(run_folder, contents.step);
  const fs::path checkpoints = final_folder.parent_path();
  const fs::path partial = checkpoints / (final_folder.filename().string() + ".partial");
  std::error_code error;
  fs::create_directories(checkpoints, error);
  if (error) {
    throw Error(fmt::format("{}: cannot create the checkpoint folder: {}", checkpoints.string(),
                            error.message()));
  }
  fs::remove_all(partial, error);  // left by a crash during an earlier save
  if (!fs::create_directory(partial, error) || error) {
    throw Error(fmt::format("{}: cannot create: {}", partial.string(),
                            error ? error.message() : "it exists"));
  }
  try {
    // Each file's digest, of the bytes written (trainer_state.json's, of the bytes to come).
    nlohmann::json files = nlohmann::json::array();
    const auto record = [&files](std::string_view name, const io::FileDigest& digest) {
      files.push_back(
          {{"name", name}, {"bytes", digest.bytes}, {"crc32", crc32_text(digest.crc32)}});
    };
    record("model.safetensors", write_tensors(partial / "model.safetensors", contents.model));
    record("optimizer.safetensors",
           write_tensors(partial / "optimizer.safetensors", contents.optimizer));
    if (!contents.fp8_scaling.empty()) {
      record("fp8_scaling.safetensors",
             write_tensors(partial / "fp8_scaling.safetensors", contents.fp8_scaling));
    }
    record("config.yaml", io::write_file_atomically(partial / "config.yaml", contents.config_yaml));
    nlohmann::json state = contents.trainer_state;
    state["format_version"] = kFormatVersion;
    state["step"] = contents.step;
    const std::string state_text = state.dump(2) + "\n";
    record("trainer_state.json", io::digest_of(state_text));
    const nlohmann::json manifest = {{"format", kManifestFormat}, {"version", 1}, {"files", files}};
    io::write_file_atomically(partial / kManifestName, manifest.dump(2) + "\n");
    // Written last: a folder without it is never taken for a checkpoint.
    io::write_file_atomically(partial / "trainer_state.json", state_text);
  } catch (const Error&) {
    fs::remove_all(partial, error);
    throw;
  }
  // Swap in: the old checkpoint of this step (a re-save after resuming) goes only once the new
  // one is complete. Exchanged in one step where the file system can, so that a crash never
  // leaves the step without a checkpoint; else moved aside first.
  const fs::path replaced = checkpoints / (final_folder.filename().string() + ".replaced");
  fs::remove_all(replaced, error);
  if (fs::exists(final_folder) && io::exchange_paths(partial, final_folder)) {
    fs::rename(partial, replaced, error);
  } else {
    if (fs::exists(final_folder)) fs::rename(final_folder, replaced, error);
    if (!error) fs::rename(partial, final_folder, error);
  }
  if (error) {
    throw Error(fmt::format("{}: cannot move the new checkpoint into place: {}",
                            final_folder.string(), error.message()));
  }
  io::sync_folder(checkpoints);
  fs::remove_all(replaced, error);
}

std::string CheckpointCheck::first_problem(const fs::path& folder) const {
  for (const FileCheck& check : files) {
    if (!check.problem.empty())
      return fmt::format("{}: {}", (folder / check.file).string(), check.problem);
  }
  return "";
}

CheckpointCheck verify_checkpoint(const fs::path& folder) {
  CheckpointCheck result;
  const fs::path manifest_path = folder / kManifestName;
  if (!fs::exists(manifest_path)) return result;
  result.has_manifest = true;
  nlohmann::json manifest;
  try {
    manifest = nlohmann::json::parse(io::read_file(manifest_path));
    if (manifest.at("format") != kManifestFormat || !manifest.at("files").is_array()) {
      throw Error("not a checkpoint manifest");
    }
  } catch (const std::exception& e) {
    result.files.push_back({std::string(kManifestName), fmt::format("unreadable: {}", e.what())});
    return result;
  }
  for (const nlohmann::json& entry : manifest.at("files")) {
    FileCheck check;
    try {
      check.file = entry.at("name").get<std::string>();
      const auto bytes = entry.at("bytes").get<uint64_t>();
      const auto crc = entry.at("crc32").get<std::string>();
      const std::optional<io::FileDigest> found = io::file_digest(folder / check.file);
      if (!found) {
        check.problem = "missing or unreadable";
      } else if (found->bytes != bytes) {
        check.problem = fmt::format("{} bytes, the manifest says {}: cut short or overwritten",
                                    found->bytes, bytes);
      } else if (crc32_text(found->crc32) != crc) {
        check.problem = fmt::format("CRC-32 {}, the manifest says {}: the contents changed",
                                    crc32_text(found->crc32), crc);
      }
      result.bytes += found ? found->bytes : 0;
    } catch (const nlohmann::json::exception& e) {
      check.file = std::string(kManifestName);
      check.problem = fmt::format("bad entry: {}", e.what());
    }
    result.files.push_back(std::move(check));
  }
  return result;
}

namespace {

// Deletes the step folders of the steps `doomed` picks, complete or left half deleted by a crash
// during an earlier deletion.
void delete_step_folders(const fs::path& run_folder, const std::function<bool(int64_t)>& doomed) {
  std::vector<fs::path> folders;
  std::error_code error;
  for (const fs::directory_entry& entry :
       fs::directory_iterator(run_folder / "checkpoints", error)) {
    const std::optional<int64_t> step = step_of(entry.path().filename().string());
    if (step && doomed(*step)) folders.push_back(entry.path());
  }
  for (const fs::path& folder : folders) {
    // trainer_state.json first: a crash during the deletion then leaves a folder that is no
    // longer taken for a checkpoint, not one that looks complete and fails its manifest check.
    fs::remove(folder / "trainer_state.json", error);
    if (!error) fs::remove_all(folder, error);
    if (error) {
      throw Error(fmt::format("{}: cannot delete: {}", folder.string(), error.message()));
    }
  }
}

}  // namespace

void prune_checkpoints(const fs::path& run_folder, int64_t keep) {
  if (keep <= 0) return;
  const std::vector<int64_t> steps = saved_steps(run_folder);
  if (steps.size() <= static_cast<size_t>(keep)) return;
  const int64_t oldest_kept = steps[steps.size() - static_cast<size_t>(keep)];
  delete_step_folders(run_folder, [oldest_kept](int64_t step) { return step < oldest_kept; });
}

void discard_checkpoints_after(const fs::path& run_folder, int64_t step) {
  delete_step_folders(run_folder, [step](int64_t saved) { return saved > step; });
}

LoadedCheckpoint load_checkpoint(const fs::path& run_folder, int64_t step,
                                 const CheckpointContents& contents) {
  const fs::path folder = checkpoint_folder(run_folder, step);
  const fs::path state_path = folder / "trainer_state.json";
  if (!fs::exists(state_path)) {
    const std::vector<int64_t> steps = saved_steps(run_folder);
    throw Error(fmt::format("{}: no checkpoint of step {}; saved steps: {}", run_folder.string(),
                            step, steps_text(steps)));
  }
  const std::string damaged = verify_checkpoint(folder).first_problem(folder);
  if (!damaged.empty()) {
    std::vector<int64_t> earlier = saved_steps(run_folder);
    std::erase_if(earlier, [step](int64_t saved) { return saved >= step; });
    throw Error(fmt::format("{}; earlier checkpoints: {}", damaged, steps_text(earlier)));
  }
  LoadedCheckpoint loaded;
  try {
    loaded.trainer_state = nlohmann::json::parse(io::read_file(state_path));
  } catch (const nlohmann::json::exception& e) {
    throw Error(fmt::format("{}: not valid JSON: {}", state_path.string(), e.what()));
  }
  const int version = loaded.trainer_state.value("format_version", 0);
  if (version != kFormatVersion) {
    throw Error(fmt::format("{}: format_version {} is not supported (this build reads {})",
                            state_path.string(), version, kFormatVersion));
  }
  if (contents.with_tensors) {
    read_checkpoint_tensors(folder / "model.safetensors", contents.model);
    read_checkpoint_tensors(folder / "optimizer.safetensors", contents.optimizer);
  }
  const fs::path fp8_path = folder / "fp8_scaling.safetensors";
  loaded.had_fp8_scaling = fs::exists(fp8_path);
  if (loaded.had_fp8_scaling && !contents.fp8_scaling.empty()) {
    // By name: the FP8 linears may differ from the saving run's.
    read_tensors_by_name(
        fp8_path, contents.fp8_scaling,
        [&](const std::string& name) { loaded.fp8_scaling_missing.push_back(name); },
        [&](const std::string& name) { loaded.fp8_scaling_ignored.push_back(name); });
  }
  loaded.config_yaml = io::read_file(folder / "config.yaml");
  return loaded;
}

}  // namespace fp8t::train
