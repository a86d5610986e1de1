// The GPU path of Flux training: CudaFluxModel and CudaAdamW on the device, the parameters and
// optimizer state mirrored on the host for checkpoints and sample grids only. Under tensor
// parallelism each rank of a group holds its shares of the split tensors with their gradients
// and moments: the replicated tensors' partial gradients are summed over the group, then every
// gradient over the replicas (the ranks at the same place of the other groups); the gradient
// norm adds the shares' squares over the group; the group's first rank alone keeps the host
// mirror (unless ZeRO-1 gathers the state through every rank's), which gathers the shares and
// which the group's other ranks load from.
#include <algorithm>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"
#include "platform/device_info.h"
#include "train/flux_engine.h"
#include "train/memory_fit.h"
#include "train/run_log.h"
#include "train/training_engine.h"

#if FP8TRAIN_WITH_CUDA
#include "core/cuda_check.h"
#include "core/cuda_resources.h"
#include "gemm/cublaslt_gemm.h"
#include "models/cuda/flux_model_cuda.h"
#include "models/flux_memory.h"
#include "ops/cuda/flux_ops.h"
#include "optim/cuda/adamw_cuda.h"
#include "train/cuda_tensor_group.h"
#include "train/evaluation_mode.h"
#include "train/micro_batch_losses.h"
#endif
#if FP8TRAIN_WITH_NCCL
#include "train/cuda_rank_sums.h"
#endif

namespace fp8t::train {

#if FP8TRAIN_WITH_CUDA

namespace {

class FluxCudaEngine final : public FluxEngine {
 public:
  FluxCudaEngine(const FluxEngineSetup& setup, GpuInfo gpu)
      : gpu_(std::move(gpu)),
        communicator_(setup.communicator),
        batch_(setup.batch),
        img_tokens_(setup.img_tokens),
        txt_tokens_(setup.txt_tokens),
        img_ids_(setup.img_ids),
        tensor_group_(setup.communicator, setup.layout, setup.sequence_parallel),
        model_(setup.model, setup.batch, setup.img_tokens, setup.txt_tokens, setup.precision,
               stream_.get(), setup.recompute, tensor_group_.device),
        layout_(setup.layout),
        sharded_(setup.shard_optimizer_state && setup.communicator != nullptr && layout_.data > 1),
        every_rank_hosts_(layout_.tensor == 1 || sharded_),
        shard_(optim::adamw_shard(flux_optimized_parameters(setup.model),
                                  sharded_ ? layout_.data_rank : 0, sharded_ ? layout_.data : 1)),
        host_(every_rank_hosts_ || layout_.tensor_rank == 0 ? std::make_unique<HostMirror>(setup)
                                                            : nullptr),
        optimizer_(model_.layout(), setup.adamw, &shard_, model_.gradient_shares()),
        base_lr_(setup.adamw.lr),
        lr_(setup.adamw.lr),
        norm_host_(1) {
    FP8T_CHECK(std::ssize(img_ids_) == setup.img_tokens * 3, "expected {} image ids, found {}",
               setup.img_tokens * 3, img_ids_.size());
    FP8T_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&norm_), sizeof(float)));
    model_.gemm().configure_tuning(setup.gemm_tuning);
    // Unsharded, this rank's step writes every weight: it takes their amaxes as it goes.
    if (!sharded_) optimizer_.measure_amaxes(model_.weight_amax_slots());
#if FP8TRAIN_WITH_NCCL
    if (communicator_ != nullptr && layout_.data > 1)
      rank_sums_ = std::make_unique<FluxRankSums>(*communicator_, model_, layout_,
                                                  sharded_ ? &shard_ : nullptr);
#endif
    peak_memory_ = device_memory_in_use();
  }
  ~FluxCudaEngine() override {
    cudaStreamSynchronize(stream_.get());  // no collective left in flight when NCCL goes
    cudaFree(norm_);
  }

  std::string gemm_tuning_summary() const override {
    return model_.gemm().tuning_summary();
  }

  std::string device_name() const override {
    return fmt::format("cuda: {} ({})", gpu_.name, gpu_.architecture());
  }

  std::string memory_plan() const override {
    const CudaFluxMemory& m = model_.memory();
    const std::string host =
        host_ ? fmt::format(
                    "host mirror {} on {}",
                    format_bytes(double(host_->arena.capacity() + host_->optimizer.state_bytes())),
                    every_rank_hosts_ ? "every rank" : "each group's first rank")
              : "no host mirror";
    return fmt::format(
        "device: parameters {}, gradients {}, optimizer {}, activations {}, workspace {}, "
        "linear copies {}; {} in all; {}",
        format_bytes(double(m.parameters)), format_bytes(double(m.gradients)),
        format_bytes(double(optimizer_.device_bytes())), format_bytes(double(m.activations)),
        format_bytes(double(m.workspace)), format_bytes(double(m.linear_copies)),
        format_bytes(double(m.total() + optimizer_.device_bytes())), host);
  }
  double peak_memory_bytes() const override {
    return peak_memory_;
  }
  const std::vector<FluxLinearPrecision>& linear_precision() const override {
    return model_.linear_precision();
  }

  StepResult train_step(std::span<const FluxBatch> micro_batches, double clip_grad,
                        double lr_multiplier) override {
    FP8T_CHECK(!micro_batches.empty(), "expected at least one micro-batch");
    model_.zero_gradients();
    StepResult result;
    // Each micro-batch's loss gradient is scaled by 1/(A·D): the gradient of the mean loss over
    // the D replicas' micro-batches, once the replicas' gradients are summed. The ranks of a
    // tensor-parallel group see the same micro-batches: the loss is the mean over all R ranks'.
    const int ranks = communicator_ != nullptr ? communicator_->size() : 1;
    const int64_t count = std::ssize(micro_batches);
    const auto share = static_cast<float>(1.0 / static_cast<double>(count * layout_.data));
    for (const FluxBatch& batch : micro_batches) {
      model_.forward(inputs(batch), batch.target.data(), true, share);
      losses_.add(model_.loss_device(), stream_.get());
      model_.backward();
    }
    model_.sum_partial_gradients();
    if (layout_.data > 1) sum_gradients();
    optimizer_.clip(model_.gradients(), norm_, static_cast<float>(std::max(clip_grad, 0.0)),
                    stream_.get());
    FP8T_CUDA_CHECK(cudaMemcpyAsync(norm_host_.data(), norm_, sizeof(float), cudaMemcpyDeviceToHost,
                                    stream_.get()));
    result.loss = losses_.take(stream_.get());  // synchronizes: the norm has arrived too
    if (ranks > 1) communicator_->sum(&result.loss, 1);
    result.loss /= static_cast<double>(count * ranks);
    result.grad_norm = norm_host_.data()[0];
    if (result.finite()) {
      optimizer_.step(model_.parameters(), model_.gradients(), lr_multiplier, stream_.get());
      if (layout_.data > 1) after_update();
      model_.end_step(/*weight_amaxes_measured=*/!sharded_);
      lr_ = base_lr_ * lr_multiplier;
    }
    peak_memory_ = std::max(peak_memory_, device_memory_in_use());
    return result;
  }

  double evaluation_loss(const FluxBatch& batch) override {
    const EvaluationMode evaluation(model_);
    model_.forward(inputs(batch), batch.target.data(), false);
    return model_.loss_value();
  }

  void predict(const FluxInputs& inputs, int64_t rows, float* prediction) override {
    const EvaluationMode evaluation(model_);
    const std::vector<float> no_target(size_t(batch_ * img_tokens_ * model_.config().in_channels),
                                       0.0f);  // the loss is not read
    predict_in_micro_batches(model_.config(), batch_, img_tokens_, txt_tokens_, inputs, rows,
                             prediction, [&](const FluxInputs& micro_batch, float* out) {
                               model_.forward(micro_batch, no_target.data(), false);
                               const std::vector<float> values = model_.prediction();
                               std::copy(values.begin(), values.end(), out);
                             });
  }

  double lr() const override {
    return lr_;
  }
  FluxParameterSet* host_parameters() override {
    return host_ ? &host_->parameters : nullptr;
  }
  std::vector<NamedTensor> host_optimizer_state() override {
    return host_ ? host_->optimizer.state() : std::vector<NamedTensor>{};
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
  // Under tensor parallelism every rank of the group together: the shares are gathered.
  void to_host() override {
    model_.download_parameters(host_parameters());
    // Sharded, gather_optimizer_state() has brought the whole state already.
    if (!sharded_) optimizer_.download_state(host_optimizer(), state_transfer());
  }
  // Under tensor parallelism every rank of the group together: the first rank's host tensors go
  // to each, and the job's first rank's step count.
  void from_host() override {
    model_.upload_parameters(host_parameters());
    optimizer_.upload_state(host_optimizer(), state_transfer());
    if (!every_rank_hosts_) {
      int64_t steps = optimizer_.steps_taken();
      communicator_->broadcast(&steps, sizeof steps);
      optimizer_.set_steps_taken(steps);
    }
    model_.scalings_changed();
  }
  void gather_optimizer_state() override {
    if (!sharded_) return;
    optimizer_.download_state(host_optimizer(), state_transfer());
    // Each replica's owned moments, whole on every rank of its group: the first rank's count.
    train::gather_optimizer_state(host_->optimizer.state(), shard_, *communicator_,
                                  layout_.tensor_rank == 0);
  }

 private:
  // The whole tensors on the host, for checkpoints and sample grids.
  struct HostMirror {
    Arena arena;
    FluxParameterSet parameters;
    optim::AdamWOptimizer optimizer;  // its state; the device optimizer steps
    explicit HostMirror(const FluxEngineSetup& setup)
        : arena("parameters (host mirror)",
                FluxParameterSet::planned_bytes(setup.model, DType::F32)),
          parameters(arena, setup.model, DType::F32),
          optimizer(flux_optimized_parameters(setup.model), setup.adamw) {}
  };

  optim::AdamWOptimizer* host_optimizer() const {
    return host_ ? &host_->optimizer : nullptr;
  }

  // The moments go through the model, which gathers and cuts out its shares.
  optim::StateTransfer state_transfer() const {
    return {[this](const std::string& name, const float* device, float* host) {
              model_.download_tensor(name, device, host);
            },
            [this](const std::string& name, const float* host, float* device) {
              model_.upload_tensor(name, host, device);
            }};
  }

  FluxInputs inputs(const FluxBatch& batch) const {
    return {batch.img.data(),       img_ids_.data(),
            batch.txt.data(),       batch.y.data(),
            batch.timesteps.data(), batch.guidance.empty() ? nullptr : batch.guidance.data()};
  }

  // Every replica's fp32 gradients summed over NCCL (not yet averaged: the loss share did that).
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

  GpuInfo gpu_;
  distributed::Communicator* communicator_;
  CudaStream stream_;
  int64_t batch_, img_tokens_, txt_tokens_;
  std::vector<float> img_ids_;
  CudaTensorGroup tensor_group_;
  CudaFluxModel model_;
  distributed::ParallelLayout layout_;
  bool sharded_;  // ZeRO-1 over the replicas: this rank updates its share of the parameters
  // Whether every rank keeps the host mirror: without tensor parallelism, and with ZeRO-1,
  // whose gather runs through every rank's host state. Else a group's first rank alone.
  bool every_rank_hosts_;
  optim::OptimizerShard shard_;
  std::unique_ptr<HostMirror> host_;  // null: this rank keeps none
  optim::CudaAdamW optimizer_;
  double base_lr_, lr_;
  float* norm_ = nullptr;
  PinnedFloats norm_host_;
  MicroBatchLosses losses_;
  double peak_memory_ = 0.0;
#if FP8TRAIN_WITH_NCCL
  std::unique_ptr<FluxRankSums> rank_sums_;  // with several ranks
#endif
};

// The host plan (models/flux_memory.h) against the GPU's free memory, before anything is
// allocated: an error naming the plan and the micro-batch that would fit.
void check_flux_fits(const FluxEngineSetup& setup, const GpuInfo& gpu) {
  const auto plan_for = [&](int64_t batch, const ModelPrecision& precision) {
    const FluxMicroBatch micro_batch{batch, setup.img_tokens, setup.txt_tokens};
    return std::pair(
        plan_flux_memory(setup.model, micro_batch, precision, setup.layout.tensor, setup.recompute,
                         setup.layout.tensor, setup.sequence_parallel),
        double(flux_runtime_reserve_bytes(setup.model, micro_batch)));
  };
  const int64_t most = ops::cuda::flux_max_batch(setup.model.hidden_size);
  if (setup.batch > most) {
    throw ConfigError(fmt::format(
        "micro_batch_size {} is more than the GPU path takes at hidden_size {}: at most {} "
        "(gradient accumulation keeps the samples per step)",
        setup.batch, setup.model.hidden_size, most));
  }
  size_t free = 0, total = 0;
  FP8T_CUDA_CHECK(cudaMemGetInfo(&free, &total));
  const auto fits = [&](int64_t batch) {
    const auto [plan, reserve] = plan_for(batch, setup.precision);
    return double(plan.total()) + reserve <= double(free);
  };
  // Plans grow with the batch: bisection for the largest below the asked one that fits.
  const auto largest_fitting = [&] {
    int64_t low = 0, high = setup.batch - 1;
    while (low < high) {
      const int64_t middle = (low + high + 1) / 2;
      if (fits(middle)) {
        low = middle;
      } else {
        high = middle - 1;
      }
    }
    return low;
  };
  const auto [plan, reserve] = plan_for(setup.batch, setup.precision);
  // An FP8 run that keeps its weight transposes and does not fit could hold less.
  double weight_transposes_saving = 0.0;
  const ModelPrecision& precision = setup.precision;
  if (double(plan.total()) + reserve > double(free) && precision.fp8.mode != Fp8Mode::None &&
      precision.fp8_weight_transposes == ops::WeightTransposes::Kept &&
      precision.fp8.recipe != ScalingRecipe::Mxfp8) {
    ModelPrecision in_backward = precision;
    in_backward.fp8_weight_transposes = ops::WeightTransposes::InBackward;
    weight_transposes_saving =
        double(plan.linear_copies) - double(plan_for(setup.batch, in_backward).first.linear_copies);
  }
  check_gpu_memory_plan({.parameters = double(plan.parameters),
                         .gradients = double(plan.gradients),
                         .optimizer = double(plan.optimizer_state),
                         .activations = double(plan.activations),
                         .workspace = double(plan.workspace),
                         .linear_copies = double(plan.linear_copies),
                         .runtime = reserve,
                         .weight_transposes_saving = weight_transposes_saving},
                        setup.batch, double(free), gpu.name, "samples", largest_fitting,
                        "not even one sample per micro-batch fits: fewer blocks or smaller images");
}

}  // namespace

std::unique_ptr<FluxEngine> make_flux_cuda_engine(const FluxEngineSetup& setup) {
  check_gpu_precision(setup.precision);
  GpuInfo gpu = training_gpu(setup.communicator);
  check_flux_fits(setup, gpu);
  return std::make_unique<FluxCudaEngine>(setup, std::move(gpu));
}

#else

std::unique_ptr<FluxEngine> make_flux_cuda_engine(const FluxEngineSetup& setup) {
  check_gpu_precision(setup.precision);
  training_gpu();  // throws: no CUDA in this build
  return nullptr;
}

#endif  // FP8TRAIN_WITH_CUDA

}  // namespace fp8t::train
