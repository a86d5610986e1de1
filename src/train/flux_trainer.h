// The Flux training job (docs/flux.md): a Flux preset trained on the built-in shapes data or on
// precomputed shards with the rectified-flow objective, AdamW over every parameter and the GPT
// trainer's run folder, log, checkpoints (under BFL's parameter names), resume and stop
// handling; sample grids into the run folder (the built-in data only). On the CPU or the GPU
// (train/flux_engine.h).
#pragma once

#include <cstdint>
#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "config/train_config.h"
#include "data/flux_shapes.h"
#include "distributed/communicator.h"
#include "train/flux_batches.h"
#include "train/flux_sample_grid.h"
#include "train/trainer.h"

namespace fp8t::train {

// Runs the job of a Flux configuration; as run_training, data-parallel over the ranks of
// `communicator` on the CPU path (rank 0 writes the run folder, logs, checkpoints, validation
// and sample grids).
TrainOutcome run_flux_training(const TrainConfig& config, distributed::Communicator& communicator);

// What a Flux run trains on: data.flux_shards, or the built-in shapes data when it is empty.
struct FluxTrainingData {
  std::unique_ptr<const data::FluxShapesDataset> shapes;  // the built-in data, else null
  std::unique_ptr<const FluxSampleSource> source;         // the batches' samples
  // The config's objective; with shards, latent_scale and latent_shift from their metadata
  // where it has them.
  FluxObjectiveOptions objective;
  std::string description;  // what the log's "data:" line says about the samples
};

// Opens the data of a Flux configuration. Shards: every file's header is checked against the
// model and the first training shard (docs/data.md); a latent_scale or latent_shift the config
// changed from its default must equal the metadata's where the shards carry one. Throws
// ConfigError starting with the key (flux_shards, flux_val_shards, latent_scale, latent_shift)
// and naming the file.
FluxTrainingData open_flux_data(const TrainConfig& config);

// The built-in data of a Flux configuration: image_size, the model's text and pooled widths, the
// seed.
data::FluxShapesOptions flux_dataset_options(const TrainConfig& config);

// The sample grid of a Flux configuration: these prompts, the sample_* keys, the seed, the
// σ shift and latent normalization of training.
FluxGridOptions flux_grid_options(const TrainConfig& config, std::vector<std::string> prompts);

// Where the grid of step `step` goes: RUN/samples/step_NNNNNN.png.
std::filesystem::path flux_sample_grid_path(const std::filesystem::path& run_folder, int64_t step);

}  // namespace fp8t::train
