#include "models/flux_model.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstring>
#include <initializer_list>
#include <iterator>
#include <map>
#include <random>
#include <tuple>
#include <utility>

#include <fmt/format.h>

#include "core/error.h"
#include "core/parallel_runs.h"
#include "models/fp8_layers.h"
#include "ops/attention.h"
#include "ops/flux_rope.h"
#include "ops/gelu.h"
#include "ops/layernorm.h"
#include "ops/modulation.h"
#include "ops/rmsnorm.h"
#include "ops/timestep.h"

namespace fp8t {

// BFL's QKNorm is an RMSNorm with eps 1e-6, not the machine epsilon of nanochat's norm.
constexpr float kQkNormEps = 1e-6f;

// The sizes every buffer is planned from.
struct FluxDims {
  int64_t batch, img_tokens, txt_tokens;
  int64_t tokens;  // per sample: the joint [txt; img] sequence
  // This rank's image and text tokens of each sample in the residual streams: all of them, or
  // under sequence parallelism its 1/T of each stream.
  int64_t own_img, own_txt;
  int64_t hidden, heads, head_dim, mlp_hidden;  // heads and mlp_hidden: this rank's share
  int64_t attention;                            // heads · head_dim: the attention's width
  int64_t in_channels, context_in_dim, vec_in_dim, timestep_dim;
  bool guidance;
  int double_blocks, single_blocks;
  bool sequence;  // sequence parallelism

  int64_t own_tokens() const { return own_txt + own_img; }
};

// What the activations hold under a recompute setting.
struct FluxSaving {
  bool selective = false;  // GELU's outputs shared among the blocks, computed again in backward
  // Per block, the set of activations it saves into: the blocks that save their own come
  // first, one set each, then one set per place in a full recompute group, which the groups
  // share (models/recompute.h).
  std::vector<int> double_set, single_set;
  int double_sets = 0, single_sets = 0;
  int double_groups = 0, single_groups = 0;  // full recompute: each saves its input
};

// One MLPEmbedder (time_in, vector_in, guidance_in), [B, ·].
struct FluxEmbedderActivations {
  TensorView input;   // the in_layer's input: the sinusoid of t or guidance, or a copy of y
  TensorView hidden;  // [B, C] in_layer's output, before SiLU
  TensorView act;     // [B, C] after SiLU: out_layer's input
};

// The joint attention of a block over [txt; img]: [B, L, H, D] unless noted.
struct FluxAttentionActivations {
  TensorView q_normed, k_normed;  // RMS-normalized per head, before the learnable scale
  TensorView q_rstd, k_rstd;      // [B, L, H]
  TensorView q, k, v;             // the attention's inputs: q and k scaled and rotated
  TensorView lse;                 // [B, H, L]
};

// One stream of a double block: [B, O_s, C] for this rank's O_s of its L_s tokens (all of them
// without sequence parallelism) unless noted.
struct FluxStreamActivations {
  TensorView mod;                // [B, 6C]: shift1, scale1, gate1, shift2, scale2, gate2
  TensorView norm1_rstd, norm1;  // [B, O_s] and LN(x)
  TensorView modulated1;         // qkv's input
  TensorView attn;               // [B, L_s, A]: this stream's part of the attention output
  TensorView proj;               // proj's output: the first gated branch
  TensorView norm2_rstd, norm2;
  TensorView modulated2;  // mlp.0's input
  TensorView mlp_hidden;  // [B, L_s, M] before GELU
  TensorView mlp_act;     // [B, L_s, M]: mlp.2's input; shared under selective recompute
  TensorView mlp_out;     // the second gated branch
};

struct FluxDoubleActivations {
  FluxStreamActivations img, txt;
  FluxAttentionActivations attention;
};

// A single block on the joint sequence: [B, O, C] for this rank's O of its L tokens unless
// noted.
struct FluxSingleActivations {
  TensorView mod;  // [B, 3C]: shift, scale, gate
  TensorView norm_rstd, norm;
  TensorView modulated;  // linear1's input
  FluxAttentionActivations attention;
  TensorView mlp_hidden;  // [B, L, M] before GELU
  TensorView linear2_in;  // [B, L, C + M]: the attention output, then GELU(mlp_hidden); shared
                          // under selective recompute
  TensorView attn;        // selective recompute: [B, L, C] the attention output, kept apart
  TensorView out;         // linear2's output: the gated branch
};

// Full recompute: the residual streams (this rank's tokens) a group of double blocks starts from.
struct FluxDoubleGroupInput {
  TensorView img, txt;  // [B, O_img, C], [B, O_txt, C]
};

// What forward saves for backward.
struct FluxActivations {
  TensorView img, txt;  // copies of this rank's tokens of the inputs of img_in and txt_in
  FluxEmbedderActivations time_in, vector_in, guidance_in;
  TensorView vec;      // [B, C]
  TensorView vec_act;  // [B, C] SiLU(vec): the input of every modulation
  // Per block: the views of its set (bind_blocks()).
  std::vector<FluxDoubleActivations> double_blocks;
  std::vector<FluxSingleActivations> single_blocks;
  std::vector<FluxDoubleActivations> double_sets;  // as FluxSaving numbers them
  std::vector<FluxSingleActivations> single_sets;
  // Full recompute: per group, the input of its first block.
  std::vector<FluxDoubleGroupInput> double_group_inputs;
  std::vector<TensorView> single_group_inputs;  // [B, O, C]
  // Selective recompute: GELU's outputs, shared among the blocks.
  TensorView mlp_act;     // [B · max(L_img, L_txt), M]: of a double block's stream
  TensorView linear2_in;  // [B, L, C + M]: of a single block
  TensorView final_mod;   // [B, 2C]: shift, scale
  TensorView final_norm_rstd, final_norm;
  TensorView final_modulated;  // [B, O_img, C]: final_layer.linear's input

  // Calls tensor(slot, shape) for every tensor above but the per-block views, in one place for
  // sizing and allocation.
  template <typename Visit>
  void visit(const FluxDims& d, const FluxSaving& saving, Visit&& tensor);
  // Points every block at its set and, under selective recompute, at the shared buffers.
  void bind_blocks(const FluxDims& d, const FluxSaving& saving);
};

// Temporaries of one forward and backward. N = B·L rows hold any stream's tokens, O = B·O_joint
// rows this rank's tokens of any stream (O_img + O_txt = O_joint per sample; all of them without
// sequence parallelism).
struct FluxWorkspace {
  // The residual streams, this rank's tokens: [B, O_img, C], [B, O_txt, C], [B, O_joint, C].
  TensorView img, txt, joint;
  TensorView projection;    // [N, 3C + M]: a stream's qkv or linear1's output
  TensorView q_raw, k_raw;  // [B, L, H, D] before the QK norm
  TensorView attn;          // [B, L, C]: the attention output
  TensorView embedding;     // [B, C]: one embedder's output
  // Backward.
  TensorView d_img, d_txt, d_joint;        // gradients of the residual streams
  TensorView d_mod_img, d_mod_txt;         // [B, 6C]: of a double block's modulation outputs
  TensorView mod_share;                    // [B, ≤ 6C]: a split modulation's share
  TensorView d_vec_act, d_vec;             // [B, C]
  TensorView d_embed_act, d_embed_hidden;  // [B, C]
  TensorView d_branch, d_norm;             // [O, C]
  TensorView d_modulated;                  // [N, C]: a column-parallel linear's input gradient
  TensorView d_mlp_act, d_mlp_hidden;      // [N, M]
  TensorView d_projection;                 // [N, 3C + M]
  TensorView d_linear2_in;                 // [N, C + M]
  TensorView d_attn, dq, dk, dv, d_rotated, d_normed, dq_raw, dk_raw;  // [N, A]
  // Sequence parallelism only: a stream's every token [N, C] (a gathered input or output
  // gradient, a row-parallel linear's partial output), a gather's tokens in the group's rank
  // order (of the hidden width, or the prediction's), a summed input gradient's own tokens
  // [O, C], and the final layer's output (or its gradient) on this rank's image tokens
  // [B, O_img, in_channels].
  TensorView whole, ranks, own, own_prediction;

  template <typename Visit>
  void visit(const FluxDims& d, Visit&& tensor);
};

template <typename Visit>
void FluxActivations::visit(const FluxDims& d, const FluxSaving& saving, Visit&& tensor) {
  const int64_t B = d.batch, Li = d.img_tokens, Lt = d.txt_tokens, L = d.tokens;
  const int64_t C = d.hidden, H = d.heads, D = d.head_dim, M = d.mlp_hidden, A = d.attention;
  // The residual streams' tensors hold this rank's tokens (Oi, Ot, O), the attention's and the
  // MLP's every token of its heads and hidden features.
  const int64_t Oi = d.own_img, Ot = d.own_txt, O = d.own_tokens();
  tensor(img, {B, Oi, d.in_channels});
  tensor(txt, {B, Ot, d.context_in_dim});
  const auto embedder = [&](FluxEmbedderActivations& saved, int64_t in) {
    tensor(saved.input, {B, in});
    tensor(saved.hidden, {B, C});
    tensor(saved.act, {B, C});
  };
  embedder(time_in, d.timestep_dim);
  embedder(vector_in, d.vec_in_dim);
  if (d.guidance) embedder(guidance_in, d.timestep_dim);
  tensor(vec, {B, C});
  tensor(vec_act, {B, C});
  const auto attention = [&](FluxAttentionActivations& saved) {
    for (TensorView* view : {&saved.q_normed, &saved.k_normed, &saved.q, &saved.k, &saved.v})
      tensor(*view, {B, L, H, D});
    tensor(saved.q_rstd, {B, L, H});
    tensor(saved.k_rstd, {B, L, H});
    tensor(saved.lse, {B, H, L});
  };
  double_sets.resize(static_cast<size_t>(saving.double_sets));
  for (FluxDoubleActivations& block : double_sets) {
    for (const auto& [stream, Ls, Os] :
         {std::tuple{&block.img, Li, Oi}, std::tuple{&block.txt, Lt, Ot}}) {
      tensor(stream->mod, {B, 6 * C});
      for (TensorView* view : {&stream->norm1_rstd, &stream->norm2_rstd})
        tensor(*view, {B, Os});
      for (TensorView* view : {&stream->norm1, &stream->modulated1, &stream->proj, &stream->norm2,
                               &stream->modulated2, &stream->mlp_out}) {
        tensor(*view, {B, Os, C});
      }
      tensor(stream->attn, {B, Ls, A});
      tensor(stream->mlp_hidden, {B, Ls, M});
      if (!saving.selective) tensor(stream->mlp_act, {B, Ls, M});
    }
    attention(block.attention);
  }
  single_sets.resize(static_cast<size_t>(saving.single_sets));
  for (FluxSingleActivations& block : single_sets) {
    tensor(block.mod, {B, 3 * C});
    tensor(block.norm_rstd, {B, O});
    for (TensorView* view : {&block.norm, &block.modulated, &block.out})
      tensor(*view, {B, O, C});
    attention(block.attention);
    tensor(block.mlp_hidden, {B, L, M});
    if (saving.selective) {
      tensor(block.attn, {B, L, A});
    } else {
      tensor(block.linear2_in, {B, L, A + M});
    }
  }
  double_group_inputs.resize(static_cast<size_t>(saving.double_groups));
  for (FluxDoubleGroupInput& input : double_group_inputs) {
    tensor(input.img, {B, Oi, C});
    tensor(input.txt, {B, Ot, C});
  }
  single_group_inputs.resize(static_cast<size_t>(saving.single_groups));
  for (TensorView& input : single_group_inputs)
    tensor(input, {B, O, C});
  if (saving.selective && d.double_blocks > 0) tensor(mlp_act, {B * std::max(Li, Lt), M});
  if (saving.selective && d.single_blocks > 0) tensor(linear2_in, {B, L, A + M});
  tensor(final_mod, {B, 2 * C});
  tensor(final_norm_rstd, {B, Oi});
  tensor(final_norm, {B, Oi, C});
  tensor(final_modulated, {B, Oi, C});
}

void FluxActivations::bind_blocks(const FluxDims& d, const FluxSaving& saving) {
  double_blocks.clear();
  for (const int set : saving.double_set)
    double_blocks.push_back(double_sets[static_cast<size_t>(set)]);
  single_blocks.clear();
  for (const int set : saving.single_set)
    single_blocks.push_back(single_sets[static_cast<size_t>(set)]);
  if (!saving.selective) return;
  const int64_t B = d.batch, M = d.mlp_hidden;
  for (FluxDoubleActivations& block : double_blocks) {
    block.img.mlp_act = TensorView(mlp_act.raw(), DType::F32, {B, d.img_tokens, M});
    block.txt.mlp_act = TensorView(mlp_act.raw(), DType::F32, {B, d.txt_tokens, M});
  }
  for (FluxSingleActivations& block : single_blocks)
    block.linear2_in = linear2_in;
}

template <typename Visit>
void FluxWorkspace::visit(const FluxDims& d, Visit&& tensor) {
  const int64_t B = d.batch, N = d.batch * d.tokens, C = d.hidden, M = d.mlp_hidden;
  const int64_t A = d.attention, O = d.batch * d.own_tokens();
  for (TensorView* view : {&img, &d_img})
    tensor(*view, {B * d.own_img, C});
  for (TensorView* view : {&txt, &d_txt})
    tensor(*view, {B * d.own_txt, C});
  for (TensorView* view : {&joint, &d_joint, &d_branch, &d_norm})
    tensor(*view, {O, C});
  tensor(d_modulated, {N, C});
  if (d.sequence) {
    tensor(whole, {N, C});
    tensor(ranks, {std::max(N * C, B * d.img_tokens * d.in_channels)});
    tensor(own, {O, C});
    tensor(own_prediction, {B, d.own_img, d.in_channels});
  }
  for (TensorView* view :
       {&q_raw, &k_raw, &attn, &d_attn, &dq, &dk, &dv, &d_rotated, &d_normed, &dq_raw, &dk_raw}) {
    tensor(*view, {N, A});
  }
  for (TensorView* view : {&projection, &d_projection})
    tensor(*view, {N, 3 * A + M});
  for (TensorView* view : {&embedding, &d_vec_act, &d_vec, &d_embed_act, &d_embed_hidden})
    tensor(*view, {B, C});
  for (TensorView* view : {&d_mod_img, &d_mod_txt, &mod_share})
    tensor(*view, {B, 6 * C});
  for (TensorView* view : {&d_mlp_act, &d_mlp_hidden})
    tensor(*view, {N, M});
  tensor(d_linear2_in, {N, A + M});
}

namespace {

FluxDims flux_dims(const FluxConfig& config, int64_t batch, int64_t img_tokens, int64_t txt_tokens,
                   int tensor_parallel = 1, bool sequence = false) {
  const int64_t heads = config.num_heads / tensor_parallel;
  const int64_t streams_split = sequence ? tensor_parallel : 1;
  return {batch,
          img_tokens,
          txt_tokens,
          txt_tokens + img_tokens,
          img_tokens / streams_split,
          txt_tokens / streams_split,
          config.hidden_size,
          heads,
          config.head_dim(),
          config.mlp_hidden() / tensor_parallel,
          heads * config.head_dim(),
          config.in_channels,
          config.context_in_dim,
          config.vec_in_dim,
          config.timestep_dim(),
          config.guidance_embed,
          config.double_blocks,
          config.single_blocks,
          sequence};
}

// The set of saved activations each block of a stack saves into (FluxSaving numbers them).
std::vector<int> activation_sets_of_blocks(const std::vector<RecomputeGroup>& groups, int blocks) {
  const std::vector<int> slots = recompute_slots(groups, blocks);
  const auto own = static_cast<int>(std::count(slots.begin(), slots.end(), -1));
  std::vector<int> set_of_block;
  int next_own = 0;
  for (const int slot : slots)
    set_of_block.push_back(slot < 0 ? next_own++ : own + slot);
  return set_of_block;
}

FluxSaving flux_saving(const FluxConfig& config, RecomputeGranularity granularity,
                       const FluxRecomputeGroups& groups) {
  FluxSaving saving;
  saving.selective = granularity == RecomputeGranularity::Selective;
  saving.double_set = activation_sets_of_blocks(groups.doubles, config.double_blocks);
  saving.single_set = activation_sets_of_blocks(groups.singles, config.single_blocks);
  saving.double_sets = recompute_saved_sets(groups.doubles, config.double_blocks);
  saving.single_sets = recompute_saved_sets(groups.singles, config.single_blocks);
  saving.double_groups = static_cast<int>(groups.doubles.size());
  saving.single_groups = static_cast<int>(groups.singles.size());
  return saving;
}

template <typename Tensors, typename... Layout>
size_t planned_bytes(const Layout&... layout) {
  Tensors sizing;
  size_t bytes = 0;
  sizing.visit(layout..., [&](TensorView&, std::initializer_list<int64_t> shape) {
    int64_t count = 1;
    for (int64_t extent : shape)
      count *= extent;
    bytes += Arena::footprint(DType::F32, count);
  });
  return bytes;
}

template <typename Tensors, typename... Layout>
std::unique_ptr<Tensors> allocate(Arena& arena, const Layout&... layout) {
  auto tensors = std::make_unique<Tensors>();
  tensors->visit(layout..., [&](TensorView& slot, std::initializer_list<int64_t> shape) {
    slot = arena.allocate(DType::F32, shape);
  });
  return tensors;
}

float* data(const TensorView& view) {
  return view.data<float>();
}

void zero(const TensorView& view) {
  std::memset(view.raw(), 0, view.bytes());
}

void add(float* out, const float* in, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    out[i] += in[i];
}

// BFL's MLPEmbedder and Modulation put SiLU (x·σ(x)) before their linears.
float sigmoid(float x) {
  return 1.0f / (1.0f + std::exp(-x));
}

void silu_forward(float* out, const float* in, int64_t n) {
  for (int64_t i = 0; i < n; ++i)
    out[i] = in[i] * sigmoid(in[i]);
}

// din += dout · σ(x)·(1 + x·(1 - σ(x))).
void silu_backward(float* din, const float* dout, const float* in, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float s = sigmoid(in[i]);
    din[i] += dout[i] * s * (1.0f + in[i] * (1.0f - s));
  }
}

// Where a stream's tokens sit in a [batch, per_sample, stride] buffer: from row `first` of each
// sample (in the joint sequence the image's tokens come after the text's).
struct TokenRows {
  int64_t per_sample;
  int64_t first;
  int64_t stride;
};

// to[b, to_rows.first + t, c] = from[b, from_rows.first + t, c] for t < tokens, c < width.
void copy_tokens(float* to, const TokenRows& to_rows, const float* from, const TokenRows& from_rows,
                 int64_t batch, int64_t tokens, int64_t width) {
  for (int64_t b = 0; b < batch; ++b) {
    for (int64_t t = 0; t < tokens; ++t) {
      std::copy_n(from + (b * from_rows.per_sample + from_rows.first + t) * from_rows.stride, width,
                  to + (b * to_rows.per_sample + to_rows.first + t) * to_rows.stride);
    }
  }
}

// A single block's linear2 input: per token the attention output [B, L, A], then GELU of the
// MLP's hidden values [B, L, M].
void fill_linear2_input(float* linear2_in, const float* attn, const float* mlp_hidden,
                        const FluxDims& d) {
  const int64_t L = d.tokens, A = d.attention, M = d.mlp_hidden;
  copy_tokens(linear2_in, {L, 0, A + M}, attn, {L, 0, A}, d.batch, L, A);
  for (int64_t row = 0; row < d.batch * L; ++row)
    ops::gelu_tanh_forward(linear2_in + row * (A + M) + A, mlp_hidden + row * M, M);
}

// out[b, t, h, :] = normed[b, t, h, :] · the QK-norm scale of token t's stream: the text's for
// the first txt_tokens tokens of each sample, the image's after them.
void scale_heads(float* out, const float* normed, const float* txt_scale, const float* img_scale,
                 const FluxDims& d) {
  const int64_t D = d.head_dim;
  for (int64_t b = 0; b < d.batch; ++b) {
    for (int64_t t = 0; t < d.tokens; ++t) {
      const float* scale = t < d.txt_tokens ? txt_scale : img_scale;
      for (int64_t h = 0; h < d.heads; ++h) {
        const int64_t row = ((b * d.tokens + t) * d.heads + h) * D;
        for (int64_t i = 0; i < D; ++i)
          out[row + i] = normed[row + i] * scale[i];
      }
    }
  }
}

// Writes dnormed = dout · scale; adds Σ dout · normed into the scale gradient of each stream.
void scale_heads_backward(float* dnormed, float* dtxt_scale, float* dimg_scale, const float* dout,
                          const float* normed, const float* txt_scale, const float* img_scale,
                          const FluxDims& d) {
  const int64_t D = d.head_dim;
  for (int64_t b = 0; b < d.batch; ++b) {
    for (int64_t t = 0; t < d.tokens; ++t) {
      const bool txt = t < d.txt_tokens;
      const float* scale = txt ? txt_scale : img_scale;
      float* dscale = txt ? dtxt_scale : dimg_scale;
      for (int64_t h = 0; h < d.heads; ++h) {
        const int64_t row = ((b * d.tokens + t) * d.heads + h) * D;
        for (int64_t i = 0; i < D; ++i) {
          dnormed[row + i] = dout[row + i] * scale[i];
          dscale[i] += dout[row + i] * normed[row + i];
        }
      }
    }
  }
}

bool is_fp8_candidate(FluxParamKind kind) {
  return kind == FluxParamKind::Attention || kind == FluxParamKind::Mlp ||
         kind == FluxParamKind::Single;
}

std::string non_candidate_reason(FluxParamKind kind) {
  switch (kind) {
    case FluxParamKind::Embedder:
      return "embedders stay in BF16";
    case FluxParamKind::Modulation:
      return "modulation stays in BF16";
    case FluxParamKind::Final:
      return "final layer stays in BF16";
    default:
      return "not a linear layer";
  }
}

// Flux's attention: every head its own k and v, no mask, over the joint [txt; img] sequence.
ops::AttentionShape joint_attention_shape(const FluxDims& d) {
  return {.batch = d.batch,
          .seq_len = d.tokens,
          .heads = d.heads,
          .kv_heads = d.heads,
          .head_dim = d.head_dim,
          .window = 0,
          .causal = false};
}

// One stream of a double block, as its forward and backward see it.
struct Stream {
  std::string prefix;  // "double_blocks.{i}.img" or ".txt"
  FluxStream stream;
  FluxStreamActivations& saved;
  TokenRows stream_rows;  // its rows in its own [B, L_s, A] attention buffers
  TokenRows joint;        // its rows in the joint [B, L, A] attention (the text comes first)
  int64_t tokens;         // L_s
  int64_t own_tokens;     // of them, this rank's in the residual stream
  float* x;               // its residual stream [B, own_tokens, C]
  float* dx;              // the gradient of that residual
  float* dmod;            // [B, 6C]: the gradient of its modulation output
};

std::array<Stream, 2> double_block_streams(FluxActivations& act, FluxWorkspace& ws,
                                           const FluxDims& d, int block) {
  FluxDoubleActivations& saved = act.double_blocks[static_cast<size_t>(block)];
  const int64_t A = d.attention, L = d.tokens;
  return {Stream{fmt::format("double_blocks.{}.img", block), FluxStream::Image, saved.img,
                 TokenRows{d.img_tokens, 0, A}, TokenRows{L, d.txt_tokens, A}, d.img_tokens,
                 d.own_img, data(ws.img), data(ws.d_img), data(ws.d_mod_img)},
          Stream{fmt::format("double_blocks.{}.txt", block), FluxStream::Text, saved.txt,
                 TokenRows{d.txt_tokens, 0, A}, TokenRows{L, 0, A}, d.txt_tokens, d.own_txt,
                 data(ws.txt), data(ws.d_txt), data(ws.d_mod_txt)}};
}

}  // namespace

size_t FluxParameterSet::planned_bytes(const FluxConfig& config, DType dtype) {
  size_t bytes = 0;
  for (const FluxParam& param : flux_parameters(config))
    bytes += Arena::footprint(dtype, param.numel());
  return bytes;
}

FluxParameterSet::FluxParameterSet(Arena& arena, const FluxConfig& config, DType dtype)
    : specs_(flux_parameters(config)) {
  for (const FluxParam& param : specs_) {
    TensorView view = param.shape.size() == 1
                          ? arena.allocate(dtype, {param.shape[0]})
                          : arena.allocate(dtype, {param.shape[0], param.shape[1]});
    tensors_.emplace(param.name, view);
  }
}

TensorView& FluxParameterSet::operator[](const std::string& name) {
  const auto found = tensors_.find(name);
  FP8T_CHECK(found != tensors_.end(), "no Flux parameter named '{}'", name);
  return found->second;
}

const TensorView& FluxParameterSet::operator[](const std::string& name) const {
  const auto found = tensors_.find(name);
  FP8T_CHECK(found != tensors_.end(), "no Flux parameter named '{}'", name);
  return found->second;
}

void FluxParameterSet::fill_zero() {
  for (auto& [name, view] : tensors_)
    zero(view);
}

std::vector<FluxLinear> flux_linears(const FluxConfig& config) {
  std::vector<FluxLinear> linears;
  for (const FluxParam& param : flux_parameters(config)) {
    constexpr std::string_view kWeight = ".weight";
    if (!param.name.ends_with(kWeight)) continue;
    linears.push_back({param.name.substr(0, param.name.size() - kWeight.size()), param.shape[1],
                       param.shape[0], param.kind, param.block});
  }
  return linears;
}

FluxRankParameters flux_rank_parameters(const FluxConfig& config, int size, int rank) {
  std::map<std::string, TensorShare> shares;
  for (const FluxLinear& linear : flux_linears(config)) {
    TensorShare share = flux_tensor_share(linear, config, size, rank);
    if (share.split != TensorSplit::None) shares.emplace(linear.name, std::move(share));
  }
  FluxRankParameters rank_parameters;
  std::vector<FluxParam> replicated;
  for (FluxParam param : flux_parameters(config)) {
    const std::string linear = param.name.substr(0, param.name.rfind('.'));
    const auto found = shares.find(linear);
    // A row-parallel bias stays whole: the group's first rank adds it.
    if (found == shares.end() || (param.is_bias() && found->second.split == TensorSplit::Inputs)) {
      replicated.push_back(std::move(param));
      continue;
    }
    const int64_t out = param.shape[0], in = param.is_bias() ? 1 : param.shape[1];
    const auto [share_in, share_out] = found->second.features(in, out);
    param.shape = param.is_bias() ? std::vector<int64_t>{share_out}
                                  : std::vector<int64_t>{share_out, share_in};
    rank_parameters.parameters.push_back(std::move(param));
  }
  rank_parameters.shares = rank_parameters.parameters.size();
  std::ranges::move(replicated, std::back_inserter(rank_parameters.parameters));
  return rank_parameters;
}

std::vector<FluxLinearPrecision> decide_flux_precision(const FluxConfig& config,
                                                       const PrecisionOptions& options) {
  const std::vector<FluxLinear> linears = flux_linears(config);
  // The candidates go through the GPT's filter as block linears, with the blocks numbered
  // double ones first, as first_last_layers_bf16 counts them.
  std::vector<LinearSpec> candidates;
  for (const FluxLinear& linear : linears) {
    if (!is_fp8_candidate(linear.kind)) continue;
    candidates.push_back({linear.name, linear.in_features, linear.out_features,
                          ParamKind::BlockLinear, linear.block});
  }
  const std::vector<LinearPrecision> candidate_decisions =
      decide_precision(candidates, config.double_blocks + config.single_blocks, options);
  std::vector<FluxLinearPrecision> decisions;
  auto next = candidate_decisions.begin();
  for (const FluxLinear& linear : linears) {
    if (is_fp8_candidate(linear.kind)) {
      decisions.push_back({linear, next->fp8, next->reason});
      ++next;
    } else {
      decisions.push_back(
          {linear, false,
           options.mode == Fp8Mode::None ? "fp8: none" : non_candidate_reason(linear.kind)});
    }
  }
  return decisions;
}

void init_flux_weights(FluxParameterSet& parameters, const FluxConfig& config, uint64_t seed) {
  // Every run of kInitRunValues values draws from a generator of its own, seeded by the seed,
  // the tensor's place and the run's: the values do not depend on how many threads draw them,
  // and flux_12b's 12 B draws take seconds on a many-core host instead of minutes on one core.
  struct InitRun {
    float* values;
    int64_t count;
    float bound;  // uniform in ±bound; 0: zeros
    uint32_t tensor;
    uint32_t run;
  };
  std::map<std::string, float> bounds;  // of the drawn weights and biases
  for (const FluxLinear& linear : flux_linears(config)) {
    if (linear.kind == FluxParamKind::Modulation || linear.kind == FluxParamKind::Final) continue;
    const auto bound = static_cast<float>(1.0 / std::sqrt(double(linear.in_features)));
    for (const char* part : {".weight", ".bias"})
      bounds[linear.name + part] = bound;
  }
  std::vector<InitRun> runs;
  for (size_t tensor = 0; tensor < parameters.specs().size(); ++tensor) {
    const FluxParam& param = parameters.specs()[tensor];
    TensorView& view = parameters[param.name];
    if (param.kind == FluxParamKind::NormScale) {
      std::fill_n(view.data<float>(), view.numel(), 1.0f);
      continue;
    }
    const auto found = bounds.find(param.name);
    const float bound = found == bounds.end() ? 0.0f : found->second;
    for (int64_t first = 0; first < view.numel(); first += kInitRunValues) {
      runs.push_back({view.data<float>() + first, std::min(kInitRunValues, view.numel() - first),
                      bound, static_cast<uint32_t>(tensor),
                      static_cast<uint32_t>(first / kInitRunValues)});
    }
  }
  parallel_runs(std::ssize(runs), 1, [&](int64_t first, int64_t last) {
    for (int64_t index = first; index < last; ++index) {
      const InitRun& run = runs[static_cast<size_t>(index)];
      if (run.bound == 0.0f) {
        std::fill_n(run.values, run.count, 0.0f);
        continue;
      }
      std::seed_seq seeds{static_cast<uint32_t>(seed), static_cast<uint32_t>(seed >> 32),
                          run.tensor, run.run};
      std::mt19937_64 generator(seeds);
      std::uniform_real_distribution<float> uniform(-run.bound, run.bound);
      for (int64_t i = 0; i < run.count; ++i)
        run.values[i] = uniform(generator);
    }
  });
}

std::string flux_precision_summary(const std::vector<FluxLinearPrecision>& decisions) {
  std::vector<std::pair<std::string, int>> reasons;  // in order of first appearance
  size_t fp8_count = 0;
  for (const FluxLinearPrecision& decision : decisions) {
    if (decision.fp8) {
      ++fp8_count;
      continue;
    }
    const auto found = std::find_if(reasons.begin(), reasons.end(), [&](const auto& entry) {
      return entry.first == decision.reason;
    });
    if (found == reasons.end()) {
      reasons.emplace_back(decision.reason, 1);
    } else {
      ++found->second;
    }
  }
  std::string text = fmt::format("FP8: {}/{} linear layers; ", fp8_count, decisions.size());
  if (reasons.empty()) return text + "none kept in BF16";
  std::string listing;
  for (const auto& [reason, count] : reasons)
    listing += fmt::format("{}{} × {}", listing.empty() ? "" : "; ", count, reason);
  return text + fmt::format("{} kept in BF16 ({})", decisions.size() - fp8_count, listing);
}

int64_t flux_linear_rows(const FluxLinear& linear, int64_t batch, int64_t img_tokens,
                         int64_t txt_tokens) {
  const bool img = linear.name == "img_in" || linear.name.find(".img_") != std::string::npos;
  const bool txt = linear.name == "txt_in" || linear.name.find(".txt_") != std::string::npos;
  switch (linear.kind) {
    case FluxParamKind::Attention:
    case FluxParamKind::Mlp:
      return batch * (img ? img_tokens : txt_tokens);
    case FluxParamKind::Single:
      return batch * (img_tokens + txt_tokens);
    case FluxParamKind::Final:
      return batch * img_tokens;
    case FluxParamKind::Embedder:
      return batch * (img ? img_tokens : txt ? txt_tokens : 1);
    default:  // the modulation linears read SiLU(vec)
      return batch;
  }
}

bool flux_reads_own_tokens(const std::string& linear) {
  return linear == "img_in" || linear == "txt_in" || linear == "final_layer.linear";
}

FluxOwnTokens flux_own_tokens(FluxStream stream, int64_t img_tokens, int64_t txt_tokens, int size,
                              int rank) {
  if (size == 1) rank = 0;  // every token, whatever the rank's place in its group
  const int64_t own_img = img_tokens / size, own_txt = txt_tokens / size;
  switch (stream) {
    case FluxStream::Image:
      return {img_tokens, own_img, {{rank * own_img, 0, own_img}}};
    case FluxStream::Text:
      return {txt_tokens, own_txt, {{rank * own_txt, 0, own_txt}}};
    case FluxStream::Joint:
      break;
  }
  return {img_tokens + txt_tokens,
          own_img + own_txt,
          {{rank * own_txt, 0, own_txt}, {txt_tokens + rank * own_img, own_txt, own_img}}};
}

double flux_flops_per_sample(const FluxConfig& config, int64_t img_tokens, int64_t txt_tokens) {
  const FluxDims dims = flux_dims(config, 1, img_tokens, txt_tokens);
  double flops = 0.0;
  for (const FluxLinear& linear : flux_linears(config)) {
    flops += 6.0 * double(flux_linear_rows(linear, 1, img_tokens, txt_tokens)) *
             double(linear.in_features) * double(linear.out_features);
  }
  const int blocks = config.double_blocks + config.single_blocks;
  return flops + 12.0 * blocks * double(dims.tokens) * double(dims.tokens) * double(dims.hidden);
}

FluxModel::FluxModel(const FluxConfig& config, int64_t batch, int64_t img_tokens,
                     int64_t txt_tokens, const FluxPrecision& precision,
                     const RecomputeOptions& recompute, const TensorParallel& tensor_parallel)
    : config_(config),
      batch_(batch),
      img_tokens_(img_tokens),
      txt_tokens_(txt_tokens),
      precision_(precision),
      recompute_(recompute),
      tensor_parallel_(tensor_parallel) {
  config_.validate();
  const int group = tensor_parallel_.size;
  check_flux_tensor_parallel(config_, group);
  check_group(tensor_parallel_, precision_.fp8_attention);
  FP8T_CHECK(batch >= 1, "expected a batch of at least 1, found {}", batch);
  FP8T_CHECK(img_tokens >= 1 && txt_tokens >= 1,
             "expected at least one image and one text token, found {} and {}", img_tokens,
             txt_tokens);
  sequence_ = tensor_parallel_.sequence;
  if (sequence_) check_flux_sequence_parallel(group, img_tokens, txt_tokens);
  recompute_groups_ =
      flux_recompute_groups(recompute_, config_.double_blocks, config_.single_blocks);
  const FluxDims dims = this->dims();
  const FluxSaving saving = flux_saving(config_, recompute_.granularity, recompute_groups_);
  const size_t parameter_bytes = FluxParameterSet::planned_bytes(config_, DType::F32);
  parameter_arena_ = std::make_unique<Arena>("parameters", parameter_bytes);
  gradient_arena_ = std::make_unique<Arena>("gradients", parameter_bytes);
  activation_arena_ =
      std::make_unique<Arena>("activations", planned_bytes<FluxActivations>(dims, saving));
  workspace_arena_ = std::make_unique<Arena>("workspace", planned_bytes<FluxWorkspace>(dims));
  parameters_ = std::make_unique<FluxParameterSet>(*parameter_arena_, config_, DType::F32);
  gradients_ = std::make_unique<FluxParameterSet>(*gradient_arena_, config_, DType::F32);
  activations_ = allocate<FluxActivations>(*activation_arena_, dims, saving);
  activations_->bind_blocks(dims, saving);
  workspace_ = allocate<FluxWorkspace>(*workspace_arena_, dims);
  parameters_->fill_zero();
  gradients_->fill_zero();

  ids_.assign(static_cast<size_t>(dims.tokens * 3), 0.0f);  // the text's ids stay zero
  rope_cos_.resize(static_cast<size_t>(dims.tokens * dims.head_dim / 2));
  rope_sin_.resize(rope_cos_.size());

  linear_precision_ = decide_flux_precision(config_, precision_.policy);
  for (FluxLinearPrecision& decision : linear_precision_) {
    const FluxLinear& spec = decision.linear;
    // Under sequence parallelism the linears on the residual streams' ends read this rank's
    // tokens.
    const int64_t tokens = sequence_ && flux_reads_own_tokens(spec.name)
                               ? flux_linear_rows(spec, batch, dims.own_img, dims.own_txt)
                               : flux_linear_rows(spec, batch, img_tokens, txt_tokens);
    Linear layer{{tokens, spec.in_features, spec.out_features},
                 parameter(spec.name + ".weight"),
                 parameter(spec.name + ".bias"),
                 gradient(spec.name + ".weight"),
                 gradient(spec.name + ".bias"),
                 nullptr,
                 share_of(spec)};
    layer.shape.in_features = layer.share.in_features();
    layer.shape.out_features = layer.share.out_features();
    if (layer.share.split() == Split::Inputs && tensor_parallel_.rank != 0) {
      layer.bias = nullptr;  // the sum over the group adds rank 0's
      layer.grad_bias = nullptr;
    }
    layer.fp8 = make_fp8_share(decision.fp8, decision.reason, layer.shape, layer.share.split(),
                               precision_, tensor_parallel_);
    linears_.emplace(spec.name, std::move(layer));
  }
  if (precision_.fp8_attention) {
    fp8_attention_.assign(static_cast<size_t>(config_.double_blocks + config_.single_blocks),
                          ops::AttentionFp8(attention_fp8_formats(precision_)));
  }
}

FluxModel::~FluxModel() = default;

size_t FluxModel::planned_activation_bytes(const FluxConfig& config, int64_t batch,
                                           int64_t img_tokens, int64_t txt_tokens,
                                           const RecomputeOptions& recompute, int tensor_parallel,
                                           bool sequence_parallel) {
  const FluxRecomputeGroups groups =
      flux_recompute_groups(recompute, config.double_blocks, config.single_blocks);
  if (sequence_parallel) check_flux_sequence_parallel(tensor_parallel, img_tokens, txt_tokens);
  return planned_bytes<FluxActivations>(
      flux_dims(config, batch, img_tokens, txt_tokens, tensor_parallel, sequence_parallel),
      flux_saving(config, recompute.granularity, groups));
}

FluxDims FluxModel::dims() const {
  return flux_dims(config_, batch_, img_tokens_, txt_tokens_, tensor_parallel_.size, sequence_);
}

FluxOwnTokens FluxModel::own_tokens(FluxStream stream) const {
  return own_tokens(stream, tensor_parallel_.rank);
}

FluxOwnTokens FluxModel::own_tokens(FluxStream stream, int rank) const {
  return flux_own_tokens(stream, img_tokens_, txt_tokens_, sequence_ ? tensor_parallel_.size : 1,
                         rank);
}

void FluxModel::init_weights(uint64_t seed) {
  init_flux_weights(*parameters_, config_, seed);
  end_step();  // the FP8 weight caches hold the old weights
}

FluxModel::Linear& FluxModel::linear(const std::string& name) {
  const auto found = linears_.find(name);
  FP8T_CHECK(found != linears_.end(), "no Flux linear layer named '{}'", name);
  return found->second;
}

float* FluxModel::parameter(const std::string& name) {
  return (*parameters_)[name].data<float>();
}

float* FluxModel::gradient(const std::string& name) {
  return (*gradients_)[name].data<float>();
}

TensorShare flux_tensor_share(const FluxLinear& linear, const FluxConfig& config, int size,
                              int rank) {
  if (size == 1) return {};
  const int64_t C = config.hidden_size, A = C / size, M = config.mlp_hidden() / size;
  const auto ends_with = [&](std::string_view suffix) { return linear.name.ends_with(suffix); };
  const std::vector<ShareSegment> heads = {{rank * A, A}, {C + rank * A, A}, {2 * C + rank * A, A}};
  if (ends_with("_attn.qkv")) return {TensorSplit::Outputs, heads};
  if (ends_with(".linear1")) {
    std::vector<ShareSegment> rows = heads;
    rows.push_back({3 * C + rank * M, M});
    return {TensorSplit::Outputs, rows};
  }
  if (ends_with("_mlp.0")) return {TensorSplit::Outputs, {{rank * M, M}}};
  if (linear.kind == FluxParamKind::Modulation) {  // a run of the shift, scale and gate chunks
    const int64_t chunks = linear.out_features / size;
    return {TensorSplit::Outputs, {{rank * chunks, chunks}}};
  }
  if (ends_with("_attn.proj")) return {TensorSplit::Inputs, {{rank * A, A}}};
  if (ends_with("_mlp.2")) return {TensorSplit::Inputs, {{rank * M, M}}};
  if (ends_with(".linear2")) return {TensorSplit::Inputs, {{rank * A, A}, {C + rank * M, M}}};
  return {};
}

void keep_unblocked_flux_shares_in_bf16(std::vector<FluxLinearPrecision>& decisions,
                                        const FluxConfig& config, ScalingRecipe recipe, int size) {
  for (FluxLinearPrecision& decision : decisions) {
    const TensorShare share = flux_tensor_share(decision.linear, config, size, 0);
    if (!decision.fp8 || share.split == TensorSplit::None) continue;
    const auto [in, out] =
        share.features(decision.linear.in_features, decision.linear.out_features);
    if (std::optional<std::string> why = tensor_parallel_share_reason(in, out, recipe, size)) {
      decision.fp8 = false;
      decision.reason = *why;
    }
  }
}

WeightShare FluxModel::share_of(const FluxLinear& linear) const {
  const int64_t out = linear.out_features, in = linear.in_features;
  const TensorShare share =
      flux_tensor_share(linear, config_, tensor_parallel_.size, tensor_parallel_.rank);
  if (share.split == Split::None) return WeightShare(out, in);
  return WeightShare(share.split, share.segments, out, in);
}

void FluxModel::sum_over_group(float* values, int64_t count) {
  if (tensor_parallel_.split()) tensor_parallel_.sum(values, static_cast<size_t>(count));
}

void FluxModel::copy_own_tokens(const float* from, float* to, FluxStream stream, int64_t width,
                                bool to_whole) const {
  copy_rank_tokens(tensor_parallel_.rank, from, to, stream, width, to_whole);
}

void FluxModel::copy_rank_tokens(int rank, const float* from, float* to, FluxStream stream,
                                 int64_t width, bool to_whole) const {
  const FluxOwnTokens tokens = own_tokens(stream, rank);
  for (const FluxTokenRun& run : tokens.runs) {
    const TokenRows own{tokens.own, run.own_first, width};
    const TokenRows whole{tokens.whole, run.whole_first, width};
    copy_tokens(to, to_whole ? whole : own, from, to_whole ? own : whole, batch_, run.count, width);
  }
}

const float* FluxModel::gather_tokens(const float* own, FluxStream stream) {
  if (!sequence_) return own;
  float* whole = data(workspace_->whole);
  gather_tokens_into(own, stream, config_.hidden_size, whole);
  return whole;
}

void FluxModel::gather_tokens_into(const float* own, FluxStream stream, int64_t width,
                                   float* whole) {
  // The ranks' tokens in rank order, [size, B·O_s, width], then each rank's runs to their places.
  const int64_t count = batch_ * own_tokens(stream).own * width;
  float* ranks = data(workspace_->ranks);
  tensor_parallel_.all_gather(own, ranks, static_cast<size_t>(count));
  for (int rank = 0; rank < tensor_parallel_.size; ++rank)
    copy_rank_tokens(rank, ranks + rank * count, whole, stream, width, /*to_whole=*/true);
}

const float* FluxModel::backward_input(const Linear& layer, const float* own, FluxStream stream) {
  return layer.fp8 ? nullptr : gather_tokens(own, stream);
}

float* FluxModel::partial_output(float* own) {
  return sequence_ ? data(workspace_->whole) : own;
}

const float* FluxModel::reduce_to_own_tokens(float* partial, FluxStream stream, int64_t width,
                                             float* own) {
  sum_over_group(partial, batch_ * own_tokens(stream).whole * width);
  if (!sequence_) return partial;
  copy_own_tokens(partial, own, stream, width, /*to_whole=*/false);
  return own;
}

void FluxModel::sum_modulation_gradient(float* dmod, int64_t width) {
  if (sequence_) sum_over_group(dmod, batch_ * width);
}

void FluxModel::gather_split_gradients() {
  if (!tensor_parallel_.split()) return;
  for (auto& [name, layer] : linears_) {
    // Under sequence parallelism the linears on the streams' ends saw this rank's tokens only.
    if (layer.share.split() == Split::None && !(sequence_ && flux_reads_own_tokens(name))) continue;
    for (const char* tensor : {".weight", ".bias"})  // every rank's: rank 0's alone adds a bias
      sum_over_group(gradient(name + tensor), (*gradients_)[name + tensor].numel());
  }
  for (const FluxParam& param : gradients_->specs()) {
    if (param.name.ends_with("_norm.scale"))  // each rank's heads add their part
      sum_over_group(gradient(param.name), param.numel());
  }
}

void FluxModel::linear_forward(Linear& layer, const float* x, float* y) {
  const auto [tokens, in, out] = layer.shape;
  WeightShare& share = layer.share;
  share.refresh(layer.weight, layer.bias);
  if (layer.fp8) {
    layer.fp8->forward(x, tokens, share.weight(), y);
  } else {
    ops::linear_forward(x, share.weight(), y, layer.shape, precision_.other_linears);
  }
  if (share.bias() == nullptr) return;
  for (int64_t row = 0; row < tokens; ++row)  // the bias stays out of FP8: fp32, after the GEMM
    add(y + row * out, share.bias(), out);
}

void FluxModel::linear_backward(Linear& layer, const float* dy, const float* x, float* dx) {
  const auto [tokens, in, out] = layer.shape;
  WeightShare& share = layer.share;
  share.refresh(layer.weight, layer.bias);
  share.begin_gradients(layer.grad_weight, layer.grad_bias);
  if (layer.fp8) {
    layer.fp8->backward(dy, tokens, dx, share.weight_gradient());
  } else {
    ops::linear_backward(dy, x, share.weight(), dx, share.weight_gradient(), layer.shape,
                         precision_.other_linears);
  }
  if (share.bias_gradient() != nullptr) {
    for (int64_t row = 0; row < tokens; ++row)
      add(share.bias_gradient(), dy + row * out, out);
  }
  share.end_gradients();
}

void FluxModel::modulation_forward(Linear& layer, float* mod) {
  const float* vec_act = data(activations_->vec_act);
  if (!tensor_parallel_.split()) {
    linear_forward(layer, vec_act, mod);
    return;
  }
  // This rank's run of the chunks, placed in zeros and summed over the group: the whole chunks.
  // A sum rather than an all-gather: B × chunks·C values, too few for a staging buffer.
  const auto [rows, in, share] = layer.shape;
  const int64_t whole = share * tensor_parallel_.size, first = tensor_parallel_.rank * share;
  float* part = data(workspace_->mod_share);
  linear_forward(layer, vec_act, part);
  std::fill(mod, mod + rows * whole, 0.0f);
  copy_tokens(mod + first, {1, 0, whole}, part, {1, 0, share}, rows, 1, share);
  sum_over_group(mod, rows * whole);
}

void FluxModel::modulation_backward(Linear& layer, const float* dmod) {
  const float* vec_act = data(activations_->vec_act);
  float* d_vec_act = data(workspace_->d_vec_act);
  if (!tensor_parallel_.split()) {
    linear_backward(layer, dmod, vec_act, d_vec_act);
    return;
  }
  const auto [rows, in, share] = layer.shape;
  const int64_t whole = share * tensor_parallel_.size, first = tensor_parallel_.rank * share;
  float* part = data(workspace_->mod_share);
  copy_tokens(part, {1, 0, share}, dmod + first, {1, 0, whole}, rows, 1, share);
  linear_backward(layer, part, vec_act, d_vec_act);  // a partial sum: backward() adds the group's
}

void FluxModel::embedder_forward(const std::string& name, FluxEmbedderActivations& saved,
                                 float* out) {
  linear_forward(linear(name + ".in_layer"), data(saved.input), data(saved.hidden));
  silu_forward(data(saved.act), data(saved.hidden), saved.hidden.numel());
  linear_forward(linear(name + ".out_layer"), data(saved.act), out);
}

void FluxModel::embedder_backward(const std::string& name, const FluxEmbedderActivations& saved,
                                  const float* dout) {
  FluxWorkspace& ws = *workspace_;
  zero(ws.d_embed_act);
  linear_backward(linear(name + ".out_layer"), dout, data(saved.act), data(ws.d_embed_act));
  zero(ws.d_embed_hidden);
  silu_backward(data(ws.d_embed_hidden), data(ws.d_embed_act), data(saved.hidden),
                saved.hidden.numel());
  // The embedder's input (a sinusoid or the pooled vector) is not trained: no dx.
  linear_backward(linear(name + ".in_layer"), data(ws.d_embed_hidden), data(saved.input), nullptr);
}

void FluxModel::attention_forward(FluxAttentionActivations& saved, int attention,
                                  const std::string& txt_norm, const std::string& img_norm) {
  const FluxDims d = dims();
  FluxWorkspace& ws = *workspace_;
  const int64_t L = d.tokens, H = d.heads, D = d.head_dim, rows = d.batch * L * H;
  struct Path {
    const TensorView& raw;
    const TensorView& normed;
    const TensorView& rstd;
    const TensorView& out;  // the attention's input
    const char* scale_name;
  };
  for (const Path& path :
       {Path{ws.q_raw, saved.q_normed, saved.q_rstd, saved.q, ".query_norm.scale"},
        Path{ws.k_raw, saved.k_normed, saved.k_rstd, saved.k, ".key_norm.scale"}}) {
    ops::rmsnorm_forward(data(path.normed), data(path.rstd), data(path.raw), rows, D, kQkNormEps);
    scale_heads(data(path.out), data(path.normed), parameter(txt_norm + path.scale_name),
                parameter(img_norm + path.scale_name), d);
    for (int64_t b = 0; b < d.batch; ++b) {
      float* sample = data(path.out) + b * L * H * D;
      ops::flux_rope_forward(sample, sample, rope_cos_.data(), rope_sin_.data(), L, H, D);
    }
  }
  const ops::AttentionShape shape = joint_attention_shape(d);
  const auto scale = static_cast<float>(1.0 / std::sqrt(double(D)));
  if (precision_.fp8_attention) {
    fp8_attention_[static_cast<size_t>(attention)].forward(
        data(ws.attn), data(saved.lse), data(saved.q), data(saved.k), data(saved.v), shape, scale);
  } else {
    ops::attention_forward(data(ws.attn), data(saved.lse), data(saved.q), data(saved.k),
                           data(saved.v), shape, scale);
  }
}

void FluxModel::attention_backward(const FluxAttentionActivations& saved, int attention,
                                   const std::string& txt_norm, const std::string& img_norm) {
  const FluxDims d = dims();
  FluxWorkspace& ws = *workspace_;
  const int64_t L = d.tokens, H = d.heads, D = d.head_dim, rows = d.batch * L * H;
  for (const TensorView* view : {&ws.dq, &ws.dk, &ws.dv})
    zero(*view);
  const ops::AttentionShape shape = joint_attention_shape(d);
  const auto scale = static_cast<float>(1.0 / std::sqrt(double(D)));
  if (precision_.fp8_attention) {
    fp8_attention_[static_cast<size_t>(attention)].backward(
        data(ws.dq), data(ws.dk), data(ws.dv), data(ws.d_attn), data(saved.q), data(saved.k),
        data(saved.v), data(ws.attn), data(saved.lse), shape, scale);
  } else {
    ops::attention_backward(data(ws.dq), data(ws.dk), data(ws.dv), data(ws.d_attn), data(saved.q),
                            data(saved.k), data(saved.v), data(saved.lse), shape, scale);
  }
  struct Path {
    const TensorView& grad;  // of the attention's input
    const TensorView& normed;
    const TensorView& rstd;
    const TensorView& grad_raw;
    const char* scale_name;
  };
  for (const Path& path :
       {Path{ws.dq, saved.q_normed, saved.q_rstd, ws.dq_raw, ".query_norm.scale"},
        Path{ws.dk, saved.k_normed, saved.k_rstd, ws.dk_raw, ".key_norm.scale"}}) {
    zero(ws.d_rotated);
    for (int64_t b = 0; b < d.batch; ++b) {
      const int64_t sample = b * L * H * D;
      ops::flux_rope_backward(data(ws.d_rotated) + sample, data(path.grad) + sample,
                              rope_cos_.data(), rope_sin_.data(), L, H, D);
    }
    scale_heads_backward(data(ws.d_normed), gradient(txt_norm + path.scale_name),
                         gradient(img_norm + path.scale_name), data(ws.d_rotated),
                         data(path.normed), parameter(txt_norm + path.scale_name),
                         parameter(img_norm + path.scale_name), d);
    zero(path.grad_raw);
    ops::rmsnorm_backward(data(path.grad_raw), data(ws.d_normed), data(path.normed),
                          data(path.rstd), rows, D);
  }
}

void FluxModel::double_block_forward(int block) {
  const FluxDims d = dims();
  FluxActivations& act = *activations_;
  FluxWorkspace& ws = *workspace_;
  FluxDoubleActivations& saved = act.double_blocks[static_cast<size_t>(block)];
  const int64_t B = d.batch, C = d.hidden, M = d.mlp_hidden, A = d.attention;
  const std::array<Stream, 2> streams = double_block_streams(act, ws, d, block);
  for (const Stream& s : streams) {
    FluxStreamActivations& a = s.saved;
    const int64_t rows = B * s.own_tokens;
    const ops::ModulationShape shape{B, s.own_tokens, C};
    float* mod = data(a.mod);
    modulation_forward(linear(s.prefix + "_mod.lin"), mod);
    ops::layernorm_forward(data(a.norm1), data(a.norm1_rstd), s.x, rows, C);
    ops::modulate_forward(data(a.modulated1), data(a.norm1), mod + C, mod, 6 * C, shape);
    linear_forward(linear(s.prefix + "_attn.qkv"), gather_tokens(data(a.modulated1), s.stream),
                   data(ws.projection));
    // "B L (K H D)": q, k and v are consecutive thirds of each token's features (of this
    // rank's heads under tensor parallelism).
    const TokenRows qkv{s.tokens, 0, 3 * A};
    copy_tokens(data(ws.q_raw), s.joint, data(ws.projection), qkv, B, s.tokens, A);
    copy_tokens(data(ws.k_raw), s.joint, data(ws.projection) + A, qkv, B, s.tokens, A);
    copy_tokens(data(saved.attention.v), s.joint, data(ws.projection) + 2 * A, qkv, B, s.tokens, A);
  }
  const std::string prefix = fmt::format("double_blocks.{}.", block);
  attention_forward(saved.attention, block, prefix + "txt_attn.norm", prefix + "img_attn.norm");
  for (const Stream& s : streams) {
    FluxStreamActivations& a = s.saved;
    const int64_t rows = B * s.own_tokens;
    const ops::ModulationShape shape{B, s.own_tokens, C};
    const float* mod = data(a.mod);
    copy_tokens(data(a.attn), s.stream_rows, data(ws.attn), s.joint, B, s.tokens, A);
    float* proj = partial_output(data(a.proj));
    linear_forward(linear(s.prefix + "_attn.proj"), data(a.attn), proj);
    reduce_to_own_tokens(proj, s.stream, C, data(a.proj));
    ops::gated_residual_forward(s.x, data(a.proj), mod + 2 * C, 6 * C, shape);
    ops::layernorm_forward(data(a.norm2), data(a.norm2_rstd), s.x, rows, C);
    ops::modulate_forward(data(a.modulated2), data(a.norm2), mod + 4 * C, mod + 3 * C, 6 * C,
                          shape);
    linear_forward(linear(s.prefix + "_mlp.0"), gather_tokens(data(a.modulated2), s.stream),
                   data(a.mlp_hidden));
    ops::gelu_tanh_forward(data(a.mlp_act), data(a.mlp_hidden), B * s.tokens * M);
    float* mlp_out = partial_output(data(a.mlp_out));
    linear_forward(linear(s.prefix + "_mlp.2"), data(a.mlp_act), mlp_out);
    reduce_to_own_tokens(mlp_out, s.stream, C, data(a.mlp_out));
    ops::gated_residual_forward(s.x, data(a.mlp_out), mod + 5 * C, 6 * C, shape);
  }
}

void FluxModel::double_block_backward(int block) {
  const FluxDims d = dims();
  FluxActivations& act = *activations_;
  FluxWorkspace& ws = *workspace_;
  const FluxDoubleActivations& saved = act.double_blocks[static_cast<size_t>(block)];
  const int64_t B = d.batch, C = d.hidden, M = d.mlp_hidden, A = d.attention;
  const std::array<Stream, 2> streams = double_block_streams(act, ws, d, block);
  for (const Stream& s : streams) {
    const FluxStreamActivations& a = s.saved;
    const int64_t rows = B * s.own_tokens;
    const ops::ModulationShape shape{B, s.own_tokens, C};
    const float* mod = data(a.mod);
    std::fill_n(s.dmod, B * 6 * C, 0.0f);
    // x_out = mid + gate2 · mlp(modulate2(LN(mid)))
    zero(ws.d_branch);
    ops::gated_residual_backward(data(ws.d_branch), s.dmod + 5 * C, s.dx, data(a.mlp_out),
                                 mod + 5 * C, 6 * C, shape);
    // Selective recompute shares mlp_act among the blocks: this stream's GELU again.
    if (recompute_.granularity == RecomputeGranularity::Selective)
      ops::gelu_tanh_forward(data(a.mlp_act), data(a.mlp_hidden), B * s.tokens * M);
    zero(ws.d_mlp_act);
    linear_backward(linear(s.prefix + "_mlp.2"), gather_tokens(data(ws.d_branch), s.stream),
                    data(a.mlp_act), data(ws.d_mlp_act));
    zero(ws.d_mlp_hidden);
    ops::gelu_tanh_backward(data(ws.d_mlp_hidden), data(ws.d_mlp_act), data(a.mlp_hidden),
                            B * s.tokens * M);
    zero(ws.d_modulated);
    Linear& mlp_in = linear(s.prefix + "_mlp.0");
    linear_backward(mlp_in, data(ws.d_mlp_hidden),
                    backward_input(mlp_in, data(a.modulated2), s.stream), data(ws.d_modulated));
    zero(ws.d_norm);
    ops::modulate_backward(data(ws.d_norm), s.dmod + 4 * C, s.dmod + 3 * C,
                           reduce_to_own_tokens(data(ws.d_modulated), s.stream, C, data(ws.own)),
                           data(a.norm2), mod + 4 * C, 6 * C, shape);
    ops::layernorm_backward(s.dx, data(ws.d_norm), data(a.norm2), data(a.norm2_rstd), rows, C);
    // mid = x + gate1 · proj(attention); s.dx now holds d mid.
    zero(ws.d_branch);
    ops::gated_residual_backward(data(ws.d_branch), s.dmod + 2 * C, s.dx, data(a.proj), mod + 2 * C,
                                 6 * C, shape);
    zero(ws.d_modulated);  // here: d of this stream's attention output
    linear_backward(linear(s.prefix + "_attn.proj"), gather_tokens(data(ws.d_branch), s.stream),
                    data(a.attn), data(ws.d_modulated));
    copy_tokens(data(ws.d_attn), s.joint, data(ws.d_modulated), s.stream_rows, B, s.tokens, A);
    // FP8 attention's backward quantizes the forward's output again.
    if (precision_.fp8_attention) {
      copy_tokens(data(ws.attn), s.joint, data(a.attn), s.stream_rows, B, s.tokens, A);
    }
  }
  const std::string prefix = fmt::format("double_blocks.{}.", block);
  attention_backward(saved.attention, block, prefix + "txt_attn.norm", prefix + "img_attn.norm");
  for (const Stream& s : streams) {
    const FluxStreamActivations& a = s.saved;
    const ops::ModulationShape shape{B, s.own_tokens, C};
    const TokenRows qkv{s.tokens, 0, 3 * A};
    float* d_qkv = data(ws.d_projection);
    copy_tokens(d_qkv, qkv, data(ws.dq_raw), s.joint, B, s.tokens, A);
    copy_tokens(d_qkv + A, qkv, data(ws.dk_raw), s.joint, B, s.tokens, A);
    copy_tokens(d_qkv + 2 * A, qkv, data(ws.dv), s.joint, B, s.tokens, A);
    zero(ws.d_modulated);
    Linear& qkv_layer = linear(s.prefix + "_attn.qkv");
    linear_backward(qkv_layer, d_qkv, backward_input(qkv_layer, data(a.modulated1), s.stream),
                    data(ws.d_modulated));
    zero(ws.d_norm);
    ops::modulate_backward(data(ws.d_norm), s.dmod + C, s.dmod,
                           reduce_to_own_tokens(data(ws.d_modulated), s.stream, C, data(ws.own)),
                           data(a.norm1), data(a.mod) + C, 6 * C, shape);
    ops::layernorm_backward(s.dx, data(ws.d_norm), data(a.norm1), data(a.norm1_rstd),
                            B * s.own_tokens, C);
    sum_modulation_gradient(s.dmod, 6 * C);
    modulation_backward(linear(s.prefix + "_mod.lin"), s.dmod);
  }
}

void FluxModel::single_block_forward(int block) {
  const FluxDims d = dims();
  FluxActivations& act = *activations_;
  FluxWorkspace& ws = *workspace_;
  FluxSingleActivations& a = act.single_blocks[static_cast<size_t>(block)];
  const int64_t B = d.batch, L = d.tokens, N = B * L, C = d.hidden, M = d.mlp_hidden;
  const int64_t A = d.attention;
  const std::string prefix = fmt::format("single_blocks.{}", block);
  const ops::ModulationShape shape{B, d.own_tokens(), C};
  float* x = data(ws.joint);
  float* mod = data(a.mod);
  modulation_forward(linear(prefix + ".modulation.lin"), mod);
  ops::layernorm_forward(data(a.norm), data(a.norm_rstd), x, B * d.own_tokens(), C);
  ops::modulate_forward(data(a.modulated), data(a.norm), mod + C, mod, 3 * C, shape);
  linear_forward(linear(prefix + ".linear1"), gather_tokens(data(a.modulated), FluxStream::Joint),
                 data(ws.projection));
  // linear1's output: q, k, v (as "B L (K H D)"), then the MLP's input.
  const TokenRows projection{L, 0, 3 * A + M}, joint{L, 0, A};
  copy_tokens(data(ws.q_raw), joint, data(ws.projection), projection, B, L, A);
  copy_tokens(data(ws.k_raw), joint, data(ws.projection) + A, projection, B, L, A);
  copy_tokens(data(a.attention.v), joint, data(ws.projection) + 2 * A, projection, B, L, A);
  copy_tokens(data(a.mlp_hidden), {L, 0, M}, data(ws.projection) + 3 * A, projection, B, L, M);
  attention_forward(a.attention, config_.double_blocks + block, prefix + ".norm", prefix + ".norm");
  // Selective recompute shares linear2_in among the blocks: the attention output is kept apart.
  if (recompute_.granularity == RecomputeGranularity::Selective)
    std::copy_n(data(ws.attn), N * A, data(a.attn));
  fill_linear2_input(data(a.linear2_in), data(ws.attn), data(a.mlp_hidden), d);
  float* out = partial_output(data(a.out));
  linear_forward(linear(prefix + ".linear2"), data(a.linear2_in), out);
  reduce_to_own_tokens(out, FluxStream::Joint, C, data(a.out));
  ops::gated_residual_forward(x, data(a.out), mod + 2 * C, 3 * C, shape);
}

void FluxModel::single_block_backward(int block) {
  const FluxDims d = dims();
  FluxActivations& act = *activations_;
  FluxWorkspace& ws = *workspace_;
  const FluxSingleActivations& a = act.single_blocks[static_cast<size_t>(block)];
  const int64_t B = d.batch, L = d.tokens, N = B * L, C = d.hidden, M = d.mlp_hidden;
  const int64_t A = d.attention;
  const std::string prefix = fmt::format("single_blocks.{}", block);
  const ops::ModulationShape shape{B, d.own_tokens(), C};
  float* dx = data(ws.d_joint);
  float* dmod = data(ws.d_mod_img);  // [B, 3C] here
  const float* mod = data(a.mod);
  zero(ws.d_mod_img);
  zero(ws.d_branch);
  ops::gated_residual_backward(data(ws.d_branch), dmod + 2 * C, dx, data(a.out), mod + 2 * C, 3 * C,
                               shape);
  if (recompute_.granularity == RecomputeGranularity::Selective)
    fill_linear2_input(data(a.linear2_in), data(a.attn), data(a.mlp_hidden), d);
  zero(ws.d_linear2_in);
  linear_backward(linear(prefix + ".linear2"), gather_tokens(data(ws.d_branch), FluxStream::Joint),
                  data(a.linear2_in), data(ws.d_linear2_in));
  const TokenRows linear2_in{L, 0, A + M}, joint{L, 0, A}, mlp{L, 0, M};
  copy_tokens(data(ws.d_attn), joint, data(ws.d_linear2_in), linear2_in, B, L, A);
  copy_tokens(data(ws.d_mlp_act), mlp, data(ws.d_linear2_in) + A, linear2_in, B, L, M);
  zero(ws.d_mlp_hidden);
  ops::gelu_tanh_backward(data(ws.d_mlp_hidden), data(ws.d_mlp_act), data(a.mlp_hidden), N * M);
  if (precision_.fp8_attention) {  // FP8 attention's backward quantizes its output again
    copy_tokens(data(ws.attn), joint, data(a.linear2_in), linear2_in, B, L, A);
  }
  attention_backward(a.attention, config_.double_blocks + block, prefix + ".norm",
                     prefix + ".norm");
  const TokenRows projection{L, 0, 3 * A + M};
  float* d_projection = data(ws.d_projection);
  copy_tokens(d_projection, projection, data(ws.dq_raw), joint, B, L, A);
  copy_tokens(d_projection + A, projection, data(ws.dk_raw), joint, B, L, A);
  copy_tokens(d_projection + 2 * A, projection, data(ws.dv), joint, B, L, A);
  copy_tokens(d_projection + 3 * A, projection, data(ws.d_mlp_hidden), mlp, B, L, M);
  zero(ws.d_modulated);
  Linear& linear1 = linear(prefix + ".linear1");
  linear_backward(linear1, d_projection,
                  backward_input(linear1, data(a.modulated), FluxStream::Joint),
                  data(ws.d_modulated));
  zero(ws.d_norm);
  ops::modulate_backward(
      data(ws.d_norm), dmod + C, dmod,
      reduce_to_own_tokens(data(ws.d_modulated), FluxStream::Joint, C, data(ws.own)), data(a.norm),
      mod + C, 3 * C, shape);
  ops::layernorm_backward(dx, data(ws.d_norm), data(a.norm), data(a.norm_rstd), B * d.own_tokens(),
                          C);
  sum_modulation_gradient(dmod, 3 * C);
  modulation_backward(linear(prefix + ".modulation.lin"), dmod);
}

void FluxModel::forward(const FluxInputs& inputs, float* prediction) {
  FP8T_CHECK(
      inputs.img && inputs.img_ids && inputs.txt && inputs.y && inputs.timesteps && prediction,
      "expected img, img_ids, txt, y, timesteps and a prediction buffer; found a null "
      "pointer");
  FP8T_CHECK((inputs.guidance != nullptr) == config_.guidance_embed,
             "guidance: expected {} (guidance_embed: {}), found {}",
             config_.guidance_embed ? "values" : "none", config_.guidance_embed,
             inputs.guidance != nullptr ? "values" : "none");
  const FluxDims d = dims();
  FluxActivations& act = *activations_;
  FluxWorkspace& ws = *workspace_;
  const int64_t B = d.batch, Li = d.img_tokens, Lt = d.txt_tokens, L = d.tokens, C = d.hidden;
  const int64_t Oi = d.own_img, Ot = d.own_txt, O = d.own_tokens();

  if (sequence_) {
    copy_own_tokens(inputs.img, data(act.img), FluxStream::Image, d.in_channels,
                    /*to_whole=*/false);
    copy_own_tokens(inputs.txt, data(act.txt), FluxStream::Text, d.context_in_dim,
                    /*to_whole=*/false);
  } else {
    std::copy_n(inputs.img, act.img.numel(), data(act.img));
    std::copy_n(inputs.txt, act.txt.numel(), data(act.txt));
  }
  std::copy_n(inputs.y, act.vector_in.input.numel(), data(act.vector_in.input));

  // vec = time_in(sinusoid(t)) [+ guidance_in(sinusoid(guidance))] + vector_in(y)
  ops::timestep_embedding(data(act.time_in.input), inputs.timesteps, B, d.timestep_dim);
  embedder_forward("time_in", act.time_in, data(act.vec));
  if (config_.guidance_embed) {
    ops::timestep_embedding(data(act.guidance_in.input), inputs.guidance, B, d.timestep_dim);
    embedder_forward("guidance_in", act.guidance_in, data(ws.embedding));
    add(data(act.vec), data(ws.embedding), B * C);
  }
  embedder_forward("vector_in", act.vector_in, data(ws.embedding));
  add(data(act.vec), data(ws.embedding), B * C);
  silu_forward(data(act.vec_act), data(act.vec), B * C);

  linear_forward(linear("img_in"), data(act.img), data(ws.img));
  linear_forward(linear("txt_in"), data(act.txt), data(ws.txt));
  std::copy_n(inputs.img_ids, Li * 3, ids_.begin() + Lt * 3);
  ops::flux_rope_tables(rope_cos_.data(), rope_sin_.data(), ids_.data(), L, config_.axes_dim,
                        config_.rope_theta);

  // Full recompute: the blocks update the streams in place, so a group's input is kept apart.
  for (int block = 0; block < config_.double_blocks; ++block) {
    if (const int group = recompute_group_starting_at(recompute_groups_.doubles, block);
        group >= 0) {
      const FluxDoubleGroupInput& input = act.double_group_inputs[static_cast<size_t>(group)];
      std::copy_n(data(ws.img), input.img.numel(), data(input.img));
      std::copy_n(data(ws.txt), input.txt.numel(), data(input.txt));
    }
    double_block_forward(block);
  }
  if (config_.single_blocks > 0) {
    const TokenRows img{Oi, 0, C}, txt{Ot, 0, C};
    copy_tokens(data(ws.joint), {O, 0, C}, data(ws.txt), txt, B, Ot, C);
    copy_tokens(data(ws.joint), {O, Ot, C}, data(ws.img), img, B, Oi, C);
    for (int block = 0; block < config_.single_blocks; ++block) {
      if (const int group = recompute_group_starting_at(recompute_groups_.singles, block);
          group >= 0) {
        const TensorView& input = act.single_group_inputs[static_cast<size_t>(group)];
        std::copy_n(data(ws.joint), input.numel(), data(input));
      }
      single_block_forward(block);
    }
    copy_tokens(data(ws.img), img, data(ws.joint), {O, Ot, C}, B, Oi, C);
  }

  // The final layer on the image tokens; its modulation chunks are (shift, scale).
  float* mod = data(act.final_mod);
  modulation_forward(linear("final_layer.adaLN_modulation.1"), mod);
  ops::layernorm_forward(data(act.final_norm), data(act.final_norm_rstd), data(ws.img), B * Oi, C);
  ops::modulate_forward(data(act.final_modulated), data(act.final_norm), mod + C, mod, 2 * C,
                        {B, Oi, C});
  if (!sequence_) {
    linear_forward(linear("final_layer.linear"), data(act.final_modulated), prediction);
    return;
  }
  // Every rank returns the whole prediction: its tokens' gathered over the group.
  linear_forward(linear("final_layer.linear"), data(act.final_modulated), data(ws.own_prediction));
  gather_tokens_into(data(ws.own_prediction), FluxStream::Image, d.in_channels, prediction);
}

void FluxModel::backward(const float* grad_prediction) {
  const FluxDims d = dims();
  FluxActivations& act = *activations_;
  FluxWorkspace& ws = *workspace_;
  const int64_t B = d.batch, Oi = d.own_img, Ot = d.own_txt, O = d.own_tokens(), C = d.hidden;
  zero(ws.d_vec_act);  // every modulation adds into it

  float* dmod = data(ws.d_mod_img);  // [B, 2C] here
  zero(ws.d_mod_img);
  zero(ws.d_modulated);
  const float* d_prediction = grad_prediction;
  if (sequence_) {  // this rank's tokens of it
    copy_own_tokens(grad_prediction, data(ws.own_prediction), FluxStream::Image, d.in_channels,
                    /*to_whole=*/false);
    d_prediction = data(ws.own_prediction);
  }
  linear_backward(linear("final_layer.linear"), d_prediction, data(act.final_modulated),
                  data(ws.d_modulated));
  zero(ws.d_norm);
  ops::modulate_backward(data(ws.d_norm), dmod + C, dmod, data(ws.d_modulated),
                         data(act.final_norm), data(act.final_mod) + C, 2 * C, {B, Oi, C});
  zero(ws.d_img);
  ops::layernorm_backward(data(ws.d_img), data(ws.d_norm), data(act.final_norm),
                          data(act.final_norm_rstd), B * Oi, C);
  sum_modulation_gradient(dmod, 2 * C);
  modulation_backward(linear("final_layer.adaLN_modulation.1"), dmod);

  zero(ws.d_txt);
  if (config_.single_blocks > 0) {
    const TokenRows img{Oi, 0, C}, txt{Ot, 0, C};
    zero(ws.d_joint);  // the text's tokens do not reach the prediction but through attention
    copy_tokens(data(ws.d_joint), {O, Ot, C}, data(ws.d_img), img, B, Oi, C);
    for (int block = config_.single_blocks - 1; block >= 0; --block) {
      if (const int group = recompute_group_ending_at(recompute_groups_.singles, block); group >= 0)
        rerun_single_group(group);
      single_block_backward(block);
    }
    copy_tokens(data(ws.d_txt), txt, data(ws.d_joint), {O, 0, C}, B, Ot, C);
    copy_tokens(data(ws.d_img), img, data(ws.d_joint), {O, Ot, C}, B, Oi, C);
  }
  for (int block = config_.double_blocks - 1; block >= 0; --block) {
    if (const int group = recompute_group_ending_at(recompute_groups_.doubles, block); group >= 0)
      rerun_double_group(group);
    double_block_backward(block);
  }
  // The inputs are not trained: no dx for img_in and txt_in.
  linear_backward(linear("img_in"), data(ws.d_img), data(act.img), nullptr);
  linear_backward(linear("txt_in"), data(ws.d_txt), data(act.txt), nullptr);

  sum_over_group(data(ws.d_vec_act), B * C);  // each rank's modulation shares add their part
  zero(ws.d_vec);
  silu_backward(data(ws.d_vec), data(ws.d_vec_act), data(act.vec), B * C);
  embedder_backward("time_in", act.time_in, data(ws.d_vec));
  if (config_.guidance_embed) embedder_backward("guidance_in", act.guidance_in, data(ws.d_vec));
  embedder_backward("vector_in", act.vector_in, data(ws.d_vec));
}

// The backward reads only saved activations: the workspace's streams are free for the rerun.
void FluxModel::rerun_double_group(int group) {
  const FluxDoubleGroupInput& input = activations_->double_group_inputs[static_cast<size_t>(group)];
  std::copy_n(data(input.img), input.img.numel(), data(workspace_->img));
  std::copy_n(data(input.txt), input.txt.numel(), data(workspace_->txt));
  const RecomputeGroup& blocks = recompute_groups_.doubles[static_cast<size_t>(group)];
  pause_fp8_recording(linears_);
  for (int block = blocks.first; block < blocks.end; ++block)
    double_block_forward(block);
  resume_fp8_recording(linears_, training_, recording_fp8_health_);
}

void FluxModel::rerun_single_group(int group) {
  const TensorView& input = activations_->single_group_inputs[static_cast<size_t>(group)];
  std::copy_n(data(input), input.numel(), data(workspace_->joint));
  const RecomputeGroup& blocks = recompute_groups_.singles[static_cast<size_t>(group)];
  pause_fp8_recording(linears_);
  for (int block = blocks.first; block < blocks.end; ++block)
    single_block_forward(block);
  resume_fp8_recording(linears_, training_, recording_fp8_health_);
}

void FluxModel::end_step() {
  end_fp8_step(linears_);
  invalidate_weight_shares(linears_);
}

void FluxModel::set_training(bool training) {
  training_ = training;
  record_fp8_amaxes(linears_, training);
}

void FluxModel::weights_changed() {
  invalidate_fp8_weights(linears_);
  invalidate_weight_shares(linears_);
}

std::vector<std::pair<std::string, DelayedScaling*>> FluxModel::delayed_scalings() {
  return fp8_delayed_scalings(linears_);
}

void FluxModel::set_record_fp8_health(bool record) {
  recording_fp8_health_ = record;
  record_fp8_health(linears_, record);
}

std::vector<Fp8TensorHealth> FluxModel::take_fp8_health() {
  return fp8t::take_fp8_health(linears_, linear_precision_);
}

}  // namespace fp8t
