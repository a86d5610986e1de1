// What the Flux training loop drives: the model and its optimizer on one device. The CPU engine
// runs the CPU path in place; the GPU engine keeps everything on the device and mirrors the
// parameters and optimizer state into host buffers for checkpoints and sampling only. Either
// way the host views (host_parameters, host_optimizer_state, delayed_scalings) are what a
// checkpoint saves and loads: call to_host() before saving them and from_host() after changing
// them. Under tensor parallelism the GPU engine's to_host() gathers the shares over the group
// and from_host() sends the group's first rank's tensors to every rank of it: every rank of it
// calls them together.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "distributed/communicator.h"
#include "distributed/tensor_parallel_group.h"
#include "gemm/gemm_tuning.h"
#include "models/flux_model.h"
#include "models/recompute.h"
#include "optim/adamw.h"
#include "train/flux_batches.h"
#include "train/training_loop.h"

namespace fp8t::train {

class FluxEngine {
 public:
  virtual ~FluxEngine() = default;

  virtual std::string device_name() const = 0;
  // One line for the log before step 1: where the memory goes.
  virtual std::string memory_plan() const = 0;
  virtual double peak_memory_bytes() const = 0;
  virtual const std::vector<FluxLinearPrecision>& linear_precision() const = 0;

  // One optimizer step: the mean loss and gradient over the micro-batches (with R ranks, over
  // every rank's: R times as many), the global norm (clipped to clip_grad when > 0) and, unless
  // the loss or the norm is not finite (StepResult::finite), AdamW at lr · lr_multiplier and the
  // model's end_step.
  virtual StepResult train_step(std::span<const FluxBatch> micro_batches, double clip_grad,
                                double lr_multiplier) = 0;
  // The loss of one batch, without gradients and without touching the FP8 scaling state.
  virtual double evaluation_loss(const FluxBatch& batch) = 0;
  // The model's prediction [rows, img_tokens, in_channels] for `rows` samples (FluxInputs'
  // arrays of `rows` each; the image ids of training's latents), as evaluation_loss runs it, in
  // micro-batches: a sample grid's steps (models/flux_sampling.h). Under tensor parallelism
  // every rank of the group calls it together, with the same inputs.
  virtual void predict(const FluxInputs& inputs, int64_t rows, float* prediction) = 0;
  virtual double lr() const = 0;  // of the last step

  // Null and empty on a rank that keeps no host copies: under tensor parallelism on the GPU,
  // the ranks of a group but the first, which load from it and gather to it.
  virtual FluxParameterSet* host_parameters() = 0;
  virtual std::vector<NamedTensor> host_optimizer_state() = 0;
  virtual std::vector<std::pair<std::string, DelayedScaling*>> delayed_scalings() = 0;
  // FP8 health statistics (ops/fp8_health.h): while on, the FP8 linears' casts count;
  // take_fp8_health() returns this rank's counts since the last call, per FP8 linear and operand
  // (none in BF16), and starts a fresh count.
  virtual void set_record_fp8_health(bool record) = 0;
  virtual std::vector<Fp8TensorHealth> take_fp8_health() = 0;
  virtual void to_host() = 0;
  virtual void from_host() = 0;
  // As TrainingEngine::gather_optimizer_state: every rank together, before a checkpoint's
  // to_host(), the whole optimizer state into the host views from each rank's part.
  virtual void gather_optimizer_state() = 0;
  // As TrainingEngine's.
  virtual std::string gemm_tuning_summary() const { return {}; }
};

struct FluxEngineSetup {
  FluxConfig model;
  ModelPrecision precision;
  RecomputeOptions recompute;  // activation recompute (models/recompute.h)
  int64_t batch = 0;           // samples per micro-batch
  int64_t img_tokens = 0;
  int64_t txt_tokens = 0;
  std::vector<float> img_ids;  // [img_tokens, 3], the same for every sample
  optim::AdamWHyperparameters adamw;
  // Data parallelism: the gradients and losses are summed over the ranks and the delayed-scaling
  // amaxes max-reduced. Null: one process.
  distributed::Communicator* communicator = nullptr;
  // Tensor and sequence parallelism, on both paths (EngineSetup's are the GPT's).
  distributed::ParallelLayout layout;
  bool sequence_parallel = false;
  // With several ranks: ZeRO-1 (optim/optimizer_shard.h), as EngineSetup's.
  bool shard_optimizer_state = false;
  // The GPU path's GEMM selection, as EngineSetup's.
  gemm::GemmTuning gemm_tuning;
};

// `rows` samples through a model of micro-batches of `batch`: forward(a micro-batch's inputs,
// its prediction) for each, the last filled up with zero inputs whose predictions are dropped.
void predict_in_micro_batches(const FluxConfig& config, int64_t batch, int64_t img_tokens,
                              int64_t txt_tokens, const FluxInputs& inputs, int64_t rows,
                              float* prediction,
                              const std::function<void(const FluxInputs&, float*)>& forward);

// Every Flux parameter, as the optimizer (AdamWOptimizer) takes them.
std::vector<optim::AdamWOptimizer::Parameter> flux_optimized_parameters(const FluxConfig& config);

std::unique_ptr<FluxEngine> make_flux_cpu_engine(const FluxEngineSetup& setup);
// The GPU path (train/flux_cuda_engine.cpp); throws ConfigError naming the key for what it does
// not run (delayed scaling, fnuz) and without a GPU or a CUDA build.
std::unique_ptr<FluxEngine> make_flux_cuda_engine(const FluxEngineSetup& setup);

}  // namespace fp8t::train
