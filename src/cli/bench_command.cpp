// `fp8train bench gpt` and `bench flux`: training steps on the GPU with random inputs, timed with
// CUDA events. Both also run over several ranks (one per GPU, through NCCL): data parallel, and
// tensor parallel in groups of --tensor-parallel ranks.
#include <algorithm>
#include <array>
#include <cctype>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <memory>
#include <optional>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "cli/commands.h"
#include "config/train_config.h"
#include "core/error.h"
#include "distributed/communicator.h"
#include "distributed/launch.h"
#include "distributed/tensor_parallel_group.h"
#include "gemm/gemm_tuning.h"
#include "io/files.h"
#include "models/flux_config.h"
#include "models/flux_model.h"
#include "models/gpt_config.h"
#include "models/gpt_model.h"
#include "optim/gpt_optimizer.h"
#include "platform/device_info.h"
#include "platform/gpu_trace.h"
#include "train/flux_batches.h"
#include "train/flux_trainer.h"
#include "train/run_log.h"
#include "train/trainer.h"
#include "train/training_loop.h"

#if FP8TRAIN_WITH_CUDA
#include <cuda_runtime_api.h>

#include "core/cuda_check.h"
#include "core/cuda_resources.h"
#include "core/phase_timer.h"
#include "gemm/cublaslt_gemm.h"
#include "models/cuda/flux_model_cuda.h"
#include "models/cuda/gpt_model_cuda.h"
#include "ops/cuda/gpt_gates.h"
#include "optim/cuda/adamw_cuda.h"
#include "optim/cuda/gpu_optimizer.h"
#include "platform/cuda_trace.h"
#include "train/cuda_tensor_group.h"
#include "train/flux_engine.h"
#include "train/training_engine.h"
#if FP8TRAIN_WITH_NCCL
#include "train/cuda_rank_sums.h"
#endif
#endif

namespace fp8t::cli {

#if FP8TRAIN_WITH_CUDA

namespace {

// nanochat's MFU reference: the H100/H200 dense BF16 peak, for FP8 runs too.
constexpr double kBf16PeakFlops = 989e12;

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  const size_t middle = values.size() / 2;
  return values.size() % 2 == 1 ? values[middle] : 0.5 * (values[middle - 1] + values[middle]);
}

struct Measurement {
  std::string name;
  bool out_of_memory = false;  // the run did not fit the GPU: nothing below was measured
  double step_ms = 0.0;
  double forward_ms = 0.0, backward_ms = 0.0, optimizer_ms = 0.0;
  // Host time to issue forward + backward (no waits in them): near their GPU time, the GPU
  // waits on launches.
  double issue_ms = 0.0;
  double throughput = 0.0;  // tokens/s (GPT) or samples/s (Flux)
  double mfu = 0.0;
  double peak_memory = 0.0;
  std::string fp8_layers;
  double final_loss = 0.0;
  // --phases: medians over extra steps timed piece by piece, and the rest of forward + backward.
  std::array<double, kStepPhases> phase_ms{};
  double other_ms = 0.0;
  // GEMM autotuning: the one-line summary and each problem's record (empty without it).
  std::string tuning_summary;
  std::vector<gemm::CublasLtGemm::TuningRecord> tuning_records;
};

// One measured run: BF16, or FP8 with a recipe, with or without FP8 attention, with or without
// GEMM autotuning (unset: as training does).
struct RunKind {
  bool fp8 = false;
  ScalingRecipe recipe = ScalingRecipe::Tensorwise;
  bool fp8_attention = false;
  std::optional<bool> autotune;
  RecomputeGranularity recompute = RecomputeGranularity::None;  // full: one block per group
  ops::WeightTransposes weight_transposes = ops::WeightTransposes::Kept;
  bool fp8_wgrad = true;
};

RecomputeOptions bench_recompute(const RunKind& run) {
  return {run.recompute, RecomputeMethod::Uniform, 1};
}

// The GEMM selection of a run: training's (the environment over gemm_autotune's default, the
// cache file in the cache folder), with `autotune`, when given, in place of FP8TRAIN_AUTOTUNE.
gemm::GemmTuning bench_tuning(std::optional<bool> autotune) {
  gemm::GemmTuningRequest request;
  request.gemm_tuning_cache = train::default_gemm_tuning_cache().string();
  if (autotune) request.gemm_autotune = *autotune;
  return gemm::resolve_gemm_tuning(request, [autotune](const char* name) -> const char* {
    if (autotune && std::string_view(name) == "FP8TRAIN_AUTOTUNE") return nullptr;
    return std::getenv(name);
  });
}

// Without --gemm-autotune the runs follow training's selection: its log lines, once.
void print_tuning_notes(const BenchTiming& timing) {
  if (!timing.gemm_autotune.empty()) return;
  for (const std::string& note : bench_tuning(std::nullopt).notes)
    fmt::print("{}\n", note);
}

// ", autotuned" when the tuning times any GEMMs.
std::string tuning_suffix(const gemm::GemmTuning& tuning) {
  return tuning.autotunes_any() ? ", autotuned" : "";
}

std::string run_name(const RunKind& run, const std::string& formats) {
  const char* recompute = run.recompute == RecomputeGranularity::Full ? ", full recompute"
                          : run.recompute == RecomputeGranularity::Selective
                              ? ", selective recompute"
                              : "";
  if (!run.fp8) return fmt::format("bf16{}", recompute);
  return fmt::format(
      "fp8 {} {}{}{}{}{}{}", formats, recipe_name(run.recipe),
      run.recipe == ScalingRecipe::Mxfp8 ? " (emulated)" : "",
      run.fp8_attention ? " + fp8 attention" : "",
      run.weight_transposes == ops::WeightTransposes::InBackward ? ", Ŵᵗ in backward" : "",
      run.fp8_wgrad ? "" : ", bf16 wgrad", recompute);
}

ModelPrecision bench_precision(const RunKind& run, const std::string& formats) {
  ModelPrecision precision;
  precision.fp8.mode =
      run.fp8 ? (formats == "e4m3" ? Fp8Mode::E4M3 : Fp8Mode::Hybrid) : Fp8Mode::None;
  precision.fp8.recipe = run.recipe;
  precision.policy.mode = precision.fp8.mode;
  precision.policy.recipe = run.recipe;
  precision.family = Fp8Family::Ocp;
  precision.fp8_attention = run.fp8 && run.fp8_attention;
  precision.fp8_weight_transposes = run.weight_transposes;
  precision.fp8_wgrad = run.fp8_wgrad;
  return precision;
}

// What a timed step runs: prepare (host inputs, untimed), then forward, backward and the
// optimizer, each between CUDA events; loss reads the last step's loss.
struct StepParts {
  std::function<void()> prepare, forward, backward, optimize;
  std::function<double()> loss;
};

std::string percent_of(double part, double whole) {
  return whole > 0.0 ? fmt::format("{:.1f} %", 100.0 * part / whole) : "-";
}

void print_trace_summary(const TraceSummary& trace, const std::string& run,
                         const std::string& file) {
  fmt::print(
      "{}: one step traced into {}: the GPU ran {:.1f} ms of a {:.1f} ms span and sat idle "
      "{:.1f} ms in {} gaps, {:.1f} ms of it waiting for the host to issue work; kernels "
      "{:.1f} ms ({}), copies {:.1f} ms ({}), memsets {:.1f} ms ({})\n",
      run, file, trace.busy_ms, trace.span_ms, trace.idle_ms, trace.gaps,
      trace.idle_waiting_for_host_ms, trace.kernel_ms, trace.kernels, trace.memcpy_ms,
      trace.memcpys, trace.memset_ms, trace.memsets);
  const auto table = [](const char* title, const std::vector<NamedTime>& rows, double whole) {
    fmt::print("\n| {} | count | ms | share |\n|---|---|---|---|\n", title);
    for (const NamedTime& row : rows)
      fmt::print("| {} | {} | {:.2f} | {} |\n", row.name, row.count, row.ms,
                 percent_of(row.ms, whole));
  };
  table("kernel", trace.top_kernels, trace.span_ms);
  table("what the GPU waited idle to start", trace.top_waits, trace.idle_ms);
  table("host CUDA call", trace.top_api, trace.span_ms);
  fmt::print("\n");
}

// The file of a run's trace in timing.trace (empty: none), "MODEL.RUN.trace.json" with one `_`
// for each stretch of anything but ASCII letters and digits; each rank of several writes its own.
std::string trace_file(const BenchTiming& timing, const char* model, const std::string& run,
                       int rank, int rank_count) {
  if (timing.trace.empty()) return {};
  std::string stem = std::string(model) + ".";
  for (const char c : run) {
    const bool plain = c >= 0 && std::isalnum(static_cast<unsigned char>(c));
    if (plain) {
      stem.push_back(c);
    } else if (stem.back() != '_' && stem.back() != '.') {
      stem.push_back('_');
    }
  }
  if (stem.back() == '_') stem.pop_back();
  if (rank_count > 1) stem += fmt::format(".rank{}", rank);
  return (std::filesystem::path(timing.trace) / (stem + ".trace.json")).string();
}

// Runs warmup + steps steps (and with timing.phases as many again, with the phase timer on)
// and fills result's medians, peak memory and final loss; with a trace file, one more step is
// then traced there.
void time_steps(const BenchTiming& timing, const std::string& trace_path, cudaStream_t stream,
                const StepParts& parts, Measurement& result) {
  TimingEvents events(4);
  std::vector<double> step_ms, forward_ms, backward_ms, optimizer_ms, issue_ms;
  std::array<std::vector<double>, kStepPhases> phase_ms;
  std::vector<double> other_ms;
  PhaseTimer phase_timer;
  // The timed steps, then (--phases) as many again with the phase timer on: its events are
  // kept out of the step times above.
  const int timed_end = timing.warmup + timing.steps;
  const int end = timing.phases ? timed_end + timing.steps : timed_end;
  for (int step = 0; step < end; ++step) {
    const bool phased = step >= timed_end;
    parts.prepare();
    events.record(0, stream);
    if (phased) set_active_phase_timer(&phase_timer);
    const auto issue_start = std::chrono::steady_clock::now();
    parts.forward();
    events.record(1, stream);
    parts.backward();
    events.record(2, stream);
    const std::chrono::duration<double, std::milli> issued =
        std::chrono::steady_clock::now() - issue_start;
    set_active_phase_timer(nullptr);
    parts.optimize();
    events.record(3, stream);
    FP8T_CUDA_CHECK(cudaStreamSynchronize(stream));
    if (step < timing.warmup) continue;
    if (phased) {
      const std::array<double, kStepPhases> phases = phase_timer.collect();
      double timed = 0.0;
      for (size_t phase = 0; phase < kStepPhases; ++phase) {
        phase_ms[phase].push_back(phases[phase]);
        timed += phases[phase];
      }
      other_ms.push_back(events.ms(0, 2) - timed);
      continue;
    }
    step_ms.push_back(events.ms(0, 3));
    forward_ms.push_back(events.ms(0, 1));
    backward_ms.push_back(events.ms(1, 2));
    optimizer_ms.push_back(events.ms(2, 3));
    issue_ms.push_back(issued.count());
    result.peak_memory = std::max(result.peak_memory, device_memory_in_use());
  }
  result.step_ms = median(step_ms);
  result.forward_ms = median(forward_ms);
  result.backward_ms = median(backward_ms);
  result.optimizer_ms = median(optimizer_ms);
  result.issue_ms = median(issue_ms);
  if (timing.phases) {
    for (size_t phase = 0; phase < kStepPhases; ++phase)
      result.phase_ms[phase] = median(phase_ms[phase]);
    result.other_ms = median(other_ms);
  }
  result.final_loss = parts.loss();
  if (trace_path.empty()) return;
  parts.prepare();
  CudaTrace trace;
  parts.forward();
  parts.backward();
  parts.optimize();
  const std::vector<TraceRecord> records = trace.finish();
  std::filesystem::create_directories(std::filesystem::path(trace_path).parent_path());
  io::write_file_atomically(trace_path, chrome_trace_json(records));
  print_trace_summary(summarize_trace(records), result.name, trace_path);
}

// The ranks of the job (one: none), how they split into tensor-parallel groups and how they sum.
struct BenchRanks {
  distributed::Communicator* communicator = nullptr;  // with several ranks
  distributed::ParallelLayout layout;                 // the groups of --tensor-parallel
  DeviceTensorParallel tensor;                        // this rank's group, when it has several
  bool overlap = false;                               // --overlap-grad-reduce
  bool shard = false;                                 // --shard-optimizer-state
  int count() const { return communicator != nullptr ? communicator->size() : 1; }
  int rank() const { return communicator != nullptr ? communicator->rank() : 0; }
  int replicas() const { return layout.data; }  // the micro-batches of a step
  // The replica and replica count the optimizer shards over: 0 of 1 unless sharding several
  // replicas (under tensor parallelism each rank of a group owns the same parameters' shares).
  bool sharded() const { return shard && replicas() > 1; }
  int shard_rank() const { return sharded() ? layout.data_rank : 0; }
  int shard_count() const { return sharded() ? layout.data : 1; }
};

Measurement measure(const BenchGptOptions& options, const GptConfig& config,
                    const GptPrecision& precision, const RecomputeOptions& recompute,
                    const std::string& name, const gemm::GemmTuning& tuning,
                    const BenchRanks& ranks, cudaStream_t stream) {
  const int64_t batch = options.batch, seq = options.sequence_len, tokens = batch * seq;
  Measurement result;
  result.name = name + tuning_suffix(tuning);
  const optim::GptOptimizer host_optimizer(config, optim::OptimizerSettings{}, tokens,
                                           ranks.shard_rank(), ranks.shard_count());
  CudaGptModel model(
      config, batch, seq, precision, stream, {}, recompute, ranks.tensor,
      optim::CudaGptOptimizer::planned_workspace_bytes(
          host_optimizer, optim::device_parameter_layout(config, /*bf16_embeddings=*/true,
                                                         ranks.tensor.size, ranks.tensor.rank)));
  model.gemm().configure_tuning(tuning);
  const std::span<uint8_t> scratch = model.scratch_between_steps();
  optim::CudaGptOptimizer optimizer(host_optimizer, model.layout(), model.gemm(), scratch.data(),
                                    scratch.size(), train::share_collectives(ranks.tensor));
  {
    Arena arena("parameters", ParameterSet::planned_bytes(config, DType::F32));
    ParameterSet parameters(arena, config, DType::F32);
    init_gpt_weights(parameters, config, 1);
    model.upload_parameters(parameters);
  }
  result.fp8_layers = precision_summary(model.linear_precision());
  // Several ranks: what a training step adds on each (train/cuda_rank_sums.h).
#if FP8TRAIN_WITH_NCCL
  std::unique_ptr<train::GptRankSums> rank_sums;
  if (ranks.communicator != nullptr && ranks.replicas() > 1) {
    rank_sums = std::make_unique<train::GptRankSums>(
        *ranks.communicator, model, ranks.layout, ranks.overlap,
        ranks.sharded() ? &host_optimizer.shard() : nullptr);
  }
  const auto backward = [&] { rank_sums ? rank_sums->last_backward() : model.backward(); };
  const auto sum_over_ranks = [&] {
    model.gather_split_gradients();
    if (!rank_sums) return;
    rank_sums->sum_gradients();
    ops::cuda::scale_f32(model.gradients(), 1.0f / float(ranks.replicas()),
                         model.layout().total_elements, stream);
  };
  const auto after_update = [&] {
    if (rank_sums) rank_sums->after_update();
  };
#else
  const auto backward = [&] { model.backward(); };
  const auto sum_over_ranks = [] {};
  const auto after_update = [] {};
#endif

  std::mt19937 generator(7);
  std::uniform_int_distribution<int32_t> token(0, config.vocab_size - 1);
  std::vector<int32_t> idx(static_cast<size_t>(tokens)), targets(idx.size());
  const optim::StepSchedule schedule;
  const int64_t count = model.layout().total_elements;
  float* norm = nullptr;
  FP8T_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&norm), sizeof(float)));
  time_steps(options.timing,
             trace_file(options.timing, "gpt", result.name, ranks.rank(), ranks.count()), stream,
             {.prepare =
                  [&] {
                    for (size_t i = 0; i < idx.size(); ++i) {
                      idx[i] = token(generator);
                      targets[i] = token(generator);
                    }
                  },
              .forward =
                  [&] {
                    model.zero_gradients();
                    model.forward(idx.data(), targets.data(), true);
                  },
              .backward = backward,
              .optimize =
                  [&] {
                    sum_over_ranks();
                    optimizer.global_norm(model.gradients(), count, norm, stream);
                    optimizer.step(model.parameters(), model.bf16_parameters(), model.gradients(),
                                   schedule, stream);
                    after_update();
                    model.end_step();
                  },
              .loss = [&] { return model.loss_value(); }},
             result);
  result.tuning_summary = model.gemm().tuning_summary();
  result.tuning_records = model.gemm().tuning_records();
  cudaFree(norm);
  result.throughput = double(tokens) * ranks.replicas() / (result.step_ms * 1e-3);
  // Per GPU: a tensor-parallel group's GPUs share each token's FLOPs (--rank-alone's too).
  result.mfu = result.throughput / (ranks.replicas() * ranks.layout.tensor) *
               gpt_flops_per_token(config) / kBf16PeakFlops;
  return result;
}

}  // namespace

namespace {

// "87.5 K" tokens/s, "58.3" samples/s.
std::string format_rate(double rate) {
  return rate >= 1e3 ? fmt::format("{:.1f} K", rate / 1e3) : fmt::format("{:.1f}", rate);
}

// Each precision in turn, and for fp8 each recipe with each attention setting ("off", "on"):
// measure_run(RunKind) per run, a line each. In one process a run that runs out of GPU memory
// is reported as such and the next one measured (with several, the others would wait for it).
template <typename Measure>
std::vector<Measurement> measure_runs(const std::vector<std::string>& precisions,
                                      const std::vector<std::string>& fp8_recipes,
                                      const std::vector<std::string>& fp8_attention,
                                      const std::string& formats, const BenchTiming& timing,
                                      const char* unit, bool one_process,
                                      const Measure& measure_run) {
  std::vector<RunKind> runs;
  for (const std::string& precision : precisions) {
    if (precision != "fp8") {
      runs.push_back({});
      continue;
    }
    for (const std::string& recipe_text : fp8_recipes) {
      ScalingRecipe recipe = ScalingRecipe::Tensorwise;
      for (const auto& [name, value] : kScalingRecipeNames) {
        if (name == recipe_text) recipe = value;
      }
      for (const std::string& attention : fp8_attention)
        runs.push_back({.fp8 = true,
                        .recipe = recipe,
                        .fp8_attention = attention == "on",
                        .autotune = std::nullopt});
    }
  }
  // Each run (fp8_only: each FP8 run) in each setting given (none: as it is), `apply` setting it.
  const auto in_each = [&runs](const std::vector<std::string>& settings, bool fp8_only,
                               const auto& apply) {
    if (settings.empty()) return;
    std::vector<RunKind> expanded;
    for (const RunKind& run : runs) {
      if (fp8_only && !run.fp8) {
        expanded.push_back(run);
        continue;
      }
      for (const std::string& setting : settings) {
        expanded.push_back(run);
        apply(expanded.back(), setting);
      }
    }
    runs = std::move(expanded);
  };
  in_each(timing.gemm_autotune, false,
          [](RunKind& run, const std::string& setting) { run.autotune = setting == "on"; });
  in_each(timing.recompute, false, [](RunKind& run, const std::string& setting) {
    run.recompute = setting == "full"        ? RecomputeGranularity::Full
                    : setting == "selective" ? RecomputeGranularity::Selective
                                             : RecomputeGranularity::None;
  });
  in_each(timing.fp8_weight_transposes, true, [](RunKind& run, const std::string& setting) {
    run.weight_transposes = weight_transposes_named(setting, "--fp8-weight-transposes");
    check_fp8_weight_transposes(run.weight_transposes, run.recipe, "--fp8-weight-transposes");
  });
  in_each(timing.fp8_wgrad, true,
          [](RunKind& run, const std::string& setting) { run.fp8_wgrad = setting == "on"; });
  std::vector<Measurement> results;
  for (const RunKind& run : runs) {
    Measurement result;
    try {
      result = measure_run(run);
    } catch (const DeviceOutOfMemory& error) {
      if (!one_process) throw;
      result = Measurement{};
      result.name = run_name(run, formats);
      result.out_of_memory = true;
      fmt::print("{}: out of GPU memory: {}\n", result.name, error.what());
      results.push_back(result);
      continue;
    }
    if (!result.tuning_summary.empty()) fmt::print("{}\n", result.tuning_summary);
    fmt::print(
        "{}: {:.1f} ms/step (forward {:.1f}, backward {:.1f}, optimizer {:.1f}; forward + "
        "backward issued in {:.1f} ms), {} {}, bf16-MFU {:.1f} %, peak {}, loss {:.3f}; {}\n",
        result.name, result.step_ms, result.forward_ms, result.backward_ms, result.optimizer_ms,
        result.issue_ms, format_rate(result.throughput), unit, 100.0 * result.mfu,
        train::format_bytes(result.peak_memory), result.final_loss, result.fp8_layers);
    results.push_back(result);
  }
  if (std::all_of(results.begin(), results.end(),
                  [](const Measurement& result) { return result.out_of_memory; })) {
    throw DeviceOutOfMemory("bench: no run fits in the GPU's memory (see above)");
  }
  return results;
}

void print_results(const std::vector<Measurement>& results, const char* unit,
                   const BenchTiming& timing) {
  const Measurement& base = *std::find_if(results.begin(), results.end(),
                                          [](const auto& result) { return !result.out_of_memory; });
  fmt::print(
      "\n| run | step ms | {} | bf16-MFU | peak memory | forward | backward | optimizer | vs {} "
      "|\n|---|---|---|---|---|---|---|---|---|\n",
      unit, base.name);
  for (const Measurement& result : results) {
    if (result.out_of_memory) {
      fmt::print("| {} | out of memory | | | | | | | |\n", result.name);
      continue;
    }
    fmt::print(
        "| {} | {:.1f} | {} | {:.1f} % | {} | {:.1f} ms | {:.1f} ms | {:.1f} ms | {:.3f}x "
        "step |\n",
        result.name, result.step_ms, format_rate(result.throughput), 100.0 * result.mfu,
        train::format_bytes(result.peak_memory), result.forward_ms, result.backward_ms,
        result.optimizer_ms, result.step_ms / base.step_ms);
  }
  if (!timing.phases) return;
  fmt::print(
      "\nForward + backward by kind of work (ms per step, medians of {} more steps with an event "
      "pair around each piece; other: norms, modulation, rotary, gates, residuals, the loss, "
      "launch gaps)\n\n| run | {} | {} | {} | other | optimizer |\n|---|---|---|---|---|---|\n",
      timing.steps, step_phase_name(StepPhase::Gemm), step_phase_name(StepPhase::Attention),
      step_phase_name(StepPhase::Quantization));
  for (const Measurement& result : results) {
    if (result.out_of_memory) continue;
    fmt::print("| {} | {:.1f} | {:.1f} | {:.1f} | {:.1f} | {:.1f} |\n", result.name,
               result.phase_ms[0], result.phase_ms[1], result.phase_ms[2], result.other_ms,
               result.optimizer_ms);
  }
}

// The weights every run of a benchmark starts from (init_flux_weights, seed 1), made once: at
// flux_12b's size that takes minutes on the host.
struct FluxBenchWeights {
  Arena arena;
  FluxParameterSet parameters;
  explicit FluxBenchWeights(const FluxConfig& config)
      : arena("parameters", FluxParameterSet::planned_bytes(config, DType::F32)),
        parameters(arena, config, DType::F32) {
    init_flux_weights(parameters, config, 1);
  }
};

// W-FLUX535's step: random latents, text and pooled embeddings and σ, the rectified-flow loss,
// AdamW with Primus' settings (lr 1e-4, wd 0.01, betas 0.9 / 0.999) and clipping at 1.0.
Measurement measure_flux(const BenchFluxOptions& options, const FluxConfig& config,
                         const FluxParameterSet& initial, const FluxPrecision& precision,
                         const RecomputeOptions& recompute, const std::string& name,
                         const gemm::GemmTuning& tuning, const BenchRanks& ranks,
                         cudaStream_t stream) {
  const int64_t B = options.batch, Li = options.img_tokens, Lt = options.txt_tokens;
  Measurement result;
  result.name = name + tuning_suffix(tuning);
  CudaFluxModel model(config, B, Li, Lt, precision, stream, recompute, ranks.tensor);
  model.gemm().configure_tuning(tuning);
  const optim::AdamWHyperparameters adamw{.lr = 1e-4, .weight_decay = 0.01};
  // ZeRO-1 over the replicas, as training's: a tensor-parallel group's ranks hold other shares.
  const bool sharded = ranks.sharded();
  const optim::OptimizerShard shard = optim::adamw_shard(train::flux_optimized_parameters(config),
                                                         ranks.shard_rank(), ranks.shard_count());
  optim::CudaAdamW optimizer(model.layout(), adamw, &shard, model.gradient_shares());
  if (!sharded) optimizer.measure_amaxes(model.weight_amax_slots());  // as training's
  model.upload_parameters(initial);
  result.fp8_layers = flux_precision_summary(model.linear_precision());
  // Several ranks: what a training step adds on each (train/cuda_rank_sums.h). Each rank's
  // loss gradient is scaled by 1/replicas, as training's share of the mean over the replicas.
#if FP8TRAIN_WITH_NCCL
  std::unique_ptr<train::FluxRankSums> rank_sums;
  if (ranks.communicator != nullptr && ranks.replicas() > 1)
    rank_sums = std::make_unique<train::FluxRankSums>(*ranks.communicator, model, ranks.layout,
                                                      sharded ? &shard : nullptr);
  const auto sum_over_ranks = [&] {
    model.sum_partial_gradients();
    if (rank_sums) rank_sums->sum_gradients();
  };
  const auto after_update = [&] {
    if (rank_sums) rank_sums->after_update();
  };
#else
  const auto sum_over_ranks = [&] { model.sum_partial_gradients(); };
  const auto after_update = [] {};
#endif
  const float share = 1.0f / static_cast<float>(ranks.replicas());

  std::mt19937 generator(7);
  std::normal_distribution<float> normal;
  std::uniform_real_distribution<float> unit;
  const auto draw = [&](std::vector<float>& values, int64_t count) {
    values.resize(size_t(count));
    for (float& value : values)
      value = normal(generator);
  };
  std::vector<float> img, txt, y, target, ids;
  std::vector<float> timesteps(static_cast<size_t>(B));
  const std::vector<float> guidance(static_cast<size_t>(B), 3.5f);  // FLUX.1-dev's default
  const auto side = static_cast<int64_t>(std::lround(std::sqrt(double(Li))));
  for (int64_t token = 0; token < Li; ++token)
    ids.insert(ids.end(), {0.0f, float(token / side), float(token % side)});
  float* norm = nullptr;
  FP8T_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&norm), sizeof(float)));
  time_steps(options.timing,
             trace_file(options.timing, "flux", result.name, ranks.rank(), ranks.count()), stream,
             {.prepare =
                  [&] {
                    draw(img, B * Li * config.in_channels);
                    draw(txt, B * Lt * config.context_in_dim);
                    draw(y, B * config.vec_in_dim);
                    draw(target, B * Li * config.in_channels);
                    for (float& t : timesteps)
                      t = unit(generator);
                  },
              .forward =
                  [&] {
                    model.zero_gradients();
                    const FluxInputs inputs{
                        img.data(),       ids.data(),
                        txt.data(),       y.data(),
                        timesteps.data(), config.guidance_embed ? guidance.data() : nullptr};
                    model.forward(inputs, target.data(), true, share);
                  },
              .backward = [&] { model.backward(); },
              .optimize =
                  [&] {
                    sum_over_ranks();
                    optimizer.clip(model.gradients(), norm, 1.0f, stream);
                    optimizer.step(model.parameters(), model.gradients(), 1.0, stream);
                    after_update();
                    model.end_step(/*weight_amaxes_measured=*/!sharded);
                  },
              .loss = [&] { return model.loss_value(); }},
             result);
  result.tuning_summary = model.gemm().tuning_summary();
  result.tuning_records = model.gemm().tuning_records();
  cudaFree(norm);
  result.throughput = double(B) * ranks.replicas() / (result.step_ms * 1e-3);
  // Per GPU: a tensor-parallel group's GPUs share each sample's FLOPs.
  result.mfu = result.throughput / (ranks.replicas() * ranks.layout.tensor) *
               flux_flops_per_sample(config, Li, Lt) / kBf16PeakFlops;
  return result;
}

// The job's ranks in groups of --tensor-parallel, known before any GPU is touched; an error
// that says how to start the ranks when they do not make whole groups.
distributed::ParallelLayout bench_layout(const char* command, int tensor,
                                         const distributed::LaunchInfo& launch) {
  if (launch.world_size % tensor != 0) {
    throw Error(fmt::format(
        "{}: --tensor-parallel {} needs the ranks in groups of {}, and the job has {} (start it "
        "with --nproc-per-node {}, or under mpirun or srun)",
        command, tensor, tensor, launch.world_size, tensor));
  }
  return distributed::parallel_layout(launch.world_size, launch.rank, tensor);
}

// Started as one of several ranks (--nproc-per-node, mpirun, srun): each rank times a micro-batch
// on its own GPU (LOCAL_RANK), the same on each rank of a tensor-parallel group, and sums the
// gradients with the others; rank 0 prints. The overlapped sums need whole gradients: none
// under tensor parallelism, as in training.
BenchRanks join_ranks(distributed::Communicator& communicator, const char* command, bool overlap,
                      bool shard, const distributed::ParallelLayout& layout) {
  BenchRanks ranks;
  ranks.layout = layout;
  ranks.overlap = overlap && layout.tensor == 1;
  ranks.shard = shard;
  if (communicator.several()) {
#if !FP8TRAIN_WITH_NCCL
    throw Error(fmt::format("{}: several ranks need NCCL, not in this build", command));
#endif
    train::training_gpu(&communicator);
    ranks.communicator = &communicator;
  }
  if (communicator.rank() != 0 && std::freopen("/dev/null", "w", stdout) == nullptr) {
    throw Error(fmt::format("{}: cannot silence the output of the ranks after the first", command));
  }
  return ranks;
}

// The header's note on the ranks; empty for one rank.
std::string ranks_text(const BenchRanks& ranks, const char* unit) {
  if (ranks.count() == 1) return "";
  const std::string tensor =
      ranks.layout.tensor == 1
          ? ""
          : fmt::format(" in {} tensor-parallel group{} of {} (the blocks split over each)",
                        ranks.replicas(), ranks.replicas() == 1 ? "" : "s", ranks.layout.tensor);
  return fmt::format(
      " x {} ranks{}, data parallel (NCCL all-reduce of the fp32 gradients, {}{}); {} of all "
      "ranks, memory of rank 0",
      ranks.count(), tensor, ranks.overlap ? "overlapped with the backward" : "after the backward",
      ranks.sharded() ? "; ZeRO-1: each rank updates its share and broadcasts it" : "", unit);
}

// --rank-alone: the first rank of a group of `tensor` ranks, with collectives that leave their
// values as they are (no other rank adds to them).
distributed::ParallelLayout alone_layout(const char* command, int tensor,
                                         const distributed::LaunchInfo& launch) {
  if (tensor == 1 || launch.world_size != 1) {
    throw Error(fmt::format(
        "{}: --rank-alone times one rank of a --tensor-parallel group in one process: expected "
        "--tensor-parallel above 1 and one rank, found {} and {}",
        command, tensor, launch.world_size));
  }
  return {.tensor = tensor, .tensor_rank = 0, .data = 1, .data_rank = 0};
}

// The collectives of a rank alone: sums and maxima leave its values as they are; a gather puts
// its values in every rank's place, a reduce-scatter takes its own place's.
DeviceTensorParallel alone_in_group(int tensor, bool sequence) {
  DeviceTensorParallel group;
  group.size = tensor;
  group.sequence = sequence;
  group.sum_bf16 = [](bf16*, size_t, cudaStream_t) {};
  group.sum = [](float*, size_t, cudaStream_t) {};
  group.max = [](float*, size_t, cudaStream_t) {};
  group.all_gather_bf16 = [tensor](const bf16* own, bf16* all, size_t count, cudaStream_t stream) {
    for (int rank = 0; rank < tensor; ++rank) {
      FP8T_CUDA_CHECK(cudaMemcpyAsync(all + size_t(rank) * count, own, count * sizeof(bf16),
                                      cudaMemcpyDeviceToDevice, stream));
    }
  };
  group.reduce_scatter_bf16 = [](const bf16* all, bf16* own, size_t count, cudaStream_t stream) {
    FP8T_CUDA_CHECK(
        cudaMemcpyAsync(own, all, count * sizeof(bf16), cudaMemcpyDeviceToDevice, stream));
  };
  return group;
}

// The header's note on --rank-alone and --sequence-parallel; empty without them.
std::string rank_alone_text(bool rank_alone, int tensor, bool sequence) {
  const char* sequence_text = sequence ? "; sequence parallel" : "";
  if (!rank_alone) return sequence_text;
  return fmt::format(
      "; the first rank of a tensor-parallel group of {} alone: its shares of the blocks, its "
      "collectives within the group left out (losses not the model's){}",
      tensor, sequence_text);
}

}  // namespace

int run_bench_gpt(const BenchGptOptions& options) {
  if (options.sequence_parallel)
    check_sequence_parallel(options.tensor_parallel, options.batch, options.sequence_len);
  const distributed::LaunchInfo launch = distributed::detect_launch();
  const distributed::ParallelLayout layout =
      options.rank_alone ? alone_layout("bench gpt", options.tensor_parallel, launch)
                         : bench_layout("bench gpt", options.tensor_parallel, launch);
  const std::vector<GpuInfo> gpus = query_gpus();
  if (gpus.empty()) throw Error("bench gpt: no CUDA GPU is visible");
  distributed::Communicator communicator(launch, 0);
  BenchRanks ranks = join_ranks(communicator, "bench gpt", options.overlap_grad_reduce,
                                options.shard_optimizer_state, layout);
  const train::CudaTensorGroup tensor_group(ranks.communicator, ranks.layout,
                                            options.sequence_parallel);
  ranks.tensor = options.rank_alone
                     ? alone_in_group(options.tensor_parallel, options.sequence_parallel)
                     : tensor_group.device;
  GptConfig config = GptConfig::from_depth(options.depth);
  config.vocab_size = options.vocab_size;
  config.sequence_len = options.sequence_len;
  config.window_pattern = options.window_pattern;
  config.validate();
  const double flops_per_token = gpt_flops_per_token(config);
  fmt::print(
      "bench gpt: depth {}, dim {}, {} heads, vocab {}, sequence {}, windows {}, micro-batch {} "
      "({} tokens), {:.3f}B parameters, {:.4g} FLOPs/token; MuonAdamW, random tokens; {} "
      "warm-up + {} timed steps\nGPU: {} ({}){}{}\n",
      config.n_layer, config.n_embd, config.n_head, config.vocab_size, config.sequence_len,
      config.window_pattern, options.batch, options.batch * config.sequence_len,
      double(ParameterSet::planned_bytes(config, DType::F32)) / 4e9, flops_per_token,
      options.timing.warmup, options.timing.steps, gpus[0].name, gpus[0].architecture(),
      ranks_text(ranks, "tokens/s"),
      rank_alone_text(options.rank_alone, options.tensor_parallel, options.sequence_parallel));

  cudaStream_t stream = nullptr;
  FP8T_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  print_tuning_notes(options.timing);
  const std::vector<Measurement> results = measure_runs(
      options.precisions, options.fp8_recipes, options.fp8_attention, options.fp8, options.timing,
      "tokens/s", launch.world_size == 1, [&](const RunKind& run) {
        return measure(options, config, bench_precision(run, options.fp8), bench_recompute(run),
                       run_name(run, options.fp8), bench_tuning(run.autotune), ranks, stream);
      });
  FP8T_CUDA_CHECK(cudaStreamDestroy(stream));
  print_results(results, "tokens/s", options.timing);
  return kExitOk;
}

int run_bench_flux(const BenchFluxOptions& options) {
  if (options.sequence_parallel) {
    check_flux_sequence_parallel(options.tensor_parallel, options.img_tokens, options.txt_tokens);
  }
  const distributed::LaunchInfo launch = distributed::detect_launch();
  const distributed::ParallelLayout layout =
      options.rank_alone ? alone_layout("bench flux", options.tensor_parallel, launch)
                         : bench_layout("bench flux", options.tensor_parallel, launch);
  const std::vector<GpuInfo> gpus = query_gpus();
  if (gpus.empty()) throw Error("bench flux: no CUDA GPU is visible");
  distributed::Communicator communicator(launch, 0);
  BenchRanks ranks =
      join_ranks(communicator, "bench flux", false, options.shard_optimizer_state, layout);
  const train::CudaTensorGroup tensor_group(ranks.communicator, ranks.layout,
                                            options.sequence_parallel);
  ranks.tensor = options.rank_alone
                     ? alone_in_group(options.tensor_parallel, options.sequence_parallel)
                     : tensor_group.device;
  const FluxConfig config = flux_config_of(options.model);
  fmt::print(
      "bench flux: {} ({:.1f}M parameters; {} double + {} single blocks, hidden {}), micro-batch "
      "{} of {} image + {} text tokens, {:.3g} FLOPs per sample; AdamW, clip 1.0, random inputs; "
      "{} warm-up + {} timed steps\nGPU: {} ({}){}{}\n",
      options.model.preset, double(flux_parameter_count(config)) / 1e6, config.double_blocks,
      config.single_blocks, config.hidden_size, options.batch, options.img_tokens,
      options.txt_tokens, flux_flops_per_sample(config, options.img_tokens, options.txt_tokens),
      options.timing.warmup, options.timing.steps, gpus[0].name, gpus[0].architecture(),
      ranks_text(ranks, "samples/s"),
      rank_alone_text(options.rank_alone, options.tensor_parallel, options.sequence_parallel));

  cudaStream_t stream = nullptr;
  FP8T_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  print_tuning_notes(options.timing);
  const FluxBenchWeights weights(config);
  const std::vector<Measurement> results = measure_runs(
      options.precisions, options.fp8_recipes, options.fp8_attention, options.fp8, options.timing,
      "samples/s", launch.world_size == 1, [&](const RunKind& run) {
        return measure_flux(options, config, weights.parameters, bench_precision(run, options.fp8),
                            bench_recompute(run), run_name(run, options.fp8),
                            bench_tuning(run.autotune), ranks, stream);
      });
  FP8T_CUDA_CHECK(cudaStreamDestroy(stream));
  print_results(results, "samples/s", options.timing);
  return kExitOk;
}

namespace {

// One step of the configured model with `tuning`, then each problem's record.
void tune_on_gpu(const TrainConfig& config, const gemm::GemmTuning& tuning) {
  const std::vector<GpuInfo> gpus = query_gpus();
  if (gpus.empty()) throw Error("tune: no CUDA GPU is visible");
  BenchTiming one_step;
  one_step.warmup = 0;
  one_step.steps = 1;
  const ModelPrecision precision = train::model_precision(config, /*cuda=*/true);
  cudaStream_t stream = nullptr;
  FP8T_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  Measurement result;
  if (config.is_flux()) {
    const FluxConfig model = config.flux_config();
    const train::FluxTrainingData data = train::open_flux_data(config);
    const train::FluxBatchBuilder batches(*data.source, model, data.objective,
                                          config.training.micro_batch_size,
                                          static_cast<uint64_t>(config.training.seed));
    BenchFluxOptions flux;
    flux.batch = config.training.micro_batch_size;
    flux.img_tokens = batches.latent_shape().tokens();
    flux.txt_tokens = batches.dims().text_tokens;
    flux.timing = one_step;
    fmt::print("tune: {}, micro-batch {} of {} image + {} text tokens, {}; one step on {}\n",
               config.model.name, flux.batch, flux.img_tokens, flux.txt_tokens,
               describe(precision.fp8), gpus[0].name);
    const FluxBenchWeights weights(model);
    result = measure_flux(flux, model, weights.parameters, precision, {}, config.model.name, tuning,
                          {}, stream);
  } else {
    BenchGptOptions gpt;
    gpt.batch = config.training.micro_batch_size;
    gpt.sequence_len = config.model.sequence_len;
    gpt.timing = one_step;
    const GptConfig model = config.gpt_config();
    fmt::print("tune: GPT depth {}, micro-batch {} x {} tokens, {}; one step on {}\n",
               model.n_layer, gpt.batch, gpt.sequence_len, describe(precision.fp8), gpus[0].name);
    result = measure(gpt, model, precision, {}, "gpt", tuning, {}, stream);
  }
  FP8T_CUDA_CHECK(cudaStreamDestroy(stream));
  fmt::print(
      "\n| GEMM | candidates | agreeing | kept | heuristic's first ms | kept ms | change |\n"
      "|---|---|---|---|---|---|---|\n");
  for (const gemm::CublasLtGemm::TuningRecord& record : result.tuning_records) {
    const std::string agreeing = record.from_cache   ? "(cache)"
                                 : record.no_scratch ? "(no memory)"
                                                     : fmt::format("{}", record.agreeing);
    fmt::print(
        "| {} | {} | {} | {} | {:.4f} | {:.4f} | {:+.1f} % |\n", record.problem, record.candidates,
        agreeing, record.winner, record.heuristic_ms, record.best_ms,
        record.heuristic_ms > 0.0 ? 100.0 * (record.best_ms / record.heuristic_ms - 1.0) : 0.0);
  }
  fmt::print("\n{}\n", result.tuning_summary);
}

}  // namespace

#else

namespace {

void tune_on_gpu(const TrainConfig&, const gemm::GemmTuning&) {
  throw Error(
      "tune: this fp8train was built without CUDA (FP8TRAIN_CUDA=ON needs the CUDA toolkit)");
}

}  // namespace

int run_bench_gpt(const BenchGptOptions&) {
  throw Error(
      "bench gpt: this fp8train was built without CUDA (FP8TRAIN_CUDA=ON needs the CUDA "
      "toolkit)");
}

int run_bench_flux(const BenchFluxOptions&) {
  throw Error(
      "bench flux: this fp8train was built without CUDA (FP8TRAIN_CUDA=ON needs the CUDA "
      "toolkit)");
}

#endif  // FP8TRAIN_WITH_CUDA

int run_tune(const TuneOptions& options) {
  TrainConfig config = load_train_config(options.config_args);
  config.run.gemm_autotune = true;
  const gemm::GemmTuning tuning = train::run_gemm_tuning(config);
  if (!tuning.autotunes_any()) {
    std::string why;
    for (const std::string& note : tuning.notes)
      why += (why.empty() ? "" : "; ") + note;
    throw ConfigError(fmt::format("tune: nothing to tune: {}", why));
  }
  for (const std::string& note : tuning.notes)
    fmt::print("{}\n", note);
  tune_on_gpu(config, tuning);
  return kExitOk;
}

}  // namespace fp8t::cli
