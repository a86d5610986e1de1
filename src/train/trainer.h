// The training job: data, model, optimizer and schedules from a TrainConfig; a run folder with
// the resolved config, metrics.jsonl and checkpoints; resume from any saved step; a clean stop
// (with a checkpoint) on SIGINT or SIGTERM. The GPT's here; Flux's in train/flux_trainer.h.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <string>

#include "config/train_config.h"
#include "distributed/communicator.h"
#include "distributed/tensor_parallel_group.h"
#include "gemm/gemm_tuning.h"

namespace fp8t::train {

struct TrainOutcome {
  int64_t steps_done = 0;  // optimizer steps completed, counting those before a resume
  double last_loss = 0.0;
  std::optional<double> last_val_loss;
  int stop_signal = 0;  // SIGINT or SIGTERM when the run was interrupted, else 0
  std::string sample;   // the GPT: the text generated at the end, when sample_tokens > 0
  std::filesystem::path sample_grid;  // Flux: the PNG of samples written at the end, if any
};

// Where the built-in corpus is prepared: $FP8TRAIN_CACHE, else $XDG_CACHE_HOME/fp8train, else
// ~/.cache/fp8train, else .fp8train-cache in the working folder.
std::filesystem::path cache_folder();

// Where autotuned GEMM choices persist unless gemm_tuning_cache names a file:
// gemm_tuning.json in cache_folder().
std::filesystem::path default_gemm_tuning_cache();

// The GEMM selection the run's keys and the environment ask for (gemm/gemm_tuning.h), with the
// cache file in cache_folder() unless gemm_tuning_cache names one. Throws fp8t::ConfigError for
// a value that is not valid.
gemm::GemmTuning run_gemm_tuning(const TrainConfig& config);

// After a step: the engine's gemm_tuning_summary, once per run and by the leader only.
void print_gemm_tuning_once(bool leader, const std::string& summary, bool& printed);

// Runs the job of the configured model (a Flux model: run_flux_training), printing progress to
// stdout. Throws fp8t::Error (ConfigError for settings that cannot work together) naming the
// file, key or value at fault.
TrainOutcome run_training(const TrainConfig& config);
// The same as one rank of a data-parallel job (communicator.several()): every rank trains the
// same model on its share of each step's micro-batches; rank 0 alone prints, writes the run
// folder and checkpoints, and evaluates. So far the GPT (CPU path or GPUs) and Flux on the CPU
// path (ConfigError otherwise).
TrainOutcome run_training(const TrainConfig& config, distributed::Communicator& communicator);

// The batch line's " on each of R ranks (launcher, data parallel)", with tensor parallelism
// " on each of D data-parallel replica(s) of T tensor-parallel ranks (launcher)", or "" for one
// process.
std::string ranks_note(const distributed::Communicator& communicator,
                       const distributed::ParallelLayout& layout = {});

// What overlap_grad_reduce does in this run, as a line to print: "" when it is not asked for;
// where it has no effect, why_gradient_sums_wait's reason (train/training_engine.h).
std::string overlap_grad_reduce_note(bool requested, bool cuda, bool flux,
                                     const distributed::ParallelLayout& layout);

class ScalingStateBuffers;
// Throws fp8t::Error naming the rank whose delayed-scaling state differs from rank 0's at
// `step`: the checkpoints' check that the amax reduction keeps the ranks' scales identical.
void check_same_scaling_on_every_rank(ScalingStateBuffers& scaling,
                                      distributed::Communicator& communicator, int64_t step);

}  // namespace fp8t::train
