// The CPU path of the training loop: GptModel and GptOptimizer in host memory.
#include <algorithm>
#include <limits>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"
#include "optim/clip.h"
#include "train/evaluation_mode.h"
#include "train/memory_fit.h"
#include "train/nan_guard.h"
#include "train/run_log.h"
#include "train/training_engine.h"

namespace fp8t::train {

namespace {

class CpuEngine final : public TrainingEngine {
 public:
  explicit CpuEngine(const EngineSetup& setup)
      : communicator_(setup.communicator),
        layout_(setup.layout),
        plan_(plan_gpt_memory(setup.model, setup.batch, setup.seq, setup.recompute,
                              setup.layout.tensor, setup.sequence_parallel)),
        model_((check_memory_fits(plan_), setup.model), setup.batch, setup.seq, setup.precision,
               setup.recompute,
               distributed::training_tensor_parallel_group(setup.communicator, setup.layout,
                                                           setup.sequence_parallel)),
        sharded_(setup.shard_optimizer_state && setup.communicator != nullptr),
        optimizer_(setup.model, setup.optimizer, setup.tokens_per_step,
                   sharded_ ? setup.communicator->rank() : 0,
                   sharded_ ? setup.communicator->size() : 1),
        scan_order_(gradient_scan_order(setup.model)) {
    for (const ParamSpec& spec : model_.gradients().specs()) {
      TensorView& view = model_.gradients()[spec.name];
      gradient_spans_.push_back({view.data<float>(), view.numel()});
    }
  }

  std::string device_name() const override { return "cpu"; }

  std::string memory_plan() const override {
    return fmt::format("{} (parameters {}, gradients {}, optimizer {}, activations {})",
                       format_bytes(double(plan_.total())), format_bytes(double(plan_.parameters)),
                       format_bytes(double(plan_.gradients)),
                       format_bytes(double(optimizer_.state_bytes())),
                       format_bytes(double(plan_.activations)));
  }
  double peak_memory_bytes() const override { return peak_resident_memory_bytes(); }
  const std::vector<LinearPrecision>& linear_precision() const override {
    return model_.linear_precision();
  }

  StepResult train_step(data::TokenLoader& loader, int64_t accumulation, double clip_grad,
                        const optim::StepSchedule& schedule) override {
    model_.zero_gradients();
    StepResult result;
    const int ranks = communicator_ != nullptr ? communicator_->size() : 1;
    for (int64_t micro = 0; micro < accumulation; ++micro) {
      const data::TokenBatch batch = this_ranks_batch(loader, layout_);
      result.loss += model_.forward(batch.inputs.data(), batch.targets.data());
      model_.backward();
    }
    // Every rank of a tensor-parallel group then holds the whole gradient, as a replica without
    // tensor parallelism does: the sums below average the replicas.
    model_.gather_split_gradients();
    if (ranks > 1) {  // the sums over every rank's micro-batches
      for (const optim::GradientSpan& span : gradient_spans_)
        communicator_->sum(span.data, static_cast<size_t>(span.count));
      communicator_->sum(&result.loss, 1);
    }
    for (float* gradient : nan_injections_)
      *gradient = std::numeric_limits<float>::quiet_NaN();
    nan_injections_.clear();
    const int64_t micro_batches = accumulation * ranks;
    result.loss /= double(micro_batches);
    if (micro_batches > 1) {  // the gradient of the mean over micro-batches
      const float inverse = 1.0f / float(micro_batches);
      for (const optim::GradientSpan& span : gradient_spans_)
        for (int64_t i = 0; i < span.count; ++i)
          span.data[i] *= inverse;
    }
    result.grad_norm = clip_grad > 0.0 ? optim::clip_gradients(gradient_spans_, clip_grad)
                                       : optim::global_norm(gradient_spans_);
    if (result.finite()) {
      optimizer_.step(model_.parameters(), model_.gradients(), schedule);
      if (sharded_) gather_parameters(model_.parameters(), optimizer_.shard(), *communicator_);
      if (ranks > 1) reduce_delayed_amaxes(model_.delayed_scalings(), *communicator_);
      model_.end_step();
    }
    return result;
  }

  std::optional<std::string> first_non_finite_gradient() override {
    for (const std::string& parameter : scan_order_) {
      const TensorView& gradient = model_.gradients()[parameter];
      if (!all_finite({gradient.data<float>(), static_cast<size_t>(gradient.numel())})) {
        return parameter;
      }
    }
    return std::nullopt;
  }

  void inject_nan(const std::string& parameter) override {
    nan_injections_.push_back(model_.gradients()[parameter].data<float>());
  }

  double evaluation_loss(const data::TokenBatch& batch) override {
    const EvaluationMode evaluation(model_);
    return model_.forward(batch.inputs.data(), batch.targets.data());
  }

  const std::vector<optim::OptimizerGroup>& optimizer_groups() const override {
    return optimizer_.groups();
  }
  ParameterSet& host_parameters() override { return model_.parameters(); }
  optim::GptOptimizer& host_optimizer() override { return optimizer_; }
  std::vector<std::pair<std::string, DelayedScaling*>> delayed_scalings() override {
    return model_.delayed_scalings();
  }
  void set_record_fp8_health(bool record) override { model_.set_record_fp8_health(record); }
  std::vector<Fp8TensorHealth> take_fp8_health() override { return model_.take_fp8_health(); }
  void to_host() override {}
  void gather_optimizer_state() override {
    if (sharded_)
      train::gather_optimizer_state(optimizer_.state(), optimizer_.shard(), *communicator_);
  }
  void from_host() override { model_.weights_changed(); }

 private:
  // Fails before allocating when the plan cannot fit in the memory the system has available.
  static void check_memory_fits(const GptMemoryPlan& plan) {
    check_memory_plan("the CPU path, for this model and batch,",
                      {{"parameters", double(plan.parameters)},
                       {"gradients", double(plan.gradients)},
                       {"optimizer", double(plan.optimizer_state)},
                       {"activations", double(plan.activations)}},
                      available_memory_bytes(), "is available",
                      "lower micro_batch_size, sequence_len or depth");
  }

  distributed::Communicator* communicator_;
  distributed::ParallelLayout layout_;
  GptMemoryPlan plan_;
  GptModel model_;
  bool sharded_;  // ZeRO-1: this rank updates its share of the parameters
  optim::GptOptimizer optimizer_;
  std::vector<optim::GradientSpan> gradient_spans_;
  std::vector<std::string> scan_order_;
  std::vector<float*> nan_injections_;  // gradients the next step poisons
};

}  // namespace

void reduce_delayed_amaxes(const std::vector<std::pair<std::string, DelayedScaling*>>& scalings,
                           distributed::Communicator& communicator) {
  if (scalings.empty()) return;
  std::vector<float> amaxes;
  for (const auto& [name, scaling] : scalings)
    amaxes.push_back(scaling->pending_amax());
  communicator.max(amaxes.data(), amaxes.size());
  for (size_t i = 0; i < scalings.size(); ++i) {
    if (amaxes[i] != 0.0f) scalings[i].second->record_amax(amaxes[i]);
  }
}

void print_zero1_note(int ranks, bool cuda) {
  fmt::print("optimizer: ZeRO-1, each of {} ranks updates its share of the parameters{}\n", ranks,
             cuda ? " and holds only their optimizer state" : "");
}

void gather_from_owner(float* values, size_t count, bool owned,
                       distributed::Communicator& communicator) {
  if (!owned) std::fill_n(values, count, 0.0f);
  communicator.sum(values, count);
}

void gather_parameters(ParameterSet& parameters, const optim::OptimizerShard& shard,
                       distributed::Communicator& communicator) {
  for (const ParamSpec& spec : parameters.specs()) {
    TensorView& view = parameters[spec.name];
    gather_from_owner(view.data<float>(), static_cast<size_t>(view.numel()), shard.owns(spec.name),
                      communicator);
  }
}

void gather_optimizer_state(const std::vector<NamedTensor>& state,
                            const optim::OptimizerShard& shard,
                            distributed::Communicator& communicator, bool counts) {
  for (const NamedTensor& buffer : state) {
    if (buffer.view.dtype() != DType::F32) continue;  // the step counter, the same everywhere
    gather_from_owner(buffer.view.data<float>(), static_cast<size_t>(buffer.view.numel()),
                      counts && shard.owns(optim::parameter_of_state(buffer.name)), communicator);
  }
}

data::TokenBatch this_ranks_batch(data::TokenLoader& loader,
                                  const distributed::ParallelLayout& layout) {
  data::TokenBatch kept;
  for (int replica = 0; replica < layout.data; ++replica) {
    data::TokenBatch batch = loader.next_batch();
    if (replica == layout.data_rank) kept = std::move(batch);
  }
  return kept;
}

std::unique_ptr<TrainingEngine> make_cpu_engine(const EngineSetup& setup) {
  return std::make_unique<CpuEngine>(setup);
}

}  // namespace fp8t::train
