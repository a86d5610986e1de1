// The configuration of a training run: every setting of an experiment, read from a YAML file
// and command-line overrides (config/config_keys.h holds the one table of keys that reads,
// writes and documents them), with conversions to the settings each component takes.
#pragma once

#include <algorithm>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <vector>

#include "models/flux_config.h"
#include "models/flux_objective.h"
#include "models/gpt_config.h"
#include "models/precision_policy.h"
#include "models/recompute.h"
#include "numerics/scaling.h"
#include "optim/gpt_optimizer.h"
#include "optim/schedule.h"

namespace fp8t {

enum class DeviceChoice : uint8_t { Auto, Cpu, Cuda };
// The key `resume`: never (only resume_from_step resumes) or auto (the newest checkpoint).
enum class ResumeChoice : uint8_t { Never, Auto };
// The key `nan_remedy`: what the NaN guard changes when it restores a checkpoint after
// nan_restore_after bad steps in a row (train/nan_guard.h).
// The key `tracker`: where a run's metrics go (train/run_trackers.h).
enum class Tracker : uint8_t {
  Jsonl,        // metrics.jsonl and fp8_health.jsonl in the run folder
  Tensorboard,  // TensorBoard event files in the run folder
  Mlflow,       // the MLflow tracking server at MLFLOW_TRACKING_URI
};
enum class NanRemedy : uint8_t {
  LowerLr,    // every lr times nan_lr_factor for the rest of the run
  Fp8Margin,  // fp8_margin + 1 (delayed scaling)
  Bf16Layer,  // the layer of the first non-finite gradient keeps its linears in BF16
};

using optim::OptimizerKind;

// The key `model`: the nanochat GPT, or one of the Flux presets (kFluxPresets).
inline constexpr std::string_view kGptModel = "gpt";

// Fields are named as their keys, except where the key repeats the section (run.name is the key
// `run`, model.name the key `model`, optimizer.kind the key `optimizer`, fp8.scaling.mode the
// key `fp8`).
struct RunSection {
  std::string name = "default";
  std::string output_dir = "runs";
  int64_t resume_from_step = -1;  // -1: a fresh run
  ResumeChoice resume = ResumeChoice::Never;
  bool overwrite = false;        // a fresh run may replace the run folder's checkpoints
  int64_t save_every = -1;       // -1 or 0: a checkpoint only at the end
  int64_t keep_checkpoints = 0;  // 0: every checkpoint stays
  int64_t log_every = 1;
  std::vector<Tracker> tracker = {Tracker::Jsonl, Tracker::Tensorboard};
  std::string experiment = "fp8train";     // MLflow's experiment
  bool log_timers_to_tensorboard = false;  // per-phase step timers as metrics too
  bool tracks(Tracker which) const {
    return std::find(tracker.begin(), tracker.end(), which) != tracker.end();
  }
  int64_t sample_tokens = 0;  // 0: no sample at the end
  int64_t eval_every = 250;   // -1 or 0: no evaluation
  int64_t eval_iters = 100;   // micro-batches per evaluation
  DeviceChoice device = DeviceChoice::Auto;
  // Several GPUs: sum each block's gradients over the ranks while the backward goes on.
  bool overlap_grad_reduce = false;
  // Several ranks: ZeRO-1, each rank updates its share of the parameters.
  bool shard_optimizer_state = true;
  // Ranks per tensor-parallel group (models/tensor_parallel.h); the groups are data parallel.
  int tensor_model_parallel_size = 1;
  // Sequence parallelism within each tensor-parallel group (the GPT on the CPU path).
  bool sequence_parallel = false;
  // GEMM selection on the GPU (gemm/gemm_tuning.h); FP8TRAIN_AUTOTUNE and FP8TRAIN_GEMM_BACKEND
  // take precedence.
  bool gemm_autotune = true;
  std::string gemm_backend;       // empty: none pinned
  std::string gemm_tuning_cache;  // empty: gemm_tuning.json in the cache folder
  bool deterministic = false;     // the heuristic's algorithms, no autotuning
  // Flux: sample grids of the model being trained (models/flux_sampling.h).
  int64_t sample_every = 0;  // 0: only at the end
  int64_t sample_steps = 28;
  double sample_guidance = 4.0;
  std::string sample_prompts =
      "a red circle on the left; a blue square on the right; a green triangle at the top and a "
      "yellow circle at the bottom; a yellow square in the centre";
  int64_t sample_images_per_prompt = 4;
  // The GPT's NaN guard: a step with a non-finite loss or gradient norm is skipped; after
  // nan_restore_after of them in a row the last good checkpoint is restored with the remedies.
  int64_t nan_restore_after = 5;  // 0: only skip
  int64_t nan_max_restores = 3;
  std::vector<NanRemedy> nan_remedy = {NanRemedy::LowerLr};
  double nan_lr_factor = 0.5;
  // A testing aid: a NaN in this parameter's gradient at these steps (counting from 1).
  std::vector<int64_t> nan_inject_steps;
  std::string nan_inject_parameter;
};

struct ModelSection {
  std::string name{kGptModel};
  int depth = 20;
  int aspect_ratio = 64;
  int head_dim = 128;
  int vocab_size = 32768;
  int sequence_len = 2048;
  std::string window_pattern = "SSSL";
};

struct DataSection {
  std::string data_path;       // empty: the built-in corpus
  std::string tokenizer_path;  // empty: the data source's default tokenizer
  int image_size = 32;         // Flux: pixels per side of the built-in shapes data
  // Flux: precomputed shards (a folder or a glob pattern); empty: the built-in shapes data.
  std::string flux_shards;
  std::string flux_val_shards;  // empty: validation reads training samples
};

struct TrainingSection {
  int64_t micro_batch_size = 32;  // sequences per device per forward/backward
  int64_t global_batch_size = 0;  // sequences per optimizer step; 0: micro_batch_size x world
  int64_t train_iters = 1000;
  int64_t seed = 42;
  // Activation recompute (models/recompute.h): recompute_granularity, recompute_method,
  // recompute_num_layers.
  RecomputeOptions recompute;
};

struct OptimizerSection {
  OptimizerKind kind = OptimizerKind::Muon;
  double lr = 0.02;  // muon: the matrix lr; adamw: the lr of every parameter
  double embedding_lr = 0.3;
  double unembedding_lr = 0.008;
  double scalar_lr = 0.5;
  double min_lr = 0.0;
  double weight_decay = 0.28;
  double adam_beta1 = 0.9;
  double adam_beta2 = 0.95;
  double adam_eps = 1e-8;
  double clip_grad = 0.0;  // 0: no clipping
};

struct ScheduleSection {
  int64_t lr_warmup_iters = 40;
  optim::LrDecayStyle lr_decay_style = optim::LrDecayStyle::Nanochat;
  double lr_warmdown_ratio = 0.65;
  double final_lr_frac = 0.05;
};

struct Fp8Section {
  // Training defaults to BF16; the other fp8 settings keep Fp8Config's defaults.
  Fp8Config scaling = [] {
    Fp8Config bf16;
    bf16.mode = Fp8Mode::None;
    return bf16;
  }();
  bool wgrad = true;
  ops::WeightTransposes weight_transposes = ops::WeightTransposes::Kept;  // the GPU's FP8 linears
  bool dot_product_attention = false;  // attention's products in FP8 (ops/attention_fp8.h)
  bool multi_head_attention = false;   // reserved: not implemented, only false
  bool lm_head_fp8 = true;
  bool first_last_layers_bf16 = false;
  int num_layers_at_start_in_bf16 = 1;
  int num_layers_at_end_in_bf16 = 1;
  // FP8 health statistics, their warnings and the automatic fallback
  // (train/fp8_health_monitor.h).
  int64_t health_every = 100;  // 0: never
  double saturation_threshold = 1e-3;
  double underflow_threshold = 0.25;
  double amax_jump_threshold = 16.0;
  bool auto_fallback = false;
  int64_t fallback_after = 3;
};

struct TrainConfig {
  RunSection run;
  ModelSection model;
  DataSection data;
  TrainingSection training;
  OptimizerSection optimizer;
  ScheduleSection schedule;
  Fp8Section fp8;
  FluxObjectiveOptions flux;  // the σ sampler, latent normalization and CFG dropout

  // The defaults of `model`: the GPT's are nanochat's (a default TrainConfig); a Flux preset's
  // are Primus' Flux AdamW settings on the CPU path (docs/flux.md).
  static TrainConfig defaults_for(std::string_view model);

  bool is_flux() const { return model.name != kGptModel; }
  // The preset named by `model`; throws ConfigError for the GPT.
  FluxConfig flux_config() const;

  // nanochat's sizing: n_embd = depth * aspect_ratio rounded up to a multiple of head_dim,
  // n_head = n_embd / head_dim, as many kv heads.
  GptConfig gpt_config() const;
  const Fp8Config& fp8_config() const { return fp8.scaling; }
  PrecisionOptions precision_options() const;
  // min_lr_frac = min_lr / lr.
  optim::LrSchedule lr_schedule() const;
  // muon: lr is Muon's matrix lr, the AdamW groups keep nanochat's betas and eps; adamw: lr,
  // adam_beta1, adam_beta2, adam_eps and weight_decay for every parameter.
  optim::OptimizerSettings optimizer_settings() const;
  // Data-parallel replicas of a job of `world_size` ranks: tensor-parallel groups (at least one,
  // for checks made before the job's ranks are known).
  int data_parallel_size(int world_size) const {
    return std::max(1, world_size / run.tensor_model_parallel_size);
  }
  // Sequences per optimizer step, with global_batch_size 0 resolved.
  int64_t global_batch_size(int world_size) const;
  // Micro-batches each device runs per optimizer step.
  int64_t grad_accum_steps(int world_size) const;
  std::filesystem::path run_dir() const { return std::filesystem::path(run.output_dir) / run.name; }
};

// Reads the configuration from command-line arguments (the argv tail of a command): the defaults
// of the configured model (defaults_for), then an optional `--config FILE` (anywhere among
// them), then every other argument overrides a key, in order (`--key=value`, `--key value`,
// `--flag`, nanochat's flag names; see docs/configuration.md). The result is validated for
// `world_size` devices; a key of another model is an error. Throws ConfigError naming the file
// and line, or the flag, and the key.
TrainConfig load_train_config(const std::vector<std::string>& args, int world_size = 1);

// Checks what single keys cannot: the batch sizes against each other and the world size, the
// model's shape, the schedule, the fp8 settings together, and that keys of another model keep
// their defaults. Throws ConfigError "KEY: message".
void validate(const TrainConfig& config, int world_size = 1);

// Every key that applies to the configured model, in sections, as a YAML file that
// load_train_config reads back to the same config.
std::string to_yaml(const TrainConfig& config);

// Writes to_yaml(config) to `file` (the run folder's config.yaml); throws Error on failure.
void save_train_config(const TrainConfig& config, const std::filesystem::path& file);

// docs/configuration.md: every key with its type, default, allowed values and meaning, the
// command-line rules and the nanochat flag names, generated from the key table.
std::string configuration_markdown();

}  // namespace fp8t
