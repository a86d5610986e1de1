// The subcommands of the fp8train command line. main() parses the options into these structs
// and calls the command; commands throw fp8t::Error for failures and return an exit code.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "models/flux_config.h"

namespace fp8t::cli {

// Exit codes shared by every command.
inline constexpr int kExitOk = 0;
inline constexpr int kExitProblemFound = 1;  // the command ran and found a problem
inline constexpr int kExitError = 2;         // the command could not run (bad input, failed call)

struct DoctorOptions {
  bool json = false;
};

// Reports the build, GPUs, CUDA and library versions, and the FP8 formats that would be used.
// kExitProblemFound when GPUs are present but none can run FP8 GEMMs.
int run_doctor(const DoctorOptions& options);

struct CheckNumericsOptions {
  std::string config_path;  // empty: the default fp8 configuration
  int64_t rows = 256;
  int64_t cols = 1024;
};

// Quantizes random data with every recipe and checks the errors against bounds, the formats'
// code round trips and, with a GPU, that the CUDA kernels give the CPU path's bytes.
// kExitProblemFound when any check fails.
int run_check_numerics(const CheckNumericsOptions& options);

// A Flux preset, its block counts optionally changed (a flux_12b reduced to what one GPU holds).
struct FluxModelOptions {
  std::string preset;
  std::optional<int> double_blocks = std::nullopt;  // unset: the preset's
  std::optional<int> single_blocks = std::nullopt;
};

// The preset with the block counts given; throws ConfigError for an unknown preset or no block.
FluxConfig flux_config_of(const FluxModelOptions& options);

struct ModelSummaryOptions {
  int depth = 20;
  int vocab_size = 32768;
  int sequence_len = 2048;
  std::string window_pattern = "SSSL";
  int64_t batch = 1;
  std::string fp8 = "hybrid";
  std::string fp8_recipe = "tensorwise";
  std::string fp8_weight_transposes = "kept";  // Flux: the GPU's FP8 linears, for the plan
  bool lm_head_fp8 = true;
  bool first_last_layers_bf16 = false;
  int layers_at_start_in_bf16 = 1;
  int layers_at_end_in_bf16 = 1;
  // flux.preset set: the Flux model instead of the GPT, its memory planned for the GPU path.
  FluxModelOptions flux;
  int64_t img_tokens = 4096;
  int64_t txt_tokens = 512;
  std::vector<int> gpus = {1};  // a plan per GPU count
  int tensor_parallel = 1;      // ranks per tensor-parallel group; the plans are one rank's
  // The plan of a rank with sequence parallelism (Flux: the GPU plans, and the CPU path's
  // activations beside them).
  bool sequence_parallel = false;
  std::optional<double> gpu_memory_gib;  // one GPU's; unset: an H200's
};

// Prints the GPT of a given depth: its shape, parameter counts by group, FLOPs per token, which
// linears run in FP8 (with the reasons for the others) and the memory the CPU path plans. With a
// Flux preset, the same for the Flux model, and its GPU memory per GPU for each GPU count, with
// whether it fits and, when not, the most blocks that do.
int run_model_summary(const ModelSummaryOptions& options);

struct ConfigOptions {
  std::string config_path;             // empty: the defaults
  std::vector<std::string> overrides;  // the other arguments: --key=value, --key value, --flag
  bool markdown = false;
};

// Prints the resolved training configuration as YAML (every key), or with `markdown` the
// reference of every key (docs/configuration.md).
int run_config(const ConfigOptions& options);

struct TokenizeOptions {
  std::string tokenizer_path;  // read, or written with train_tokenizer
  bool train_tokenizer = false;
  int vocab_size = 32768;  // with train_tokenizer; special tokens included
  std::string output_dir;
  int64_t val_every = 0;  // every N-th document to validation; 0: none
  int64_t shard_tokens = 100'000'000;
  std::string separator;  // a line that separates documents; empty: one document per file
  std::vector<std::string> inputs;
};

// Turns text files into token shards (docs/data.md), training the tokenizer first when asked.
int run_tokenize(const TokenizeOptions& options);

// How a benchmark times its steps.
struct BenchTiming {
  int warmup = 4;
  int steps = 10;
  bool phases = false;  // then as many steps again, timed by kind of work (core/phase_timer.h)
  // GEMM autotuning for each run, each setting in turn ("off", "on"); empty: as training does
  // (on, unless FP8TRAIN_AUTOTUNE=0 or FP8TRAIN_GEMM_BACKEND pins a backend).
  std::vector<std::string> gemm_autotune;
  // Activation recompute for each run, each setting in turn ("none", "selective"; "full":
  // uniform, one block per group); empty: none.
  std::vector<std::string> recompute;
  // Each FP8 run with its linears' Ŵᵗ kept and/or made in backward ("kept", "in_backward";
  // fp8_weight_transposes); empty: kept.
  std::vector<std::string> fp8_weight_transposes;
  // Each FP8 run with its weight-gradient GEMMs in FP8 and/or BF16 ("on", "off"; fp8_wgrad);
  // empty: on.
  std::vector<std::string> fp8_wgrad;
  // A folder: each run then takes one more step with its GPU timeline recorded
  // (platform/cuda_trace.h), written there as a Chrome trace and summed up in the output.
  std::string trace;
};

struct BenchGptOptions {
  // Defaults: W-GPT24 of docs/benchmarks.md (nanochat d24, sequence 2048, micro-batch 16,
  // all windows long, MuonAdamW, random tokens).
  int depth = 24;
  int64_t batch = 16;
  int sequence_len = 2048;
  int vocab_size = 32768;
  std::string window_pattern = "L";
  std::vector<std::string> precisions = {"bf16", "fp8"};  // each is measured in turn
  std::vector<std::string> fp8_recipes = {"tensorwise"};  // each, for the fp8 precision
  std::string fp8 = "hybrid";                             // fp8 formats: hybrid or e4m3
  std::vector<std::string> fp8_attention = {"off"};       // each, for each fp8 recipe: off, on
  BenchTiming timing;
  bool overlap_grad_reduce = false;   // with several ranks (--nproc-per-node)
  bool shard_optimizer_state = true;  // with several ranks: ZeRO-1
  int tensor_parallel = 1;            // ranks per tensor-parallel group
  // One process times the first rank of one tensor-parallel group alone (as for bench flux).
  bool rank_alone = false;
  bool sequence_parallel = false;  // with tensor_parallel above 1 (sequence_parallel)
};

// Times training steps of the GPT on the GPU (docs/benchmarks.md): step ms (median), tokens/s,
// bf16-MFU, peak device memory, FP8 layers, forward / backward / optimizer times (CUDA events
// between the phases), and each run's step time relative to the first.
int run_bench_gpt(const BenchGptOptions& options);

struct BenchFluxOptions {
  // Defaults: W-FLUX535 of docs/benchmarks.md (flux_535m, 1024² images: 4096 image and 512
  // text tokens, micro-batch 4, AdamW).
  FluxModelOptions model{.preset = "flux_535m"};
  int64_t batch = 4;
  int64_t img_tokens = 4096;  // a square grid of latent tokens
  int64_t txt_tokens = 512;
  std::vector<std::string> precisions = {"bf16", "fp8"};
  std::vector<std::string> fp8_recipes = {"tensorwise"};
  std::string fp8 = "hybrid";
  std::vector<std::string> fp8_attention = {"off"};
  BenchTiming timing;
  bool shard_optimizer_state = true;  // with several ranks: ZeRO-1
  int tensor_parallel = 1;            // ranks per tensor-parallel group
  // One process times the first rank of one tensor-parallel group alone, its collectives within
  // the group left out: the rank's memory and compute on one GPU, not the group's numbers.
  bool rank_alone = false;
  bool sequence_parallel = false;  // with tensor_parallel above 1 (sequence_parallel)
};

// Times Flux training steps on the GPU: as run_bench_gpt, with samples/s.
int run_bench_flux(const BenchFluxOptions& options);

// `fp8train tune`: the training configuration's GEMMs, autotuned (gemm/gemm_tuning.h).
struct TuneOptions {
  std::vector<std::string> config_args;  // --config FILE and key overrides, as `train` takes
};

// Runs one training step of the configured model on the GPU with random inputs and GEMM
// autotuning on, so that every GEMM problem of a step is timed and its winner saved in the
// tuning cache; prints each problem's candidates and times. Throws fp8t::ConfigError when the
// configuration leaves nothing to tune (deterministic, or both precisions pinned).
int run_tune(const TuneOptions& options);

struct SampleOptions {
  std::string checkpoint;            // a checkpoint folder, its model.safetensors, or a run folder
  std::string config_path;           // empty: the checkpoint's config.yaml
  std::vector<std::string> prompts;  // empty: the configuration's sample_prompts
  std::optional<int> steps;          // unset: the configuration's sample_steps
  std::optional<double> guidance;    // unset: sample_guidance
  std::optional<uint64_t> seed;      // unset: seed
  std::optional<int64_t> images_per_prompt;  // unset: sample_images_per_prompt
  std::string output = "samples.png";
};

// Samples pictures from a Flux checkpoint (docs/flux.md): one row per prompt, one column per
// seed, written as a PNG grid.
int run_sample(const SampleOptions& options);

struct PlotOptions {
  std::vector<std::string> run_folders;  // each holds metrics.jsonl; the first is the reference
  std::string output;
  std::string metric = "loss";
  int smooth = 1;     // moving average over this many values; 1: none
  std::string title;  // empty: the metric and the smoothing
};

// Draws the runs' curves of a metric, and each relative to the first, side by side into a PNG
// (docs/cli.md), and prints each run's last value as a table.
int run_plot(const PlotOptions& options);

struct CompareOptions {
  std::vector<std::string> run_folders;  // each holds metrics.jsonl; the first is the reference
  std::string output = "comparison.html";
  double tolerance = 5.0;  // percent
  int smooth = 25;         // moving average over this many logged values
};

// Writes the HTML report of the runs against the first (train/run_comparison.h) and prints
// the verdicts; kExitProblemFound when a run's smoothed loss is not within the tolerance.
int run_compare(const CompareOptions& options);

struct ConvergenceOptions {
  std::vector<std::string> config_args;  // --config FILE and key overrides, as `train` takes
  int64_t steps = 0;                     // 0: the configuration's train_iters
  double tolerance = 5.0;
  int smooth = 25;
};

// Trains the configuration twice, in BF16 (fp8: none) as RUN-bf16 and as configured as
// RUN-fp8, then compares them as run_compare does into OUTPUT_DIR/RUN-convergence.html.
// Throws fp8t::ConfigError when the configuration does not train in FP8.
int run_convergence(const ConvergenceOptions& options);

struct DataCheckOptions {
  // The Flux preset whose input widths the shards must match, or "none".
  std::string model = "flux_535m";
  std::vector<std::string> paths;
};

// Checks precomputed Flux shards (docs/data.md): header, dtypes, shapes, the model's widths,
// agreement between shards and every value. Prints a line per file and a summary;
// kExitProblemFound when any file fails.
int run_data_check(const DataCheckOptions& options);

struct CheckpointVerifyOptions {
  std::vector<std::string> paths;  // checkpoint folders, or run folders (every checkpoint)
};

// Checks each checkpoint's files against its manifest.json (size and CRC-32). Prints a line per
// checkpoint (and per damaged file) and a summary; kExitProblemFound when a checkpoint is
// damaged or has no manifest.
int run_checkpoint_verify(const CheckpointVerifyOptions& options);

// Runs the training job configured by `args` (--config FILE and overrides, see
// load_train_config), as one process or as one rank of a job a launcher started. kExitOk when
// it ran to the end; 128 + the signal after SIGINT or SIGTERM (a checkpoint was saved).
int run_train(const std::vector<std::string>& args);

// `--nproc-per-node N`: N ranks of `fp8train ARGUMENTS...` on this node
// (distributed/local_ranks.h); their exit code. Refused in a process that already is a rank.
int run_local_ranks(int processes, const std::vector<std::string>& arguments);

}  // namespace fp8t::cli
