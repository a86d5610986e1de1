// What the training loop drives: the GPT and its optimizer on one device. The CPU engine runs
// the CPU path in place; the CUDA engine keeps everything on the GPU and mirrors parameters and
// optimizer state into host buffers only for checkpoints and sampling. Either way the host views
// (host_parameters, host_optimizer, delayed_scalings) are what a checkpoint saves and loads:
// call to_host() before saving them and from_host() after changing them.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "config/train_config.h"
#include "data/token_loader.h"
#include "distributed/communicator.h"
#include "distributed/tensor_parallel_group.h"
#include "gemm/gemm_tuning.h"
#include "models/gpt_memory.h"
#include "models/gpt_model.h"
#include "models/recompute.h"
#include "optim/gpt_optimizer.h"
#include "platform/device_info.h"
#include "train/training_loop.h"

namespace fp8t::train {

class TrainingEngine {
 public:
  virtual ~TrainingEngine() = default;

  // "cpu", or the GPU's name.
  virtual std::string device_name() const = 0;
  // Lines for the log before step 1: where the memory goes.
  virtual std::string memory_plan() const = 0;
  // Peak memory of the device so far (resident memory on the CPU).
  virtual double peak_memory_bytes() const = 0;
  virtual const std::vector<LinearPrecision>& linear_precision() const = 0;

  // One optimizer step: `accumulation` micro-batches from the loader (with R ranks, micro-batch
  // m of this rank is the loader's m·R + rank: R times as many are read), their mean gradient
  // over all ranks, the global norm (clipped to clip_grad when > 0) and, unless the loss or the
  // norm is not finite (StepResult::finite), the update.
  virtual StepResult train_step(data::TokenLoader& loader, int64_t accumulation, double clip_grad,
                                const optim::StepSchedule& schedule) = 0;
  // After a step that was not applied, whose gradients are still in place: the first parameter
  // in gradient_scan_order (train/nan_guard.h) whose gradient holds a non-finite value, or
  // nothing. Reads every gradient: for bad steps only.
  virtual std::optional<std::string> first_non_finite_gradient() = 0;
  // Fault injection (nan_inject_steps): the next train_step writes a NaN into the gradient of
  // each parameter named here, once the backward and the sum over the ranks are done. Throws
  // fp8t::Error for a name the model does not have.
  virtual void inject_nan(const std::string& parameter) = 0;
  // The loss of one batch, without gradients and without touching the FP8 scaling state.
  virtual double evaluation_loss(const data::TokenBatch& batch) = 0;

  // The optimizer's groups, with the lrs of the last step.
  virtual const std::vector<optim::OptimizerGroup>& optimizer_groups() const = 0;

  virtual ParameterSet& host_parameters() = 0;
  virtual optim::GptOptimizer& host_optimizer() = 0;
  virtual std::vector<std::pair<std::string, DelayedScaling*>> delayed_scalings() = 0;
  // FP8 health statistics (ops/fp8_health.h): while on, the FP8 linears' casts count;
  // take_fp8_health() returns this rank's counts since the last call, per FP8 linear and operand
  // (none in BF16), and starts a fresh count.
  virtual void set_record_fp8_health(bool record) = 0;
  virtual std::vector<Fp8TensorHealth> take_fp8_health() = 0;
  virtual void to_host() = 0;
  virtual void from_host() = 0;
  // With shard_optimizer_state over several ranks, every rank together before a checkpoint's
  // to_host(): the whole optimizer state into host_optimizer() from each rank's part. A no-op
  // otherwise.
  virtual void gather_optimizer_state() = 0;
  // After the first step on the GPU: what GEMM autotuning did (CublasLtGemm::tuning_summary);
  // empty on the CPU path or without autotuning.
  virtual std::string gemm_tuning_summary() const { return {}; }
};

struct EngineSetup {
  GptConfig model;
  GptPrecision precision;
  RecomputeOptions recompute;  // activation recompute (models/recompute.h)
  int64_t batch = 0;
  int64_t seq = 0;
  optim::OptimizerSettings optimizer;
  int64_t tokens_per_step = 0;
  // Data parallelism: each rank takes its share of a step's micro-batches and the gradients are
  // summed over the ranks before the update (on the GPU path through NCCL). Null: one process.
  distributed::Communicator* communicator = nullptr;
  // Tensor parallelism: the ranks' split into tensor-parallel groups, which see the same
  // micro-batches, and data-parallel replicas, which share a step's micro-batches.
  distributed::ParallelLayout layout;
  // Sequence parallelism within each tensor-parallel group (models/tensor_parallel.h).
  bool sequence_parallel = false;
  // With several ranks on the GPU path: the gradient sums overlap the backward.
  bool overlap_grad_reduce = false;
  // With several ranks: ZeRO-1 (optim/optimizer_shard.h). Each rank updates the parameters it
  // owns and sends them to the others; the GPU keeps optimizer state for those only.
  bool shard_optimizer_state = false;
  // The GPU path's GEMM selection (autotuning, pinned backends, the cache file).
  gemm::GemmTuning gemm_tuning;
};

// The CPU path. Throws ConfigError when the plan does not fit in the available memory.
std::unique_ptr<TrainingEngine> make_cpu_engine(const EngineSetup& setup);
// The GPU path on the current CUDA device; throws ConfigError in builds without CUDA.
std::unique_ptr<TrainingEngine> make_cuda_engine(const EngineSetup& setup);

// Delayed scaling over several ranks, before the step's end_step: every rank folds the largest
// amax any rank saw into its histories, so the scales stay the same on every rank (a tensor
// that ran on no rank still records nothing).
void reduce_delayed_amaxes(const std::vector<std::pair<std::string, DelayedScaling*>>& scalings,
                           distributed::Communicator& communicator);

// Why the gradient sums over the data-parallel replicas wait for the end of the backward, or null
// where overlap_grad_reduce overlaps them with it: only the GPT on GPUs with several replicas and
// no tensor parallelism sums its gradients during the backward.
const char* why_gradient_sums_wait(bool cuda, bool flux, const distributed::ParallelLayout& layout);

// The log line of a run with shard_optimizer_state over `ranks` ranks.
void print_zero1_note(int ranks, bool cuda);

// ZeRO-1 across ranks, every rank together: `values` as the owner holds them, on every rank (the
// others' values are overwritten). A sum in which only the owner's values are non-zero, so exact.
void gather_from_owner(float* values, size_t count, bool owned,
                       distributed::Communicator& communicator);
// Each parameter as its owner updated it.
void gather_parameters(ParameterSet& parameters, const optim::OptimizerShard& shard,
                       distributed::Communicator& communicator);
// The optimizer's whole state (state(): "<parameter>.<kind>" buffers and an I64 step counter,
// the same on every rank) from the owners' parts, for a checkpoint. counts: whether this rank's
// owned parts count (false where another rank holds the same parts: under tensor parallelism on
// the GPU path, where a replica's ranks each gather their owned moments whole).
void gather_optimizer_state(const std::vector<NamedTensor>& state,
                            const optim::OptimizerShard& shard,
                            distributed::Communicator& communicator, bool counts = true);

// The next batch of each data-parallel replica from the loader, of which this rank keeps its
// replica's.
data::TokenBatch this_ranks_batch(data::TokenLoader& loader,
                                  const distributed::ParallelLayout& layout);

// `device`: auto picks CUDA when the build has it and a GPU is present.
bool use_cuda(DeviceChoice device);

// Throws ConfigError, naming the key, for FP8 settings no GPU model runs (the fnuz formats).
void check_gpu_precision(const ModelPrecision& precision);

// The GPU a CUDA engine trains on, made the current device: with several ranks (communicator
// set) GPU LOCAL_RANK (one rank per GPU of a node) or the only visible one (a launcher that
// gives each rank its own GPU); else GPU 0. Throws ConfigError naming `device` when none is
// visible, when this build has no CUDA, when the node has fewer GPUs than ranks, or for several
// ranks in a build without NCCL.
GpuInfo training_gpu(const distributed::Communicator* communicator = nullptr);

}  // namespace fp8t::train
