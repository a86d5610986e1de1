#if FP8TRAIN_WITH_CUDA

#include "models/cuda/gpt_model_cuda.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <map>
#include <optional>
#include <string_view>

#include <fmt/format.h>

#include "core/cuda_check.h"
#include "core/device_arena.h"
#include "core/error.h"
#include "gemm/cublaslt_gemm.h"
#include "models/cuda/linear_scalings.h"
#include "models/cuda/share_transfer.h"
#include "models/tensor_parallel.h"
#include "ops/cross_entropy.h"
#include "ops/cuda/attention_cudnn.h"
#include "ops/cuda/attention_fp8_cuda.h"
#include "ops/cuda/gpt_gates.h"
#include "ops/cuda/linear_cuda.h"
#include "ops/cuda/ops_cuda.h"
#include "ops/fp8_linear_layout.h"
#include "ops/rmsnorm.h"
#include "ops/rotary.h"

namespace fp8t {

namespace kernels = ops::cuda;
using kernels::GradStore;

namespace {

constexpr auto kEps = static_cast<float>(ops::kRmsNormEps);
constexpr auto kSoftcap = static_cast<float>(ops::kLogitSoftcap);

// Pinned host memory for the token ids of one micro-batch.
template <typename T>
struct PinnedBuffer {
  T* data = nullptr;
  explicit PinnedBuffer(size_t count) {
    FP8T_CUDA_CHECK(cudaMallocHost(reinterpret_cast<void**>(&data), count * sizeof(T)));
  }
  ~PinnedBuffer() { cudaFreeHost(data); }
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
};

// A linear's share on this rank of a tensor-parallel group (the whole linear without one).
struct LinearShare {
  TensorSplit split = TensorSplit::None;
  int64_t in_features = 0, out_features = 0;
};

LinearShare share_of(const LinearSpec& linear, const DeviceTensorParallel& group) {
  LinearShare share{group.split() ? gpt_tensor_split(linear.name) : TensorSplit::None,
                    linear.in_features, linear.out_features};
  if (share.split == TensorSplit::Outputs) {  // this rank's run of whole rows
    share.out_features /= group.size;
  } else if (share.split == TensorSplit::Inputs) {  // this rank's run of each row's columns
    share.in_features /= group.size;
  }
  return share;
}

}  // namespace

struct CudaGptModel::Linear {
  std::string weight;  // parameter name
  std::unique_ptr<kernels::CudaLinear> layer;
  int fp8_index = -1;  // its CudaLinearScalings index; -1 outside FP8
};

// What one block saves for backward.
struct CudaGptModel::Layer {
  bf16* attn_norm;
  float* attn_rstd;
  bf16 *q, *k, *v;
  float *q_rstd, *k_rstd;
  float* value_gate;  // layers with a value embedding
  float* stats;       // [B, H, T]
  bf16* attn_out;     // FP8 attention: a workspace buffer, read back from fp8_attention.out
  kernels::Fp8AttentionSaved fp8_attention;
  bf16* mlp_norm;
  float* mlp_rstd;
  bf16* fc;  // before relu²
  bf16* output;
};

struct CudaGptModel::Buffers {
  DeviceArena parameters{"parameters"};
  DeviceArena gradients{"gradients"};
  DeviceArena activations{"activations"};
  DeviceArena workspace{"workspace"};
  DeviceArena linear_scratch{"FP8 scratch"};
  gemm::CublasLtGemm gemm;
  kernels::CudnnAttention attention;
  std::unique_ptr<kernels::CudaFp8Attention> fp8_attention;  // fp8_dot_product_attention
  kernels::Fp8AttentionScratch fp8_attention_scratch;
  std::map<std::string, Linear> linears;
  CudaLinearScalings scalings;
  kernels::Fp8Scratch fp8_scratch;

  PinnedBuffer<int32_t> idx_host, targets_host;
  cudaEvent_t ids_copied = nullptr;
  int32_t *idx = nullptr, *targets = nullptr;
  float *rotary_cos = nullptr, *rotary_sin = nullptr;

  // Saved activations.
  bf16* embedding_norm = nullptr;
  float* embedding_rstd = nullptr;
  float* smear_gate = nullptr;
  bf16* x0 = nullptr;
  std::vector<Layer> layers;
  bf16* final_norm = nullptr;
  float* final_rstd = nullptr;

  // Workspace: forward temporaries, then backward's.
  bf16 *input = nullptr, *mid = nullptr;
  bf16 *q_lin = nullptr, *k_lin = nullptr, *value_embed = nullptr, *fc_act = nullptr;
  bf16* logits = nullptr;
  float* row_losses = nullptr;
  int32_t* valid_rows = nullptr;
  float* reduction = nullptr;  // block partial sums of the parameter-gradient reductions
  bf16 *dres = nullptr, *dres_next = nullptr, *dbackout = nullptr, *dx0 = nullptr;
  bf16 *dnorm = nullptr, *dattn_out = nullptr, *dq = nullptr, *dk = nullptr, *dv = nullptr;
  bf16 *dvalue_embed = nullptr, *dfc_act = nullptr;
  // Sequence parallelism: the group's rows [B·T, C] (gathered, or partial sums), and this rank's
  // rows of a summed input gradient.
  bf16 *whole = nullptr, *dnorm_own = nullptr;
  uint8_t* region = nullptr;  // where the pieces of one phase take turns (lay_out)
  size_t region_bytes = 0;
  bool forward_has_gradient = false;

  Buffers(size_t tokens, const ModelPrecision& precision)
      : scalings(precision.fp8, precision.family), idx_host(tokens), targets_host(tokens) {
    FP8T_CUDA_CHECK(cudaEventCreateWithFlags(&ids_copied, cudaEventDisableTiming));
  }
  ~Buffers() { cudaEventDestroy(ids_copied); }
};

CudaGptModel::CudaGptModel(const GptConfig& config, int64_t batch, int64_t seq,
                           const GptPrecision& precision, cudaStream_t stream,
                           const PlanCheck& check_plan, const RecomputeOptions& recompute,
                           const DeviceTensorParallel& tensor_parallel, size_t between_steps_bytes)
    : config_(config),
      batch_(batch),
      seq_(seq),
      tokens_(batch * seq),
      precision_(precision),
      recompute_groups_(recompute_groups(recompute, config.n_layer)),
      tensor_parallel_(tensor_parallel),
      between_steps_bytes_(between_steps_bytes),
      stream_(stream) {
  config_.validate();
  const int group_size = tensor_parallel_.size;
  check_tensor_parallel(config_, group_size);
  check_device_group(tensor_parallel_, precision_.fp8_attention);
  heads_ = config_.n_head / group_size;
  kv_heads_ = config_.n_kv_head / group_size;
  hidden_ = 4 * int64_t{config_.n_embd} / group_size;
  FP8T_CHECK(batch >= 1, "expected a batch of at least 1, found {}", batch);
  FP8T_CHECK(seq >= 2 && seq <= config_.sequence_len,
             "expected a sequence of 2 to {} tokens, found {}", config_.sequence_len, seq);
  FP8T_CHECK(tokens_ % 16 == 0,
             "the GPU path needs batch x sequence to be a multiple of 16, found {} x {}", batch,
             seq);
  sequence_ = tensor_parallel_.sequence;
  if (sequence_) {
    check_sequence_parallel(group_size, batch, seq);
    if (tokens_ / group_size % 16 != 0) {
      throw ConfigError(fmt::format(
          "sequence_parallel: the GPU path needs each rank's rows, {} x {} / {}, to be a "
          "multiple of 16",
          batch, seq, group_size));
    }
  }
  rows_ = sequence_ ? tokens_ / group_size : tokens_;
  first_row_ = sequence_ ? tensor_parallel_.rank * rows_ : 0;
  if (!recompute_groups_.empty() && precision_.fp8_attention) {
    throw ConfigError(
        "recompute_granularity: full does not combine with fp8_dot_product_attention on the GPU "
        "path (a rerun of the FP8 attention's forward would change the scales its backward "
        "reads); use one of the two");
  }
  buffers_ = std::make_unique<Buffers>(static_cast<size_t>(tokens_), precision_);
  linear_precision_ = decide_precision(config_, precision_.policy);
  for (LinearPrecision& decision : linear_precision_) {  // shares a block recipe cannot cast
    const LinearShare share = share_of(decision.linear, tensor_parallel_);
    if (std::optional<std::string> why = tensor_parallel_share_reason(
            share.in_features, share.out_features, precision_.fp8.recipe, tensor_parallel_.size);
        decision.fp8 && share.split != TensorSplit::None && why) {
      decision.fp8 = false;
      decision.reason = *why;
    }
  }

  layout_ = optim::device_parameter_layout(config_, /*bf16_embeddings=*/true, group_size,
                                           tensor_parallel_.rank);
  plan_gradient_ranges();
  lay_out();
  memory_.parameters = buffers_->parameters.bytes();
  memory_.gradients = buffers_->gradients.bytes();
  memory_.activations = buffers_->activations.bytes();
  memory_.workspace = buffers_->workspace.bytes();
  memory_.linear_copies = memory_.linear_scratch = buffers_->linear_scratch.bytes();
  if (check_plan) {
    CudaGptMemory planned = memory_;
    const ScalingRecipe recipe = precision_.fp8.recipe;
    // FP8 linears keeping Ŵᵗ: their copies made in backward instead, with the one buffer they
    // would share.
    const bool transposes_kept = precision_.fp8_weight_transposes == ops::WeightTransposes::Kept &&
                                 recipe != ScalingRecipe::Mxfp8;
    size_t kept = 0, made_in_backward = 0;
    ops::WeightTScratch weight_t;
    for (const LinearPrecision& decision : linear_precision_) {
      if (decision.linear.kind == ParamKind::Gate) continue;  // kernels of their own
      const LinearShare share = share_of(decision.linear, tensor_parallel_);
      const int64_t in = share.in_features, out = share.out_features;
      planned.linear_copies += ops::linear_weight_bytes(in, out, /*bias=*/false, decision.fp8,
                                                        recipe, precision_.fp8_weight_transposes);
      if (!decision.fp8 || !transposes_kept) continue;
      kept += ops::linear_weight_bytes(in, out, false, true, recipe);
      made_in_backward +=
          ops::linear_weight_bytes(in, out, false, true, recipe, ops::WeightTransposes::InBackward);
      weight_t.fit(in, out, recipe);
    }
    DeviceArena shared_transpose("Ŵᵗ made in backward");  // planned only
    shared_transpose.take<uint8_t>(static_cast<size_t>(weight_t.bytes));
    shared_transpose.take<float>(static_cast<size_t>(weight_t.scale_floats));
    if (kept > made_in_backward + shared_transpose.bytes())
      planned.weight_transposes_saving = kept - made_in_backward - shared_transpose.bytes();
    check_plan(planned, layout_, buffers_->region_bytes);
  }
  for (DeviceArena* arena : {&buffers_->parameters, &buffers_->gradients, &buffers_->activations,
                             &buffers_->workspace, &buffers_->linear_scratch}) {
    arena->allocate_planned();
  }
  lay_out();

  // Rotary tables, and the linears.
  const int64_t half = config_.head_dim() / 2;
  std::vector<float> cos(static_cast<size_t>(seq * half)), sin(cos.size());
  ops::rotary_tables(cos.data(), sin.data(), seq, config_.head_dim());
  FP8T_CUDA_CHECK(cudaMemcpy(buffers_->rotary_cos, cos.data(), cos.size() * sizeof(float),
                             cudaMemcpyHostToDevice));
  FP8T_CUDA_CHECK(cudaMemcpy(buffers_->rotary_sin, sin.data(), sin.size() * sizeof(float),
                             cudaMemcpyHostToDevice));
  buffers_->scalings.initialize();
  if (precision_.fp8_attention) {
    buffers_->fp8_attention = std::make_unique<kernels::CudaFp8Attention>(
        buffers_->attention, attention_fp8_formats(precision_));
    for (Layer& layer : buffers_->layers) {
      FP8T_CUDA_CHECK(cudaMemsetAsync(layer.fp8_attention.floats, 0,
                                      sizeof(float) * kernels::kAttentionFp8Floats, stream_));
    }
  }
  std::map<std::string, int> fp8_index_of;  // linear name -> its scaling floats
  std::map<std::string, bool> fp8_of;       // linear name -> in FP8
  for (const LinearPrecision& decision : linear_precision_)
    fp8_of[decision.linear.name] = decision.fp8;
  // Blockwise: c_q, c_k and c_v compute their weight gradients as one GEMM where all three are
  // FP8 and their gradients lie back to back (kernels::LinearSetup::wgrad_group): whole, not as
  // tensor-parallel shares.
  const auto qkv_wgrad_group = [&](const LinearSpec& linear) {
    kernels::LinearSetup::WgradGroup group;
    constexpr std::array<std::string_view, 3> kParts = {"attn.c_q", "attn.c_k", "attn.c_v"};
    const auto part = std::find_if(kParts.begin(), kParts.end(), [&](std::string_view each) {
      return linear.name.ends_with(each);
    });
    const int64_t rows = linear.out_features;  // each of the three is [rows, in]
    if (part == kParts.end() || precision_.fp8.recipe != ScalingRecipe::Blockwise ||
        !precision_.fp8_wgrad || tensor_parallel_.split() ||
        !kernels::holds_wgrad_group(buffers_->fp8_scratch, tokens_, linear.in_features, 3 * rows)) {
      return group;
    }
    const std::string prefix = linear.name.substr(0, linear.name.size() - part->size());
    int64_t next_offset = layout_[prefix + "attn.c_q.weight"].offset;
    for (const std::string_view each : kParts) {
      const std::string name = prefix + std::string(each);
      if (!fp8_of.at(name) || layout_[name + ".weight"].offset != next_offset) return group;
      next_offset += rows * linear.in_features;
    }
    group.first_row = (part - kParts.begin()) * rows;
    group.rows = 3 * rows;
    return group;
  };
  for (const LinearPrecision& decision : linear_precision_) {
    if (decision.linear.kind == ParamKind::Gate) continue;  // the gates are kernels of their own
    const LinearShare share = share_of(decision.linear, tensor_parallel_);
    kernels::LinearSetup setup;
    setup.in_features = share.in_features;
    setup.out_features = share.out_features;
    if (share.split != TensorSplit::None) {
      // Column-parallel: the weight and the output gradient are shares, the input is whole;
      // row-parallel: the input and the weight are shares.
      const bool outputs = share.split == TensorSplit::Outputs;
      setup.split_roles = {!outputs, true, outputs};
    }
    // Under sequence parallelism lm_head reads this rank's rows and their gradient.
    if (sequence_ && decision.linear.kind == ParamKind::LmHead)
      setup.split_roles = {true, false, true};
    if (std::ranges::any_of(setup.split_roles, [](bool split) { return split; })) {
      setup.group_max = [this](float* amax, cudaStream_t amax_stream) {
        tensor_parallel_.max(amax, 1, amax_stream);
      };
    }
    setup.max_tokens = tokens_;
    setup.fp8 = decision.fp8;
    setup.fp8_config = precision_.fp8;
    setup.family = precision_.family;
    setup.fp8_wgrad = precision_.fp8_wgrad;
    setup.weight_transposes = precision_.fp8_weight_transposes;
    // mlp.c_proj casts relu² of the MLP's hidden layer itself: the activation is never stored.
    // With delayed and blockwise scaling mlp.c_fc casts the gradient through relu² too, so the
    // hidden layer's gradient is never stored either; tensorwise reads both of that cast's
    // inputs twice (its amax pass, then the cast), which measured 1.2 ms per W-GPT24 step
    // slower than storing it.
    const ScalingRecipe recipe = precision_.fp8.recipe;
    const bool one_pass_casts =
        recipe == ScalingRecipe::Delayed || recipe == ScalingRecipe::Blockwise;
    const bool relu2_casts = decision.fp8 && precision_.fp8_wgrad &&
                             (one_pass_casts || recipe == ScalingRecipe::Tensorwise);
    setup.input_relu2 = relu2_casts && decision.linear.name.ends_with("mlp.c_proj");
    setup.output_relu2 =
        relu2_casts && one_pass_casts && decision.linear.name.ends_with("mlp.c_fc");
    if (decision.fp8) setup.wgrad_group = qkv_wgrad_group(decision.linear);
    Linear linear;
    linear.weight = decision.linear.name + ".weight";
    const std::string& name = decision.linear.name;
    if (decision.fp8) {
      const int index = static_cast<int>(fp8_index_of.size());
      fp8_index_of[name] = index;
      int input_index = index;
      // k and v read the input q has just quantized.
      if (name.ends_with("attn.c_k") || name.ends_with("attn.c_v")) {
        const std::string q_name = name.substr(0, name.size() - 3) + "c_q";
        const auto q = buffers_->linears.find(q_name);
        if (q != buffers_->linears.end() && q->second.layer->fp8()) {
          setup.input_from = q->second.layer.get();
          input_index = fp8_index_of.at(q_name);
        }
      }
      setup.scaling = buffers_->scalings.floats(index);
      setup.health = buffers_->scalings.health(index);
      buffers_->scalings.add(name, index, input_index);
      linear.fp8_index = index;
    }
    linear.layer =
        std::make_unique<kernels::CudaLinear>(setup, buffers_->gemm, buffers_->fp8_scratch);
    memory_.linear_copies += linear.layer->device_bytes();
    buffers_->linears.emplace(decision.linear.name, std::move(linear));
  }
  FP8T_CUDA_CHECK(cudaMemsetAsync(gradients_, 0, layout_.total_bytes(), stream_));
  FP8T_CUDA_CHECK(cudaMemsetAsync(
      parameters_, 0, sizeof(float) * size_t(layout_.fp32_parameter_elements()), stream_));
  FP8T_CUDA_CHECK(cudaMemsetAsync(
      bf16_parameters_, 0, sizeof(bf16) * size_t(layout_.bf16_parameter_elements()), stream_));
}

CudaGptModel::~CudaGptModel() {
  cudaStreamSynchronize(stream_);
}

namespace {

// Consecutive 256-byte aligned pieces of a region from byte `start` on: their pointers, or null
// while the region is not yet there (base null), and where they end.
class RegionPieces {
 public:
  RegionPieces(uint8_t* base, size_t start) : base_(base), end_(start) {}
  template <typename T>
  T* take(size_t count) {
    const size_t offset = end_;
    constexpr size_t kAlignment = DeviceArena::kAlignment;
    end_ += (count * sizeof(T) + kAlignment - 1) / kAlignment * kAlignment;
    return base_ != nullptr ? reinterpret_cast<T*>(base_ + offset) : nullptr;
  }
  size_t end() const { return end_; }

 private:
  uint8_t* base_;
  size_t end_;
};

}  // namespace

void CudaGptModel::lay_out() {
  Buffers& b = *buffers_;
  const auto N = static_cast<size_t>(tokens_);
  const auto R = static_cast<size_t>(rows_);  // of the residual stream on this rank
  const auto C = static_cast<size_t>(config_.n_embd);
  const auto H = static_cast<size_t>(heads_);
  const auto Hkv = static_cast<size_t>(kv_heads_);
  const auto D = static_cast<size_t>(config_.head_dim());
  const auto hidden = static_cast<size_t>(hidden_);
  const auto vocab = static_cast<size_t>(config_.padded_vocab());

  parameters_ = b.parameters.take<float>(static_cast<size_t>(layout_.fp32_parameter_elements()));
  bf16_parameters_ =
      b.parameters.take<bf16>(static_cast<size_t>(layout_.bf16_parameter_elements()));
  gradients_ = b.gradients.take<float>(static_cast<size_t>(layout_.total_elements));

  DeviceArena& act = b.activations;
  b.embedding_norm = act.take<bf16>(N * C);
  b.embedding_rstd = act.take<float>(N);
  b.smear_gate = act.take<float>(N);
  b.x0 = act.take<bf16>(R * C);
  b.layers.resize(static_cast<size_t>(config_.n_layer));
  DeviceArena& ws = b.workspace;
  // FP8 attention keeps v and the attention output in FP8 for the backward: their bf16 forms
  // live only until the next layer's.
  const bool fp8_attention = precision_.fp8_attention;
  bf16* v_work = fp8_attention ? ws.take<bf16>(N * Hkv * D) : nullptr;
  bf16* attn_out_work = fp8_attention ? ws.take<bf16>(N * H * D) : nullptr;
  // Everything a block saves but its output.
  const auto take_layer = [&](Layer& layer, bool value_gate) {
    layer.attn_norm = act.take<bf16>(R * C);
    layer.attn_rstd = act.take<float>(R);
    layer.q = act.take<bf16>(N * H * D);
    layer.k = act.take<bf16>(N * Hkv * D);
    layer.v = fp8_attention ? v_work : act.take<bf16>(N * Hkv * D);
    layer.q_rstd = act.take<float>(N * H);
    layer.k_rstd = act.take<float>(N * Hkv);
    layer.value_gate = value_gate ? act.take<float>(N * Hkv) : nullptr;
    layer.stats = act.take<float>(N * H);
    layer.attn_out = fp8_attention ? attn_out_work : act.take<bf16>(N * H * D);
    if (fp8_attention) {
      kernels::Fp8AttentionSaved& saved = layer.fp8_attention;
      saved.q = act.take<uint8_t>(N * H * D);
      saved.k = act.take<uint8_t>(N * Hkv * D);
      saved.v = act.take<uint8_t>(N * Hkv * D);
      saved.out = act.take<uint8_t>(N * H * D);
      saved.floats = act.take<float>(static_cast<size_t>(kernels::kAttentionFp8Floats));
    }
    layer.mlp_norm = act.take<bf16>(R * C);
    layer.mlp_rstd = act.take<float>(R);
    layer.fc = act.take<bf16>(N * hidden);
  };
  // Full recompute: the blocks at the same place of their groups share one set, and only a
  // group's last block (and the backout layer, which the final mix reads) keeps its output.
  const std::vector<int> slots = recompute_slots(recompute_groups_, config_.n_layer);
  std::vector<Layer> places(static_cast<size_t>(recompute_slot_count(recompute_groups_)));
  for (Layer& place : places) {
    take_layer(place, true);  // a value gate: the last block has a value embedding at any depth
    place.output = act.take<bf16>(R * C);
  }
  for (int index = 0; index < config_.n_layer; ++index) {
    Layer& layer = b.layers[static_cast<size_t>(index)];
    const int slot = slots[static_cast<size_t>(index)];
    if (slot < 0) {
      take_layer(layer, config_.has_value_embedding(index));
      layer.output = act.take<bf16>(R * C);
      continue;
    }
    layer = places[static_cast<size_t>(slot)];
    if (!config_.has_value_embedding(index)) layer.value_gate = nullptr;
    const bool last_of_group = recompute_group_ending_at(recompute_groups_, index) >= 0;
    if (last_of_group || index == config_.backout_layer()) layer.output = act.take<bf16>(R * C);
  }
  b.final_norm = act.take<bf16>(R * C);
  b.final_rstd = act.take<float>(R);

  b.idx = ws.take<int32_t>(N);
  b.targets = ws.take<int32_t>(N);
  b.rotary_cos = ws.take<float>(static_cast<size_t>(seq_) * D / 2);
  b.rotary_sin = ws.take<float>(static_cast<size_t>(seq_) * D / 2);
  b.row_losses = ws.take<float>(R);
  b.valid_rows = ws.take<int32_t>(1);
  loss_ = ws.take<float>(1);
  b.reduction = ws.take<float>(static_cast<size_t>(
      std::max<int64_t>({kernels::kResidualMixWorkspaceFloats, kernels::kValueGateWorkspaceFloats,
                         kernels::kSmearWorkspaceFloats, kernels::kBackoutWorkspaceFloats})));
  b.dnorm = ws.take<bf16>(N * C);  // lm_head's backward writes it while reading the logits

  // What lives in one phase of a step only takes turns in one region: the forward's temporaries
  // (until lm_head's forward), the logits (from there to the end of lm_head's backward), the
  // backward's temporaries (after it), and between steps the optimizer's workspace
  // (scratch_between_steps). fc_act, value_embed and (sequence parallelism) the group's rows
  // serve forward and backward both. Under full recompute the forward runs inside the backward
  // too: its temporaries follow the backward's. Under sequence parallelism the residual
  // stream's pieces hold this rank's rows.
  const auto lay_out_region = [&](uint8_t* base) {
    RegionPieces both(base, 0);
    b.fc_act = both.take<bf16>(N * hidden);
    b.value_embed = both.take<bf16>(N * Hkv * D);
    b.whole = sequence_ ? both.take<bf16>(N * C) : nullptr;
    RegionPieces backward(base, both.end());
    b.dres = backward.take<bf16>(R * C);
    b.dres_next = backward.take<bf16>(R * C);
    b.dbackout = backward.take<bf16>(R * C);
    b.dx0 = backward.take<bf16>(R * C);
    b.dnorm_own = sequence_ ? backward.take<bf16>(R * C) : nullptr;
    b.dattn_out = backward.take<bf16>(N * H * D);
    b.dq = backward.take<bf16>(N * H * D);
    b.dk = backward.take<bf16>(N * Hkv * D);
    b.dv = backward.take<bf16>(N * Hkv * D);
    b.dvalue_embed = backward.take<bf16>(N * Hkv * D);
    b.dfc_act = backward.take<bf16>(N * hidden);
    RegionPieces forward(base, recompute_groups_.empty() ? both.end() : backward.end());
    b.input = forward.take<bf16>(R * C);
    b.mid = forward.take<bf16>(R * C);
    b.q_lin = forward.take<bf16>(N * H * D);
    b.k_lin = forward.take<bf16>(N * Hkv * D);
    RegionPieces logits(base, 0);
    b.logits = logits.take<bf16>(R * vocab);
    return std::max({forward.end(), backward.end(), logits.end()});
  };
  // A region smaller than the optimizer's workspace (a small micro-batch; sequence parallelism)
  // would leave that workspace to take memory of its own beside it.
  memory_.step_temporaries = lay_out_region(nullptr);
  b.region_bytes = std::max(memory_.step_temporaries, between_steps_bytes_);
  b.region = ws.take<uint8_t>(b.region_bytes);
  lay_out_region(b.region);
  if (fp8_attention) {
    b.fp8_attention_scratch = {ws.take<uint8_t>(N * H * D), ws.take<uint8_t>(N * H * D),
                               ws.take<uint8_t>(N * Hkv * D), ws.take<uint8_t>(N * Hkv * D)};
  }

  // FP8: the scaling floats and the quantization scratch of the largest linear (share).
  int fp8_count = 0;
  int64_t max_in = 0, max_out = 0;
  ops::WeightTScratch weight_t;
  for (const LinearPrecision& decision : linear_precision_) {
    if (decision.linear.kind == ParamKind::Gate) continue;
    const LinearShare share = share_of(decision.linear, tensor_parallel_);
    if (!decision.fp8) continue;
    ++fp8_count;
    max_in = std::max(max_in, share.in_features);
    max_out = std::max(max_out, share.out_features);
    if (precision_.fp8_weight_transposes == ops::WeightTransposes::InBackward)
      weight_t.fit(share.in_features, share.out_features, precision_.fp8.recipe);
  }
  b.scalings.take(b.linear_scratch, fp8_count);
  if (fp8_count > 0) {
    DeviceArena& scratch = b.linear_scratch;
    // The backward scratch fits the MLP's layers whole; lm_head takes its tokens in chunks.
    b.fp8_scratch = kernels::take_fp8_scratch(scratch, precision_.fp8.recipe, tokens_, max_in,
                                              max_out, std::max<int64_t>(hidden_, C), weight_t);
  }
}

gemm::CublasLtGemm& CudaGptModel::gemm() {
  return buffers_->gemm;
}

const gemm::CublasLtGemm& CudaGptModel::gemm() const {
  return buffers_->gemm;
}

std::span<uint8_t> CudaGptModel::scratch_between_steps() const {
  return {buffers_->region, buffers_->region_bytes};
}

float* CudaGptModel::parameter(const std::string& name) const {
  const optim::DeviceParameter& tensor = layout_[name];
  FP8T_CHECK(!tensor.bf16, "'{}' is stored in bf16", name);
  return parameters_ + tensor.offset;
}
const bf16* CudaGptModel::embedding_table(const std::string& name) const {
  const optim::DeviceParameter& tensor = layout_[name];
  FP8T_CHECK(tensor.bf16, "'{}' is not an embedding table stored in bf16", name);
  return bf16_parameters_ + (tensor.offset - layout_.bf16_offset);
}
float* CudaGptModel::gradient(const std::string& name) const {
  return gradients_ + layout_[name].offset;
}

const float* CudaGptModel::weight(const Linear& linear) const {
  return parameter(linear.weight);
}

float* CudaGptModel::weight_gradient(const Linear& linear) const {
  return gradient(linear.weight);
}

const bf16* CudaGptModel::mlp_activation(const bf16* fc, const ops::cuda::CudaLinear& mlp_proj) {
  if (mlp_proj.input_relu2()) return fc;
  const int64_t count = tokens_ * hidden_;
  ops::cuda::relu2_forward(buffers_->fc_act, fc, count, stream_);
  return buffers_->fc_act;
}

CudaGptModel::Linear& CudaGptModel::linear(const std::string& name) {
  const auto found = buffers_->linears.find(name);
  FP8T_CHECK(found != buffers_->linears.end(), "no linear layer named '{}'", name);
  return found->second;
}

void CudaGptModel::upload_parameters(const ParameterSet& host) {
  FP8T_CUDA_CHECK(cudaStreamSynchronize(stream_));
  std::vector<float> share;
  std::vector<bf16> staging;
  for (const optim::DeviceParameter& tensor : layout_.parameters) {
    const TensorView& view = host[tensor.name];
    FP8T_CHECK(view.dtype() == DType::F32, "expected f32 parameters, '{}' is {}", tensor.name,
               dtype_name(view.dtype()));
    const float* values = view.data<float>();
    if (tensor.split != TensorSplit::None) {
      share = optim::host_share(layout_, tensor, values);
      values = share.data();
    }
    if (tensor.bf16) {
      staging.resize(static_cast<size_t>(tensor.numel));
      std::transform(values, values + tensor.numel, staging.begin(), float_to_bf16);
      FP8T_CUDA_CHECK(cudaMemcpy(bf16_parameters_ + (tensor.offset - layout_.bf16_offset),
                                 staging.data(), staging.size() * sizeof(bf16),
                                 cudaMemcpyHostToDevice));
    } else {
      FP8T_CUDA_CHECK(cudaMemcpy(parameters_ + tensor.offset, values,
                                 size_t(tensor.numel) * sizeof(float), cudaMemcpyHostToDevice));
    }
  }
  weights_ready_ = false;
}

void CudaGptModel::download_parameters(ParameterSet& host) const {
  download(parameters_, bf16_parameters_, host);
}

void CudaGptModel::download_gradients(ParameterSet& host) const {
  download(gradients_, nullptr, host);
}

void CudaGptModel::download(const float* base, const bf16* bf16_base, ParameterSet& host) const {
  FP8T_CUDA_CHECK(cudaStreamSynchronize(stream_));
  int64_t largest_whole = 0;
  for (const optim::DeviceParameter& tensor : layout_.parameters)
    if (tensor.split != TensorSplit::None)
      largest_whole = std::max(largest_whole, tensor.whole_numel());
  const ShareStaging staging(size_t(largest_whole) * sizeof(float));
  std::vector<bf16> values;
  for (const optim::DeviceParameter& tensor : layout_.parameters) {
    TensorView& view = host[tensor.name];
    const bool in_bf16 = bf16_base != nullptr && tensor.bf16;
    const bool split = tensor.split != TensorSplit::None;
    if (in_bf16) {
      const bf16* device = bf16_base + (tensor.offset - layout_.bf16_offset);
      values.resize(static_cast<size_t>(view.numel()));
      if (split) {
        gather_share(share_blocks(layout_, tensor), device, staging.as<bf16>(),
                     tensor_parallel_.sum_bf16, values.data(), stream_);
      } else {
        FP8T_CUDA_CHECK(cudaMemcpy(values.data(), device, values.size() * sizeof(bf16),
                                   cudaMemcpyDeviceToHost));
      }
      std::ranges::transform(values, view.data<float>(), bf16_to_float);
    } else if (split) {
      gather_share(share_blocks(layout_, tensor), base + tensor.offset, staging.as<float>(),
                   tensor_parallel_.sum, view.data<float>(), stream_);
    } else {
      FP8T_CUDA_CHECK(
          cudaMemcpy(view.raw(), base + tensor.offset, view.bytes(), cudaMemcpyDeviceToHost));
    }
  }
}

void CudaGptModel::zero_gradients() {
  FP8T_CUDA_CHECK(cudaMemsetAsync(gradients_, 0, layout_.total_bytes(), stream_));
}

double CudaGptModel::loss_value() {
  float loss = 0.0f;
  FP8T_CUDA_CHECK(cudaMemcpyAsync(&loss, loss_, sizeof loss, cudaMemcpyDeviceToHost, stream_));
  FP8T_CUDA_CHECK(cudaStreamSynchronize(stream_));
  return loss;
}

void CudaGptModel::prepare_weights() {
  // Recorded in evaluation passes too: the next training forward uses this cast.
  std::vector<kernels::CudaLinear::WeightToPrepare> weights;
  for (auto& [name, linear] : buffers_->linears)
    weights.push_back({linear.layer.get(), weight(linear)});
  kernels::CudaLinear::prepare_weights(weights, stream_);
  weights_ready_ = true;
}

void CudaGptModel::end_step() {
  weights_ready_ = false;
  CudaLinearScalings& scalings = buffers_->scalings;
  keep_cuda_fp8_health(buffers_->linears, scalings, fp8_health_, stream_);
  scalings.end_step(stream_, tensor_parallel_);
}

void CudaGptModel::set_record_fp8_health(bool record) {
  record_cuda_fp8_health(buffers_->linears, buffers_->scalings, fp8_health_, record, stream_);
}

std::vector<Fp8TensorHealth> CudaGptModel::take_fp8_health() {
  return take_cuda_fp8_health(buffers_->linears, buffers_->scalings, fp8_health_, stream_);
}

CudaLinearScalings& CudaGptModel::scalings() {
  return buffers_->scalings;
}

void CudaGptModel::scalings_changed() {
  buffers_->scalings.scalings_changed(stream_);
}

std::vector<std::pair<std::string, DelayedScaling*>> CudaGptModel::delayed_scalings() {
  return buffers_->scalings.delayed_scalings();
}

const bf16* CudaGptModel::previous_output(int index) const {
  return index > 0 ? buffers_->layers[static_cast<size_t>(index - 1)].output : buffers_->x0;
}

const bf16* CudaGptModel::gather_rows(const bf16* own) {
  if (!sequence_) return own;
  tensor_parallel_.all_gather_bf16(own, buffers_->whole,
                                   static_cast<size_t>(rows_ * config_.n_embd), stream_);
  return buffers_->whole;
}

bf16* CudaGptModel::partial_rows(bf16* own) const {
  return sequence_ ? buffers_->whole : own;
}

const bf16* CudaGptModel::sum_rows(bf16* partial, bf16* own) {
  if (!sequence_) {
    tensor_parallel_.sum_partials(partial, rows_ * config_.n_embd, stream_);
    return partial;
  }
  tensor_parallel_.reduce_scatter_bf16(partial, own, static_cast<size_t>(rows_ * config_.n_embd),
                                       stream_);
  return own;
}

void CudaGptModel::sum_partial_rows(bf16* own, const bf16* residual) {
  sum_rows(partial_rows(own), own);
  if (sequence_) kernels::add_forward(own, own, residual, rows_ * config_.n_embd, stream_);
}

void CudaGptModel::block_forward(int index, bool record) {
  const int64_t B = batch_, T = seq_, N = tokens_, R = rows_, C = config_.n_embd;
  const int64_t H = heads_, Hkv = kv_heads_, D = config_.head_dim();
  const int rank = tensor_parallel_.rank;
  const int64_t vocab = config_.padded_vocab();
  Buffers& b = *buffers_;
  cudaStream_t s = stream_;
  const kernels::RotaryShape q_shape{B, T, H, D}, k_shape{B, T, Hkv, D};
  const bf16* previous = previous_output(index);
  Layer& layer = b.layers[static_cast<size_t>(index)];
  const std::string prefix = fmt::format("transformer.h.{}.", index);
  // A norm casts for the linear after it unless that linear reads the group's rows.
  const auto input_cast = [&](kernels::CudaLinear& next) {
    return sequence_ ? kernels::FusedCast{} : next.fused_input_cast(record, s);
  };
  kernels::residual_mix_forward(b.input, previous, b.x0, parameter("resid_lambdas") + index,
                                parameter("x0_lambdas") + index, R * C, s);
  kernels::CudaLinear& c_q = *linear(prefix + "attn.c_q").layer;
  kernels::rmsnorm_forward(layer.attn_norm, layer.attn_rstd, b.input, R, C, kEps, s,
                           input_cast(c_q));
  const bf16* attn_norm = gather_rows(layer.attn_norm);
  c_q.forward(attn_norm, N, b.q_lin, record, s);
  linear(prefix + "attn.c_k").layer->forward(attn_norm, N, b.k_lin, record, s);
  linear(prefix + "attn.c_v").layer->forward(attn_norm, N, layer.v, record, s);
  if (config_.has_value_embedding(index)) {  // this rank's kv heads' columns and gates
    kernels::embedding_forward(b.value_embed, b.idx,
                               embedding_table(fmt::format("value_embeds.{}.weight", index)), N,
                               vocab, Hkv * D, s);
    kernels::value_gate_forward(layer.v, layer.value_gate, attn_norm, b.value_embed,
                                parameter(prefix + "attn.ve_gate.weight"),
                                {N, C, Hkv, D, kValueGateChannels}, s);
  }
  kernels::rotary_rmsnorm_forward(layer.q, layer.q_rstd, b.q_lin, b.rotary_cos, b.rotary_sin,
                                  q_shape, kEps, s);
  kernels::rotary_rmsnorm_forward(layer.k, layer.k_rstd, b.k_lin, b.rotary_cos, b.rotary_sin,
                                  k_shape, kEps, s);
  const ops::AttentionShape shape{B, T, H, Hkv, D, config_.window(index)};
  if (b.fp8_attention) {
    b.fp8_attention->forward(layer.attn_out, layer.stats, layer.q, layer.k, layer.v,
                             layer.fp8_attention, shape, config_.attention_scale(), s);
  } else {
    b.attention.forward(layer.attn_out, layer.stats, layer.q, layer.k, layer.v, shape,
                        config_.attention_scale(), s);
  }
  // The residual adds happen in the projections' GEMM epilogues (under tensor parallelism the
  // first rank's, before the partial outputs are summed; under sequence parallelism each rank
  // adds its rows' after the reduce-scatter).
  const auto residual = [&](const bf16* x) { return rank == 0 && !sequence_ ? x : nullptr; };
  linear(prefix + "attn.c_proj")
      .layer->forward(layer.attn_out, N, partial_rows(b.mid), record, s, residual(b.input));
  sum_partial_rows(b.mid, b.input);
  kernels::CudaLinear& c_fc = *linear(prefix + "mlp.c_fc").layer;
  kernels::rmsnorm_forward(layer.mlp_norm, layer.mlp_rstd, b.mid, R, C, kEps, s, input_cast(c_fc));
  c_fc.forward(gather_rows(layer.mlp_norm), N, layer.fc, record, s);
  kernels::CudaLinear& mlp_proj = *linear(prefix + "mlp.c_proj").layer;
  mlp_proj.forward(mlp_activation(layer.fc, mlp_proj), N, partial_rows(layer.output), record, s,
                   residual(b.mid));
  sum_partial_rows(layer.output, b.mid);
}

void CudaGptModel::forward(const int32_t* idx, const int32_t* targets, bool with_gradient) {
  const int64_t B = batch_, T = seq_, N = tokens_, R = rows_, C = config_.n_embd;
  const int64_t vocab = config_.padded_vocab();
  Buffers& b = *buffers_;
  check_tokens(config_, idx, targets, N);
  // The previous copy out of the pinned buffers must be done before they are refilled.
  FP8T_CUDA_CHECK(cudaEventSynchronize(b.ids_copied));
  std::memcpy(b.idx_host.data, idx, size_t(N) * sizeof(int32_t));
  std::memcpy(b.targets_host.data, targets, size_t(N) * sizeof(int32_t));
  FP8T_CUDA_CHECK(cudaMemcpyAsync(b.idx, b.idx_host.data, size_t(N) * sizeof(int32_t),
                                  cudaMemcpyHostToDevice, stream_));
  FP8T_CUDA_CHECK(cudaMemcpyAsync(b.targets, b.targets_host.data, size_t(N) * sizeof(int32_t),
                                  cudaMemcpyHostToDevice, stream_));
  FP8T_CUDA_CHECK(cudaEventRecord(b.ids_copied, stream_));
  if (!weights_ready_) prepare_weights();

  const bool record = training_;
  cudaStream_t s = stream_;
  // The embedding, its norm and the smear (which mixes each token with the one before) run on
  // every row; under sequence parallelism this rank keeps its rows of x0.
  bf16* every_row = sequence_ ? b.whole : b.input;
  kernels::embedding_forward(every_row, b.idx, embedding_table("transformer.wte.weight"), N, vocab,
                             C, s);
  kernels::rmsnorm_forward(b.embedding_norm, b.embedding_rstd, every_row, N, C, kEps, s);
  kernels::smear_forward(sequence_ ? b.whole : b.x0, b.smear_gate, b.embedding_norm,
                         parameter("smear_gate.weight"), parameter("smear_lambda"),
                         {B, T, C, kSmearGateChannels}, s);
  if (sequence_) {
    FP8T_CUDA_CHECK(cudaMemcpyAsync(b.x0, b.whole + first_row_ * C, sizeof(bf16) * size_t(R * C),
                                    cudaMemcpyDeviceToDevice, s));
  }
  for (int index = 0; index < config_.n_layer; ++index)
    block_forward(index, record);
  const bf16* previous = previous_output(config_.n_layer);
  const Layer& backout = b.layers[static_cast<size_t>(config_.backout_layer())];
  kernels::backout_forward(b.input, previous, backout.output, parameter("backout_lambda"), R * C,
                           s);
  kernels::CudaLinear& lm_head = *linear("lm_head").layer;
  kernels::rmsnorm_forward(b.final_norm, b.final_rstd, b.input, R, C, kEps, s,
                           lm_head.fused_input_cast(record, s));
  lm_head.forward(b.final_norm, R, b.logits, record, s);
  // Under sequence parallelism each rank's mean over its rows, weighted by its share of the
  // counted rows and summed over the group: the mean over every row, and its gradient.
  float share = 1.0f;
  if (sequence_) {
    const auto counted = [](const int32_t* first, int64_t count) {
      return std::count_if(first, first + count, [](int32_t t) { return t != ops::kIgnoreTarget; });
    };
    const int64_t all = counted(targets, N);
    share = all > 0 ? float(counted(targets + first_row_, R)) / float(all) : 0.0f;
  }
  const int32_t* own_targets = b.targets + first_row_;
  if (with_gradient) {
    kernels::softcap_cross_entropy_with_gradient(b.logits, own_targets, R, config_.vocab_size,
                                                 vocab, kSoftcap, share, b.row_losses, loss_,
                                                 b.valid_rows, s);
  } else {
    kernels::softcap_cross_entropy_forward(b.logits, own_targets, R, config_.vocab_size, vocab,
                                           kSoftcap, b.row_losses, loss_, b.valid_rows, s);
  }
  if (sequence_) {
    kernels::scale_f32(loss_, share, 1, s);
    tensor_parallel_.sum(loss_, 1, s);
  }
  b.forward_has_gradient = with_gradient;
}

void CudaGptModel::plan_gradient_ranges() {
  std::map<std::string, const ParamSpec*> spec_of;
  const std::vector<ParamSpec> specs = gpt_parameters(config_);
  for (const ParamSpec& spec : specs)
    spec_of[spec.name] = &spec;
  gradient_ranges_.assign(static_cast<size_t>(config_.n_layer + 2), {});
  split_gradient_ranges_.clear();
  replicated_gradient_ranges_.clear();
  const auto& parameters = layout_.parameters;
  for (size_t i = 0; i < parameters.size(); ++i) {
    const optim::DeviceParameterLayout::Range range = layout_.padded_range(i);
    const ParamSpec& spec = *spec_of.at(parameters[i].name);
    optim::append_range(
        gradient_ranges_[static_cast<size_t>(backward_gradient_group(spec, config_.n_layer))],
        range);
    // Under sequence parallelism lm_head and the residual mixes' scalars take their gradients
    // from this rank's rows; the split tensors' shares have theirs whole.
    if (!tensor_parallel_.split() || parameters[i].split != TensorSplit::None) continue;
    optim::append_range(sequence_ && gpt_sequence_split_gradient(spec)
                            ? split_gradient_ranges_
                            : replicated_gradient_ranges_,
                        range);
  }
}

void CudaGptModel::gather_split_gradients() {
  if (!tensor_parallel_.split()) return;
  // Every rank computes the replicated tensors' gradients from the same values, but its sums
  // may round differently (the embedding's atomics, autotuned GEMM algorithms): the first
  // rank's, zeros elsewhere summed, so that their copies cannot drift apart.
  if (tensor_parallel_.rank != 0) {
    for (const auto& [offset, count] : replicated_gradient_ranges_) {
      FP8T_CUDA_CHECK(
          cudaMemsetAsync(gradients_ + offset, 0, size_t(count) * sizeof(float), stream_));
    }
  }
  tensor_parallel_.sum_ranges(gradients_, replicated_gradient_ranges_, stream_);
  tensor_parallel_.sum_ranges(gradients_, split_gradient_ranges_, stream_);
}

void CudaGptModel::report_gradients(size_t group) const {
  if (!gradients_ready_) return;
  for (const auto& [offset, count] : gradient_ranges_[group])
    gradients_ready_(offset, count);
}

void CudaGptModel::backward() {
  const int64_t B = batch_, T = seq_, N = tokens_, R = rows_, C = config_.n_embd;
  const int64_t H = heads_, Hkv = kv_heads_, D = config_.head_dim();
  const int64_t vocab = config_.padded_vocab();
  Buffers& b = *buffers_;
  FP8T_CHECK(b.forward_has_gradient, "backward() needs a forward with the gradient first");
  b.forward_has_gradient = false;
  const bool record = training_;
  cudaStream_t s = stream_;

  // The logits hold their gradient (the fused cross-entropy wrote it).
  linear("lm_head").layer->backward(b.logits, b.final_norm, R, b.dnorm, false,
                                    gradient("lm_head.weight"), record, s);
  report_gradients(0);
  kernels::rmsnorm_backward(b.dres_next, b.dnorm, b.final_norm, b.final_rstd, R, C,
                            GradStore::Write, s);  // d final_input
  // final_input = output - backout_lambda * backout layer's output: d output of the last
  // block, and the share of the backout layer's output, added when the loop reaches it.
  const int backout_layer = config_.backout_layer();
  kernels::backout_backward(b.dres, b.dbackout, gradient("backout_lambda"), b.dres_next,
                            b.layers[static_cast<size_t>(backout_layer)].output,
                            parameter("backout_lambda"), R * C, GradStore::Write, GradStore::Write,
                            b.reduction, s);
  const kernels::RotaryShape q_shape{B, T, H, D}, k_shape{B, T, Hkv, D};
  bool dx0_written = false;
  for (int index = config_.n_layer - 1; index >= 0; --index) {
    if (const int group = recompute_group_ending_at(recompute_groups_, index); group >= 0) {
      // The group's forward again, neither recording amaxes nor counting FP8 health twice.
      const RecomputeGroup& rerun = recompute_groups_[static_cast<size_t>(group)];
      pause_cuda_fp8_health(b.linears, fp8_health_, true);
      for (int block = rerun.first; block < rerun.end; ++block)
        block_forward(block, false);
      pause_cuda_fp8_health(b.linears, fp8_health_, false);
    }
    Layer& layer = b.layers[static_cast<size_t>(index)];
    const std::string prefix = fmt::format("transformer.h.{}.", index);
    if (index == backout_layer) kernels::add_forward(b.dres, b.dres, b.dbackout, R * C, s);

    // MLP: output = mid + c_proj(relu²(c_fc(norm(mid))))
    Linear& mlp_proj = linear(prefix + "mlp.c_proj");
    const Linear& mlp_fc = linear(prefix + "mlp.c_fc");
    kernels::CudaLinear& c_fc = *mlp_fc.layer;
    float* c_fc_gradient = weight_gradient(mlp_fc);
    if (c_fc.casts_reader_input_t(*mlp_proj.layer, N)) {
      // c_fc's gradient cast, which reads fc anyway, casts c_proj's x̂ᵗ too; c_proj's weight
      // gradient waits for it.
      mlp_proj.layer->backward_leaving_wgrad(gather_rows(b.dres), N, b.dfc_act, record, s);
      c_fc.backward(b.dfc_act, gather_rows(layer.mlp_norm), N, b.dnorm, false, c_fc_gradient,
                    record, s, layer.fc, {mlp_proj.layer.get(), weight_gradient(mlp_proj)});
    } else {
      mlp_proj.layer->backward(gather_rows(b.dres), mlp_activation(layer.fc, *mlp_proj.layer), N,
                               b.dfc_act, false, weight_gradient(mlp_proj), record, s);
      const bf16* mlp_norm = gather_rows(layer.mlp_norm);
      if (c_fc.output_relu2()) {  // its gradient cast reads d relu²(fc) and fc
        c_fc.backward(b.dfc_act, mlp_norm, N, b.dnorm, false, c_fc_gradient, record, s, layer.fc);
      } else {
        kernels::relu2_backward(b.fc_act, b.dfc_act, layer.fc, N * hidden_, GradStore::Write, s);
        c_fc.backward(b.fc_act, mlp_norm, N, b.dnorm, false, c_fc_gradient, record, s);
      }
    }
    kernels::rmsnorm_backward(b.dres, sum_rows(b.dnorm, buffers_->dnorm_own), layer.mlp_norm,
                              layer.mlp_rstd, R, C, GradStore::Add, s);  // dres: d mid

    // Attention: mid = input + c_proj(attention(q, k, v))
    const ops::AttentionShape shape{B, T, H, Hkv, D, config_.window(index)};
    if (b.fp8_attention)
      b.fp8_attention->read_output(layer.attn_out, layer.fp8_attention, shape, s);
    const Linear& attn_proj = linear(prefix + "attn.c_proj");
    attn_proj.layer->backward(gather_rows(b.dres), layer.attn_out, N, b.dattn_out, false,
                              weight_gradient(attn_proj), record, s);
    if (b.fp8_attention) {
      b.fp8_attention->backward(b.dq, b.dk, b.dv, b.dattn_out, layer.fp8_attention, layer.stats,
                                b.fp8_attention_scratch, shape, config_.attention_scale(), s);
    } else {
      b.attention.backward(b.dq, b.dk, b.dv, b.dattn_out, layer.q, layer.k, layer.v, layer.attn_out,
                           layer.stats, shape, config_.attention_scale(), s);
    }
    // q's and k's gradients through their norm and rotary, each made just before its
    // projection's backward: cast straight into the projection's dŷ and dŷᵗ where it takes that
    // cast (its dy null), else stored in bf16 for it, in dattn_out, which the attention's
    // backward has read. v's gradient is the attention's own.
    struct Projection {
      const char* name;
      bf16* dlin;  // the gradient before the norm and rotary (null for v)
      const bf16* dout;
      const bf16* out;
      const float* rstd;
      kernels::RotaryShape shape;
    };
    const std::array<Projection, 3> projections = {
        {{"attn.c_q", b.dattn_out, b.dq, layer.q, layer.q_rstd, q_shape},
         {"attn.c_k", b.dattn_out, b.dk, layer.k, layer.k_rstd, k_shape},
         {"attn.c_v", nullptr, b.dv, nullptr, nullptr, k_shape}}};
    const bf16* attn_norm = gather_rows(layer.attn_norm);
    for (const Projection& p : projections) {
      const Linear& projection = linear(prefix + p.name);
      const bf16* dy = p.dlin != nullptr ? p.dlin : p.dout;
      if (p.dlin != nullptr) {
        std::optional<fp8t::cuda::BlockCastOutput> cast;
        if (D == kernels::kRotaryCastHeadDim) cast = projection.layer->fused_grad_output_cast(N);
        if (cast) {
          kernels::rotary_rmsnorm_backward_cast(p.dout, p.out, p.rstd, b.rotary_cos, b.rotary_sin,
                                                p.shape, *cast, s);
          dy = nullptr;
        } else {
          kernels::rotary_rmsnorm_backward(p.dlin, p.dout, p.out, p.rstd, b.rotary_cos,
                                           b.rotary_sin, p.shape, GradStore::Write, s);
        }
      }
      projection.layer->backward(dy, attn_norm, N, b.dnorm, &p != projections.data(),
                                 weight_gradient(projection), record, s);
    }
    if (config_.has_value_embedding(index)) {  // this rank's kv heads' columns and gates
      const std::string table = fmt::format("value_embeds.{}.weight", index);
      kernels::embedding_forward(b.value_embed, b.idx, embedding_table(table), N, vocab, Hkv * D,
                                 s);
      kernels::value_gate_backward(b.dnorm, gradient(prefix + "attn.ve_gate.weight"),
                                   b.dvalue_embed, b.dv, attn_norm, b.value_embed,
                                   parameter(prefix + "attn.ve_gate.weight"), layer.value_gate,
                                   {N, C, Hkv, D, kValueGateChannels}, b.reduction, s);
      kernels::embedding_backward(gradient(table), b.dvalue_embed, b.idx, N, vocab, Hkv * D, s);
    }
    kernels::rmsnorm_backward(b.dres, sum_rows(b.dnorm, buffers_->dnorm_own), layer.attn_norm,
                              layer.attn_rstd, R, C, GradStore::Add, s);  // dres: d input

    // input = resid_lambda * previous + x0_lambda * x0; the first block's previous is x0.
    const bf16* previous = previous_output(index);
    kernels::residual_mix_backward(
        b.dres_next, b.dx0, gradient("resid_lambdas") + index, gradient("x0_lambdas") + index,
        b.dres, previous, b.x0, parameter("resid_lambdas") + index, parameter("x0_lambdas") + index,
        R * C, GradStore::Write, dx0_written ? GradStore::Add : GradStore::Write, b.reduction, s);
    dx0_written = true;
    std::swap(b.dres, b.dres_next);
    report_gradients(static_cast<size_t>(1 + (config_.n_layer - 1 - index)));
  }
  kernels::add_forward(b.dx0, b.dx0, b.dres, R * C, s);

  // The smear and the embedding ran on every row: their gradients from every row's d x0.
  kernels::smear_backward(b.dnorm, gradient("smear_gate.weight"), gradient("smear_lambda"),
                          gather_rows(b.dx0), b.embedding_norm, b.smear_gate,
                          parameter("smear_gate.weight"), parameter("smear_lambda"),
                          {B, T, C, kSmearGateChannels}, GradStore::Write, b.reduction, s);
  bf16* dembedding = sequence_ ? b.whole : b.dres;  // of every row
  kernels::rmsnorm_backward(dembedding, b.dnorm, b.embedding_norm, b.embedding_rstd, N, C,
                            GradStore::Write, s);
  kernels::embedding_backward(gradient("transformer.wte.weight"), dembedding, b.idx, N, vocab, C,
                              s);
  report_gradients(static_cast<size_t>(1 + config_.n_layer));
}

}  // namespace fp8t

#endif  // FP8TRAIN_WITH_CUDA
