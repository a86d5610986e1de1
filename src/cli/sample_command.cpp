// `fp8train sample`: pictures from a Flux checkpoint, as a PNG grid.
#include <filesystem>
#include <memory>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "cli/commands.h"
#include "config/train_config.h"
#include "core/arena.h"
#include "core/error.h"
#include "train/checkpoint.h"
#include "train/flux_trainer.h"

namespace fp8t::cli {

namespace fs = std::filesystem;

namespace {

// The model file of a checkpoint folder, the file itself, or the last checkpoint of a run
// folder.
fs::path model_file(const fs::path& checkpoint) {
  if (fs::is_regular_file(checkpoint)) return checkpoint;
  if (fs::is_regular_file(checkpoint / "model.safetensors"))
    return checkpoint / "model.safetensors";
  if (const std::vector<int64_t> steps = train::saved_steps(checkpoint); !steps.empty()) {
    return train::checkpoint_folder(checkpoint, steps.back()) / "model.safetensors";
  }
  throw Error(
      fmt::format("--checkpoint: {} is neither a model.safetensors file, nor a "
                  "checkpoint folder holding one, nor a run folder with checkpoints",
                  checkpoint.string()));
}

}  // namespace

int run_sample(const SampleOptions& options) {
  const fs::path model_path = model_file(options.checkpoint);
  fs::path config_path = options.config_path;
  if (config_path.empty()) {
    config_path = model_path.parent_path() / "config.yaml";
    if (!fs::exists(config_path)) {
      throw ConfigError(
          fmt::format("{}: no config.yaml beside the model; pass --config", model_path.string()));
    }
  }
  const TrainConfig config = load_train_config({"--config", config_path.string()});
  if (!config.is_flux()) {
    throw ConfigError(
        fmt::format("{}: model: {}; sample draws pictures from a Flux model (the "
                    "GPT's text sample comes from train with sample_tokens)",
                    config_path.string(), config.model.name));
  }
  if (!config.data.flux_shards.empty()) {
    throw ConfigError(fmt::format(
        "{}: flux_shards: '{}': sample encodes prompts and decodes pictures of the built-in data "
        "only; a model trained on shards needs its own text encoders and VAE",
        config_path.string(), config.data.flux_shards));
  }
  const FluxConfig model = config.flux_config();
  std::vector<std::string> prompts =
      options.prompts.empty() ? train::split_prompts(config.run.sample_prompts) : options.prompts;
  if (prompts.empty()) {
    throw ConfigError(
        fmt::format("{}: sample_prompts is empty; give --prompt", config_path.string()));
  }
  train::FluxGridOptions grid_options = train::flux_grid_options(config, std::move(prompts));
  if (options.steps) grid_options.sampling.steps = *options.steps;
  if (options.guidance) grid_options.sampling.guidance = *options.guidance;
  if (options.seed) grid_options.seed = *options.seed;
  if (options.images_per_prompt) grid_options.images_per_prompt = *options.images_per_prompt;

  const data::FluxShapesDataset dataset(train::flux_dataset_options(config));
  train::FluxSampleGrid grid(dataset, model, grid_options);
  Arena arena("checkpoint weights", FluxParameterSet::planned_bytes(model, DType::F32));
  FluxParameterSet weights(arena, model, DType::F32);
  std::vector<NamedTensor> tensors;
  for (const FluxParam& param : weights.specs())
    tensors.push_back({param.name, weights[param.name]});
  train::read_checkpoint_tensors(model_path, tensors);

  fmt::print("checkpoint: {} ({})\n", model_path.string(), config.model.name);
  fmt::print("sampling: {} Euler steps, guidance {}, σ shift {}, seeds {} .. {}\n",
             grid_options.sampling.steps, grid_options.sampling.guidance,
             grid_options.sampling.shift, grid_options.seed,
             grid_options.seed + uint64_t(grid_options.images_per_prompt) - 1);
  grid.write(weights, options.output);
  fmt::print("wrote {}: {}x{} pixels, a row per prompt:\n", options.output, grid.width(),
             grid.height());
  for (const std::string& prompt : grid_options.prompts)
    fmt::print("  {}\n", prompt);
  return kExitOk;
}

}  // namespace fp8t::cli
