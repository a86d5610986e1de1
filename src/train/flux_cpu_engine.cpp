// The CPU path of Flux training: FluxModel and AdamW in host memory.
#include <algorithm>
#include <functional>
#include <memory>
#include <vector>

#include <fmt/format.h>

#include "core/error.h"
#include "models/flux_objective.h"
#include "optim/clip.h"
#include "train/evaluation_mode.h"
#include "train/flux_engine.h"
#include "train/run_log.h"
#include "train/training_engine.h"

namespace fp8t::train {

namespace {

class FluxCpuEngine final : public FluxEngine {
 public:
  explicit FluxCpuEngine(const FluxEngineSetup& setup)
      : communicator_(setup.communicator),
        batch_(setup.batch),
        img_tokens_(setup.img_tokens),
        txt_tokens_(setup.txt_tokens),
        img_ids_(setup.img_ids),
        model_(setup.model, setup.batch, setup.img_tokens, setup.txt_tokens, setup.precision,
               setup.recompute,
               distributed::training_tensor_parallel_group(setup.communicator, setup.layout,
                                                           setup.sequence_parallel)),
        sharded_(setup.shard_optimizer_state && setup.communicator != nullptr),
        optimizer_(flux_optimized_parameters(setup.model), setup.adamw,
                   sharded_ ? setup.communicator->rank() : 0,
                   sharded_ ? setup.communicator->size() : 1),
        prediction_(size_t(setup.batch * setup.img_tokens * setup.model.in_channels)),
        grad_prediction_(prediction_.size()) {
    FP8T_CHECK(std::ssize(img_ids_) == setup.img_tokens * 3, "expected {} image ids, found {}",
               setup.img_tokens * 3, img_ids_.size());
    for (const FluxParam& param : model_.parameters().specs()) {
      TensorView& gradient = model_.gradients()[param.name];
      parameter_data_.push_back(model_.parameters()[param.name].data<float>());
      gradient_data_.push_back(gradient.data<float>());
      gradient_spans_.push_back({gradient.data<float>(), gradient.numel()});
    }
  }

  std::string device_name() const override { return "cpu"; }

  std::string memory_plan() const override {
    const auto parameters = double(FluxParameterSet::planned_bytes(model_.config(), DType::F32));
    return fmt::format("parameters {}, gradients {}, optimizer {}, activations {}",
                       format_bytes(parameters), format_bytes(parameters),
                       format_bytes(double(optimizer_.state_bytes())),
                       format_bytes(double(model_.activation_bytes())));
  }
  double peak_memory_bytes() const override { return peak_resident_memory_bytes(); }
  const std::vector<FluxLinearPrecision>& linear_precision() const override {
    return model_.linear_precision();
  }

  StepResult train_step(std::span<const FluxBatch> micro_batches, double clip_grad,
                        double lr_multiplier) override {
    FP8T_CHECK(!micro_batches.empty(), "expected at least one micro-batch");
    model_.zero_gradients();
    StepResult result;
    // Each micro-batch's loss gradient is scaled by 1/(A·R): the gradient of the mean loss over
    // every rank's micro-batches, once the ranks' gradients are summed.
    const int ranks = communicator_ != nullptr ? communicator_->size() : 1;
    const auto total = static_cast<double>(std::ssize(micro_batches) * ranks);
    const auto share = static_cast<float>(1.0 / total);
    for (const FluxBatch& batch : micro_batches) {
      model_.forward(inputs(batch), prediction_.data());
      result.loss +=
          flow_mse_loss_with_gradient(grad_prediction_.data(), prediction_.data(),
                                      batch.target.data(), std::ssize(prediction_), share);
      model_.backward(grad_prediction_.data());
    }
    // Every rank of a tensor-parallel group then holds its replica's whole gradient, counted
    // once per rank of the group in the sums below, as its loss is: the mean stays right.
    model_.gather_split_gradients();
    if (ranks > 1) {
      for (const optim::GradientSpan& span : gradient_spans_)
        communicator_->sum(span.data, static_cast<size_t>(span.count));
      communicator_->sum(&result.loss, 1);
    }
    result.loss /= total;
    result.grad_norm = clip_grad > 0.0 ? optim::clip_gradients(gradient_spans_, clip_grad)
                                       : optim::global_norm(gradient_spans_);
    if (result.finite()) {
      optimizer_.step(parameter_data_, gradient_data_, lr_multiplier);
      if (sharded_) gather_parameters();
      if (ranks > 1) reduce_delayed_amaxes(model_.delayed_scalings(), *communicator_);
      model_.end_step();
    }
    return result;
  }

  double evaluation_loss(const FluxBatch& batch) override {
    {
      const EvaluationMode evaluation(model_);
      model_.forward(inputs(batch), prediction_.data());
    }
    return flow_mse_loss(prediction_.data(), batch.target.data(), std::ssize(prediction_));
  }

  void predict(const FluxInputs& inputs, int64_t rows, float* prediction) override {
    const EvaluationMode evaluation(model_);
    predict_in_micro_batches(
        model_.config(), batch_, img_tokens_, txt_tokens_, inputs, rows, prediction,
        [&](const FluxInputs& micro_batch, float* out) { model_.forward(micro_batch, out); });
  }

  double lr() const override { return optimizer_.lr(); }
  FluxParameterSet* host_parameters() override { return &model_.parameters(); }
  std::vector<NamedTensor> host_optimizer_state() override { return optimizer_.state(); }
  std::vector<std::pair<std::string, DelayedScaling*>> delayed_scalings() override {
    return model_.delayed_scalings();
  }
  void set_record_fp8_health(bool record) override { model_.set_record_fp8_health(record); }
  std::vector<Fp8TensorHealth> take_fp8_health() override { return model_.take_fp8_health(); }
  void to_host() override {}
  void from_host() override { model_.weights_changed(); }
  void gather_optimizer_state() override {
    if (sharded_)
      train::gather_optimizer_state(optimizer_.state(), optimizer_.shard(), *communicator_);
  }

 private:
  // Each parameter as its owner updated it (ZeRO-1).
  void gather_parameters() {
    for (const FluxParam& param : model_.parameters().specs()) {
      TensorView& view = model_.parameters()[param.name];
      gather_from_owner(view.data<float>(), static_cast<size_t>(view.numel()),
                        optimizer_.shard().owns(param.name), *communicator_);
    }
  }

  FluxInputs inputs(const FluxBatch& batch) const {
    FP8T_CHECK(batch.img.size() == prediction_.size() && batch.target.size() == prediction_.size(),
               "expected a micro-batch of {} latent values, found {}", prediction_.size(),
               batch.img.size());
    return {batch.img.data(),       img_ids_.data(),
            batch.txt.data(),       batch.y.data(),
            batch.timesteps.data(), batch.guidance.empty() ? nullptr : batch.guidance.data()};
  }

  distributed::Communicator* communicator_;
  int64_t batch_, img_tokens_, txt_tokens_;
  std::vector<float> img_ids_;
  FluxModel model_;
  bool sharded_;  // ZeRO-1: this rank updates its share of the parameters
  optim::AdamWOptimizer optimizer_;
  std::vector<float> prediction_, grad_prediction_;
  std::vector<float*> parameter_data_;
  std::vector<const float*> gradient_data_;
  std::vector<optim::GradientSpan> gradient_spans_;
};

}  // namespace

void predict_in_micro_batches(const FluxConfig& config, int64_t batch, int64_t img_tokens,
                              int64_t txt_tokens, const FluxInputs& inputs, int64_t rows,
                              float* prediction,
                              const std::function<void(const FluxInputs&, float*)>& forward) {
  const int64_t img = img_tokens * config.in_channels, txt = txt_tokens * config.context_in_dim;
  const int64_t vec = config.vec_in_dim;
  const bool guided = inputs.guidance != nullptr;
  // The last micro-batch's inputs and prediction, zeros past its rows.
  std::vector<float> last_img, last_txt, last_y, last_timesteps, last_guidance, last_prediction;
  for (int64_t first = 0; first < rows; first += batch) {
    const int64_t count = std::min(batch, rows - first);
    FluxInputs micro_batch{inputs.img + first * img, inputs.img_ids,
                           inputs.txt + first * txt, inputs.y + first * vec,
                           inputs.timesteps + first, guided ? inputs.guidance + first : nullptr};
    float* out = prediction + first * img;
    if (count < batch) {
      const auto fill = [&](std::vector<float>& to, const float* from, int64_t per_row) {
        to.assign(size_t(batch * per_row), 0.0f);
        std::copy_n(from, count * per_row, to.begin());
        return to.data();
      };
      micro_batch = {fill(last_img, micro_batch.img, img),
                     inputs.img_ids,
                     fill(last_txt, micro_batch.txt, txt),
                     fill(last_y, micro_batch.y, vec),
                     fill(last_timesteps, micro_batch.timesteps, 1),
                     guided ? fill(last_guidance, micro_batch.guidance, 1) : nullptr};
      last_prediction.resize(size_t(batch * img));
      out = last_prediction.data();
    }
    forward(micro_batch, out);
    if (count < batch) std::copy_n(last_prediction.begin(), count * img, prediction + first * img);
  }
}

std::vector<optim::AdamWOptimizer::Parameter> flux_optimized_parameters(const FluxConfig& config) {
  std::vector<optim::AdamWOptimizer::Parameter> parameters;
  for (const FluxParam& param : flux_parameters(config))
    parameters.push_back({param.name, param.shape});
  return parameters;
}

std::unique_ptr<FluxEngine> make_flux_cpu_engine(const FluxEngineSetup& setup) {
  return std::make_unique<FluxCpuEngine>(setup);
}

}  // namespace fp8t::train
