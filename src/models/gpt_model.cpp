#include "models/gpt_model.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <random>
#include <vector>

#include "models/fp8_layers.h"
#include "ops/attention.h"
#include "ops/cross_entropy.h"
#include "ops/elementwise.h"
#include "ops/embedding.h"
#include "ops/rmsnorm.h"
#include "ops/rotary.h"

namespace fp8t {

namespace {

void zero(const TensorView& view) {
  std::memset(view.raw(), 0, view.bytes());
}
void copy(const TensorView& to, const TensorView& from) {
  std::memcpy(to.raw(), from.raw(), to.bytes());
}

void add(float* out, const float* a, const float* b, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    out[i] = a[i] + b[i];
}

}  // namespace

GptModel::GptModel(const GptConfig& config, int64_t batch, int64_t seq,
                   const GptPrecision& precision, const RecomputeOptions& recompute,
                   const TensorParallel& tensor_parallel)
    : config_(config),
      batch_(batch),
      seq_(seq),
      precision_(precision),
      recompute_(recompute),
      tensor_parallel_(tensor_parallel) {
  config_.validate();
  const int group = tensor_parallel_.size;
  check_tensor_parallel(config_, group);
  check_group(tensor_parallel_, precision_.fp8_attention);
  heads_ = config_.n_head / group;
  kv_heads_ = config_.n_kv_head / group;
  hidden_ = 4 * int64_t{config_.n_embd} / group;
  FP8T_CHECK(batch >= 1, "expected a batch of at least 1, found {}", batch);
  FP8T_CHECK(seq >= 2 && seq <= config_.sequence_len,
             "expected a sequence of 2 to {} tokens, found {}", config_.sequence_len, seq);
  const int64_t tokens = batch * seq;
  sequence_ = tensor_parallel_.sequence;
  if (sequence_) check_sequence_parallel(group, batch, seq);
  rows_ = sequence_ ? tokens / group : tokens;
  recompute_groups_ = recompute_groups(recompute_, config_.n_layer);
  parameter_arena_ =
      std::make_unique<Arena>("parameters", ParameterSet::planned_bytes(config_, DType::F32));
  gradient_arena_ =
      std::make_unique<Arena>("gradients", ParameterSet::planned_bytes(config_, DType::F32));
  activation_arena_ = std::make_unique<Arena>(
      "activations",
      GptActivations::planned_bytes(config_, batch, seq, DType::F32, recompute_, group, sequence_));
  workspace_arena_ = std::make_unique<Arena>(
      "workspace", GptWorkspace::planned_bytes(config_, tokens, group, sequence_));
  parameters_ = std::make_unique<ParameterSet>(*parameter_arena_, config_, DType::F32);
  gradients_ = std::make_unique<ParameterSet>(*gradient_arena_, config_, DType::F32);
  activations_ = std::make_unique<GptActivations>(*activation_arena_, config_, batch, seq,
                                                  DType::F32, recompute_, group, sequence_);
  workspace_ = std::make_unique<GptWorkspace>(*workspace_arena_, config_, tokens, group, sequence_);
  parameters_->fill_zero();
  gradients_->fill_zero();
  idx_.resize(static_cast<size_t>(tokens));
  targets_.resize(static_cast<size_t>(tokens));

  const int64_t half = config_.head_dim() / 2;
  rotary_cos_.resize(static_cast<size_t>(seq * half));
  rotary_sin_.resize(static_cast<size_t>(seq * half));
  ops::rotary_tables(rotary_cos_.data(), rotary_sin_.data(), seq, config_.head_dim());

  linear_precision_ = decide_precision(config_, precision_.policy);
  for (LinearPrecision& decision : linear_precision_) {
    const int64_t in = decision.linear.in_features, out = decision.linear.out_features;
    const Split split =
        tensor_parallel_.split() ? gpt_tensor_split(decision.linear.name) : Split::None;
    // This rank's run of rows (its heads, its hidden features) or of columns.
    const int64_t run = (split == Split::Outputs ? out : in) / group;
    // lm_head, past the blocks, reads this rank's rows; the rest reads every row.
    const bool lm_head = decision.linear.kind == ParamKind::LmHead;
    Linear layer{decision.linear.name + ".weight",
                 {lm_head ? rows_ : tokens, in, out},
                 nullptr,
                 split == Split::None
                     ? WeightShare(out, in)
                     : WeightShare(split, {{tensor_parallel_.rank * run, run}}, out, in)};
    layer.shape.in_features = layer.share.in_features();
    layer.shape.out_features = layer.share.out_features();
    layer.fp8 = make_fp8_share(decision.fp8, decision.reason, layer.shape, split, precision_,
                               tensor_parallel_);
    // Under sequence parallelism lm_head's input and output gradient are split by rows: their
    // per-tensor scales come from the group's amax too.
    if (layer.fp8 && sequence_ && lm_head)
      layer.fp8->set_split_operands(tensor_parallel_.max, {true, false, true});
    linears_.emplace(decision.linear.name, std::move(layer));
  }
  if (precision_.fp8_attention) {
    fp8_attention_.assign(static_cast<size_t>(config_.n_layer),
                          ops::AttentionFp8(attention_fp8_formats(precision_)));
  }
}

void init_gpt_weights(ParameterSet& parameters, const GptConfig& config, uint64_t seed) {
  std::mt19937_64 generator(seed);
  const auto fill_normal = [&](const std::string& name, double std_dev) {
    std::normal_distribution<float> normal(0.0f, static_cast<float>(std_dev));
    TensorView& view = parameters[name];
    float* data = view.data<float>();
    for (int64_t i = 0; i < view.numel(); ++i)
      data[i] = normal(generator);
  };
  const auto fill_uniform = [&](const std::string& name, double low, double high) {
    std::uniform_real_distribution<float> uniform(static_cast<float>(low),
                                                  static_cast<float>(high));
    TensorView& view = parameters[name];
    float* data = view.data<float>();
    for (int64_t i = 0; i < view.numel(); ++i)
      data[i] = uniform(generator);
  };
  const double bound =
      std::sqrt(3.0) / std::sqrt(double(config.n_embd));  // uniform with std 1/sqrt(dim)
  parameters.fill_zero();  // c_proj weights and smear_lambda start at zero
  fill_normal("transformer.wte.weight", 0.8);
  fill_normal("lm_head.weight", 0.001);
  const int layers = config.n_layer;
  for (int layer = 0; layer < layers; ++layer) {
    const std::string prefix = fmt::format("transformer.h.{}.", layer);
    for (const char* name : {"attn.c_q.weight", "attn.c_k.weight", "attn.c_v.weight"}) {
      fill_uniform(prefix + name, -bound, bound);
    }
    fill_uniform(prefix + "mlp.c_fc.weight", -0.4 * bound, 0.4 * bound);
    if (config.has_value_embedding(layer)) {
      fill_uniform(prefix + "attn.ve_gate.weight", 0.0, 0.02);
      fill_uniform(fmt::format("value_embeds.{}.weight", layer), -bound, bound);
    }
    const double depth = layers > 1 ? double(layer) / (layers - 1) : 0.0;
    parameters["resid_lambdas"].data<float>()[layer] = static_cast<float>(1.15 - 0.10 * depth);
    parameters["x0_lambdas"].data<float>()[layer] = static_cast<float>(0.20 - 0.15 * depth);
  }
  fill_uniform("smear_gate.weight", 0.0, 0.02);
  parameters["backout_lambda"].data<float>()[0] = 0.2f;
}

void check_tokens(const GptConfig& config, const int32_t* idx, const int32_t* targets,
                  int64_t count) {
  for (int64_t i = 0; i < count; ++i) {
    FP8T_CHECK(idx[i] >= 0 && idx[i] < config.vocab_size,
               "token {} at position {} is outside the vocabulary [0, {})", idx[i], i,
               config.vocab_size);
    FP8T_CHECK(targets[i] == -1 || (targets[i] >= 0 && targets[i] < config.vocab_size),
               "target {} at position {} is neither -1 nor in [0, {})", targets[i], i,
               config.vocab_size);
  }
}

void GptModel::init_weights(uint64_t seed) {
  init_gpt_weights(*parameters_, config_, seed);
  end_step();  // the FP8 weight caches hold the old weights
}

GptModel::Linear& GptModel::linear(const std::string& name) {
  const auto found = linears_.find(name);
  FP8T_CHECK(found != linears_.end(), "no linear layer named '{}'", name);
  return found->second;
}

float* GptModel::parameter(const std::string& name) {
  return (*parameters_)[name].data<float>();
}
float* GptModel::gradient(const std::string& name) {
  return (*gradients_)[name].data<float>();
}
float GptModel::scalar(const std::string& name, int index) {
  return parameter(name)[index];
}

void GptModel::linear_forward(Linear& layer, const float* x, float* y) {
  layer.share.refresh(parameter(layer.weight), nullptr);
  if (layer.fp8) {
    layer.fp8->forward(x, layer.shape.tokens, layer.share.weight(), y);
  } else {
    ops::linear_forward(x, layer.share.weight(), y, layer.shape, precision_.other_linears);
  }
}

void GptModel::linear_backward(Linear& layer, const float* dy, const float* x, float* dx) {
  WeightShare& share = layer.share;
  share.refresh(parameter(layer.weight), nullptr);
  share.begin_gradients(gradient(layer.weight), nullptr);
  if (layer.fp8) {
    layer.fp8->backward(dy, layer.shape.tokens, dx, share.weight_gradient());
  } else {
    ops::linear_backward(dy, x, share.weight(), dx, share.weight_gradient(), layer.shape,
                         precision_.other_linears);
  }
  share.end_gradients();
}

void GptModel::value_embedding_forward(int layer) {
  const int64_t N = batch_ * seq_, width = kv_heads_ * config_.head_dim();
  const int64_t row = config_.kv_dim(), offset = tensor_parallel_.rank * width;
  const float* table = parameter(fmt::format("value_embeds.{}.weight", layer));
  float* out = workspace_->value_embed.data<float>();
  for (int64_t n = 0; n < N; ++n) {
    const float* from = table + idx_[static_cast<size_t>(n)] * row + offset;
    std::copy(from, from + width, out + n * width);
  }
}

void GptModel::value_embedding_backward(int layer) {
  const int64_t N = batch_ * seq_, width = kv_heads_ * config_.head_dim();
  const int64_t row = config_.kv_dim(), offset = tensor_parallel_.rank * width;
  float* dtable = gradient(fmt::format("value_embeds.{}.weight", layer));
  const float* dout = workspace_->dvalue_embed.data<float>();
  for (int64_t n = 0; n < N; ++n) {
    float* to = dtable + idx_[static_cast<size_t>(n)] * row + offset;
    for (int64_t i = 0; i < width; ++i)
      to[i] += dout[n * width + i];
  }
}

float* GptModel::value_gate_weight(const std::string& prefix,
                                   const std::unique_ptr<ParameterSet>& tensors) {
  return (*tensors)[prefix + "attn.ve_gate.weight"].data<float>() +
         tensor_parallel_.rank * kv_heads_ * kValueGateChannels;
}

void GptModel::sum_over_group(const TensorView& partial) {
  if (tensor_parallel_.split())
    tensor_parallel_.sum(partial.data<float>(), static_cast<size_t>(partial.numel()));
}

const float* GptModel::gather_rows(const TensorView& local) {
  if (!sequence_) return local.data<float>();
  // A rank's rows are consecutive in the micro-batch: the ranks' in rank order are the whole.
  const TensorView& whole = workspace_->gathered;
  tensor_parallel_.all_gather(local.data<float>(), whole.data<float>(),
                              static_cast<size_t>(local.numel()));
  return whole.data<float>();
}

const float* GptModel::sum_rows_over_group(const TensorView& partial) {
  sum_over_group(partial);
  return partial.data<float>() + first_row() * config_.n_embd;
}

void GptModel::gather_split_gradients() {
  if (!tensor_parallel_.split()) return;
  for (const ParamSpec& spec : gradients_->specs())
    if (gpt_parameter_split(spec) != TensorSplit::None ||
        (sequence_ && gpt_sequence_split_gradient(spec)))
      sum_over_group((*gradients_)[spec.name]);
}

void GptModel::end_step() {
  end_fp8_step(linears_);
  invalidate_weight_shares(linears_);
}

void GptModel::set_training(bool training) {
  training_ = training;
  record_fp8_amaxes(linears_, training);
}

void GptModel::weights_changed() {
  invalidate_fp8_weights(linears_);
  invalidate_weight_shares(linears_);
}

std::vector<std::pair<std::string, DelayedScaling*>> GptModel::delayed_scalings() {
  return fp8_delayed_scalings(linears_);
}

void GptModel::set_record_fp8_health(bool record) {
  recording_fp8_health_ = record;
  record_fp8_health(linears_, record);
}

std::vector<Fp8TensorHealth> GptModel::take_fp8_health() {
  return fp8t::take_fp8_health(linears_, linear_precision_);
}

void GptModel::attention_forward(int layer, const ops::AttentionShape& shape) {
  BlockActivations& block = activations_->blocks[static_cast<size_t>(layer)];
  const float* q = block.q.data<float>();
  const float* k = block.k.data<float>();
  const float* v = block.v.data<float>();
  float* out = block.attn_out.data<float>();
  float* lse = block.logsumexp.data<float>();
  if (precision_.fp8_attention) {
    fp8_attention_[static_cast<size_t>(layer)].forward(out, lse, q, k, v, shape,
                                                       config_.attention_scale());
  } else {
    ops::attention_forward(out, lse, q, k, v, shape, config_.attention_scale());
  }
}

void GptModel::attention_backward(int layer, const ops::AttentionShape& shape) {
  const BlockActivations& block = activations_->blocks[static_cast<size_t>(layer)];
  GptWorkspace& ws = *workspace_;
  float* dq = ws.dq.data<float>();
  float* dk = ws.dk.data<float>();
  float* dv = ws.dv.data<float>();
  const float* dout = ws.dattn_out.data<float>();
  const float* q = block.q.data<float>();
  const float* k = block.k.data<float>();
  const float* v = block.v.data<float>();
  const float* lse = block.logsumexp.data<float>();
  if (precision_.fp8_attention) {
    fp8_attention_[static_cast<size_t>(layer)].backward(dq, dk, dv, dout, q, k, v,
                                                        block.attn_out.data<float>(), lse, shape,
                                                        config_.attention_scale());
  } else {
    ops::attention_backward(dq, dk, dv, dout, q, k, v, lse, shape, config_.attention_scale());
  }
}

const float* GptModel::previous_output(int layer) const {
  const GptActivations& act = *activations_;
  return layer > 0 ? act.blocks[static_cast<size_t>(layer - 1)].output.data<float>()
                   : act.x0.data<float>();
}

void GptModel::block_forward(int layer) {
  const int64_t B = batch_, T = seq_, N = B * T, R = rows_, C = config_.n_embd;
  const int64_t H = heads_, Hkv = kv_heads_, D = config_.head_dim();
  GptActivations& act = *activations_;
  GptWorkspace& ws = *workspace_;
  BlockActivations& block = act.blocks[static_cast<size_t>(layer)];
  const std::string prefix = fmt::format("transformer.h.{}.", layer);
  ops::residual_mix_forward(block.input.data<float>(), previous_output(layer), act.x0.data<float>(),
                            scalar("resid_lambdas", layer), scalar("x0_lambdas", layer), R * C);
  ops::rmsnorm_forward(block.attn_norm.data<float>(), block.attn_rstd.data<float>(),
                       block.input.data<float>(), R, C);
  const float* attn_norm = gather_rows(block.attn_norm);
  linear_forward(linear(prefix + "attn.c_q"), attn_norm, ws.q_lin.data<float>());
  linear_forward(linear(prefix + "attn.c_k"), attn_norm, ws.k_lin.data<float>());
  linear_forward(linear(prefix + "attn.c_v"), attn_norm, block.v.data<float>());
  if (config_.has_value_embedding(layer)) {
    value_embedding_forward(layer);
    ops::value_gate_forward(block.v.data<float>(), block.value_gate.data<float>(), attn_norm,
                            ws.value_embed.data<float>(), value_gate_weight(prefix, parameters_),
                            {N, C, Hkv, D, kValueGateChannels});
  }
  // Rotary into dq_rot and dk_rot (the backward's, free here), then the QK norm.
  ops::rotary_forward(ws.dq_rot.data<float>(), ws.q_lin.data<float>(), rotary_cos_.data(),
                      rotary_sin_.data(), B, T, H, D);
  ops::rotary_forward(ws.dk_rot.data<float>(), ws.k_lin.data<float>(), rotary_cos_.data(),
                      rotary_sin_.data(), B, T, Hkv, D);
  ops::rmsnorm_forward(block.q.data<float>(), block.q_rstd.data<float>(), ws.dq_rot.data<float>(),
                       N * H, D);
  ops::rmsnorm_forward(block.k.data<float>(), block.k_rstd.data<float>(), ws.dk_rot.data<float>(),
                       N * Hkv, D);
  attention_forward(layer, {B, T, H, Hkv, D, config_.window(layer)});
  linear_forward(linear(prefix + "attn.c_proj"), block.attn_out.data<float>(),
                 ws.branch.data<float>());
  add(block.mid.data<float>(), block.input.data<float>(), sum_rows_over_group(ws.branch), R * C);

  ops::rmsnorm_forward(block.mlp_norm.data<float>(), block.mlp_rstd.data<float>(),
                       block.mid.data<float>(), R, C);
  linear_forward(linear(prefix + "mlp.c_fc"), gather_rows(block.mlp_norm), block.fc.data<float>());
  ops::relu2_forward(block.fc_act.data<float>(), block.fc.data<float>(), N * hidden_);
  linear_forward(linear(prefix + "mlp.c_proj"), block.fc_act.data<float>(),
                 ws.branch.data<float>());
  add(block.output.data<float>(), block.mid.data<float>(), sum_rows_over_group(ws.branch), R * C);
}

void GptModel::block_backward(int layer) {
  const int64_t B = batch_, T = seq_, N = B * T, R = rows_, C = config_.n_embd;
  const int64_t H = heads_, Hkv = kv_heads_, D = config_.head_dim();
  GptActivations& act = *activations_;
  GptWorkspace& ws = *workspace_;
  BlockActivations& block = act.blocks[static_cast<size_t>(layer)];
  const std::string prefix = fmt::format("transformer.h.{}.", layer);
  float* dx = ws.dx.data<float>();  // d output of this block
  if (layer == config_.backout_layer()) add(dx, dx, ws.dbackout.data<float>(), R * C);

  // MLP: output = mid + c_proj(relu²(c_fc(norm(mid))))
  // Selective recompute shares fc_act among the blocks: this block's relu²(fc) again.
  if (recompute_.granularity == RecomputeGranularity::Selective)
    ops::relu2_forward(block.fc_act.data<float>(), block.fc.data<float>(), N * hidden_);
  zero(ws.dfc_act);
  linear_backward(linear(prefix + "mlp.c_proj"), gather_rows(ws.dx), block.fc_act.data<float>(),
                  ws.dfc_act.data<float>());
  zero(ws.dfc);
  ops::relu2_backward(ws.dfc.data<float>(), ws.dfc_act.data<float>(), block.fc.data<float>(),
                      N * hidden_);
  zero(ws.dnorm);
  Linear& c_fc = linear(prefix + "mlp.c_fc");
  // An FP8 linear's backward reads the casts its forward kept, not x: no gather for it.
  linear_backward(c_fc, ws.dfc.data<float>(), c_fc.fp8 ? nullptr : gather_rows(block.mlp_norm),
                  ws.dnorm.data<float>());
  copy(ws.dbranch, ws.dx);  // d mid
  ops::rmsnorm_backward(ws.dbranch.data<float>(), sum_rows_over_group(ws.dnorm),
                        block.mlp_norm.data<float>(), block.mlp_rstd.data<float>(), R, C);

  // Attention: mid = input + c_proj(attention(q, k, v))
  zero(ws.dattn_out);
  linear_backward(linear(prefix + "attn.c_proj"), gather_rows(ws.dbranch),
                  block.attn_out.data<float>(), ws.dattn_out.data<float>());
  for (TensorView* view : {&ws.dq, &ws.dk, &ws.dv, &ws.dq_rot, &ws.dk_rot, &ws.dq_lin, &ws.dk_lin})
    zero(*view);
  attention_backward(layer, {B, T, H, Hkv, D, config_.window(layer)});
  ops::rmsnorm_backward(ws.dq_rot.data<float>(), ws.dq.data<float>(), block.q.data<float>(),
                        block.q_rstd.data<float>(), N * H, D);
  ops::rmsnorm_backward(ws.dk_rot.data<float>(), ws.dk.data<float>(), block.k.data<float>(),
                        block.k_rstd.data<float>(), N * Hkv, D);
  ops::rotary_backward(ws.dq_lin.data<float>(), ws.dq_rot.data<float>(), rotary_cos_.data(),
                       rotary_sin_.data(), B, T, H, D);
  ops::rotary_backward(ws.dk_lin.data<float>(), ws.dk_rot.data<float>(), rotary_cos_.data(),
                       rotary_sin_.data(), B, T, Hkv, D);
  zero(ws.dnorm);  // d attn_norm, from q, k, v and the value gate
  Linear& c_q = linear(prefix + "attn.c_q");
  Linear& c_k = linear(prefix + "attn.c_k");
  Linear& c_v = linear(prefix + "attn.c_v");
  const bool reads_attn_norm =
      config_.has_value_embedding(layer) || !c_q.fp8 || !c_k.fp8 || !c_v.fp8;
  const float* attn_norm = reads_attn_norm ? gather_rows(block.attn_norm) : nullptr;
  if (config_.has_value_embedding(layer)) {
    value_embedding_forward(layer);
    zero(ws.dvalue_embed);
    ops::value_gate_backward(ws.dnorm.data<float>(), value_gate_weight(prefix, gradients_),
                             ws.dvalue_embed.data<float>(), ws.dv.data<float>(), attn_norm,
                             ws.value_embed.data<float>(), value_gate_weight(prefix, parameters_),
                             block.value_gate.data<float>(), {N, C, Hkv, D, kValueGateChannels});
    value_embedding_backward(layer);
  }
  linear_backward(c_q, ws.dq_lin.data<float>(), attn_norm, ws.dnorm.data<float>());
  linear_backward(c_k, ws.dk_lin.data<float>(), attn_norm, ws.dnorm.data<float>());
  linear_backward(c_v, ws.dv.data<float>(), attn_norm, ws.dnorm.data<float>());
  ops::rmsnorm_backward(ws.dbranch.data<float>(), sum_rows_over_group(ws.dnorm),
                        block.attn_norm.data<float>(), block.attn_rstd.data<float>(), R,
                        C);  // dbranch: d input

  // input = resid_lambda * previous + x0_lambda * x0
  zero(ws.dx_next);
  ops::residual_mix_backward(ws.dx_next.data<float>(), ws.dx0.data<float>(),
                             gradient("resid_lambdas") + layer, gradient("x0_lambdas") + layer,
                             ws.dbranch.data<float>(), previous_output(layer), act.x0.data<float>(),
                             scalar("resid_lambdas", layer), scalar("x0_lambdas", layer), R * C);
  copy(ws.dx, ws.dx_next);
}

void GptModel::recompute_group(const RecomputeGroup& group) {
  pause_fp8_recording(linears_);
  for (int layer = group.first; layer < group.end; ++layer)
    block_forward(layer);
  resume_fp8_recording(linears_, training_, recording_fp8_health_);
}

double GptModel::forward(const int32_t* idx, const int32_t* targets) {
  const int64_t B = batch_, T = seq_, N = B * T, R = rows_, C = config_.n_embd;
  const int64_t vocab = config_.padded_vocab();
  check_tokens(config_, idx, targets, N);
  std::copy(idx, idx + N, idx_.begin());
  std::copy(targets, targets + N, targets_.begin());
  GptActivations& act = *activations_;

  ops::embedding_forward(act.embedding.data<float>(), idx, parameter("transformer.wte.weight"), N,
                         vocab, C);
  ops::rmsnorm_forward(act.embedding_norm.data<float>(), act.embedding_rstd.data<float>(),
                       act.embedding.data<float>(), N, C);
  // The smear mixes each token with the one before: it runs on every row, and under sequence
  // parallelism this rank keeps its rows of x0.
  const TensorView& x0 = sequence_ ? workspace_->gathered : act.x0;
  ops::smear_forward(x0.data<float>(), act.smear_gate.data<float>(),
                     act.embedding_norm.data<float>(), parameter("smear_gate.weight"),
                     scalar("smear_lambda"), {B, T, C, kSmearGateChannels});
  if (sequence_) std::copy_n(x0.data<float>() + first_row() * C, R * C, act.x0.data<float>());

  for (int layer = 0; layer < config_.n_layer; ++layer)
    block_forward(layer);
  const BlockActivations& backout = act.blocks[static_cast<size_t>(config_.backout_layer())];
  ops::backout_forward(act.final_input.data<float>(), previous_output(config_.n_layer),
                       backout.output.data<float>(), scalar("backout_lambda"), R * C);
  ops::rmsnorm_forward(act.final_norm.data<float>(), act.final_rstd.data<float>(),
                       act.final_input.data<float>(), R, C);
  linear_forward(linear("lm_head"), act.final_norm.data<float>(), act.logits.data<float>());
  const int32_t* own_targets = targets + first_row();
  const double loss = ops::softcap_cross_entropy(act.logits.data<float>(), own_targets,
                                                 {R, config_.vocab_size, vocab});
  if (!sequence_) return loss;
  // The mean over the group's rows: each rank's mean weighted by its share of the counted rows.
  const auto counted = static_cast<float>(std::count_if(
      own_targets, own_targets + R, [](int32_t t) { return t != ops::kIgnoreTarget; }));
  std::array<float, 2> sums{static_cast<float>(loss) * counted, counted};
  tensor_parallel_.sum(sums.data(), sums.size());
  loss_share_ = sums[1] > 0.0f ? counted / sums[1] : 0.0f;
  return sums[1] > 0.0f ? double(sums[0]) / double(sums[1]) : 0.0;
}

void GptModel::backward() {
  const int64_t B = batch_, T = seq_, N = B * T, R = rows_, C = config_.n_embd;
  const int64_t vocab = config_.padded_vocab();
  GptActivations& act = *activations_;
  GptWorkspace& ws = *workspace_;

  // The logits become their own gradient: no second copy.
  ops::softcap_cross_entropy_with_gradient(act.logits.data<float>(), targets_.data() + first_row(),
                                           {R, config_.vocab_size, vocab},
                                           sequence_ ? loss_share_ : 1.0f);
  zero(ws.dnorm);
  linear_backward(linear("lm_head"), act.logits.data<float>(), act.final_norm.data<float>(),
                  ws.dnorm.data<float>());
  zero(ws.dbranch);  // d final_input
  ops::rmsnorm_backward(ws.dbranch.data<float>(), ws.dnorm.data<float>(),
                        act.final_norm.data<float>(), act.final_rstd.data<float>(), R, C);
  const BlockActivations& backout = act.blocks[static_cast<size_t>(config_.backout_layer())];
  zero(ws.dx);
  zero(ws.dbackout);
  ops::backout_backward(ws.dx.data<float>(), ws.dbackout.data<float>(), gradient("backout_lambda"),
                        ws.dbranch.data<float>(), backout.output.data<float>(),
                        scalar("backout_lambda"), R * C);
  zero(ws.dx0);

  for (int layer = config_.n_layer - 1; layer >= 0; --layer) {
    if (const int group = recompute_group_ending_at(recompute_groups_, layer); group >= 0)
      recompute_group(recompute_groups_[static_cast<size_t>(group)]);
    block_backward(layer);
  }
  // The first block's previous residual is x0 itself.
  add(ws.dx0.data<float>(), ws.dx0.data<float>(), ws.dx.data<float>(), R * C);

  zero(ws.dnorm);  // d embedding_norm
  ops::smear_backward(
      ws.dnorm.data<float>(), gradient("smear_gate.weight"), gradient("smear_lambda"),
      gather_rows(ws.dx0), act.embedding_norm.data<float>(), act.smear_gate.data<float>(),
      parameter("smear_gate.weight"), scalar("smear_lambda"), {B, T, C, kSmearGateChannels});
  zero(ws.branch);  // d embedding, of every row
  ops::rmsnorm_backward(ws.branch.data<float>(), ws.dnorm.data<float>(),
                        act.embedding_norm.data<float>(), act.embedding_rstd.data<float>(), N, C);
  ops::embedding_backward(gradient("transformer.wte.weight"), ws.branch.data<float>(), idx_.data(),
                          N, vocab, C);
}

void GptModel::capped_logits(float* out) const {
  FP8T_CHECK(!sequence_, "the logits of a sequence-parallel rank are its rows only");
  const int64_t N = batch_ * seq_, vocab = config_.padded_vocab();
  const float* logits = activations_->logits.data<float>();
  const auto softcap = static_cast<float>(ops::kLogitSoftcap);
  for (int64_t row = 0; row < N; ++row) {
    for (int64_t col = 0; col < config_.vocab_size; ++col) {
      out[row * config_.vocab_size + col] =
          softcap * std::tanh(logits[row * vocab + col] / softcap);
    }
  }
}

}  // namespace fp8t
