#include "train/flux_trainer.h"

#include <unistd.h>

#include <algorithm>
#include <memory>
#include <optional>
#include <string_view>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/error.h"
#include "models/flux_model.h"
#include "models/recompute.h"
#include "optim/schedule.h"
#include "train/checkpoint.h"
#include "train/flux_batches.h"
#include "train/flux_engine.h"
#include "train/fp8_health_monitor.h"
#include "train/run_log.h"
#include "train/run_trackers.h"
#include "train/step_phase_times.h"
#include "train/step_prefetch.h"
#include "train/stop_signal.h"
#include "train/training_engine.h"
#include "train/training_loop.h"

namespace fp8t::train {

namespace fs = std::filesystem;

namespace {

std::vector<NamedTensor> model_tensors(FluxParameterSet& parameters) {
  std::vector<NamedTensor> tensors;
  for (const FluxParam& param : parameters.specs())
    tensors.push_back({param.name, parameters[param.name]});
  return tensors;
}

// The shards a data key names, checked against the model and, for validation, the training set.
data::FluxShardSet open_shards(std::string_view key, const std::string& folder_or_pattern,
                               const FluxConfig& model, const data::FluxShardSet* training) {
  try {
    return data::FluxShardSet(data::find_flux_shard_files(folder_or_pattern), model, training);
  } catch (const Error& error) {
    throw ConfigError(fmt::format("{}: {}", key, error.what()));
  }
}

// latent_scale and latent_shift for shards: the metadata's where the shards carry the value (all
// carry the same, FluxShardSet checks), the config's otherwise.
void take_shard_normalization(const TrainConfig& config, const data::FluxShard& shard,
                              FluxObjectiveOptions& objective, std::vector<std::string>& taken) {
  const FluxObjectiveOptions defaults = TrainConfig::defaults_for(config.model.name).flux;
  const auto take = [&](std::string_view key, std::optional<double> stored, double default_value,
                        double& value) {
    if (!stored) return;
    if (value != default_value && value != *stored) {
      throw ConfigError(fmt::format(
          "{}: {} contradicts the shards' metadata {} = {} ({}); leave the key at its default "
          "({}) to use the metadata's",
          key, value, key, *stored, shard.path().string(), default_value));
    }
    value = *stored;
    taken.emplace_back(key);
  };
  take("latent_scale", shard.latent_scale(), defaults.latent_scale, objective.latent_scale);
  take("latent_shift", shard.latent_shift(), defaults.latent_shift, objective.latent_shift);
}

}  // namespace

FluxTrainingData open_flux_data(const TrainConfig& config) {
  const FluxConfig model = config.flux_config();
  FluxTrainingData result;
  result.objective = config.flux;
  if (config.data.flux_shards.empty()) {
    result.shapes = std::make_unique<const data::FluxShapesDataset>(flux_dataset_options(config));
    result.source = std::make_unique<const FluxShapesSource>(*result.shapes);
    result.description = fmt::format("built-in shapes, {}x{} pictures", config.data.image_size,
                                     config.data.image_size);
    return result;
  }

  data::FluxShardSet training = open_shards("flux_shards", config.data.flux_shards, model, nullptr);
  std::optional<data::FluxShardSet> validation;
  if (!config.data.flux_val_shards.empty()) {
    validation = open_shards("flux_val_shards", config.data.flux_val_shards, model, &training);
  }
  std::vector<std::string> from_metadata;
  take_shard_normalization(config, training.first(), result.objective, from_metadata);

  const data::FluxShardLayout& layout = training.first().layout();
  const int64_t validation_samples =
      std::min(config.run.eval_iters * config.training.micro_batch_size, training.samples());
  result.description = fmt::format(
      "{} shard(s) ({}), {} samples, latents [{}, {}, {}] ({}) and {} text tokens; x0 = "
      "{}·(latent − {}) ({}); validation: {}",
      training.shards().size(), config.data.flux_shards, training.samples(), layout.latent.channels,
      layout.latent.height, layout.latent.width, data::flux_latent_mode_name(layout.mode),
      layout.text_tokens, result.objective.latent_scale, result.objective.latent_shift,
      from_metadata.empty()
          ? std::string("from the config")
          : fmt::format("{} from the shards' metadata", fmt::join(from_metadata, " and ")),
      validation ? fmt::format("{} shard(s) ({}), {} samples", validation->shards().size(),
                               config.data.flux_val_shards, validation->samples())
                 : fmt::format("the training shards' first {} samples (not held out)",
                               validation_samples));
  result.source = std::make_unique<const FluxShardSource>(
      std::move(training), std::move(validation), static_cast<uint64_t>(config.training.seed));
  return result;
}

data::FluxShapesOptions flux_dataset_options(const TrainConfig& config) {
  const FluxConfig model = config.flux_config();
  return {.image_size = config.data.image_size,
          .context_dim = model.context_in_dim,
          .pooled_dim = model.vec_in_dim,
          .seed = static_cast<uint64_t>(config.training.seed)};
}

FluxGridOptions flux_grid_options(const TrainConfig& config, std::vector<std::string> prompts) {
  return {.prompts = std::move(prompts),
          .images_per_prompt = config.run.sample_images_per_prompt,
          .seed = static_cast<uint64_t>(config.training.seed),
          .sampling = {.steps = int(config.run.sample_steps),
                       .guidance = config.run.sample_guidance,
                       .shift = config.flux.sigma.shift},
          .latent_scale = config.flux.latent_scale,
          .latent_shift = config.flux.latent_shift};
}

fs::path flux_sample_grid_path(const fs::path& run_folder, int64_t step) {
  return run_folder / "samples" / fmt::format("step_{:06d}.png", step);
}

TrainOutcome run_flux_training(const TrainConfig& config, distributed::Communicator& communicator) {
  // Rank 0 prepares the run folder, prints and writes; the others wait for the folder first.
  const bool leader = communicator.rank() == 0;
  // Before any data is read: a bad FP8TRAIN_GEMM_BACKEND or FP8TRAIN_AUTOTUNE fails at once.
  const gemm::GemmTuning gemm_tuning =
      use_cuda(config.run.device) ? run_gemm_tuning(config) : gemm::GemmTuning{};
  const bool several = communicator.several();
  const int ranks = communicator.size();
  const distributed::ParallelLayout layout = distributed::parallel_layout(
      ranks, communicator.rank(), config.run.tensor_model_parallel_size);
  const fs::path run_folder = leader ? open_run_folder(config) : config.run_dir();
  communicator.barrier();
  const FluxConfig model_config = config.flux_config();
  const auto seed = static_cast<uint64_t>(config.training.seed);
  const FluxTrainingData data = open_flux_data(config);
  const int64_t batch = config.training.micro_batch_size;
  const int64_t accumulation = config.grad_accum_steps(ranks);  // per replica
  const int64_t samples_per_step = config.global_batch_size(ranks);
  const int64_t total_steps = config.training.train_iters;
  const FluxBatchBuilder batches(*data.source, model_config, data.objective, batch, seed);
  const int64_t img_tokens = batches.latent_shape().tokens();
  const int64_t txt_tokens = batches.dims().text_tokens;

  // The grid's prompts are checked before any time is spent training. They are encoded with the
  // built-in data's words; the configuration refuses prompts with shards. The training model
  // samples them where it trains: the leader alone, or under tensor parallelism every rank
  // (each group's ranks split its forward, and on the CPU path a group's collectives take every
  // rank of the job); the leader writes the grid.
  std::optional<FluxSampleGrid> grid;
  std::vector<std::string> prompts = split_prompts(config.run.sample_prompts);
  const bool grids = !prompts.empty() && data.shapes;  // every rank knows it
  if ((leader || layout.tensor > 1) && grids) {
    try {
      grid.emplace(*data.shapes, model_config, flux_grid_options(config, std::move(prompts)));
    } catch (const Error& error) {
      throw ConfigError(fmt::format("sample_prompts: {}", error.what()));
    }
  }

  FluxEngineSetup setup;
  setup.model = model_config;
  const bool cuda = use_cuda(config.run.device);
  const ModelPrecision configured_precision = model_precision(config, cuda);
  setup.precision = configured_precision;
  setup.batch = batch;
  setup.img_tokens = img_tokens;
  setup.txt_tokens = txt_tokens;
  setup.img_ids = batches.img_ids();
  setup.adamw = config.optimizer_settings().adamw;
  if (several) setup.communicator = &communicator;
  setup.layout = layout;
  setup.sequence_parallel = config.run.sequence_parallel;
  setup.shard_optimizer_state = config.run.shard_optimizer_state;
  setup.recompute = config.training.recompute;
  setup.gemm_tuning = gemm_tuning;
  Fp8HealthMonitor health(config.fp8, configured_precision.fp8.mode != Fp8Mode::None);
  // The engine, with the FP8 fallbacks in force, and the checkpoints' views of its model,
  // optimizer and FP8 state; built again when a fallback changes the precision.
  std::unique_ptr<FluxEngine> engine;
  ScalingStateBuffers scaling({});
  CheckpointContents contents;
  const auto build_engine = [&] {
    engine.reset();  // its memory goes before the new one takes any
    setup.precision = health.precision(configured_precision);
    engine = cuda ? make_flux_cuda_engine(setup) : make_flux_cpu_engine(setup);
    scaling = ScalingStateBuffers(engine->delayed_scalings());
    FluxParameterSet* host = engine->host_parameters();
    contents.model = host != nullptr ? model_tensors(*host) : std::vector<NamedTensor>{};
    contents.optimizer = engine->host_optimizer_state();
    contents.with_tensors = host != nullptr;  // else from_host() brings them
    contents.fp8_scaling = scaling.tensors();
  };
  build_engine();
  const optim::LrSchedule schedule = config.lr_schedule();

  if (leader) {
    fmt::print("model: {}: hidden {}, {} heads, {} double + {} single blocks; {:.3f}M parameters\n",
               config.model.name, model_config.hidden_size, model_config.num_heads,
               model_config.double_blocks, model_config.single_blocks,
               double(flux_parameter_count(model_config)) / 1e6);
    fmt::print("precision: {}; {}\n", describe(setup.precision.fp8),
               flux_precision_summary(engine->linear_precision()));
    print_emulation_note(setup.precision, cuda);
    fmt::print(
        "batch: {} pictures per micro-batch ({} image + {} text tokens each), {} micro-batch(es) "
        "per step{}, {} pictures per step; {} steps\n",
        batch, img_tokens, txt_tokens, accumulation, ranks_note(communicator, layout),
        samples_per_step, total_steps);
    fmt::print("memory plan: {}\n", engine->memory_plan());
    fmt::print("activation recompute: {}\n",
               recompute_summary(setup.recompute,
                                 model_config.double_blocks + model_config.single_blocks));
    // The GPU path shards over the replicas: a tensor-parallel group's ranks hold other shares.
    const int zero1_ranks = cuda ? layout.data : communicator.size();
    if (several && setup.shard_optimizer_state && zero1_ranks > 1)
      print_zero1_note(zero1_ranks, cuda);
    if (const std::string note = overlap_grad_reduce_note(config.run.overlap_grad_reduce, cuda,
                                                          /*flux=*/true, layout);
        !note.empty()) {
      fmt::print("{}\n", note);
    }
    for (const std::string& note : setup.gemm_tuning.notes)
      fmt::print("{}\n", note);
    fmt::print(
        "data: {}; {} image tokens of {} features per picture; σ {} (shift {}), guidance "
        "dropout {}\ndevice: {}\n",
        data.description, img_tokens, model_config.in_channels,
        sigma_sampler_name(config.flux.sigma.sampler), config.flux.sigma.shift,
        config.flux.cfg_dropout, engine->device_name());
  }

  // The data position is the step: every batch is a function of the seed and its step.
  int64_t step = 0;
  double seconds_before = 0.0;
  std::optional<nlohmann::json> resumed = resume_run(config, run_folder, contents, scaling);
  if (std::optional<nlohmann::json>& state = resumed) {
    health.resume(state->value("fp8_health", nlohmann::json::object()).get<Fp8HealthState>());
    if (health.changes_precision()) {  // the checkpoint again, into an engine built with them
      fmt::print("FP8 health: linears moved to BF16 so far: {}\n", health.describe_fallbacks());
      build_engine();
      state =
          resume_from_checkpoint(run_folder, state->at("step").get<int64_t>(), contents, scaling);
    }
    step = state->at("step").get<int64_t>();
    seconds_before = state->value("train_seconds", 0.0);
  } else if (FluxParameterSet* host = engine->host_parameters()) {
    init_flux_weights(*host, model_config, seed);
  }
  engine->from_host();
  FP8T_CHECK(step <= total_steps, "the checkpoint is at step {}, past train_iters {}", step,
             total_steps);

  // Who calls to_host() for a checkpoint: the leader, which writes it, and under
  // tensor parallelism every rank, whose shares the GPU engine gathers.
  const bool brings_to_host = leader || layout.tensor > 1;
  TrackedRun tracked(config, resumed, engine->device_name(), describe(setup.precision.fp8), leader);
  const auto save = [&](int64_t at_step, double train_seconds) {
    if (several && !scaling.empty()) {
      check_same_scaling_on_every_rank(scaling, communicator, at_step);
    }
    // Sharded optimizer state the ranks gather together, and so do a tensor-parallel group's
    // ranks their shares of the weights.
    engine->gather_optimizer_state();
    if (brings_to_host) engine->to_host();
    if (!leader) return;
    nlohmann::json trainer_state = {{"train_seconds", train_seconds},
                                    {"samples_seen", at_step * samples_per_step},
                                    {"fp8_health", health.state()}};
    tracked.add_to(trainer_state);
    save_run_checkpoint(run_folder, config, at_step, std::move(trainer_state), scaling, contents);
  };

  // Validation: the same held-out pictures, σ and noise at every evaluation.
  FluxBatch held_out;
  const bool evaluates = layout.evaluates(leader);
  const auto validation_loss = [&]() -> std::optional<double> {
    if (!evaluates) return std::nullopt;
    double sum = 0.0;
    for (int64_t i = 0; i < config.run.eval_iters; ++i) {
      batches.validation_batch(i, held_out);
      sum += engine->evaluation_loss(held_out);
    }
    if (!leader) return std::nullopt;
    return sum / double(config.run.eval_iters);
  };

  RunLog log(run_folder, tracked.log_outputs(::isatty(STDERR_FILENO) != 0));
  const auto write_grid = [&](int64_t at_step) -> fs::path {
    if (!grid) return {};
    const std::vector<float> latents =
        grid->sample([&](const FluxInputs& inputs, int64_t rows, float* prediction) {
          engine->predict(inputs, rows, prediction);
        });
    if (!leader) return {};
    const fs::path path = flux_sample_grid_path(run_folder, at_step);
    fs::create_directories(path.parent_path());
    grid->write(latents, path);
    log.event("sample", fmt::format("samples: {}", path.string()));
    return path;
  };

  // Replica r's micro-batch m is the step's m·R + r of A·R (R replicas: the ranks, or the
  // tensor-parallel groups): the step sees one process's batches. On a GPU the next step's are
  // loaded while this one trains; on the CPU path the host is the one that trains.
  StepPrefetch<std::vector<FluxBatch>> step_batches(
      [&](int64_t at_step, std::vector<FluxBatch>& micro_batches) {
        micro_batches.resize(static_cast<size_t>(accumulation));
        for (int64_t micro = 0; micro < accumulation; ++micro) {
          batches.training_batch(at_step, micro * layout.data + layout.data_rank,
                                 accumulation * layout.data, micro_batches[size_t(micro)]);
        }
      });
  TrainingLoop loop = training_loop_for(config);
  loop.tokens_per_step = double(samples_per_step * img_tokens);
  loop.samples_per_step = double(samples_per_step);
  loop.flops_per_token =
      flux_flops_per_sample(model_config, img_tokens, txt_tokens) / double(img_tokens);
  loop.memory_bytes = resident_memory_bytes;
  loop.peak_memory_bytes = [&] { return engine->peak_memory_bytes(); };
  bool gemm_tuning_printed = false;
  StepPhaseTimes phase_times(cuda && config.run.log_timers_to_tensorboard);
  std::vector<Fp8Fallback> fallbacks;  // decided by the step, applied after it
  loop.train_step = [&](int64_t at_step) {
    const std::vector<FluxBatch>& micro_batches =
        step_batches.take(at_step, cuda && at_step + 1 < total_steps ? at_step + 1 : -1);
    const double multiplier = optim::lr_multiplier(schedule, at_step);
    const bool statistics = health.due(at_step + 1);
    engine->set_record_fp8_health(statistics);
    phase_times.begin();
    const StepResult result =
        engine->train_step(micro_batches, config.optimizer.clip_grad, multiplier);
    phase_times.end();
    step_batches.wait();  // before validation, samples or anything else reads the data
    if (statistics) {
      engine->set_record_fp8_health(false);
      fallbacks = judge_fp8_health(at_step + 1, engine->take_fp8_health(), health, log,
                                   several ? &communicator : nullptr);
    }
    print_gemm_tuning_once(leader, engine->gemm_tuning_summary(), gemm_tuning_printed);
    return StepReport{result, engine->lr(), multiplier};
  };
  loop.timers = config.run.log_timers_to_tensorboard;
  loop.phase_times = [&] { return phase_times.last(); };
  loop.validation_loss = validation_loss;
  loop.save = save;
  if (several) loop.stop_signal = [&] { return communicator.max(StopSignal::received()); };
  loop.after_step = [&](int64_t steps_done, double train_seconds) {
    if (!fallbacks.empty()) {  // fp8_auto_fallback: as the GPT trainer
      log_fp8_fallbacks(fallbacks, log);
      fallbacks.clear();
      save(steps_done, train_seconds);
      communicator.barrier();  // the leader has written it
      build_engine();
      resume_from_checkpoint(run_folder, steps_done, contents, scaling);
      engine->from_host();
      log.event("fp8_fallback",
                fmt::format("FP8 health: precision from step {}: {}", steps_done + 1,
                            flux_precision_summary(engine->linear_precision())));
    }
    const int64_t every = config.run.sample_every;
    if (grids && every > 0 && steps_done % every == 0 && steps_done < total_steps) {
      write_grid(steps_done);
    }
  };
  const LoopOutcome done = run_training_loop(loop, step, seconds_before, log, run_folder);
  TrainOutcome outcome;
  outcome.steps_done = done.steps_done;
  outcome.last_loss = done.last_loss;
  outcome.last_val_loss = done.last_val_loss;
  outcome.stop_signal = done.stop_signal;
  if (outcome.stop_signal == 0 && grids) outcome.sample_grid = write_grid(outcome.steps_done);
  tracked.finish(done, log);
  return outcome;
}

}  // namespace fp8t::train
