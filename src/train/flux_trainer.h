// The Flux training job (docs/flux.md): a Flux preset trained on the built-in shapes data with
// the rectified-flow objective, AdamW over every parameter and the GPT trainer's run folder,
// log, checkpoints (under BFL's parameter names), resume and stop handling; sample grids into
// the run folder. The CPU path for now (train/flux_engine.h).
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <vector>

#include "config/train_config.h"
#include "data/flux_shapes.h"
#include "train/flux_sample_grid.h"
#include "train/trainer.h"

namespace fp8t::train {

// Runs the job of a Flux configuration; as run_training.
TrainOutcome run_flux_training(const TrainConfig& config);

// The built-in data of a Flux configuration: image_size, the model's text and pooled widths, the
// seed.
data::FluxShapesOptions flux_dataset_options(const TrainConfig& config);

// The sample grid of a Flux configuration: these prompts, the sample_* keys, the seed, the
// σ shift and latent normalization of training.
FluxGridOptions flux_grid_options(const TrainConfig& config, std::vector<std::string> prompts);

// Where the grid of step `step` goes: RUN/samples/step_NNNNNN.png.
std::filesystem::path flux_sample_grid_path(const std::filesystem::path& run_folder, int64_t step);

}  // namespace fp8t::train
