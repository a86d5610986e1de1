#include "optim/gpt_optimizer.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <map>
#include <numbers>
#include <span>
#include <string_view>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "core/error.h"
#include "numerics/float_bits.h"

namespace fp8t::optim {

namespace {

// Constants of nanochat's setup_optimizer (gpt.py).
constexpr double kReferenceModelDim = 768.0;
constexpr double kSmearLr = 0.2;  // not scaled by the batch: a literal in setup_optimizer
constexpr double kNorMuonBeta2 = 0.9;
constexpr int kPolarExpressSteps = 5;

const char* const kStepCounterName = "optimizer.step";

std::string shape_string(const TensorView& view) {
  std::vector<int64_t> shape;
  for (int axis = 0; axis < view.rank(); ++axis)
    shape.push_back(view.dim(axis));
  return fmt::format("{} [{}]", dtype_name(view.dtype()), fmt::join(shape, ", "));
}

TensorView f32_view(std::span<float> data, const std::vector<int64_t>& shape) {
  return TensorView(data.data(), DType::F32, shape.data(), static_cast<int>(shape.size()));
}

// The fp32 data of a parameter (or gradient), checked against the size the optimizer planned.
float* values_of(const ParameterSet& set, const std::string& name, int64_t numel,
                 const char* what) {
  const TensorView& view = set[name];
  FP8T_CHECK(view.numel() == numel, "expected the {} of '{}' to have {} elements, found {}", what,
             name, numel, view.numel());
  return view.data<float>();
}

// nanochat's Muon parameters: everything in transformer.h (the value-embedding gates too).
bool is_block_matrix(const ParamSpec& spec) {
  return spec.layer >= 0 && spec.kind != ParamKind::Embedding;
}

template <typename Predicate>
std::vector<std::string> names_where(const std::vector<ParamSpec>& specs, Predicate&& predicate) {
  std::vector<std::string> names;
  for (const ParamSpec& spec : specs) {
    if (predicate(spec)) names.push_back(spec.name);
  }
  return names;
}

OptimizerGroup adamw_group(std::string name, std::vector<std::string> parameters, double lr,
                           double beta1, double beta2, double eps, double weight_decay) {
  return {.name = std::move(name),
          .rule = UpdateRule::AdamW,
          .parameters = std::move(parameters),
          .initial_lr = lr,
          .beta1 = beta1,
          .beta2 = beta2,
          .eps = eps,
          .weight_decay = weight_decay,
          .lr = lr};
}

}  // namespace

void OptimizerSettings::validate() const {
  const auto require = [](bool ok, const char* key, const char* rule, double value) {
    if (!ok) throw ConfigError(fmt::format("{}: must be {}, found {}", key, rule, value));
  };
  const auto non_negative = [&](double value, const char* key) {
    require(std::isfinite(value) && value >= 0, key, "a finite number >= 0", value);
  };
  const auto beta = [&](double value, const char* key) {
    require(value >= 0 && value < 1, key, "in [0, 1)", value);
  };
  non_negative(matrix_lr, "matrix_lr");
  non_negative(embedding_lr, "embedding_lr");
  non_negative(unembedding_lr, "unembedding_lr");
  non_negative(scalar_lr, "scalar_lr");
  non_negative(weight_decay, "weight_decay");
  require(std::isfinite(target_param_data_ratio) && target_param_data_ratio > 0,
          "target_param_data_ratio", "a finite number > 0", target_param_data_ratio);
  non_negative(adam_eps, "adam_eps");
  non_negative(adamw.lr, "lr");
  beta(adamw.beta1, "adam_beta1");
  beta(adamw.beta2, "adam_beta2");
  non_negative(adamw.eps, "adam_eps");
  non_negative(adamw.weight_decay, "weight_decay");
}

double nanochat_weight_decay_multiplier(int64_t it, int64_t total_iters) {
  FP8T_CHECK(total_iters >= 1, "expected at least one step, found {}", total_iters);
  return 0.5 * (1.0 + std::cos(std::numbers::pi * double(it) / double(total_iters)));
}

StepSchedule nanochat_step_schedule(const LrSchedule& schedule, int64_t it) {
  return {lr_multiplier(schedule, it),
          muon_momentum(it, schedule.total_iters, schedule.warmdown_ratio),
          nanochat_weight_decay_multiplier(it, schedule.total_iters)};
}

int64_t nanochat_scaling_params(const GptConfig& config) {
  int64_t count = 0;
  for (const ParamSpec& spec : gpt_parameters(config)) {
    if (is_block_matrix(spec) || spec.kind == ParamKind::LmHead) count += spec.numel();
  }
  return count;
}

double nanochat_muon_weight_decay(const GptConfig& config, double weight_decay,
                                  int64_t tokens_per_step, double target_param_data_ratio) {
  FP8T_CHECK(tokens_per_step > 0, "expected tokens per step > 0, found {}", tokens_per_step);
  GptConfig d12 = GptConfig::from_depth(12);
  d12.vocab_size = config.vocab_size;
  d12.pad_vocab_to = config.pad_vocab_to;
  const double reference_tokens = target_param_data_ratio * double(nanochat_scaling_params(d12));
  // base_train truncates the horizon to whole tokens.
  const auto tokens = double(
      static_cast<int64_t>(target_param_data_ratio * double(nanochat_scaling_params(config))));
  return weight_decay * std::sqrt(double(tokens_per_step) / double(kReferenceBatchTokens)) *
         (reference_tokens / tokens);
}

GptOptimizer::GptOptimizer(const GptConfig& config, const OptimizerSettings& settings,
                           int64_t tokens_per_step, int rank, int ranks)
    : kind_(settings.kind),
      muon_precision_(settings.muon_precision),
      bf16_embeddings_(settings.bf16_embeddings) {
  settings.validate();
  if (tokens_per_step <= 0) {
    throw ConfigError(
        fmt::format("tokens per optimizer step: must be > 0, found {}", tokens_per_step));
  }
  const std::vector<ParamSpec> specs = gpt_parameters(config);
  if (kind_ == OptimizerKind::AdamW) {
    add_adamw_groups(settings.adamw, specs);
  } else {
    add_nanochat_groups(config, settings, tokens_per_step, specs);
  }
  std::vector<std::string> misplaced;
  for (const ParamSpec& spec : specs) {
    int64_t occurrences = 0;
    for (const OptimizerGroup& group : groups_)
      occurrences += std::count(group.parameters.begin(), group.parameters.end(), spec.name);
    if (occurrences != 1) misplaced.push_back(spec.name);
  }
  FP8T_CHECK(misplaced.empty(), "expected every parameter in one optimizer group, found {} not",
             fmt::join(misplaced, ", "));
  shard_.emplace(
      groups_, [&](const std::string& name) { return find_parameter(specs, name)->numel(); }, rank,
      ranks);
}

void GptOptimizer::add_adamw_groups(const AdamWHyperparameters& adamw,
                                    const std::vector<ParamSpec>& specs) {
  const auto matrices = [](const ParamSpec& spec) { return spec.shape.size() >= 2; };
  const auto vectors = [](const ParamSpec& spec) { return spec.shape.size() < 2; };
  add_group(adamw_group("weight_decay", names_where(specs, matrices), adamw.lr, adamw.beta1,
                        adamw.beta2, adamw.eps, adamw.weight_decay),
            specs);
  add_group(adamw_group("no_weight_decay", names_where(specs, vectors), adamw.lr, adamw.beta1,
                        adamw.beta2, adamw.eps, 0.0),
            specs);
}

void GptOptimizer::add_nanochat_groups(const GptConfig& config, const OptimizerSettings& settings,
                                       int64_t tokens_per_step,
                                       const std::vector<ParamSpec>& specs) {
  const double dim_scale = std::pow(double(config.n_embd) / kReferenceModelDim, -0.5);
  const double batch_scale = std::sqrt(double(tokens_per_step) / double(kReferenceBatchTokens));
  const double eps = settings.adam_eps;
  const auto named = [&](std::initializer_list<std::string_view> wanted) {
    return names_where(specs, [&](const ParamSpec& spec) {
      return std::find(wanted.begin(), wanted.end(), spec.name) != wanted.end();
    });
  };
  const auto value_embeds = names_where(specs, [](const ParamSpec& spec) {
    return spec.kind == ParamKind::Embedding && spec.layer >= 0;
  });
  add_group(adamw_group("lm_head", named({"lm_head.weight"}),
                        settings.unembedding_lr * batch_scale * dim_scale, 0.8, 0.96, eps, 0.01),
            specs);
  add_group(adamw_group("wte", named({"transformer.wte.weight"}),
                        settings.embedding_lr * batch_scale * dim_scale, 0.8, 0.995, eps, 0.001),
            specs);
  add_group(
      adamw_group("value_embeds", value_embeds,
                  settings.embedding_lr * batch_scale * dim_scale * 0.5, 0.8, 0.995, eps, 0.01),
      specs);
  add_group(adamw_group("resid_lambdas", named({"resid_lambdas"}),
                        settings.scalar_lr * batch_scale * 0.01, 0.8, 0.95, eps, 0.05),
            specs);
  add_group(adamw_group("x0_lambdas", named({"x0_lambdas"}), settings.scalar_lr * batch_scale, 0.96,
                        0.95, eps, 0.0),
            specs);
  add_group(adamw_group("smear", named({"smear_gate.weight", "smear_lambda", "backout_lambda"}),
                        kSmearLr, 0.8, 0.95, eps, 0.0),
            specs);

  // Every block matrix (the value-embedding gates included), one group per shape in sorted
  // order, as nanochat stacks them.
  std::map<std::pair<int64_t, int64_t>, std::vector<std::string>> by_shape;
  for (const ParamSpec& spec : specs) {
    if (is_block_matrix(spec)) by_shape[{spec.shape[0], spec.shape[1]}].push_back(spec.name);
  }
  const double weight_decay = nanochat_muon_weight_decay(
      config, settings.weight_decay, tokens_per_step, settings.target_param_data_ratio);
  const double matrix_lr = settings.matrix_lr * batch_scale;
  for (auto& [shape, names] : by_shape) {
    add_group({.name = fmt::format("matrix {}x{}", shape.first, shape.second),
               .rule = UpdateRule::Muon,
               .parameters = std::move(names),
               .initial_lr = matrix_lr,
               .beta1 = 0.0,
               .beta2 = kNorMuonBeta2,
               .eps = 0.0,
               .weight_decay = weight_decay,
               .lr = matrix_lr * muon_lr_scale(shape.first, shape.second)},
              specs);
  }
}

void GptOptimizer::add_group(OptimizerGroup group, const std::vector<ParamSpec>& specs) {
  const size_t index = groups_.size();
  const auto spec_of = [&](const std::string& name) -> const ParamSpec& {
    return *find_parameter(specs, name);
  };
  if (group.rule == UpdateRule::AdamW) {
    for (const std::string& name : group.parameters) {
      const ParamSpec& spec = spec_of(name);
      const auto numel = static_cast<size_t>(spec.numel());
      adamw_.push_back({name, index, spec.shape, std::vector<float>(numel, 0.0f),
                        std::vector<float>(numel, 0.0f),
                        bf16_embeddings_ && spec.kind == ParamKind::Embedding});
    }
  } else {
    const ParamSpec& first = spec_of(group.parameters.front());
    muon_.push_back(
        {index, MuonGroup(std::ssize(group.parameters), first.shape[0], first.shape[1])});
  }
  groups_.push_back(std::move(group));
}

const OptimizerGroup& GptOptimizer::group_of(const std::string& parameter) const {
  for (const OptimizerGroup& group : groups_) {
    if (std::find(group.parameters.begin(), group.parameters.end(), parameter) !=
        group.parameters.end()) {
      return group;
    }
  }
  throw Error(fmt::format("no optimizer group holds a parameter named '{}'", parameter));
}

bool GptOptimizer::stored_in_bf16(const std::string& parameter) const {
  const auto slot = std::ranges::find(adamw_, parameter, &AdamWSlot::parameter);
  return slot != adamw_.end() && slot->bf16;
}

void GptOptimizer::step(ParameterSet& params, const ParameterSet& grads,
                        const StepSchedule& schedule) {
  FP8T_CHECK(std::isfinite(schedule.lr_multiplier) && schedule.lr_multiplier >= 0,
             "expected a finite lr multiplier >= 0, found {}", schedule.lr_multiplier);
  // Every tensor is checked before anything moves, so a bad set leaves the state as it was.
  std::vector<float*> adamw_params, muon_params;
  std::vector<const float*> adamw_grads, muon_grads;
  for (const AdamWSlot& slot : adamw_) {
    const auto numel = std::ssize(slot.exp_avg);
    adamw_params.push_back(values_of(params, slot.parameter, numel, "parameter"));
    adamw_grads.push_back(values_of(grads, slot.parameter, numel, "gradient"));
  }
  for (const MuonSlot& slot : muon_) {
    const int64_t numel = slot.state.rows() * slot.state.cols();
    for (const std::string& name : groups_[slot.group].parameters) {
      muon_params.push_back(values_of(params, name, numel, "parameter"));
      muon_grads.push_back(values_of(grads, name, numel, "gradient"));
    }
  }

  ++steps_;  // nanochat counts before the update: the first step's bias correction uses 1
  for (OptimizerGroup& group : groups_)
    group.lr = group.initial_lr * schedule.lr_multiplier;
  for (size_t i = 0; i < adamw_.size(); ++i) {
    AdamWSlot& slot = adamw_[i];
    if (!shard_->owns(slot.parameter)) continue;
    const OptimizerGroup& group = groups_[slot.group];
    const std::span<float> param(adamw_params[i], slot.exp_avg.size());
    // bf16 storage: the step reads the values the bf16 tensors hold and stores its results
    // rounded, as nanochat's fp32 math on bf16 tensors does.
    const auto round_if_bf16 = [&] {
      if (!slot.bf16) return;
      for (std::span<float> values : {param, std::span(slot.exp_avg), std::span(slot.exp_avg_sq)})
        std::ranges::transform(values, values.begin(), round_to_bf16);
    };
    round_if_bf16();
    adamw_step(param.data(), adamw_grads[i], slot.exp_avg.data(), slot.exp_avg_sq.data(),
               std::ssize(slot.exp_avg), steps_,
               {group.lr, group.beta1, group.beta2, group.eps, group.weight_decay});
    round_if_bf16();
  }
  size_t first = 0;
  for (MuonSlot& slot : muon_) {
    OptimizerGroup& group = groups_[slot.group];
    const auto count = static_cast<size_t>(slot.state.count());
    const auto [owned_first, owned] = shard_->muon_range(slot.group);
    slot.state.step(std::span(muon_params).subspan(first, count),
                    std::span(muon_grads).subspan(first, count),
                    {.lr = group.lr,
                     .momentum = schedule.muon_momentum,
                     .beta2 = group.beta2,
                     .weight_decay = group.weight_decay * schedule.weight_decay_multiplier,
                     .ns_steps = kPolarExpressSteps,
                     .precision = muon_precision_},
                    owned_first, owned);
    first += count;
    group.lr *= muon_lr_scale(slot.state.rows(), slot.state.cols());
  }
}

std::vector<NamedTensor> GptOptimizer::state() {
  std::vector<NamedTensor> buffers;
  for (AdamWSlot& slot : adamw_) {
    buffers.push_back({slot.parameter + ".exp_avg", f32_view(slot.exp_avg, slot.shape)});
    buffers.push_back({slot.parameter + ".exp_avg_sq", f32_view(slot.exp_avg_sq, slot.shape)});
  }
  for (MuonSlot& slot : muon_) {
    const std::vector<int64_t> shape = {slot.state.rows(), slot.state.cols()};
    const std::vector<int64_t> second_moment_shape = slot.state.second_moment_shape();
    const std::vector<std::string>& names = groups_[slot.group].parameters;
    for (size_t index = 0; index < names.size(); ++index) {
      const auto matrix = static_cast<int64_t>(index);
      buffers.push_back({names[index] + ".momentum", f32_view(slot.state.momentum(matrix), shape)});
      buffers.push_back({names[index] + ".second_moment",
                         f32_view(slot.state.second_moment(matrix), second_moment_shape)});
    }
  }
  buffers.push_back({kStepCounterName, TensorView(&steps_, DType::I64, {1})});
  return buffers;
}

void GptOptimizer::load_state(std::span<const NamedTensor> buffers) {
  std::map<std::string, const TensorView*> given;
  for (const NamedTensor& buffer : buffers) {
    FP8T_CHECK(given.emplace(buffer.name, &buffer.view).second,
               "optimizer state: buffer '{}' given twice", buffer.name);
  }
  const std::vector<NamedTensor> own = state();
  for (const NamedTensor& buffer : own) {
    const auto found = given.find(buffer.name);
    FP8T_CHECK(found != given.end(), "optimizer state: missing buffer '{}' ({})", buffer.name,
               shape_string(buffer.view));
    const TensorView& source = *found->second;
    bool same_shape = source.dtype() == buffer.view.dtype() && source.rank() == buffer.view.rank();
    for (int axis = 0; same_shape && axis < source.rank(); ++axis)
      same_shape = source.dim(axis) == buffer.view.dim(axis);
    FP8T_CHECK(same_shape && source.is_contiguous() && source.device() == Device::Cpu,
               "optimizer state: buffer '{}' is {}, expected a contiguous host {}", buffer.name,
               shape_string(source), shape_string(buffer.view));
    if (buffer.name == kStepCounterName) {
      const int64_t steps = *source.data<int64_t>();
      FP8T_CHECK(steps >= 0, "optimizer state: '{}' must be >= 0, found {}", buffer.name, steps);
    }
  }
  for (const NamedTensor& buffer : buffers) {
    const bool known = std::any_of(
        own.begin(), own.end(), [&](const NamedTensor& mine) { return mine.name == buffer.name; });
    FP8T_CHECK(known, "optimizer state: unexpected buffer '{}' (from another model or optimizer?)",
               buffer.name);
  }
  for (const NamedTensor& buffer : own)
    std::memcpy(buffer.view.raw(), given.at(buffer.name)->raw(), buffer.view.bytes());
}

size_t GptOptimizer::state_bytes() const {
  size_t bytes = sizeof(steps_);
  for (const AdamWSlot& slot : adamw_)
    bytes += (slot.exp_avg.size() + slot.exp_avg_sq.size()) * sizeof(float);
  for (const MuonSlot& slot : muon_) {
    const auto per_matrix = static_cast<size_t>(slot.state.rows() * slot.state.cols() +
                                                std::max(slot.state.rows(), slot.state.cols()));
    bytes += static_cast<size_t>(slot.state.count()) * per_matrix * sizeof(float);
  }
  return bytes;
}

}  // namespace fp8t::optim
