#include "train/trainer.h"

#include <unistd.h>

#include <algorithm>
#include <cstdlib>
#include <memory>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"
#include "data/text_corpus.h"
#include "data/token_loader.h"
#include "data/token_shard.h"
#include "io/files.h"
#include "models/gpt_memory.h"
#include "models/gpt_model.h"
#include "models/gpt_sampling.h"
#include "models/recompute.h"
#include "optim/gpt_optimizer.h"
#include "tokenizer/bpe_tokenizer.h"
#include "train/checkpoint.h"
#include "train/flux_trainer.h"
#include "train/fp8_health_monitor.h"
#include "train/nan_guard.h"
#include "train/run_log.h"
#include "train/run_trackers.h"
#include "train/step_phase_times.h"
#include "train/stop_signal.h"
#include "train/training_engine.h"
#include "train/training_loop.h"

namespace fp8t::train {

namespace fs = std::filesystem;

namespace {

// The H100/H200 BF16 dense peak that nanochat's MFU is measured against, for FP8 runs too.
constexpr double kGpuPeakFlops = 989e12;

struct DataSources {
  fs::path tokenizer;
  std::vector<fs::path> train_shards;
  std::vector<fs::path> val_shards;
};

std::vector<fs::path> shards_with_prefix(const fs::path& folder, std::string_view prefix) {
  std::vector<fs::path> shards;
  std::error_code error;
  for (const fs::directory_entry& entry : fs::directory_iterator(folder, error)) {
    const std::string name = entry.path().filename().string();
    if (name.starts_with(prefix) && entry.path().extension() == ".tokens") {
      shards.push_back(entry.path());
    }
  }
  if (error) throw Error(fmt::format("{}: cannot list: {}", folder.string(), error.message()));
  std::sort(shards.begin(), shards.end());
  return shards;
}

DataSources find_data(const TrainConfig& config) {
  DataSources sources;
  if (config.data.data_path.empty()) {
    data::BuiltinCorpusOptions options;
    options.vocab_size = config.model.vocab_size;
    const fs::path cache = cache_folder() / fmt::format("fortunes-vocab{}", options.vocab_size);
    const data::PreparedCorpus corpus = data::prepare_builtin_corpus(cache, options);
    if (!corpus.reused) {
      fmt::print(
          "data: prepared the built-in corpus (Debian's fortunes) in {}: {} + {} documents, "
          "{} + {} tokens\n",
          cache.string(), corpus.train_documents, corpus.val_documents, corpus.train_tokens,
          corpus.val_tokens);
    }
    sources.tokenizer = corpus.tokenizer;
    sources.train_shards = {corpus.train_shard};
    sources.val_shards = {corpus.val_shard};
  } else {
    const fs::path folder = config.data.data_path;
    if (!fs::is_directory(folder)) {
      throw ConfigError(
          fmt::format("data_path: {} is not a folder of token shards", folder.string()));
    }
    sources.tokenizer = folder / "tokenizer.tiktoken";
    sources.train_shards = shards_with_prefix(folder, "train_");
    sources.val_shards = shards_with_prefix(folder, "val_");
    if (sources.train_shards.empty()) {
      throw ConfigError(
          fmt::format("data_path: {} holds no training shards (train_*.tokens; "
                      "`fp8train tokenize` writes them)",
                      folder.string()));
    }
  }
  if (!config.data.tokenizer_path.empty()) sources.tokenizer = config.data.tokenizer_path;
  return sources;
}

// The tokenizer, the shards and the model must agree on the vocabulary.
void check_vocabulary(const TrainConfig& config, const tokenizer::BpeTokenizer& tokenizer,
                      const DataSources& sources) {
  if (tokenizer.vocab_size() != config.model.vocab_size) {
    throw ConfigError(fmt::format(
        "vocab_size: the model has {} tokens but the tokenizer {} has {}; set vocab_size: {}",
        config.model.vocab_size, sources.tokenizer.string(), tokenizer.vocab_size(),
        tokenizer.vocab_size()));
  }
  for (const std::vector<fs::path>* shards : {&sources.train_shards, &sources.val_shards}) {
    for (const fs::path& shard : *shards) {
      const data::TokenShardHeader header = data::read_token_shard_header(shard);
      if (int64_t(header.vocab_size) != tokenizer.vocab_size() ||
          int32_t(header.bos_id) != tokenizer.bos_id()) {
        throw Error(
            fmt::format("{}: tokenized with vocab_size {} and BOS {}, but the tokenizer "
                        "{} has vocab_size {} and BOS {}",
                        shard.string(), header.vocab_size, header.bos_id,
                        sources.tokenizer.string(), tokenizer.vocab_size(), tokenizer.bos_id()));
      }
    }
  }
}

std::vector<NamedTensor> model_buffers(ParameterSet& parameters) {
  std::vector<NamedTensor> buffers;
  for (const ParamSpec& spec : parameters.specs()) {
    buffers.push_back({spec.name, parameters[spec.name]});
  }
  return buffers;
}

std::string describe_data(const data::TokenLoader& loader, const DataSources& sources) {
  return fmt::format("{} shard(s), {} documents, {} tokens per epoch; tokenizer {}",
                     sources.train_shards.size(), loader.documents_per_epoch(),
                     loader.tokens_per_epoch(), sources.tokenizer.string());
}

// The lr shown per step: the block matrices' (Muon's), else the first group's.
double main_lr(const std::vector<optim::OptimizerGroup>& groups) {
  for (const optim::OptimizerGroup& group : groups) {
    if (group.rule == optim::UpdateRule::Muon) return group.lr;
  }
  return groups.front().lr;
}

}  // namespace

fs::path cache_folder() {
  if (const char* cache = std::getenv("FP8TRAIN_CACHE"); cache != nullptr && *cache != '\0') {
    return cache;
  }
  if (const char* xdg = std::getenv("XDG_CACHE_HOME"); xdg != nullptr && *xdg != '\0') {
    return fs::path(xdg) / "fp8train";
  }
  if (const char* home = std::getenv("HOME"); home != nullptr && *home != '\0') {
    return fs::path(home) / ".cache" / "fp8train";
  }
  return ".fp8train-cache";
}

void print_gemm_tuning_once(bool leader, const std::string& summary, bool& printed) {
  if (printed || summary.empty()) return;
  printed = true;
  if (leader) fmt::print("{}\n", summary);
}

fs::path default_gemm_tuning_cache() {
  return cache_folder() / "gemm_tuning.json";
}

gemm::GemmTuning run_gemm_tuning(const TrainConfig& config) {
  const RunSection& run = config.run;
  const std::string cache =
      run.gemm_tuning_cache.empty() ? default_gemm_tuning_cache().string() : run.gemm_tuning_cache;
  return gemm::resolve_gemm_tuning({.gemm_autotune = run.gemm_autotune,
                                    .gemm_backend = run.gemm_backend,
                                    .deterministic = run.deterministic,
                                    .gemm_tuning_cache = cache},
                                   [](const char* name) { return std::getenv(name); });
}

std::string ranks_note(const distributed::Communicator& communicator,
                       const distributed::ParallelLayout& layout) {
  if (!communicator.several()) return "";
  if (layout.tensor == 1) {
    return fmt::format(" on each of {} ranks ({}, data parallel)", communicator.size(),
                       communicator.launch().launcher);
  }
  return fmt::format(" on each of {} data-parallel replica(s) of {} tensor-parallel ranks ({})",
                     layout.data, layout.tensor, communicator.launch().launcher);
}

const char* why_gradient_sums_wait(bool cuda, bool flux,
                                   const distributed::ParallelLayout& layout) {
  if (layout.data == 1) return "one data-parallel replica, so no gradients are summed over ranks";
  if (!cuda) return "the CPU path sums the gradients after the backward";
  if (flux) return "the Flux model sums its gradients after the backward";
  if (layout.tensor > 1) {
    return "under tensor parallelism the group's sums of the gradients come before the replicas'";
  }
  return nullptr;
}

std::string overlap_grad_reduce_note(bool requested, bool cuda, bool flux,
                                     const distributed::ParallelLayout& layout) {
  if (!requested) return "";
  if (const char* why = why_gradient_sums_wait(cuda, flux, layout)) {
    return fmt::format("gradient sums: overlap_grad_reduce has no effect here: {}", why);
  }
  return fmt::format(
      "gradient sums: each block's over the {} replicas while the backward goes on "
      "(overlap_grad_reduce)",
      layout.data);
}

// Every rank's delayed-scaling state must be the same (the amaxes are reduced over the ranks):
// checked at each checkpoint, so that a divergence stops the run with a clear error.
void check_same_scaling_on_every_rank(ScalingStateBuffers& scaling,
                                      distributed::Communicator& communicator, int64_t step) {
  scaling.copy_from_scalings();
  std::string bytes;
  for (const NamedTensor& tensor : scaling.tensors())
    bytes.append(static_cast<const char*>(tensor.view.raw()), tensor.view.bytes());
  const int differs = communicator.rank_differing_from_first(std::hash<std::string>{}(bytes));
  if (differs >= 0) {
    throw Error(fmt::format(
        "step {}: the FP8 scaling state of rank {} differs from rank 0's (the amax reduction "
        "over the ranks failed)",
        step, differs));
  }
}

TrainOutcome run_training(const TrainConfig& config) {
  distributed::Communicator one_process{distributed::LaunchInfo{}, 0};
  return run_training(config, one_process);
}

TrainOutcome run_training(const TrainConfig& config, distributed::Communicator& communicator) {
  const bool several = communicator.several();
  if (several) validate(config, communicator.size());  // the batch against the job's replicas
  const distributed::ParallelLayout layout = distributed::parallel_layout(
      communicator.size(), communicator.rank(), config.run.tensor_model_parallel_size);
  if (config.is_flux()) return run_flux_training(config, communicator);
  // Rank 0 prepares the run folder and the data (the built-in corpus is tokenized on first
  // use) and prints; the others wait for it, then only read.
  const bool leader = communicator.rank() == 0;
  // Before any data is read: a bad FP8TRAIN_GEMM_BACKEND or FP8TRAIN_AUTOTUNE fails at once.
  const gemm::GemmTuning gemm_tuning =
      use_cuda(config.run.device) ? run_gemm_tuning(config) : gemm::GemmTuning{};
  const fs::path run_folder = leader ? open_run_folder(config) : config.run_dir();
  std::optional<DataSources> leader_sources;
  if (leader) leader_sources = find_data(config);
  communicator.barrier();
  const DataSources sources = leader ? *leader_sources : find_data(config);
  const tokenizer::BpeTokenizer tokenizer = tokenizer::BpeTokenizer::load(sources.tokenizer);
  check_vocabulary(config, tokenizer, sources);
  const int64_t batch = config.training.micro_batch_size;
  const int64_t seq = config.model.sequence_len;
  const auto seed = static_cast<uint64_t>(config.training.seed);
  data::TokenLoader loader(sources.train_shards, {.batch = batch, .sequence = seq, .seed = seed});

  // Model and optimizer.
  const bool cuda = use_cuda(config.run.device);
  const GptConfig model_config = config.gpt_config();
  const int ranks = communicator.size();
  const int64_t accumulation = config.grad_accum_steps(ranks);
  const int64_t tokens_per_step = config.global_batch_size(ranks) * seq;
  EngineSetup setup;
  setup.layout = layout;
  setup.model = model_config;
  setup.batch = batch;
  setup.seq = seq;
  setup.optimizer = config.optimizer_settings();
  setup.tokens_per_step = tokens_per_step;
  if (several) setup.communicator = &communicator;
  setup.overlap_grad_reduce = config.run.overlap_grad_reduce;
  setup.shard_optimizer_state = config.run.shard_optimizer_state;
  setup.sequence_parallel = config.run.sequence_parallel;
  setup.recompute = config.training.recompute;
  setup.gemm_tuning = gemm_tuning;
  const ModelPrecision configured_precision = model_precision(config, cuda);
  NanGuard guard(config.run, model_config);
  Fp8HealthMonitor health(config.fp8, configured_precision.fp8.mode != Fp8Mode::None);
  // The engine, with the guard's remedies and the FP8 fallbacks in force, and the checkpoints'
  // views of its model, optimizer and FP8 state; built again when they change the precision.
  std::unique_ptr<TrainingEngine> engine;
  ScalingStateBuffers scaling({});
  CheckpointContents contents;
  const auto build_engine = [&] {
    engine.reset();  // its memory goes before the new one takes any
    setup.precision = health.precision(guard.precision(configured_precision));
    engine = cuda ? make_cuda_engine(setup) : make_cpu_engine(setup);
    scaling = ScalingStateBuffers(engine->delayed_scalings());
    contents.model = model_buffers(engine->host_parameters());
    contents.optimizer = engine->host_optimizer().state();
    contents.fp8_scaling = scaling.tensors();
  };
  build_engine();
  const optim::LrSchedule schedule = config.lr_schedule();
  const int64_t total_steps = config.training.train_iters;
  const double flops_per_token = gpt_flops_per_token(model_config);
  const bool adamw = config.optimizer.kind == optim::OptimizerKind::AdamW;

  if (leader) {
    fmt::print("model: depth {}, dim {}, {} heads, vocab {}, sequence {}; {:.2f}M parameters\n",
               model_config.n_layer, model_config.n_embd, model_config.n_head,
               model_config.vocab_size, seq,
               double(ParameterSet::planned_bytes(model_config, DType::F32)) / 4e6);
    fmt::print("precision: {}; {}\n", describe(setup.precision.fp8),
               precision_summary(engine->linear_precision()));
    print_emulation_note(setup.precision, cuda);
    fmt::print(
        "batch: {} x {} tokens per micro-batch, {} micro-batch(es) per step{}, {} tokens per "
        "step; {} steps\n",
        batch, seq, accumulation, ranks_note(communicator, layout), tokens_per_step, total_steps);
    fmt::print("memory plan: {}\n", engine->memory_plan());
    fmt::print("activation recompute: {}\n",
               recompute_summary(setup.recompute, model_config.n_layer));
    // The GPU path shards over the replicas: a tensor-parallel group's ranks hold other shares.
    const int zero1_ranks = cuda ? layout.data : ranks;
    if (several && setup.shard_optimizer_state && zero1_ranks > 1)
      print_zero1_note(zero1_ranks, cuda);
    if (const std::string note =
            overlap_grad_reduce_note(setup.overlap_grad_reduce, cuda, /*flux=*/false, layout);
        !note.empty()) {
      fmt::print("{}\n", note);
    }
    for (const std::string& note : setup.gemm_tuning.notes)
      fmt::print("{}\n", note);
    fmt::print("data: {}\ndevice: {}\n", describe_data(loader, sources), engine->device_name());
  }

  int64_t step = 0;
  double seconds_before = 0.0;  // training time of the steps before a resume
  std::optional<nlohmann::json> resumed = resume_run(config, run_folder, contents, scaling);
  if (std::optional<nlohmann::json>& state = resumed) {
    guard.resume(state->value("nan_guard", nlohmann::json::object()).get<NanGuardState>());
    health.resume(state->value("fp8_health", nlohmann::json::object()).get<Fp8HealthState>());
    if (guard.state().restores > 0) {
      fmt::print("NaN guard: {} restore(s) so far; remedies in force: {}\n", guard.state().restores,
                 guard.describe_remedies());
    }
    if (health.changes_precision()) {
      fmt::print("FP8 health: linears moved to BF16 so far: {}\n", health.describe_fallbacks());
    }
    if (guard.changes_precision() || health.changes_precision()) {
      // The checkpoint again, into an engine built with them.
      build_engine();
      state =
          resume_from_checkpoint(run_folder, state->at("step").get<int64_t>(), contents, scaling);
    }
    step = state->at("step").get<int64_t>();
    loader.seek(state->at("data_position").get<data::DataPosition>());
    seconds_before = state->value("train_seconds", 0.0);
    engine->from_host();
  } else {
    init_gpt_weights(engine->host_parameters(), model_config, seed);
    engine->from_host();
  }
  FP8T_CHECK(step <= total_steps, "the checkpoint is at step {}, past train_iters {}", step,
             total_steps);

  TrackedRun tracked(config, resumed, engine->device_name(), describe(setup.precision.fp8), leader);
  const auto save = [&](int64_t at_step, double train_seconds) {
    if (several && !scaling.empty()) {
      check_same_scaling_on_every_rank(scaling, communicator, at_step);
    }
    // Sharded optimizer state the ranks gather together; the weights of a tensor-parallel
    // group's shares, the group's ranks (every rank holds the same weights otherwise).
    engine->gather_optimizer_state();
    if (leader || layout.tensor > 1) engine->to_host();
    if (!leader) return;
    nlohmann::json trainer_state = {{"data_position", loader.position()},
                                    {"train_seconds", train_seconds},
                                    {"tokens_seen", at_step * tokens_per_step},
                                    {"nan_guard", guard.state()},
                                    {"fp8_health", health.state()}};
    tracked.add_to(trainer_state);
    save_run_checkpoint(run_folder, config, at_step, std::move(trainer_state), scaling, contents);
  };

  // Validation: the same batches from the start of the validation shards at every evaluation.
  // The leader reports.
  const bool evaluates = layout.evaluates(leader);
  const auto validation_loss = [&]() -> std::optional<double> {
    if (!evaluates || sources.val_shards.empty() || config.run.eval_iters <= 0) return std::nullopt;
    data::TokenLoader val_loader(sources.val_shards,
                                 {.batch = batch, .sequence = seq, .seed = seed});
    double sum = 0.0;
    for (int64_t i = 0; i < config.run.eval_iters; ++i)
      sum += engine->evaluation_loss(val_loader.next_batch());
    if (!leader) return std::nullopt;
    return sum / double(config.run.eval_iters);
  };

  RunLog log(run_folder, tracked.log_outputs(::isatty(STDERR_FILENO) != 0));

  // After nan_restore_after bad steps in a row: the last good checkpoint, with the remedies.
  const auto restore_last_good = [&](int64_t steps_done) -> std::optional<int64_t> {
    if (!guard.restore_due()) return std::nullopt;
    const std::string streak = guard.describe_streak();
    const std::vector<int64_t> good = good_checkpoint_steps(run_folder);
    if (good.empty()) {
      throw Error(fmt::format(
          "NaN guard: {} up to step {}, and no checkpoint saved after a good step in {} to "
          "restore; save checkpoints (save_every), or only skip bad steps (nan_restore_after: 0)",
          streak, steps_done, (run_folder / "checkpoints").string()));
    }
    const RemedyChange change = guard.begin_restore();
    // A fresh engine, as a resume has: nothing of the bad steps (pending amaxes, FP8 attention's
    // remembered gradient amaxes) outlives them.
    build_engine();
    const nlohmann::json state =
        *load_newest_checkpoint(run_folder, good, contents, scaling, "NaN guard");
    const auto restored = state.at("step").get<int64_t>();
    loader.seek(state.at("data_position").get<data::DataPosition>());
    engine->from_host();
    // The checkpoints after it belong to the steps given up. It is saved again with the guard's
    // state, so that a run resumed from it keeps the remedies.
    communicator.barrier();  // every rank has read it
    if (leader) discard_checkpoints_after(run_folder, restored);
    save(restored, state.value("train_seconds", 0.0));
    log.event("restored",
              fmt::format("NaN guard: {} up to step {}; restored the last good checkpoint, step "
                          "{} (restore {} of {}); remedies: {}{}",
                          streak, steps_done, restored, guard.state().restores,
                          config.run.nan_max_restores, change.description,
                          change.precision_changed
                              ? "; precision: " + precision_summary(engine->linear_precision())
                              : ""));
    return restored;
  };

  TrainingLoop loop = training_loop_for(config);
  if (several) loop.stop_signal = [&] { return communicator.max(StopSignal::received()); };
  loop.tokens_per_step = double(tokens_per_step);
  loop.flops_per_token = flops_per_token;
  if (cuda) loop.peak_flops = kGpuPeakFlops;
  loop.memory_bytes = [&] { return cuda ? engine->peak_memory_bytes() : resident_memory_bytes(); };
  loop.peak_memory_bytes = [&] { return engine->peak_memory_bytes(); };
  std::vector<int64_t> nan_inject_steps = config.run.nan_inject_steps;  // each one once
  bool gemm_tuning_printed = false;
  StepPhaseTimes phase_times(cuda && config.run.log_timers_to_tensorboard);
  std::vector<Fp8Fallback> fallbacks;  // decided by the step, applied after it
  loop.train_step = [&](int64_t at_step) {
    if (std::erase(nan_inject_steps, at_step + 1) > 0) {
      engine->inject_nan(config.run.nan_inject_parameter);
    }
    optim::StepSchedule step_schedule = optim::nanochat_step_schedule(schedule, at_step);
    if (adamw) step_schedule = {.lr_multiplier = optim::lr_multiplier(schedule, at_step)};
    step_schedule.lr_multiplier *= guard.lr_scale();
    const bool statistics = health.due(at_step + 1);
    engine->set_record_fp8_health(statistics);
    phase_times.begin();
    const StepResult result =
        engine->train_step(loader, accumulation, config.optimizer.clip_grad, step_schedule);
    phase_times.end();
    if (statistics) {
      engine->set_record_fp8_health(false);
      fallbacks = judge_fp8_health(at_step + 1, engine->take_fp8_health(), health, log,
                                   several ? &communicator : nullptr);
    }
    print_gemm_tuning_once(leader, engine->gemm_tuning_summary(), gemm_tuning_printed);
    StepReport report{result, main_lr(engine->optimizer_groups()), step_schedule.lr_multiplier};
    if (result.finite()) {
      guard.good_step();
    } else {
      report.bad_step_note = guard.bad_step(engine->first_non_finite_gradient());
    }
    return report;
  };
  loop.timers = config.run.log_timers_to_tensorboard;
  loop.phase_times = [&] { return phase_times.last(); };
  loop.validation_loss = validation_loss;
  loop.save = save;
  loop.after_bad_step = restore_last_good;
  // fp8_auto_fallback: the step saved with the decision, then loaded into an engine built with
  // the linears in BF16 (a fresh engine, as a resume has).
  loop.after_step = [&](int64_t steps_done, double train_seconds) {
    if (fallbacks.empty()) return;
    log_fp8_fallbacks(fallbacks, log);
    fallbacks.clear();
    save(steps_done, train_seconds);
    communicator.barrier();  // the leader has written it
    build_engine();
    resume_from_checkpoint(run_folder, steps_done, contents, scaling);
    engine->from_host();
    log.event("fp8_fallback", fmt::format("FP8 health: precision from step {}: {}", steps_done + 1,
                                          precision_summary(engine->linear_precision())));
  };
  const LoopOutcome done = run_training_loop(loop, step, seconds_before, log, run_folder);
  TrainOutcome outcome;
  outcome.steps_done = done.steps_done;
  outcome.last_loss = done.last_loss;
  outcome.last_val_loss = done.last_val_loss;
  outcome.stop_signal = done.stop_signal;

  if (leader && outcome.stop_signal == 0 && config.run.sample_tokens > 0) {
    const std::string prompt_text = "The";
    std::vector<int32_t> prompt = tokenizer.encode_document(prompt_text);
    SamplingOptions options;
    options.tokens = int(config.run.sample_tokens);
    options.seed = seed;
    options.stop_token = tokenizer.bos_id();
    std::vector<int32_t> generated =
        sample_tokens(model_config, engine->host_parameters(), prompt, options);
    if (!generated.empty() && generated.back() == tokenizer.bos_id()) generated.pop_back();
    outcome.sample = prompt_text + tokenizer.decode(generated);
    log.event("sample", fmt::format("sample: {}", outcome.sample));
  }
  tracked.finish(done, log);
  return outcome;
}

}  // namespace fp8t::train
