#if FP8TRAIN_WITH_CUDA

#include "models/cuda/flux_model_cuda.h"

#include <algorithm>
#include <cmath>
#include <map>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <fmt/format.h>

#include "core/cuda_check.h"
#include "core/cuda_resources.h"
#include "core/device_arena.h"
#include "core/error.h"
#include "core/parallel_runs.h"
#include "gemm/cublaslt_gemm.h"
#include "models/cuda/linear_scalings.h"
#include "models/cuda/share_transfer.h"
#include "models/tensor_parallel.h"
#include "ops/cuda/attention_cudnn.h"
#include "ops/cuda/attention_fp8_cuda.h"
#include "ops/cuda/flux_ops.h"
#include "ops/cuda/gpt_gates.h"
#include "ops/cuda/linear_cuda.h"
#include "ops/cuda/ops_cuda.h"
#include "ops/flux_rope.h"
#include "ops/timestep.h"

namespace fp8t {

namespace kernels = ops::cuda;
using kernels::GradStore;

namespace {

// Copies rows rows of width values from src (row stride src_ld) to dst (row stride dst_ld).
void copy_rows(bf16* dst, int64_t dst_ld, const bf16* src, int64_t src_ld, int64_t rows,
               int64_t width, cudaStream_t stream, float* amax = nullptr) {
  kernels::copy_rows({dst, dst_ld, rows}, {src, src_ld, rows}, 1, rows, width, stream, amax);
}

}  // namespace

// Where a linear's weight and bias and their gradients are: this rank's share of them (the whole
// tensors when it is not split).
struct CudaFluxModel::Linear {
  std::unique_ptr<kernels::CudaLinear> layer;
  float* weight = nullptr;
  float* bias = nullptr;  // null: none on this rank (a row-parallel bias is the first rank's)
  float* grad_weight = nullptr;
  float* grad_bias = nullptr;
  int fp8_index = -1;  // its CudaLinearScalings index; -1 outside FP8
};

// The joint attention of a block over [txt; img]: [B·L, A] = [B, L, H, D] unless noted, A this
// rank's attention width (C without tensor parallelism).
struct CudaFluxModel::AttentionSaved {
  bf16 *q = nullptr, *k = nullptr, *v = nullptr;  // the attention's inputs
  bf16 *q_normed = nullptr, *k_normed = nullptr;  // before the scale and the rotation
  float *q_rstd = nullptr, *k_rstd = nullptr;     // [B·L·H]
  bf16* out = nullptr;
  float* stats = nullptr;          // [B, H, L]
  kernels::Fp8AttentionSaved fp8;  // fp8_dot_product_attention
};

// One stream of a double block: [B·L_s, ·] (attn, mlp_hidden, mlp_act), [B·O_s, ·] this rank's
// tokens (the rest; O_s = L_s without sequence parallelism).
struct CudaFluxModel::Stream {
  bf16* mod = nullptr;  // [B, 6C]: shift1, scale1, gate1, shift2, scale2, gate2
  bf16 *norm1 = nullptr, *modulated1 = nullptr;
  float* rstd1 = nullptr;
  bf16 *attn = nullptr, *proj = nullptr;
  bf16 *norm2 = nullptr, *modulated2 = nullptr;
  float* rstd2 = nullptr;
  bf16 *mlp_hidden = nullptr, *mlp_act = nullptr, *mlp_out = nullptr;
};

struct CudaFluxModel::DoubleBlock {
  Stream img, txt;
  AttentionSaved attention;
};

struct CudaFluxModel::SingleBlock {
  bf16* mod = nullptr;                           // [B, 3C]: shift, scale, gate
  bf16 *normed = nullptr, *modulated = nullptr;  // [B·O, C]: this rank's tokens
  float* rstd = nullptr;
  bf16* linear1_out = nullptr;  // [B·L, 3C + M]: qkv, then the MLP's input
  AttentionSaved attention;
  bf16* linear2_in = nullptr;  // [B·L, C + M]: the attention output, then GELU(mlp)
  bf16* out = nullptr;         // [B·O, C] linear2's output: the gated branch
};

struct CudaFluxModel::Buffers {
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
  std::vector<float> ids;  // the image ids the RoPE tables were made from

  // Saved: inputs, embedders (0 time_in, 1 vector_in, 2 guidance_in), blocks, final layer.
  bf16 *img = nullptr, *txt = nullptr;
  bf16* embed_input[3] = {};
  bf16* embed_hidden[3] = {};
  bf16* embed_act[3] = {};
  bf16 *vec = nullptr, *vec_act = nullptr;
  bf16 *shared_mlp_act = nullptr, *shared_linear2_in = nullptr;  // selective recompute
  std::vector<DoubleBlock> doubles;
  std::vector<SingleBlock> singles;
  // Full recompute: per group, its input saved by the forward (the img and txt streams of a
  // group of double blocks; the joint sequence of a group of single blocks).
  std::vector<std::pair<bf16*, bf16*>> double_group_inputs;
  std::vector<bf16*> single_group_inputs;
  bf16 *final_mod = nullptr, *final_normed = nullptr, *final_modulated = nullptr;
  float* final_rstd = nullptr;
  bf16* prediction = nullptr;

  // Workspace.
  float *img_f32 = nullptr, *txt_f32 = nullptr, *y_f32 = nullptr, *target = nullptr;
  float* sinusoid_f32[2] = {};  // of the timesteps and of the guidance
  float *rope_cos = nullptr, *rope_sin = nullptr;
  float* loss = nullptr;
  float* reduction = nullptr;
  bf16 *x_img = nullptr, *x_txt = nullptr, *x_joint = nullptr, *embedding = nullptr;
  bf16* qkv = nullptr;  // a double-block stream's qkv output
  bf16 *d_img = nullptr, *d_txt = nullptr, *d_joint = nullptr, *dpred = nullptr;
  float *dmod_img = nullptr, *dmod_txt = nullptr;  // [B, 6C]
  // [B, 6C] for the modulation linears; in the forward, a split modulation's outputs.
  bf16* dmod = nullptr;
  bf16 *d_vec_act = nullptr, *d_vec = nullptr, *d_embed_act = nullptr, *d_embed_hidden = nullptr;
  // d_branch also holds a split modulation's share of dmod.
  bf16 *d_branch = nullptr, *d_modulated = nullptr, *d_attn = nullptr;
  bf16 *dq = nullptr, *dk = nullptr, *dv = nullptr;
  bf16 *d_mlp_act = nullptr, *d_mlp_hidden = nullptr, *d_qkv = nullptr;
  bf16 *d_linear1_out = nullptr, *d_linear2_in = nullptr;
  // Sequence parallelism: the all-gathers' and reduce-scatters' [T, B·O_s, width], a stream's
  // every token (a gathered input or output gradient, a row-parallel partial output; and the
  // inputs' conversion to bf16), a summed input gradient's own tokens, and the final layer's
  // output and gradient on this rank's image tokens.
  bf16 *sequence_staging = nullptr, *whole = nullptr, *d_own = nullptr, *own_prediction = nullptr;
  bool forward_has_gradient = false;

  // The host inputs of a micro-batch go through pinned memory: fast copies, and no wait for
  // them, only, before the next refill, for the copies out of it (staging_free).
  PinnedFloats staging;
  cudaEvent_t staging_free = nullptr;

  Buffers(const ModelPrecision& precision, size_t staging_floats)
      : scalings(precision.fp8, precision.family), staging(staging_floats) {
    FP8T_CUDA_CHECK(cudaEventCreateWithFlags(&staging_free, cudaEventDisableTiming));
  }
  ~Buffers() { cudaEventDestroy(staging_free); }
  Buffers(const Buffers&) = delete;
  Buffers& operator=(const Buffers&) = delete;
};

CudaFluxModel::CudaFluxModel(const FluxConfig& config, int64_t batch, int64_t img_tokens,
                             int64_t txt_tokens, const FluxPrecision& precision,
                             cudaStream_t stream, const RecomputeOptions& recompute,
                             const DeviceTensorParallel& tensor_parallel)
    : config_(config),
      batch_(batch),
      img_tokens_(img_tokens),
      txt_tokens_(txt_tokens),
      tokens_(img_tokens + txt_tokens),
      precision_(precision),
      tensor_parallel_(tensor_parallel),
      stream_(stream),
      recompute_(flux_recompute_groups(recompute, config.double_blocks, config.single_blocks)),
      selective_(recompute.granularity == RecomputeGranularity::Selective) {
  config_.validate();
  const int group_size = tensor_parallel_.size;
  check_flux_tensor_parallel(config_, group_size);
  check_device_group(tensor_parallel_, precision_.fp8_attention);
  sequence_ = tensor_parallel_.sequence;
  if (sequence_) check_flux_sequence_parallel(group_size, img_tokens, txt_tokens);
  own_img_ = sequence_ ? img_tokens / group_size : img_tokens;
  own_txt_ = sequence_ ? txt_tokens / group_size : txt_tokens;
  own_tokens_ = own_img_ + own_txt_;
  attention_width_ = config_.hidden_size / group_size;
  heads_ = config_.num_heads / group_size;
  mlp_hidden_ = config_.mlp_hidden() / group_size;
  if ((!recompute_.doubles.empty() || !recompute_.singles.empty()) && precision_.fp8_attention) {
    throw ConfigError(
        "recompute_granularity: full does not combine with fp8_dot_product_attention on the GPU "
        "path (a rerun of the FP8 attention's forward would change the scales its backward "
        "reads); use one of the two");
  }
  FP8T_CHECK(batch >= 1 && img_tokens >= 1 && txt_tokens >= 1,
             "expected a batch, image and text tokens of at least 1, found {}, {}, {}", batch,
             img_tokens, txt_tokens);
  FP8T_CHECK((batch * img_tokens) % 16 == 0 && (batch * txt_tokens) % 16 == 0,
             "the GPU Flux needs batch x image tokens and batch x text tokens to be multiples of "
             "16, found {} x {} and {} x {}",
             batch, img_tokens, batch, txt_tokens);
  // img and target, txt, y and the two sinusoids.
  const int64_t staging_floats =
      batch * (2 * img_tokens * config_.in_channels + txt_tokens * config_.context_in_dim +
               config_.vec_in_dim + 2 * config_.timestep_dim());
  buffers_ = std::make_unique<Buffers>(precision_, static_cast<size_t>(staging_floats));
  linear_precision_ = decide_flux_precision(config_, precision_.policy);
  keep_unblocked_flux_shares_in_bf16(linear_precision_, config_, precision_.fp8.recipe, group_size);
  const FluxRankParameters rank_parameters =
      flux_rank_parameters(config_, group_size, tensor_parallel_.rank);
  layout_ = optim::device_parameter_layout(rank_parameters.parameters);
  share_elements_ = rank_parameters.shares == layout_.parameters.size()
                        ? layout_.total_elements
                        : layout_.parameters[rank_parameters.shares].offset;
  lay_out();
  for (DeviceArena* arena : {&buffers_->parameters, &buffers_->gradients, &buffers_->activations,
                             &buffers_->workspace, &buffers_->linear_scratch}) {
    arena->allocate_planned();
  }
  lay_out();
  memory_.parameters = buffers_->parameters.bytes();
  memory_.gradients = buffers_->gradients.bytes();
  memory_.activations = buffers_->activations.bytes();
  memory_.workspace = buffers_->workspace.bytes();
  memory_.linear_copies = buffers_->linear_scratch.bytes();
  buffers_->scalings.initialize();
  if (precision_.fp8_attention) {
    buffers_->fp8_attention = std::make_unique<kernels::CudaFp8Attention>(
        buffers_->attention, attention_fp8_formats(precision_));
    const auto zero_floats = [&](const AttentionSaved& a) {
      FP8T_CUDA_CHECK(
          cudaMemsetAsync(a.fp8.floats, 0, sizeof(float) * kernels::kAttentionFp8Floats, stream_));
    };
    for (const DoubleBlock& block : buffers_->doubles)
      zero_floats(block.attention);
    for (const SingleBlock& block : buffers_->singles)
      zero_floats(block.attention);
  }

  const int64_t B = batch_;
  int fp8_index = 0;
  for (const FluxLinearPrecision& decision : linear_precision_) {
    const FluxLinear& spec = decision.linear;
    const int64_t rows = sequence_ && flux_reads_own_tokens(spec.name)
                             ? flux_linear_rows(spec, B, own_img_, own_txt_)
                             : flux_linear_rows(spec, B, img_tokens_, txt_tokens_);
    const TensorShare share = flux_tensor_share(spec, config_, group_size, tensor_parallel_.rank);
    const TensorSplit split = share.split;
    Linear linear;
    linear.weight = parameter(spec.name + ".weight");
    linear.bias = parameter(spec.name + ".bias");
    linear.grad_weight = gradient(spec.name + ".weight");
    linear.grad_bias = gradient(spec.name + ".bias");
    kernels::LinearSetup setup;
    std::tie(setup.in_features, setup.out_features) =
        share.features(spec.in_features, spec.out_features);
    if (split == TensorSplit::Inputs && tensor_parallel_.rank != 0) {
      linear.bias = nullptr;  // the sum over the group adds the first rank's
      linear.grad_bias = nullptr;
    }
    if (split != TensorSplit::None) {
      // Column-parallel: the weight and the output gradient are shares, the input is whole;
      // row-parallel: the input and the weight are shares.
      const bool outputs = split == TensorSplit::Outputs;
      setup.split_roles = {!outputs, true, outputs};
      setup.group_max = [this](float* amax, cudaStream_t amax_stream) {
        tensor_parallel_.max(amax, 1, amax_stream);
      };
    }
    setup.max_tokens = rows;
    setup.bias = linear.bias != nullptr;
    setup.fp8 = decision.fp8;
    setup.fp8_config = precision_.fp8;
    setup.family = precision_.family;
    setup.fp8_wgrad = precision_.fp8_wgrad;
    setup.weight_transposes = precision_.fp8_weight_transposes;
    if (decision.fp8) {
      setup.scaling = buffers_->scalings.floats(fp8_index);
      setup.health = buffers_->scalings.health(fp8_index);
      buffers_->scalings.add(spec.name, fp8_index, fp8_index);
    }
    linear.layer =
        std::make_unique<kernels::CudaLinear>(setup, buffers_->gemm, buffers_->fp8_scratch);
    linear.fp8_index = decision.fp8 ? fp8_index++ : -1;
    memory_.linear_copies += linear.layer->device_bytes();
    buffers_->linears.emplace(spec.name, std::move(linear));
    if (sequence_ && flux_reads_own_tokens(spec.name)) {  // each rank's tokens add their part
      for (const char* tensor : {".weight", ".bias"}) {
        const optim::DeviceParameter& part = layout_[spec.name + tensor];
        partial_gradient_ranges_.emplace_back(part.offset, part.numel);
      }
    }
    if (split == TensorSplit::None) continue;
    tensor_parts_[spec.name + ".weight"] = {share, spec.out_features, spec.in_features};
    if (split == TensorSplit::Outputs) {
      tensor_parts_[spec.name + ".bias"] = {share, spec.out_features, 1};
    } else {  // replicated, the first rank's gradient alone not zero
      const optim::DeviceParameter& bias = layout_[spec.name + ".bias"];
      partial_gradient_ranges_.emplace_back(bias.offset, bias.numel);
    }
  }
  if (tensor_parallel_.split()) {
    for (const optim::DeviceParameter& tensor : layout_.parameters)
      if (tensor.name.ends_with("_norm.scale"))  // each rank's heads add their part
        partial_gradient_ranges_.emplace_back(tensor.offset, tensor.numel);
  }
  FP8T_CUDA_CHECK(cudaMemsetAsync(parameters_, 0, layout_.total_bytes(), stream_));
  FP8T_CUDA_CHECK(cudaMemsetAsync(gradients_, 0, layout_.total_bytes(), stream_));
}

CudaFluxModel::~CudaFluxModel() {
  cudaStreamSynchronize(stream_);
}

std::vector<optim::TensorAmaxSlot> CudaFluxModel::weight_amax_slots() const {
  std::vector<optim::TensorAmaxSlot> slots;
  for (const auto& [name, linear] : buffers_->linears) {
    if (float* amax = linear.layer->weight_amax_slot()) slots.push_back({name + ".weight", amax});
  }
  return slots;
}

void CudaFluxModel::end_step(bool weight_amaxes_measured) {
  weights_ready_ = false;
  weight_amaxes_measured_ = weight_amaxes_measured;
  CudaLinearScalings& scalings = buffers_->scalings;
  keep_cuda_fp8_health(buffers_->linears, scalings, fp8_health_, stream_);
  scalings.end_step(stream_, tensor_parallel_);
}

void CudaFluxModel::sum_partial_gradients() {
  tensor_parallel_.sum_ranges(gradients_, partial_gradient_ranges_, stream_);
}

optim::GradientShares CudaFluxModel::gradient_shares() const {
  if (!tensor_parallel_.split()) return {};
  return {share_elements_, tensor_parallel_.sum};
}

void CudaFluxModel::set_record_fp8_health(bool record) {
  record_cuda_fp8_health(buffers_->linears, buffers_->scalings, fp8_health_, record, stream_);
}

std::vector<Fp8TensorHealth> CudaFluxModel::take_fp8_health() {
  return take_cuda_fp8_health(buffers_->linears, buffers_->scalings, fp8_health_, stream_);
}

void CudaFluxModel::scalings_changed() {
  buffers_->scalings.scalings_changed(stream_);
}

CudaLinearScalings& CudaFluxModel::scalings() {
  return buffers_->scalings;
}

std::vector<std::pair<std::string, DelayedScaling*>> CudaFluxModel::delayed_scalings() {
  return buffers_->scalings.delayed_scalings();
}

void CudaFluxModel::lay_out() {
  Buffers& b = *buffers_;
  const auto B = size_t(batch_), Li = size_t(img_tokens_), Lt = size_t(txt_tokens_);
  const auto L = size_t(tokens_), C = size_t(config_.hidden_size);
  // This rank's attention width, MLP hidden features and heads.
  const auto A = size_t(attention_width_), M = size_t(mlp_hidden_), H = size_t(heads_);
  const auto D = size_t(config_.head_dim()), Cin = size_t(config_.in_channels);
  const auto ctx = size_t(config_.context_in_dim), vec = size_t(config_.vec_in_dim);
  const auto sinusoid = size_t(config_.timestep_dim());
  const size_t N = B * L, Ls = std::max(Li, Lt);
  // This rank's tokens of the residual streams (all of them without sequence parallelism).
  const auto Oi = size_t(own_img_), Ot = size_t(own_txt_), O = size_t(own_tokens_);

  parameters_ = b.parameters.take<float>(size_t(layout_.total_elements));
  gradients_ = b.gradients.take<float>(size_t(layout_.total_elements));

  DeviceArena& act = b.activations;
  b.img = act.take<bf16>(B * Oi * Cin);
  b.txt = act.take<bf16>(B * Ot * ctx);
  const size_t embed_inputs[] = {sinusoid, vec, sinusoid};
  for (int e = 0; e < 3; ++e) {
    if (e == 2 && !config_.guidance_embed) break;
    b.embed_input[e] = act.take<bf16>(B * embed_inputs[e]);
    b.embed_hidden[e] = act.take<bf16>(B * C);
    b.embed_act[e] = act.take<bf16>(B * C);
  }
  b.vec = act.take<bf16>(B * C);
  b.vec_act = act.take<bf16>(B * C);
  const auto attention = [&](AttentionSaved& a) {
    for (bf16** view : {&a.q, &a.k, &a.v, &a.q_normed, &a.k_normed, &a.out})
      *view = act.take<bf16>(N * A);
    a.q_rstd = act.take<float>(N * H);
    a.k_rstd = act.take<float>(N * H);
    a.stats = act.take<float>(B * H * L);
    if (precision_.fp8_attention) {
      for (uint8_t** codes : {&a.fp8.q, &a.fp8.k, &a.fp8.v, &a.fp8.out})
        *codes = act.take<uint8_t>(N * A);
      a.fp8.floats = act.take<float>(size_t(kernels::kAttentionFp8Floats));
    }
  };
  const auto take_double = [&](DoubleBlock& block) {
    for (auto [stream, rows, own_rows] :
         {std::tuple{&block.img, B * Li, B * Oi}, std::tuple{&block.txt, B * Lt, B * Ot}}) {
      stream->mod = act.take<bf16>(B * 6 * C);
      for (bf16** view : {&stream->norm1, &stream->modulated1, &stream->proj, &stream->norm2,
                          &stream->modulated2, &stream->mlp_out}) {
        *view = act.take<bf16>(own_rows * C);
      }
      stream->attn = act.take<bf16>(rows * A);
      stream->rstd1 = act.take<float>(own_rows);
      stream->rstd2 = act.take<float>(own_rows);
      stream->mlp_hidden = act.take<bf16>(rows * M);
      stream->mlp_act = selective_ ? b.shared_mlp_act : act.take<bf16>(rows * M);
    }
    attention(block.attention);
  };
  const auto take_single = [&](SingleBlock& block) {
    block.mod = act.take<bf16>(B * 3 * C);
    block.normed = act.take<bf16>(B * O * C);
    block.modulated = act.take<bf16>(B * O * C);
    block.rstd = act.take<float>(B * O);
    block.linear1_out = act.take<bf16>(N * (3 * A + M));
    attention(block.attention);
    block.linear2_in = selective_ ? b.shared_linear2_in : act.take<bf16>(N * (A + M));
    block.out = act.take<bf16>(B * O * C);
  };
  // Full recompute: the blocks at the same place of their groups share one set of saved
  // activations, and each group saves its input.
  const auto take_blocks = [&](auto& blocks, int count, const std::vector<RecomputeGroup>& groups,
                               const auto& take_block) {
    using Block = typename std::remove_reference_t<decltype(blocks)>::value_type;
    std::vector<Block> places(size_t(recompute_slot_count(groups)));
    for (Block& place : places)
      take_block(place);
    const std::vector<int> slots = recompute_slots(groups, count);
    blocks.resize(size_t(count));
    for (int block = 0; block < count; ++block) {
      const int slot = slots[size_t(block)];
      if (slot < 0) {
        take_block(blocks[size_t(block)]);
      } else {
        blocks[size_t(block)] = places[size_t(slot)];
      }
    }
  };
  // Selective recompute: GELU's outputs (with the attention output beside them in a single
  // block) in one buffer that every block shares, written again before each backward reads it.
  b.shared_mlp_act = selective_ && config_.double_blocks > 0 ? act.take<bf16>(B * Ls * M) : nullptr;
  b.shared_linear2_in =
      selective_ && config_.single_blocks > 0 ? act.take<bf16>(N * (A + M)) : nullptr;
  take_blocks(b.doubles, config_.double_blocks, recompute_.doubles, take_double);
  b.double_group_inputs.clear();
  for (size_t group = 0; group < recompute_.doubles.size(); ++group)
    b.double_group_inputs.emplace_back(act.take<bf16>(B * Oi * C), act.take<bf16>(B * Ot * C));
  take_blocks(b.singles, config_.single_blocks, recompute_.singles, take_single);
  b.single_group_inputs.clear();
  for (size_t group = 0; group < recompute_.singles.size(); ++group)
    b.single_group_inputs.push_back(act.take<bf16>(B * O * C));
  b.final_mod = act.take<bf16>(B * 2 * C);
  b.final_normed = act.take<bf16>(B * Oi * C);
  b.final_modulated = act.take<bf16>(B * Oi * C);
  b.final_rstd = act.take<float>(B * Oi);
  b.prediction = act.take<bf16>(B * Li * Cin);

  DeviceArena& ws = b.workspace;
  b.img_f32 = ws.take<float>(B * Li * Cin);
  b.txt_f32 = ws.take<float>(B * Lt * ctx);
  b.y_f32 = ws.take<float>(B * vec);
  b.target = ws.take<float>(B * Li * Cin);
  b.sinusoid_f32[0] = ws.take<float>(B * sinusoid);
  b.sinusoid_f32[1] = ws.take<float>(B * sinusoid);
  b.rope_cos = ws.take<float>(L * D / 2);
  b.rope_sin = ws.take<float>(L * D / 2);
  b.loss = ws.take<float>(1);
  b.reduction = ws.take<float>(size_t(kernels::flux_reduction_workspace_floats()));
  b.x_img = ws.take<bf16>(B * Oi * C);
  b.x_txt = ws.take<bf16>(B * Ot * C);
  b.x_joint = ws.take<bf16>(B * O * C);
  b.embedding = ws.take<bf16>(B * C);
  b.qkv = ws.take<bf16>(B * Ls * 3 * A);
  b.d_img = ws.take<bf16>(B * Oi * C);
  b.d_txt = ws.take<bf16>(B * Ot * C);
  b.d_joint = ws.take<bf16>(B * O * C);
  b.dpred = ws.take<bf16>(B * Li * Cin);
  b.dmod_img = ws.take<float>(B * 6 * C);
  b.dmod_txt = ws.take<float>(B * 6 * C);
  b.dmod = ws.take<bf16>(B * 6 * C);
  for (bf16** view : {&b.d_vec_act, &b.d_vec, &b.d_embed_act, &b.d_embed_hidden})
    *view = ws.take<bf16>(B * C);
  // d_branch: a branch's gradient on this rank's tokens, or its share of a modulation's (at
  // most 6) chunks. d_modulated also holds the attention projections' input gradients
  // ([rows, A]).
  b.d_branch = ws.take<bf16>(B * std::max<size_t>(O, 6) * C);
  b.d_modulated = ws.take<bf16>(N * C);
  for (bf16** view : {&b.d_attn, &b.dq, &b.dk, &b.dv})
    *view = ws.take<bf16>(N * A);
  b.d_mlp_act = ws.take<bf16>(B * Ls * M);
  b.d_mlp_hidden = ws.take<bf16>(B * Ls * M);
  b.d_qkv = ws.take<bf16>(B * Ls * 3 * A);
  b.d_linear1_out = config_.single_blocks > 0 ? ws.take<bf16>(N * (3 * A + M)) : nullptr;
  b.d_linear2_in = config_.single_blocks > 0 ? ws.take<bf16>(N * (A + M)) : nullptr;
  if (precision_.fp8_attention) {
    b.fp8_attention_scratch = {ws.take<uint8_t>(N * A), ws.take<uint8_t>(N * A),
                               ws.take<uint8_t>(N * A), ws.take<uint8_t>(N * A)};
  }
  if (sequence_) {
    b.sequence_staging = ws.take<bf16>(std::max(N * C, B * Li * Cin));
    b.whole = ws.take<bf16>(std::max({N * C, B * Li * Cin, B * Lt * ctx}));
    b.d_own = ws.take<bf16>(B * O * C);
    b.own_prediction = ws.take<bf16>(B * Oi * Cin);
  }

  // FP8: the scaling floats and the quantization scratch of the largest linear (share).
  int fp8_count = 0;
  int64_t max_in = 0, max_out = 0, max_rows = 0;
  ops::WeightTScratch weight_t;
  for (const FluxLinearPrecision& decision : linear_precision_) {
    if (!decision.fp8) continue;
    const auto [in, out] = flux_tensor_share(decision.linear, config_, tensor_parallel_.size, 0)
                               .features(decision.linear.in_features, decision.linear.out_features);
    ++fp8_count;
    max_in = std::max(max_in, in);
    max_out = std::max(max_out, out);
    max_rows =
        std::max(max_rows, flux_linear_rows(decision.linear, batch_, img_tokens_, txt_tokens_));
    if (precision_.fp8_weight_transposes == ops::WeightTransposes::InBackward)
      weight_t.fit(in, out, precision_.fp8.recipe);
  }
  b.scalings.take(b.linear_scratch, fp8_count);
  if (fp8_count > 0) {
    DeviceArena& scratch = b.linear_scratch;
    // The backward scratch fits the MLPs whole; the single blocks' linear1 and linear2 take
    // their tokens in chunks.
    b.fp8_scratch = kernels::take_fp8_scratch(scratch, precision_.fp8.recipe, max_rows, max_in,
                                              max_out, std::max<int64_t>(C, M), weight_t);
  }
}

gemm::CublasLtGemm& CudaFluxModel::gemm() {
  return buffers_->gemm;
}

const gemm::CublasLtGemm& CudaFluxModel::gemm() const {
  return buffers_->gemm;
}

float* CudaFluxModel::parameter(const std::string& name) const {
  return parameters_ + layout_[name].offset;
}

float* CudaFluxModel::gradient(const std::string& name) const {
  return gradients_ + layout_[name].offset;
}

CudaFluxModel::Linear& CudaFluxModel::linear(const std::string& name) {
  const auto found = buffers_->linears.find(name);
  FP8T_CHECK(found != buffers_->linears.end(), "no Flux linear layer named '{}'", name);
  return found->second;
}

void CudaFluxModel::upload_parameters(const FluxParameterSet* host) {
  for (const optim::DeviceParameter& tensor : layout_.parameters) {
    const float* values = nullptr;
    if (host != nullptr) {
      const TensorView& view = (*host)[tensor.name];
      FP8T_CHECK(view.dtype() == DType::F32, "expected f32 parameters, '{}' is {}", tensor.name,
                 dtype_name(view.dtype()));
      values = view.data<float>();
    }
    upload_tensor(tensor.name, values, parameters_ + tensor.offset);
  }
  weights_ready_ = false;
  weight_amaxes_measured_ = false;
}

void CudaFluxModel::download_parameters(FluxParameterSet* host) const {
  for (const optim::DeviceParameter& tensor : layout_.parameters) {
    download_tensor(tensor.name, parameters_ + tensor.offset,
                    host != nullptr ? (*host)[tensor.name].data<float>() : nullptr);
  }
}

void CudaFluxModel::download_gradients(FluxParameterSet& host) const {
  for (const optim::DeviceParameter& tensor : layout_.parameters)
    download_tensor(tensor.name, gradients_ + tensor.offset, host[tensor.name].data<float>());
}

void CudaFluxModel::download_tensor(const std::string& name, const float* device,
                                    float* host) const {
  FP8T_CUDA_CHECK(cudaStreamSynchronize(stream_));
  const auto part = tensor_parts_.find(name);
  if (part == tensor_parts_.end()) {
    if (host == nullptr) return;
    FP8T_CUDA_CHECK(cudaMemcpy(host, device, size_t(layout_[name].numel) * sizeof(float),
                               cudaMemcpyDeviceToHost));
    return;
  }
  const TensorPart& p = part->second;
  const ShareBlocks share = share_blocks(p.share, p.whole_out, p.whole_in);
  const ShareStaging staging(size_t(share.whole_numel()) * sizeof(float));
  gather_share(share, device, staging.as<float>(), tensor_parallel_.sum, host, stream_);
}

void CudaFluxModel::upload_tensor(const std::string& name, const float* host, float* device) const {
  FP8T_CUDA_CHECK(cudaStreamSynchronize(stream_));
  if (!tensor_parallel_.split()) {
    FP8T_CHECK(host != nullptr, "'{}': expected its host values", name);
    FP8T_CUDA_CHECK(cudaMemcpy(device, host, size_t(layout_[name].numel) * sizeof(float),
                               cudaMemcpyHostToDevice));
    return;
  }
  // The group's first rank's whole tensor among the others' zeros, summed over the group: the
  // first rank's values on every rank, which keeps its share or the whole.
  FP8T_CHECK(host != nullptr || tensor_parallel_.rank != 0,
             "'{}': the tensor-parallel group's first rank must give its host values", name);
  const auto part = tensor_parts_.find(name);
  const optim::DeviceParameter& tensor = layout_[name];
  const ShareBlocks share =
      part != tensor_parts_.end()
          ? share_blocks(part->second.share, part->second.whole_out, part->second.whole_in)
          : share_blocks(TensorShare{}, tensor.numel / tensor.shape.back(), tensor.shape.back());
  const ShareStaging staging(size_t(share.whole_numel()) * sizeof(float));
  scatter_share(share, tensor_parallel_.rank == 0 ? host : nullptr, staging.as<float>(),
                tensor_parallel_.sum, device, stream_);
}

void CudaFluxModel::zero_gradients() {
  FP8T_CUDA_CHECK(cudaMemsetAsync(gradients_, 0, layout_.total_bytes(), stream_));
}

double CudaFluxModel::loss_value() {
  float loss = 0.0f;
  FP8T_CUDA_CHECK(
      cudaMemcpyAsync(&loss, buffers_->loss, sizeof loss, cudaMemcpyDeviceToHost, stream_));
  FP8T_CUDA_CHECK(cudaStreamSynchronize(stream_));
  return loss;
}

const float* CudaFluxModel::loss_device() const {
  return buffers_->loss;
}

std::vector<float> CudaFluxModel::prediction() const {
  const auto count = size_t(batch_ * img_tokens_ * config_.in_channels);
  std::vector<bf16> bits(count);
  FP8T_CUDA_CHECK(cudaStreamSynchronize(stream_));
  FP8T_CUDA_CHECK(
      cudaMemcpy(bits.data(), buffers_->prediction, count * sizeof(bf16), cudaMemcpyDeviceToHost));
  std::vector<float> values(count);
  std::transform(bits.begin(), bits.end(), values.begin(), bf16_to_float);
  return values;
}

void CudaFluxModel::prepare_weights() {
  // Recorded in evaluation passes too: the next training forward uses this cast.
  std::vector<kernels::CudaLinear::WeightToPrepare> weights;
  for (auto& [name, linear] : buffers_->linears) {
    const bool measured = weight_amaxes_measured_ && linear.layer->weight_amax_slot() != nullptr;
    weights.push_back({linear.layer.get(), linear.weight, linear.bias, measured});
  }
  kernels::CudaLinear::prepare_weights(weights, stream_);
  weights_ready_ = true;
  weight_amaxes_measured_ = false;
}

void CudaFluxModel::linear_forward(const std::string& name, const bf16* x, int64_t rows, bf16* y) {
  linear(name).layer->forward(x, rows, y, training_ && !rerunning_, stream_);
}

kernels::FusedCast CudaFluxModel::norm_cast(const std::string& name) {
  // Under sequence parallelism the norm writes this rank's tokens and a block linear reads every
  // rank's: it casts the gathered tokens itself.
  if (sequence_ && !flux_reads_own_tokens(name)) return {};
  return linear(name).layer->fused_input_cast(training_ && !rerunning_, stream_);
}

float* CudaFluxModel::fused_input_amax(const std::string& name) {
  return linear(name).layer->fused_input_amax(stream_);
}

void CudaFluxModel::linear_backward(const std::string& name, const bf16* dy, const bf16* x,
                                    int64_t rows, bf16* dx, bool accumulate_dx) {
  Linear& layer = linear(name);
  if (layer.grad_bias != nullptr) {  // first: its pass over dy also takes dy's amax
    kernels::bias_backward(layer.grad_bias, dy, rows, layer.layer->out_features(),
                           buffers_->reduction, stream_,
                           layer.layer->fused_grad_output_amax(stream_));
  }
  layer.layer->backward(dy, x, rows, dx, accumulate_dx, layer.grad_weight, training_, stream_);
}

void CudaFluxModel::modulation_forward(const std::string& name, bf16* mod) {
  Buffers& b = *buffers_;
  if (!tensor_parallel_.split()) {
    linear_forward(name, b.vec_act, batch_, mod);
    return;
  }
  // This rank's run of the chunks, placed in zeros and summed over the group: the whole chunks.
  const int64_t share = linear(name).layer->out_features(), whole = share * tensor_parallel_.size;
  linear_forward(name, b.vec_act, batch_, b.dmod);
  FP8T_CUDA_CHECK(cudaMemsetAsync(mod, 0, size_t(batch_ * whole) * sizeof(bf16), stream_));
  copy_rows(mod + tensor_parallel_.rank * share, whole, b.dmod, share, batch_, share, stream_);
  tensor_parallel_.sum_partials(mod, batch_ * whole, stream_);
}

void CudaFluxModel::modulation_backward(const std::string& name) {
  Buffers& b = *buffers_;
  if (!tensor_parallel_.split()) {
    linear_backward(name, b.dmod, b.vec_act, batch_, b.d_vec_act, true);
    return;
  }
  // This rank's run of the chunks' gradient; d SiLU(vec) gets a partial sum (backward() adds
  // the group's).
  const int64_t share = linear(name).layer->out_features(), whole = share * tensor_parallel_.size;
  copy_rows(b.d_branch, share, b.dmod + tensor_parallel_.rank * share, whole, batch_, share,
            stream_);
  linear_backward(name, b.d_branch, b.vec_act, batch_, b.d_vec_act, true);
}

void CudaFluxModel::upload_inputs(const FluxInputs& inputs, const float* target) {
  FP8T_CHECK(inputs.img && inputs.img_ids && inputs.txt && inputs.y && inputs.timesteps && target,
             "Flux forward: expected img, img_ids, txt, y, timesteps and a target");
  FP8T_CHECK((inputs.guidance != nullptr) == config_.guidance_embed,
             "Flux forward: guidance must be given exactly when the model has guidance_in");
  Buffers& b = *buffers_;
  const int64_t B = batch_, Li = img_tokens_, Lt = txt_tokens_;
  const int64_t img_count = B * Li * config_.in_channels;
  const int64_t txt_count = B * Lt * config_.context_in_dim;
  const int64_t y_count = B * config_.vec_in_dim;
  FP8T_CUDA_CHECK(cudaEventSynchronize(b.staging_free));
  float* staging = b.staging.data();
  const auto send = [&](float* device, int64_t count) {
    FP8T_CUDA_CHECK(cudaMemcpyAsync(device, staging, size_t(count) * sizeof(float),
                                    cudaMemcpyHostToDevice, stream_));
    staging += count;
  };
  const auto upload = [&](float* device, const float* host, int64_t count) {
    parallel_copy(host, count, staging);
    send(device, count);
  };
  upload(b.img_f32, inputs.img, img_count);
  upload(b.txt_f32, inputs.txt, txt_count);
  upload(b.y_f32, inputs.y, y_count);
  upload(b.target, target, img_count);
  // The sinusoids on the host (B values each), as the CPU model computes them.
  const int64_t dim = config_.timestep_dim();
  const float* scalars[] = {inputs.timesteps, inputs.guidance};
  const int embedders = config_.guidance_embed ? 2 : 1;
  for (int e = 0; e < embedders; ++e) {
    ops::timestep_embedding(staging, scalars[e], B, dim);
    send(b.sinusoid_f32[e], B * dim);
  }
  FP8T_CUDA_CHECK(cudaEventRecord(b.staging_free, stream_));
  if (sequence_) {  // img_in and txt_in read this rank's tokens
    kernels::cast_to_bf16(b.whole, b.img_f32, img_count, stream_);
    copy_token_runs(own_tokens(FluxStream::Image), b.img, b.whole, config_.in_channels, false);
    kernels::cast_to_bf16(b.whole, b.txt_f32, txt_count, stream_);
    copy_token_runs(own_tokens(FluxStream::Text), b.txt, b.whole, config_.context_in_dim, false);
  } else {
    kernels::cast_to_bf16(b.img, b.img_f32, img_count, stream_);
    kernels::cast_to_bf16(b.txt, b.txt_f32, txt_count, stream_);
  }
  kernels::cast_to_bf16(b.embed_input[1], b.y_f32, y_count, stream_);
  for (int e = 0; e < embedders; ++e)
    kernels::cast_to_bf16(b.embed_input[e == 0 ? 0 : 2], b.sinusoid_f32[e], B * dim, stream_);

  // RoPE tables for [txt; img] (text ids zero), rebuilt when the image ids change.
  const int64_t L = tokens_, half = config_.head_dim() / 2;
  const std::vector<float> ids(inputs.img_ids, inputs.img_ids + Li * 3);
  if (ids != b.ids) {
    std::vector<float> joint_ids(size_t(L * 3), 0.0f);
    std::copy(ids.begin(), ids.end(), joint_ids.begin() + Lt * 3);
    std::vector<float> cos(size_t(L * half)), sin(cos.size());
    ops::flux_rope_tables(cos.data(), sin.data(), joint_ids.data(), L, config_.axes_dim,
                          config_.rope_theta);
    FP8T_CUDA_CHECK(cudaStreamSynchronize(stream_));
    FP8T_CUDA_CHECK(
        cudaMemcpy(b.rope_cos, cos.data(), cos.size() * sizeof(float), cudaMemcpyHostToDevice));
    FP8T_CUDA_CHECK(
        cudaMemcpy(b.rope_sin, sin.data(), sin.size() * sizeof(float), cudaMemcpyHostToDevice));
    b.ids = ids;
  }
}

void CudaFluxModel::embedder_forward(const std::string& name, int index, bf16* out) {
  Buffers& b = *buffers_;
  linear_forward(name + ".in_layer", b.embed_input[index], batch_, b.embed_hidden[index]);
  kernels::silu_forward(b.embed_act[index], b.embed_hidden[index], batch_ * config_.hidden_size,
                        stream_);
  linear_forward(name + ".out_layer", b.embed_act[index], batch_, out);
}

void CudaFluxModel::embedder_backward(const std::string& name, int index, const bf16* dout) {
  Buffers& b = *buffers_;
  linear_backward(name + ".out_layer", dout, b.embed_act[index], batch_, b.d_embed_act, false);
  kernels::silu_backward(b.d_embed_hidden, b.d_embed_act, b.embed_hidden[index],
                         batch_ * config_.hidden_size, GradStore::Write, stream_);
  // The embedder's input (a sinusoid or the pooled vector) is not trained: no dx.
  linear_backward(name + ".in_layer", b.d_embed_hidden, b.embed_input[index], batch_, nullptr,
                  false);
}

void CudaFluxModel::into_joint(bf16* joint, const bf16* rows, int64_t ld, int64_t first,
                               int64_t tokens, int64_t width) {
  kernels::copy_rows({joint + first * width, width, tokens_}, {rows, ld, tokens}, batch_, tokens,
                     width, stream_);
}

void CudaFluxModel::out_of_joint(bf16* rows, int64_t ld, const bf16* joint, int64_t first,
                                 int64_t tokens, int64_t width, float* amax) {
  kernels::copy_rows({rows, ld, tokens}, {joint + first * width, width, tokens_}, batch_, tokens,
                     width, stream_, amax);
}

void CudaFluxModel::stream_into_joint(AttentionSaved& attention, const std::string& norm,
                                      const bf16* raw, int64_t ld, int64_t first, int64_t tokens) {
  Buffers& b = *buffers_;
  const int64_t A = attention_width_, H = heads_, D = config_.head_dim();
  const kernels::JointRows rows{batch_, tokens, first, tokens_};
  kernels::qk_norm_rope_forward(attention.q, attention.q_normed, attention.q_rstd, raw, ld,
                                parameter(norm + ".query_norm.scale"), b.rope_cos, b.rope_sin, rows,
                                H, D, stream_);
  kernels::qk_norm_rope_forward(attention.k, attention.k_normed, attention.k_rstd, raw + A, ld,
                                parameter(norm + ".key_norm.scale"), b.rope_cos, b.rope_sin, rows,
                                H, D, stream_);
  into_joint(attention.v, raw + 2 * A, ld, first, tokens, A);
}

void CudaFluxModel::stream_from_joint(const AttentionSaved& attention, const std::string& norm,
                                      bf16* draw, int64_t ld, int64_t first, int64_t tokens) {
  Buffers& b = *buffers_;
  const int64_t A = attention_width_, H = heads_, D = config_.head_dim();
  const kernels::JointRows rows{batch_, tokens, first, tokens_};
  kernels::qk_norm_rope_backward(draw, ld, gradient(norm + ".query_norm.scale"), b.dq,
                                 attention.q_normed, attention.q_rstd,
                                 parameter(norm + ".query_norm.scale"), b.rope_cos, b.rope_sin,
                                 rows, H, D, b.reduction, stream_);
  kernels::qk_norm_rope_backward(draw + A, ld, gradient(norm + ".key_norm.scale"), b.dk,
                                 attention.k_normed, attention.k_rstd,
                                 parameter(norm + ".key_norm.scale"), b.rope_cos, b.rope_sin, rows,
                                 H, D, b.reduction, stream_);
  out_of_joint(draw + 2 * A, ld, b.dv, first, tokens, A);
}

namespace {

ops::AttentionShape joint_attention(const FluxConfig& config, int64_t batch, int64_t tokens,
                                    int64_t heads) {
  return {.batch = batch,
          .seq_len = tokens,
          .heads = heads,
          .kv_heads = heads,
          .head_dim = config.head_dim(),
          .window = 0,
          .causal = false};
}

float attention_scale(const FluxConfig& config) {
  return static_cast<float>(1.0 / std::sqrt(double(config.head_dim())));
}

}  // namespace

void CudaFluxModel::double_block_forward(int block) {
  Buffers& b = *buffers_;
  DoubleBlock& saved = b.doubles[size_t(block)];
  const int64_t B = batch_, C = config_.hidden_size, A = attention_width_, M = mlp_hidden_;
  const std::string prefix = fmt::format("double_blocks.{}.", block);
  struct Part {
    const char* name;
    FluxStream stream;
    Stream& saved;
    bf16* x;
    int64_t tokens, own_tokens, first;
  };
  const Part parts[] = {
      {"img", FluxStream::Image, saved.img, b.x_img, img_tokens_, own_img_, txt_tokens_},
      {"txt", FluxStream::Text, saved.txt, b.x_txt, txt_tokens_, own_txt_, 0}};
  for (const Part& p : parts) {
    const std::string stream = prefix + p.name;
    const kernels::StreamShape shape{B, p.own_tokens, C, p.own_tokens};
    modulation_forward(stream + "_mod.lin", p.saved.mod);
    // Under sequence parallelism the linear casts the gathered tokens itself.
    kernels::layernorm_modulate_forward(p.saved.modulated1, p.saved.norm1, p.saved.rstd1, p.x,
                                        p.saved.mod, p.saved.mod + C, 6 * C, shape, stream_,
                                        norm_cast(stream + "_attn.qkv"));
    linear_forward(stream + "_attn.qkv", gather_tokens(p.saved.modulated1, p.stream, C, b.whole),
                   B * p.tokens, b.qkv);
    stream_into_joint(saved.attention, stream + "_attn.norm", b.qkv, 3 * A, p.first, p.tokens);
  }
  AttentionSaved& a = saved.attention;
  joint_attention_forward(a);
  for (const Part& p : parts) {
    const std::string stream = prefix + p.name;
    const kernels::StreamShape shape{B, p.own_tokens, C, p.own_tokens};
    const int64_t rows = B * p.tokens;
    Stream& s = p.saved;
    // The copies out of the joint sequence and GELU take the next linears' input amaxes.
    out_of_joint(s.attn, A, a.out, p.first, p.tokens, A, fused_input_amax(stream + "_attn.proj"));
    bf16* proj = partial_output(s.proj);
    linear_forward(stream + "_attn.proj", s.attn, rows, proj);
    reduce_to_own_tokens(proj, p.stream, C, s.proj);
    kernels::gated_residual_forward(p.x, s.proj, s.mod + 2 * C, 6 * C, shape, stream_);
    kernels::layernorm_modulate_forward(s.modulated2, s.norm2, s.rstd2, p.x, s.mod + 3 * C,
                                        s.mod + 4 * C, 6 * C, shape, stream_,
                                        norm_cast(stream + "_mlp.0"));
    linear_forward(stream + "_mlp.0", gather_tokens(s.modulated2, p.stream, C, b.whole), rows,
                   s.mlp_hidden);
    kernels::gelu_tanh_forward(s.mlp_act, M, s.mlp_hidden, M, rows, M, stream_,
                               fused_input_amax(stream + "_mlp.2"));
    bf16* mlp_out = partial_output(s.mlp_out);
    linear_forward(stream + "_mlp.2", s.mlp_act, rows, mlp_out);
    reduce_to_own_tokens(mlp_out, p.stream, C, s.mlp_out);
    kernels::gated_residual_forward(p.x, s.mlp_out, s.mod + 5 * C, 6 * C, shape, stream_);
  }
}

void CudaFluxModel::linear2_input(const SingleBlock& s, float* amax) {
  const int64_t A = attention_width_, M = mlp_hidden_, N = batch_ * tokens_;
  const int64_t width1 = 3 * A + M, width2 = A + M;
  copy_rows(s.linear2_in, width2, s.attention.out, A, N, A, stream_, amax);
  kernels::gelu_tanh_forward(s.linear2_in + A, width2, s.linear1_out + 3 * A, width1, N, M, stream_,
                             amax);
}

void CudaFluxModel::single_block_forward(int block) {
  Buffers& b = *buffers_;
  SingleBlock& s = b.singles[size_t(block)];
  const int64_t B = batch_, C = config_.hidden_size, A = attention_width_, M = mlp_hidden_;
  const int64_t N = B * tokens_, width1 = 3 * A + M;
  const std::string prefix = fmt::format("single_blocks.{}", block);
  const kernels::StreamShape shape{B, own_tokens_, C, own_tokens_};
  modulation_forward(prefix + ".modulation.lin", s.mod);
  kernels::layernorm_modulate_forward(s.modulated, s.normed, s.rstd, b.x_joint, s.mod, s.mod + C,
                                      3 * C, shape, stream_, norm_cast(prefix + ".linear1"));
  linear_forward(prefix + ".linear1", gather_tokens(s.modulated, FluxStream::Joint, C, b.whole), N,
                 s.linear1_out);
  stream_into_joint(s.attention, prefix + ".norm", s.linear1_out, width1, 0, tokens_);
  joint_attention_forward(s.attention);
  linear2_input(s, fused_input_amax(prefix + ".linear2"));
  bf16* out = partial_output(s.out);
  linear_forward(prefix + ".linear2", s.linear2_in, N, out);
  reduce_to_own_tokens(out, FluxStream::Joint, C, s.out);
  kernels::gated_residual_forward(b.x_joint, s.out, s.mod + 2 * C, 3 * C, shape, stream_);
}

void CudaFluxModel::forward(const FluxInputs& inputs, const float* target, bool with_gradient,
                            float grad_scale) {
  Buffers& b = *buffers_;
  // The weight casts first: the GPU runs them while the host copies the inputs.
  if (!weights_ready_) prepare_weights();
  upload_inputs(inputs, target);
  const int64_t B = batch_, Li = img_tokens_, C = config_.hidden_size;
  const int64_t Oi = own_img_, Ot = own_txt_, O = own_tokens_;

  linear_forward("img_in", b.img, B * Oi, b.x_img);
  linear_forward("txt_in", b.txt, B * Ot, b.x_txt);
  embedder_forward("time_in", 0, b.vec);
  embedder_forward("vector_in", 1, b.embedding);
  kernels::add_forward(b.vec, b.vec, b.embedding, B * C, stream_);
  if (config_.guidance_embed) {
    embedder_forward("guidance_in", 2, b.embedding);
    kernels::add_forward(b.vec, b.vec, b.embedding, B * C, stream_);
  }
  kernels::silu_forward(b.vec_act, b.vec, B * C, stream_);

  for (int block = 0; block < config_.double_blocks; ++block) {
    save_group_input(true, block);
    double_block_forward(block);
  }
  // The single blocks run on [txt; img] (this rank's text tokens, then its image tokens).
  kernels::copy_rows({b.x_joint, C, O}, {b.x_txt, C, Ot}, B, Ot, C, stream_);
  kernels::copy_rows({b.x_joint + Ot * C, C, O}, {b.x_img, C, Oi}, B, Oi, C, stream_);
  for (int block = 0; block < config_.single_blocks; ++block) {
    save_group_input(false, block);
    single_block_forward(block);
  }

  // The final layer on the image tokens, read in place from the joint sequence.
  modulation_forward("final_layer.adaLN_modulation.1", b.final_mod);
  const kernels::StreamShape image{B, Oi, C, O};
  kernels::layernorm_modulate_forward(b.final_modulated, b.final_normed, b.final_rstd,
                                      b.x_joint + Ot * C, b.final_mod, b.final_mod + C, 2 * C,
                                      image, stream_, norm_cast("final_layer.linear"));
  if (sequence_) {  // every rank's loss is the whole micro-batch's: the prediction gathered
    linear_forward("final_layer.linear", b.final_modulated, B * Oi, b.own_prediction);
    gather_tokens(b.own_prediction, FluxStream::Image, config_.in_channels, b.prediction);
  } else {
    linear_forward("final_layer.linear", b.final_modulated, B * Li, b.prediction);
  }
  const int64_t count = B * Li * config_.in_channels;
  kernels::flow_mse_forward_backward(b.loss, b.dpred, b.prediction, b.target, count, grad_scale,
                                     b.reduction, stream_);
  b.forward_has_gradient = with_gradient;
}

void CudaFluxModel::copy_group_input(bool doubles, size_t group, bool save) {
  Buffers& b = *buffers_;
  const auto copy = [&](bf16* saved, bf16* live, int64_t tokens) {
    const size_t bytes = size_t(batch_ * tokens * config_.hidden_size) * sizeof(bf16);
    FP8T_CUDA_CHECK(cudaMemcpyAsync(save ? saved : live, save ? live : saved, bytes,
                                    cudaMemcpyDeviceToDevice, stream_));
  };
  if (doubles) {
    copy(b.double_group_inputs[group].first, b.x_img, own_img_);
    copy(b.double_group_inputs[group].second, b.x_txt, own_txt_);
  } else {
    copy(b.single_group_inputs[group], b.x_joint, own_tokens_);
  }
}

FluxOwnTokens CudaFluxModel::own_tokens(FluxStream stream) const {
  return flux_own_tokens(stream, img_tokens_, txt_tokens_, sequence_ ? tensor_parallel_.size : 1,
                         tensor_parallel_.rank);
}

void CudaFluxModel::copy_token_runs(const FluxOwnTokens& at, bf16* own, bf16* whole, int64_t width,
                                    bool to_whole) const {
  for (const FluxTokenRun& run : at.runs) {
    bf16* place = whole + run.whole_first * width;
    bf16* slot = own + run.own_first * width;
    if (to_whole) {
      kernels::copy_rows({place, width, at.whole}, {slot, width, at.own}, batch_, run.count, width,
                         stream_);
    } else {
      kernels::copy_rows({slot, width, at.own}, {place, width, at.whole}, batch_, run.count, width,
                         stream_);
    }
  }
}

void CudaFluxModel::copy_staging(bf16* whole, FluxStream stream, int64_t width, bool to_whole) {
  for (int rank = 0; rank < tensor_parallel_.size; ++rank) {
    const FluxOwnTokens at =
        flux_own_tokens(stream, img_tokens_, txt_tokens_, tensor_parallel_.size, rank);
    copy_token_runs(at, buffers_->sequence_staging + rank * batch_ * at.own * width, whole, width,
                    to_whole);
  }
}

const bf16* CudaFluxModel::gather_tokens(const bf16* own, FluxStream stream, int64_t width,
                                         bf16* whole) {
  if (!sequence_) return own;
  const int64_t count = batch_ * own_tokens(stream).own * width;
  tensor_parallel_.all_gather_bf16(own, buffers_->sequence_staging, size_t(count), stream_);
  copy_staging(whole, stream, width, true);
  return whole;
}

const bf16* CudaFluxModel::reduce_to_own_tokens(bf16* partial, FluxStream stream, int64_t width,
                                                bf16* own) {
  const FluxOwnTokens tokens = own_tokens(stream);
  if (!sequence_) {
    tensor_parallel_.sum_partials(partial, batch_ * tokens.whole * width, stream_);
    return partial;
  }
  copy_staging(partial, stream, width, false);
  tensor_parallel_.reduce_scatter_bf16(buffers_->sequence_staging, own,
                                       size_t(batch_ * tokens.own * width), stream_);
  return own;
}

bf16* CudaFluxModel::partial_output(bf16* own) {
  return sequence_ ? buffers_->whole : own;
}

void CudaFluxModel::sum_modulation_gradient(float* dmod, int64_t width) {
  if (sequence_) tensor_parallel_.sum(dmod, size_t(batch_ * width), stream_);
}

void CudaFluxModel::save_group_input(bool doubles, int block) {
  const int group =
      recompute_group_starting_at(doubles ? recompute_.doubles : recompute_.singles, block);
  if (group >= 0) copy_group_input(doubles, size_t(group), true);
}

void CudaFluxModel::rerun_group_ending_at(bool doubles, int block) {
  const std::vector<RecomputeGroup>& groups = doubles ? recompute_.doubles : recompute_.singles;
  const int group = recompute_group_ending_at(groups, block);
  if (group < 0) return;
  // The backward reads neither the streams nor the joint sequence: they take the input back.
  copy_group_input(doubles, size_t(group), false);
  rerunning_ = true;
  pause_cuda_fp8_health(buffers_->linears, fp8_health_, true);
  for (int rerun = groups[size_t(group)].first; rerun < groups[size_t(group)].end; ++rerun) {
    if (doubles) {
      double_block_forward(rerun);
    } else {
      single_block_forward(rerun);
    }
  }
  pause_cuda_fp8_health(buffers_->linears, fp8_health_, false);
  rerunning_ = false;
}

void CudaFluxModel::joint_attention_forward(AttentionSaved& a) {
  Buffers& b = *buffers_;
  const ops::AttentionShape shape = joint_attention(config_, batch_, tokens_, heads_);
  if (b.fp8_attention) {
    b.fp8_attention->forward(a.out, a.stats, a.q, a.k, a.v, a.fp8, shape, attention_scale(config_),
                             stream_);
  } else {
    b.attention.forward(a.out, a.stats, a.q, a.k, a.v, shape, attention_scale(config_), stream_);
  }
}

void CudaFluxModel::joint_attention_backward(AttentionSaved& a) {
  Buffers& b = *buffers_;
  const ops::AttentionShape shape = joint_attention(config_, batch_, tokens_, heads_);
  if (b.fp8_attention) {
    b.fp8_attention->backward(b.dq, b.dk, b.dv, b.d_attn, a.fp8, a.stats, b.fp8_attention_scratch,
                              shape, attention_scale(config_), stream_);
  } else {
    b.attention.backward(b.dq, b.dk, b.dv, b.d_attn, a.q, a.k, a.v, a.out, a.stats, shape,
                         attention_scale(config_), stream_);
  }
}

void CudaFluxModel::single_block_backward(int block) {
  Buffers& b = *buffers_;
  SingleBlock& s = b.singles[size_t(block)];
  const int64_t B = batch_, C = config_.hidden_size, A = attention_width_, M = mlp_hidden_;
  const int64_t N = B * tokens_, width1 = 3 * A + M, width2 = A + M;
  const std::string prefix = fmt::format("single_blocks.{}", block);
  const kernels::StreamShape shape{B, own_tokens_, C, own_tokens_};
  FP8T_CUDA_CHECK(cudaMemsetAsync(b.dmod_img, 0, size_t(B * 3 * C) * sizeof(float), stream_));
  kernels::gated_residual_backward(b.d_branch, b.dmod_img + 2 * C, 3 * C, b.d_joint, s.out,
                                   s.mod + 2 * C, 3 * C, shape, b.reduction, stream_);
  if (selective_) linear2_input(s);  // the shared buffer holds a later block's
  linear_backward(prefix + ".linear2", gather_tokens(b.d_branch, FluxStream::Joint, C, b.whole),
                  s.linear2_in, N, b.d_linear2_in, false);
  kernels::gelu_tanh_backward(b.d_linear1_out + 3 * A, width1, b.d_linear2_in + A, width2,
                              s.linear1_out + 3 * A, width1, N, M, stream_);
  copy_rows(b.d_attn, A, b.d_linear2_in, width2, N, A, stream_);
  AttentionSaved& a = s.attention;
  joint_attention_backward(a);
  stream_from_joint(a, prefix + ".norm", b.d_linear1_out, width1, 0, tokens_);
  linear_backward(prefix + ".linear1", b.d_linear1_out,
                  gather_tokens(s.modulated, FluxStream::Joint, C, b.whole), N, b.d_modulated,
                  false);
  kernels::layernorm_modulate_backward(
      b.d_joint, b.dmod_img, b.dmod_img + C, 3 * C,
      reduce_to_own_tokens(b.d_modulated, FluxStream::Joint, C, b.d_own), s.normed, s.rstd,
      s.mod + C, 3 * C, shape, GradStore::Add, b.reduction, stream_);
  sum_modulation_gradient(b.dmod_img, 3 * C);
  kernels::cast_to_bf16(b.dmod, b.dmod_img, B * 3 * C, stream_);
  modulation_backward(prefix + ".modulation.lin");
}

void CudaFluxModel::double_block_backward(int block) {
  Buffers& b = *buffers_;
  DoubleBlock& saved = b.doubles[size_t(block)];
  const int64_t B = batch_, C = config_.hidden_size, A = attention_width_, M = mlp_hidden_;
  const std::string prefix = fmt::format("double_blocks.{}.", block);
  struct Part {
    const char* name;
    FluxStream stream;
    Stream& saved;
    bf16* dx;
    float* dmod;
    int64_t tokens, own_tokens, first;
  };
  const Part parts[] = {
      {"img", FluxStream::Image, saved.img, b.d_img, b.dmod_img, img_tokens_, own_img_,
       txt_tokens_},
      {"txt", FluxStream::Text, saved.txt, b.d_txt, b.dmod_txt, txt_tokens_, own_txt_, 0}};
  // The MLP halves and the attention projections, down to the joint attention's output.
  for (const Part& p : parts) {
    const std::string stream = prefix + p.name;
    const kernels::StreamShape shape{B, p.own_tokens, C, p.own_tokens};
    const int64_t rows = B * p.tokens;
    Stream& s = p.saved;
    FP8T_CUDA_CHECK(cudaMemsetAsync(p.dmod, 0, size_t(B * 6 * C) * sizeof(float), stream_));
    kernels::gated_residual_backward(b.d_branch, p.dmod + 5 * C, 6 * C, p.dx, s.mlp_out,
                                     s.mod + 5 * C, 6 * C, shape, b.reduction, stream_);
    if (selective_)  // the shared buffer holds another stream's or block's
      kernels::gelu_tanh_forward(s.mlp_act, M, s.mlp_hidden, M, rows, M, stream_);
    linear_backward(stream + "_mlp.2", gather_tokens(b.d_branch, p.stream, C, b.whole), s.mlp_act,
                    rows, b.d_mlp_act, false);
    kernels::gelu_tanh_backward(b.d_mlp_hidden, M, b.d_mlp_act, M, s.mlp_hidden, M, rows, M,
                                stream_);
    linear_backward(stream + "_mlp.0", b.d_mlp_hidden,
                    gather_tokens(s.modulated2, p.stream, C, b.whole), rows, b.d_modulated, false);
    kernels::layernorm_modulate_backward(p.dx, p.dmod + 3 * C, p.dmod + 4 * C, 6 * C,
                                         reduce_to_own_tokens(b.d_modulated, p.stream, C, b.d_own),
                                         s.norm2, s.rstd2, s.mod + 4 * C, 6 * C, shape,
                                         GradStore::Add, b.reduction, stream_);
    kernels::gated_residual_backward(b.d_branch, p.dmod + 2 * C, 6 * C, p.dx, s.proj, s.mod + 2 * C,
                                     6 * C, shape, b.reduction, stream_);
    linear_backward(stream + "_attn.proj", gather_tokens(b.d_branch, p.stream, C, b.whole), s.attn,
                    rows, b.d_modulated, false);
    into_joint(b.d_attn, b.d_modulated, A, p.first, p.tokens, A);
  }
  AttentionSaved& a = saved.attention;
  joint_attention_backward(a);
  for (const Part& p : parts) {
    const std::string stream = prefix + p.name;
    const kernels::StreamShape shape{B, p.own_tokens, C, p.own_tokens};
    const int64_t rows = B * p.tokens;
    Stream& s = p.saved;
    stream_from_joint(a, stream + "_attn.norm", b.d_qkv, 3 * A, p.first, p.tokens);
    linear_backward(stream + "_attn.qkv", b.d_qkv,
                    gather_tokens(s.modulated1, p.stream, C, b.whole), rows, b.d_modulated, false);
    kernels::layernorm_modulate_backward(
        p.dx, p.dmod, p.dmod + C, 6 * C, reduce_to_own_tokens(b.d_modulated, p.stream, C, b.d_own),
        s.norm1, s.rstd1, s.mod + C, 6 * C, shape, GradStore::Add, b.reduction, stream_);
    sum_modulation_gradient(p.dmod, 6 * C);
    kernels::cast_to_bf16(b.dmod, p.dmod, B * 6 * C, stream_);
    modulation_backward(stream + "_mod.lin");
  }
}

void CudaFluxModel::backward() {
  Buffers& b = *buffers_;
  FP8T_CHECK(b.forward_has_gradient, "backward() needs a forward with_gradient first");
  const int64_t B = batch_, C = config_.hidden_size;
  const int64_t Oi = own_img_, Ot = own_txt_, O = own_tokens_;
  FP8T_CUDA_CHECK(cudaMemsetAsync(b.d_vec_act, 0, size_t(B * C) * sizeof(bf16), stream_));
  FP8T_CUDA_CHECK(cudaMemsetAsync(b.d_joint, 0, size_t(B * O * C) * sizeof(bf16), stream_));

  // The final layer: its LayerNorm's gradient lands on the image rows of the joint sequence.
  const bf16* dpred = b.dpred;
  if (sequence_) {  // this rank's tokens of it
    copy_token_runs(own_tokens(FluxStream::Image), b.own_prediction, b.dpred, config_.in_channels,
                    false);
    dpred = b.own_prediction;
  }
  linear_backward("final_layer.linear", dpred, b.final_modulated, B * Oi, b.d_modulated, false);
  FP8T_CUDA_CHECK(cudaMemsetAsync(b.dmod_img, 0, size_t(B * 2 * C) * sizeof(float), stream_));
  const kernels::StreamShape image{B, Oi, C, O};
  kernels::layernorm_modulate_backward(b.d_joint + Ot * C, b.dmod_img, b.dmod_img + C, 2 * C,
                                       b.d_modulated, b.final_normed, b.final_rstd, b.final_mod + C,
                                       2 * C, image, GradStore::Add, b.reduction, stream_);
  sum_modulation_gradient(b.dmod_img, 2 * C);
  kernels::cast_to_bf16(b.dmod, b.dmod_img, B * 2 * C, stream_);
  modulation_backward("final_layer.adaLN_modulation.1");

  for (int block = config_.single_blocks - 1; block >= 0; --block) {
    rerun_group_ending_at(false, block);
    single_block_backward(block);
  }
  kernels::copy_rows({b.d_txt, C, Ot}, {b.d_joint, C, O}, B, Ot, C, stream_);
  kernels::copy_rows({b.d_img, C, Oi}, {b.d_joint + Ot * C, C, O}, B, Oi, C, stream_);
  for (int block = config_.double_blocks - 1; block >= 0; --block) {
    rerun_group_ending_at(true, block);
    double_block_backward(block);
  }

  // The inputs are not trained: the first linears need no dx.
  linear_backward("img_in", b.d_img, b.img, B * Oi, nullptr, false);
  linear_backward("txt_in", b.d_txt, b.txt, B * Ot, nullptr, false);
  tensor_parallel_.sum_partials(b.d_vec_act, B * C, stream_);  // the modulation shares' parts
  kernels::silu_backward(b.d_vec, b.d_vec_act, b.vec, B * C, GradStore::Write, stream_);
  embedder_backward("time_in", 0, b.d_vec);
  embedder_backward("vector_in", 1, b.d_vec);
  if (config_.guidance_embed) embedder_backward("guidance_in", 2, b.d_vec);
}

}  // namespace fp8t

#endif  // FP8TRAIN_WITH_CUDA
