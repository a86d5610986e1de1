// The GPU path of the training loop: CudaGptModel and CudaGptOptimizer on one stream, with host
// mirrors of the parameters and the optimizer state for checkpoints and sampling. With several
// ranks (one GPU each) the gradients and the delayed-scaling amaxes are reduced through NCCL;
// with shard_optimizer_state each rank's GPU holds the state of its own parameters only, and
// the host mirror is gathered whole for a checkpoint. Under tensor parallelism the model's
// blocks are split over each group's GPUs (an NCCL communicator of the group's own): each rank
// holds its shares of the split tensors, their gradients and optimizer state, sums its
// gradients with the same shares of the other replicas only, and shards ZeRO-1 over the
// replicas; every rank of a group brings the host mirror together (the shares are gathered).
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"
#include "platform/device_info.h"
#include "train/memory_fit.h"
#include "train/nan_guard.h"
#include "train/run_log.h"
#include "train/training_engine.h"

#if FP8TRAIN_WITH_CUDA
#include <cuda_runtime_api.h>

#include "core/cuda_check.h"
#include "core/cuda_resources.h"
#include "models/cuda/gpt_model_cuda.h"
#include "train/cuda_tensor_group.h"
#include "train/evaluation_mode.h"
#include "train/micro_batch_losses.h"
#if FP8TRAIN_WITH_NCCL
#include "train/cuda_rank_sums.h"
#endif
#include "ops/cuda/gpt_gates.h"
#include "optim/cuda/gpu_optimizer.h"
#endif

namespace fp8t::train {

bool use_cuda(DeviceChoice device) {
  switch (device) {
    case DeviceChoice::Cpu:
      return false;
    case DeviceChoice::Cuda:
      return true;
    case DeviceChoice::Auto:
      return !query_gpus().empty();
  }
  return false;
}

void check_gpu_precision(const ModelPrecision& precision) {
  if (precision.fp8.mode == Fp8Mode::None) return;
  if (precision.family != Fp8Family::Ocp) {
    throw ConfigError(
        "fp8_dtype_family: fnuz: the GPU path's GEMMs (cuBLASLt) take the OCP formats; set "
        "fp8_dtype_family: auto or ocp, or device: cpu");
  }
}

#if FP8TRAIN_WITH_CUDA

namespace {

class CudaEngine final : public TrainingEngine {
 public:
  CudaEngine(const EngineSetup& setup, GpuInfo gpu)
      : gpu_(std::move(gpu)),
        communicator_(setup.communicator),
        layout_(setup.layout),
        host_arena_("parameters (host mirror)",
                    ParameterSet::planned_bytes(setup.model, DType::F32)),
        host_parameters_(host_arena_, setup.model, DType::F32),
        sharded_(setup.shard_optimizer_state && setup.communicator != nullptr && layout_.data > 1),
        tensor_group_(setup.communicator, setup.layout, setup.sequence_parallel),
        host_optimizer_(setup.model, setup.optimizer, setup.tokens_per_step,
                        sharded_ ? setup.layout.data_rank : 0, sharded_ ? setup.layout.data : 1),
        model_(
            setup.model, setup.batch, setup.seq, setup.precision, stream_.get(),
            [&](const CudaGptMemory& planned, const optim::DeviceParameterLayout& layout,
                size_t lendable) { check_fits(setup, planned, layout, lendable); },
            setup.recompute, tensor_group_.device,
            optim::CudaGptOptimizer::planned_workspace_bytes(
                host_optimizer_,
                optim::device_parameter_layout(setup.model, /*bf16_embeddings=*/true,
                                               setup.layout.tensor, setup.layout.tensor_rank))),
        optimizer_(host_optimizer_, model_.layout(), model_.gemm(),
                   model_.scratch_between_steps().data(), model_.scratch_between_steps().size(),
                   share_collectives(tensor_group_.device)),
        norm_host_(1),
        scan_order_(gradient_scan_order(setup.model)) {
    FP8T_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&norm_), sizeof(float)));
    model_.gemm().configure_tuning(setup.gemm_tuning);
#if FP8TRAIN_WITH_NCCL
    if (communicator_ != nullptr && layout_.data > 1) {
      const bool overlap =
          setup.overlap_grad_reduce &&
          why_gradient_sums_wait(/*cuda=*/true, /*flux=*/false, layout_) == nullptr;
      rank_sums_ = std::make_unique<GptRankSums>(*communicator_, model_, layout_, overlap,
                                                 sharded_ ? &host_optimizer_.shard() : nullptr);
    }
#endif
    peak_memory_ = device_memory_in_use();
  }
  ~CudaEngine() override {
    cudaStreamSynchronize(stream_.get());  // no collective left in flight when NCCL goes
    cudaFree(norm_);
  }

  std::string gemm_tuning_summary() const override {
    return model_.gemm().tuning_summary();
  }

  std::string device_name() const override {
    return fmt::format("cuda ({}, {}, {:.0f} GiB)", gpu_.name, gpu_.architecture(),
                       double(gpu_.memory_bytes) / double(1 << 30));
  }

  std::string memory_plan() const override {
    const CudaGptMemory& memory = model_.memory();
    const size_t optimizer = optimizer_.device_state_bytes() + optimizer_.device_workspace_bytes();
    return fmt::format(
        "{} on the GPU (parameters {}, gradients {}, optimizer {}, activations {}, workspace {}, "
        "linear copies {})",
        format_bytes(double(memory.total() + optimizer)), format_bytes(double(memory.parameters)),
        format_bytes(double(memory.gradients)), format_bytes(double(optimizer)),
        format_bytes(double(memory.activations)), format_bytes(double(memory.workspace)),
        format_bytes(double(memory.linear_copies)));
  }
  double peak_memory_bytes() const override {
    return peak_memory_;
  }
  const std::vector<LinearPrecision>& linear_precision() const override {
    return model_.linear_precision();
  }

  StepResult train_step(data::TokenLoader& loader, int64_t accumulation, double clip_grad,
                        const optim::StepSchedule& schedule) override {
    cudaStream_t stream = stream_.get();
    model_.zero_gradients();
    StepResult result;
    const int ranks = communicator_ != nullptr ? communicator_->size() : 1;
    const bool replicated = layout_.data > 1;  // the data-parallel group's sums
    for (int64_t micro = 0; micro < accumulation; ++micro) {
      const data::TokenBatch batch = this_ranks_batch(loader, layout_);
      model_.forward(batch.inputs.data(), batch.targets.data(), true);
      losses_.add(model_.loss_device(), stream);
      if (replicated && micro + 1 == accumulation) {
        last_backward();
      } else {
        model_.backward();
      }
    }
    float* gradients = model_.gradients();
    const int64_t count = model_.layout().total_elements;
    model_.gather_split_gradients();
    if (replicated) sum_gradients();
    for (const int64_t offset : nan_injections_) {
      // Bytes 0xFF make a float NaN.
      FP8T_CUDA_CHECK(cudaMemsetAsync(gradients + offset, 0xFF, sizeof(float), stream));
    }
    nan_injections_.clear();
    // The gradients are the sums over the replicas' micro-batches; the loss over every rank's.
    const int64_t micro_batches = accumulation * ranks;
    if (const int64_t summed = accumulation * layout_.data; summed > 1) {
      ops::cuda::scale_f32(gradients, 1.0f / float(summed), count, stream);
    }
    optimizer_.global_norm(gradients, count, norm_, stream);
    if (clip_grad > 0.0) optimizer_.clip(gradients, count, norm_, float(clip_grad), stream);
    FP8T_CUDA_CHECK(
        cudaMemcpyAsync(norm_host_.data(), norm_, sizeof(float), cudaMemcpyDeviceToHost, stream));
    result.loss = losses_.take(stream);  // synchronizes: the norm has arrived too
    if (ranks > 1) communicator_->sum(&result.loss, 1);
    result.loss /= double(micro_batches);
    result.grad_norm = norm_host_.data()[0];
    if (result.finite()) {
      optimizer_.step(model_.parameters(), model_.bf16_parameters(), gradients, schedule, stream);
      if (replicated) after_update();
      model_.end_step();
    }
    peak_memory_ = std::max(peak_memory_, device_memory_in_use());
    return result;
  }

  // Copies the gradients to the host one tensor at a time: slow, and only for bad steps.
  std::optional<std::string> first_non_finite_gradient() override {
    cudaStream_t stream = stream_.get();
    std::vector<float> values;
    for (const std::string& parameter : scan_order_) {
      const optim::DeviceParameter& tensor = model_.layout()[parameter];
      values.resize(static_cast<size_t>(tensor.numel));
      FP8T_CUDA_CHECK(cudaMemcpyAsync(values.data(), model_.gradients() + tensor.offset,
                                      values.size() * sizeof(float), cudaMemcpyDeviceToHost,
                                      stream));
      FP8T_CUDA_CHECK(cudaStreamSynchronize(stream));
      if (!all_finite(values)) return parameter;
    }
    return std::nullopt;
  }

  void inject_nan(const std::string& parameter) override {
    nan_injections_.push_back(model_.layout()[parameter].offset);
  }

  double evaluation_loss(const data::TokenBatch& batch) override {
    const EvaluationMode evaluation(model_);
    model_.forward(batch.inputs.data(), batch.targets.data(), false);
    return model_.loss_value();
  }

  const std::vector<optim::OptimizerGroup>& optimizer_groups() const override {
    return optimizer_.groups();
  }
  ParameterSet& host_parameters() override {
    return host_parameters_;
  }
  optim::GptOptimizer& host_optimizer() override {
    return host_optimizer_;
  }
  std::vector<std::pair<std::string, DelayedScaling*>> delayed_scalings() override {
    return model_.delayed_scalings();
  }
  void set_record_fp8_health(bool record) override {
    model_.set_record_fp8_health(record);
  }
  std::vector<Fp8TensorHealth> take_fp8_health() override {
    return model_.take_fp8_health();
  }
  void to_host() override {
    model_.download_parameters(host_parameters_);
    // Sharded, gather_optimizer_state() has brought the whole state already.
    if (!sharded_) optimizer_.download_state(host_optimizer_);
  }
  void gather_optimizer_state() override {
    if (!sharded_) return;
    optimizer_.download_state(host_optimizer_);
    // Each replica's owned state, whole on every rank of its group: the first rank's counts.
    train::gather_optimizer_state(host_optimizer_.state(), host_optimizer_.shard(), *communicator_,
                                  layout_.tensor_rank == 0);
  }
  void from_host() override {
    model_.upload_parameters(host_parameters_);
    optimizer_.upload_state(host_optimizer_);
    model_.scalings_changed();
  }

 private:
  // With several replicas (GptRankSums); without NCCL make_cuda_engine refuses several ranks.
  void last_backward() {
#if FP8TRAIN_WITH_NCCL
    rank_sums_->last_backward();
#endif
  }
  void sum_gradients() {
#if FP8TRAIN_WITH_NCCL
    rank_sums_->sum_gradients();
#endif
  }
  void after_update() {
#if FP8TRAIN_WITH_NCCL
    rank_sums_->after_update();
#endif
  }

  // The plan of the model and the optimizer against the GPU's free memory, before either
  // allocates: an error naming the plan and the micro-batch that would fit.
  void check_fits(const EngineSetup& setup, const CudaGptMemory& planned,
                  const optim::DeviceParameterLayout& layout, size_t lendable) const {
    // The CUDA context, cuBLASLt's and cuDNN's workspaces and, with several GPUs, NCCL's buffers.
    constexpr double kRuntimeReserve = double(size_t{1} << 30);
    const double optimizer =
        double(optim::CudaGptOptimizer::planned_device_bytes(host_optimizer_, layout, lendable));
    size_t free = 0, total = 0;
    FP8T_CUDA_CHECK(cudaMemGetInfo(&free, &total));
    // Activations, the step's workspace and the linears' FP8 scratch grow with the micro-batch;
    // the rest does not. The step's temporaries take turns in a region that holds the
    // optimizer's workspace between steps, so it shrinks with the micro-batch down to that.
    const double growing =
        double(planned.activations + planned.workspace - lendable + planned.linear_scratch);
    const double per_sample = growing / double(setup.batch);
    const double region_per_sample = double(planned.step_temporaries) / double(setup.batch);
    const double region_floor =
        double(optim::CudaGptOptimizer::planned_workspace_bytes(host_optimizer_, layout));
    const double fixed =
        double(planned.total()) + optimizer + kRuntimeReserve - growing - double(lendable);
    check_gpu_memory_plan(
        {.parameters = double(planned.parameters),
         .gradients = double(planned.gradients),
         .optimizer = optimizer,
         .activations = double(planned.activations),
         .workspace = double(planned.workspace),
         .linear_copies = double(planned.linear_copies),
         .runtime = kRuntimeReserve,
         .weight_transposes_saving = double(planned.weight_transposes_saving)},
        setup.batch, double(free), gpu_.name, "tokens",
        [&] {
          return largest_fitting_batch(fixed, per_sample, double(free), region_per_sample,
                                       region_floor);
        },
        "the parameters, gradients and optimizer state alone do not fit: a smaller model "
        "(depth)");
  }

  GpuInfo gpu_;
  distributed::Communicator* communicator_;
  distributed::ParallelLayout layout_;
  CudaStream stream_;
  Arena host_arena_;
  ParameterSet host_parameters_;
  bool sharded_;  // ZeRO-1: this rank updates its share of the parameters
  CudaTensorGroup tensor_group_;
  optim::GptOptimizer host_optimizer_;
  CudaGptModel model_;
  optim::CudaGptOptimizer optimizer_;
  float* norm_ = nullptr;
  PinnedFloats norm_host_;
  MicroBatchLosses losses_;
  std::vector<std::string> scan_order_;
  std::vector<int64_t> nan_injections_;  // gradient offsets the next step poisons
  double peak_memory_ = 0.0;
#if FP8TRAIN_WITH_NCCL
  std::unique_ptr<GptRankSums> rank_sums_;  // with several replicas
#endif
};

}  // namespace

GpuInfo training_gpu(const distributed::Communicator* communicator) {
#if !FP8TRAIN_WITH_NCCL
  if (communicator != nullptr) {
    throw ConfigError(
        "device: cuda: several ranks on the GPU path reduce their gradients through NCCL, and "
        "this fp8train was built without it; rebuild with NCCL (the CUDA toolkit's) or use "
        "device: cpu");
  }
#endif
  int local_rank = communicator != nullptr ? communicator->launch().local_rank : 0;
  const std::vector<GpuInfo> gpus = query_gpus();
  if (gpus.empty()) {
    throw ConfigError("device: cuda: no CUDA GPU is visible; use device: auto or cpu");
  }
  if (gpus.size() == 1) local_rank = 0;  // the launcher gave each rank its own GPU
  if (local_rank >= int(gpus.size())) {
    throw ConfigError(fmt::format(
        "device: cuda: this is local rank {} but the node has {} GPUs: start at most one rank "
        "per GPU",
        local_rank, gpus.size()));
  }
  FP8T_CUDA_CHECK(cudaSetDevice(local_rank));
  return gpus[static_cast<size_t>(local_rank)];
}

std::unique_ptr<TrainingEngine> make_cuda_engine(const EngineSetup& setup) {
  check_gpu_precision(setup.precision);
  return std::make_unique<CudaEngine>(setup, training_gpu(setup.communicator));
}

#else

GpuInfo training_gpu(const distributed::Communicator*) {
  throw ConfigError(
      "device: cuda: this fp8train was built without CUDA; rebuild with the CUDA toolkit "
      "(FP8TRAIN_CUDA=ON) or use device: cpu");
}

std::unique_ptr<TrainingEngine> make_cuda_engine(const EngineSetup& setup) {
  check_gpu_precision(setup.precision);
  training_gpu();  // throws: no CUDA in this build
  return nullptr;
}

#endif  // FP8TRAIN_WITH_CUDA

}  // namespace fp8t::train
