// The Flux MMDiT on the CPU path (MODELS.md §2; BFL flux1's Flux.forward): an explicit forward
// that saves what backward needs, and an explicit backward (no autograd graph), as the GPT's.
// Memory is planned from the configuration, the token counts and the recompute setting and taken
// once, at construction: parameters, gradients, saved activations and a workspace.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "core/arena.h"
#include "core/tensor.h"
#include "models/flux_config.h"
#include "models/precision_policy.h"
#include "models/recompute.h"
#include "models/tensor_parallel.h"
#include "models/weight_share.h"
#include "numerics/scaling.h"
#include "ops/attention_fp8.h"
#include "ops/fp8_linear.h"
#include "ops/linear.h"

namespace fp8t {

// Parameters (or their gradients) by BFL name, in flux_parameters() order.
class FluxParameterSet {
 public:
  static size_t planned_bytes(const FluxConfig& config, DType dtype);
  FluxParameterSet(Arena& arena, const FluxConfig& config, DType dtype);

  TensorView& operator[](const std::string& name);
  const TensorView& operator[](const std::string& name) const;
  const std::vector<FluxParam>& specs() const { return specs_; }
  void fill_zero();

 private:
  std::vector<FluxParam> specs_;
  std::map<std::string, TensorView> tensors_;
};

// A linear layer of the Flux (y = x·Wᵀ + b; every one has a bias).
struct FluxLinear {
  std::string name;  // parameter name without ".weight" / ".bias"
  int64_t in_features;
  int64_t out_features;
  FluxParamKind kind;
  int block = -1;  // double blocks first, then single ones; -1 outside the blocks
};

// This rank's share of a linear under tensor parallelism over `size` ranks: for q, k and v (a
// double block's qkv, a single block's linear1) the rank's heads of each, for the MLP its share
// of the hidden features (by rows of mlp.0 and linear1, by columns of mlp.2 and linear2), the
// attention's output projections by the columns of its heads, a modulation's outputs in T
// consecutive runs (the model gathers the chunks); the rest is not split.
TensorShare flux_tensor_share(const FluxLinear& linear, const FluxConfig& config, int size,
                              int rank);

// Every linear, in flux_parameters() order.
std::vector<FluxLinear> flux_linears(const FluxConfig& config);

// The parameters a rank of a tensor-parallel group of `size` holds on the GPU path: the split
// linears' shares (weights [share_out, in] or [out, share_in], column-parallel biases
// [share_out]) first, then every replicated tensor whole, each part in flux_parameters() order.
// A share's values are its runs of rows or columns one after the other (TensorShare's order).
// Every parameter once, whole, when size is 1.
struct FluxRankParameters {
  std::vector<FluxParam> parameters;
  size_t shares = 0;  // how many of them lead as shares
};
FluxRankParameters flux_rank_parameters(const FluxConfig& config, int size, int rank);

struct FluxLinearPrecision {
  FluxLinear linear;
  bool fp8 = false;
  std::string reason;  // why it stays in BF16; empty for FP8
};

// FP8 candidates are the block linears (qkv, proj, img_mlp / txt_mlp .0 and .2, linear1,
// linear2), filtered as the GPT's block linears are (precision_policy.h: min_dim, divisibility,
// first/last blocks counting double blocks first, the recipe's block sizes); the embedders,
// the modulation and the final layer stay in BF16. options.lm_head_fp8 does not apply.
std::vector<FluxLinearPrecision> decide_flux_precision(const FluxConfig& config,
                                                       const PrecisionOptions& options);

// Moves to BF16, with the reason, the FP8 decisions whose share on each of `size` ranks `recipe`
// cannot cast in whole blocks (the CPU model's rule, make_fp8_share).
void keep_unblocked_flux_shares_in_bf16(std::vector<FluxLinearPrecision>& decisions,
                                        const FluxConfig& config, ScalingRecipe recipe, int size);

// One line: "FP8: 8/21 linear layers; 13 kept in BF16 (5 × embedder; ...)", the BF16 ones
// counted by reason.
std::string flux_precision_summary(const std::vector<FluxLinearPrecision>& decisions);

// The rows a linear reads in one micro-batch: batch × its stream's tokens (the whole [txt; img]
// sequence in the single blocks, the image tokens in the final layer), or batch for the
// modulation linears and the vector embedders (one row per sample).
int64_t flux_linear_rows(const FluxLinear& linear, int64_t batch, int64_t img_tokens,
                         int64_t txt_tokens);

// Forward + backward FLOPs of one sample: 6 per weight and row of every linear (2 forward, 4
// backward) and 12·L²·hidden per block for attention over the L = txt + img tokens (QKᵀ and PV,
// 2 FLOPs per multiply-add, forward and twice that backward), as nanochat counts the GPT's.
double flux_flops_per_sample(const FluxConfig& config, int64_t img_tokens, int64_t txt_tokens);

// FP8 per decide_flux_precision, the other linears on fp32 or bf16 operands; biases are added in
// fp32 after the GEMM either way.
using FluxPrecision = ModelPrecision;

// The values init_flux_weights draws from one generator: a run of a tensor.
inline constexpr int64_t kInitRunValues = int64_t(1) << 20;

// Deterministic from the seed: nn.Linear's default for every linear (weight and bias uniform in
// ±1/√in_features), QK-norm scales 1, and zero for the modulation linears and
// final_layer.linear (MODELS.md), so that an initialized model predicts exactly zero. Each run
// of kInitRunValues consecutive values of a tensor draws from std::mt19937_64 seeded with
// std::seed_seq{seed low, seed high, the tensor's place in specs(), the run's}; the runs are
// drawn by several threads.
void init_flux_weights(FluxParameterSet& parameters, const FluxConfig& config, uint64_t seed);

// One micro-batch, host fp32. The text ids are zero (BFL's txt_ids).
struct FluxInputs {
  const float* img = nullptr;        // [B, L_img, in_channels]: the noisy packed latents x_t
  const float* img_ids = nullptr;    // [L_img, 3]: (0, row, col) per image token, for every sample
  const float* txt = nullptr;        // [B, L_txt, context_in_dim]: T5 sequence embeddings
  const float* y = nullptr;          // [B, vec_in_dim]: CLIP pooled vectors
  const float* timesteps = nullptr;  // [B]: σ in [0, 1] (the embedder scales it by 1000)
  const float* guidance = nullptr;   // [B], given exactly when config.guidance_embed
};

// A residual stream of the Flux: a double block's image or text tokens, or the single blocks'
// joint [txt; img] sequence.
enum class FluxStream : uint8_t { Image, Text, Joint };

// Sequence parallelism over `size` ranks: where a rank's 1/size of a stream's tokens sit, per
// sample, among the stream's every token (from whole_first) and in the rank's own buffers (from
// own_first), `count` tokens each. A rank holds consecutive tokens of each stream; in the joint
// sequence its text tokens, then its image tokens. size 1: every token.
struct FluxTokenRun {
  int64_t whole_first, own_first, count;
};
struct FluxOwnTokens {
  int64_t whole, own;  // tokens per sample
  std::vector<FluxTokenRun> runs;
};
FluxOwnTokens flux_own_tokens(FluxStream stream, int64_t img_tokens, int64_t txt_tokens, int size,
                              int rank);

// The linears at the residual streams' ends (img_in, txt_in, final_layer.linear): under sequence
// parallelism they read a rank's tokens only, and their gradients are summed over the group.
bool flux_reads_own_tokens(const std::string& linear);

struct FluxDims;
struct FluxActivations;
struct FluxWorkspace;
struct FluxEmbedderActivations;
struct FluxAttentionActivations;

class FluxModel {
 public:
  // recompute: which activations the forward saves and which the backward computes again
  // (models/recompute.h; full recompute groups as flux_recompute_groups forms them); the
  // results are the same either way. Throws ConfigError for a bad recompute_num_layers.
  // tensor_parallel: the group this rank shares its blocks' heads and MLP hidden features with
  // (models/tensor_parallel.h: qkv, linear1's q, k, v and MLP rows and mlp.0 by output, proj,
  // linear2 and mlp.2 by input); every rank of it must be given the same micro-batches. With its
  // `sequence` on, each rank keeps its consecutive 1/size of every sample's image tokens and of
  // its text tokens outside the split linears (img_in, txt_in, the residual streams, the
  // LayerNorms and modulated outputs, and the final layer), and the prediction is gathered over
  // the group.
  // Throws ConfigError naming sequence_parallel when the tokens do not split so.
  FluxModel(const FluxConfig& config, int64_t batch, int64_t img_tokens, int64_t txt_tokens,
            const FluxPrecision& precision, const RecomputeOptions& recompute = {},
            const TensorParallel& tensor_parallel = {});
  ~FluxModel();

  // The bytes of the activation arena such a model takes (one rank's of `tensor_parallel`, with
  // sequence parallelism or without; throws ConfigError naming sequence_parallel when the tokens
  // do not split over the group).
  static size_t planned_activation_bytes(const FluxConfig& config, int64_t batch,
                                         int64_t img_tokens, int64_t txt_tokens,
                                         const RecomputeOptions& recompute = {},
                                         int tensor_parallel = 1, bool sequence_parallel = false);

  const FluxConfig& config() const { return config_; }
  // The bytes of this model's activation arena (planned_activation_bytes of its settings).
  size_t activation_bytes() const { return activation_arena_->capacity(); }
  FluxParameterSet& parameters() { return *parameters_; }
  FluxParameterSet& gradients() { return *gradients_; }

  void init_weights(uint64_t seed);

  // Writes the velocity prediction [B, L_img, in_channels] and saves the activations of this
  // call for backward(). Throws when an input is missing, or guidance is given without the
  // guidance embedder.
  void forward(const FluxInputs& inputs, float* prediction);
  // Adds d(loss)/d(parameter) to the gradients, given d(loss)/d(prediction) of the last
  // forward (zero the gradients first with zero_gradients()). The saved activations are only
  // read (what recompute computes again comes out the same each time): backward may run again
  // on the same forward (with fp8_attention, with the gradient scales the previous backward
  // measured).
  void backward(const float* grad_prediction);
  void zero_gradients() { gradients_->fill_zero(); }
  // Tensor parallelism, once after the step's backward passes: sums over the group the
  // gradients of the split linears (each rank holds its share, zeros elsewhere) and of the QK
  // norms' scales (each rank's heads' part), and under sequence parallelism those of img_in,
  // txt_in and final_layer.linear (each rank's tokens' part), so that every rank holds the whole
  // gradient.
  void gather_split_gradients();

  // Per linear: "fp8" or the reason it is not.
  const std::vector<FluxLinearPrecision>& linear_precision() const { return linear_precision_; }
  // Once per optimizer step: delayed-scaling updates and weight re-quantization.
  void end_step();
  // Off for evaluation: forward passes then leave the FP8 scaling state (amax histories) as
  // it was. Training is the default.
  void set_training(bool training);
  // After the weights were replaced (e.g. loaded from a checkpoint): re-quantize them on the
  // next forward, without a delayed-scaling update.
  void weights_changed();
  // Delayed scaling state of every FP8 linear by "<linear>.<input|weight|grad_output>", in a
  // fixed order; empty unless the recipe is delayed. For checkpoints.
  std::vector<std::pair<std::string, DelayedScaling*>> delayed_scalings();
  // While on, the FP8 linears' casts count their health; take_fp8_health() returns the counts
  // since the last call, per FP8 linear (in linear_precision()'s order) and operand.
  void set_record_fp8_health(bool record);
  std::vector<Fp8TensorHealth> take_fp8_health();

 private:
  using Split = TensorSplit;
  struct Linear {
    ops::LinearShape shape;  // this rank's share
    // The whole parameters. bias: null where this rank adds none (row-parallel linears: the
    // group's rank 0 alone adds it).
    float* weight = nullptr;
    float* bias = nullptr;
    float* grad_weight = nullptr;
    float* grad_bias = nullptr;
    std::unique_ptr<ops::Fp8Linear> fp8;  // null: plain linear
    WeightShare share;                    // this rank's rows or columns of the weight
  };
  // This rank's share of a linear [out, in]: its rows (q, k, v heads and MLP features) or its
  // columns, or the whole weight without tensor parallelism.
  WeightShare share_of(const FluxLinear& linear) const;
  // The sum over the tensor-parallel group of `count` values: a row-parallel output or a
  // column-parallel input's gradient; nothing to do without tensor parallelism.
  void sum_over_group(float* values, int64_t count);
  // The sizes of this rank's buffers.
  FluxDims dims() const;
  // Where a rank's tokens of a stream sit (all of them without sequence parallelism); by
  // default this rank's.
  FluxOwnTokens own_tokens(FluxStream stream) const;
  FluxOwnTokens own_tokens(FluxStream stream, int rank) const;
  // Sequence parallelism: copies this rank's tokens of a stream between own [B, O_s, width] and
  // their places among the stream's every token, whole [B, L_s, width]: from own to whole when
  // to_whole, else from whole to own. copy_rank_tokens: the same for the group's `rank`.
  void copy_own_tokens(const float* from, float* to, FluxStream stream, int64_t width,
                       bool to_whole) const;
  void copy_rank_tokens(int rank, const float* from, float* to, FluxStream stream, int64_t width,
                        bool to_whole) const;
  // Every token of a stream from this rank's own, [B, O_s, C] (the hidden width): gathered over
  // the group into the workspace (valid until the next gather or partial output) under sequence
  // parallelism, else own itself.
  const float* gather_tokens(const float* own, FluxStream stream);
  // Sequence parallelism: every token of a stream, whole [B, L_s, width], from every rank's own
  // [B, O_s, width], through the workspace's staging in rank order.
  void gather_tokens_into(const float* own, FluxStream stream, int64_t width, float* whole);
  // What a linear's backward reads as its input x: null for an FP8 linear, which reads its own
  // cast of x and needs no gather.
  const float* backward_input(const Linear& layer, const float* own, FluxStream stream);
  // Where a row-parallel linear writes its partial output, whose own tokens go to `own`: the
  // workspace under sequence parallelism, else own itself.
  float* partial_output(float* own);
  // Reduces a partial [B, L_s, width] (a row-parallel output, a column-parallel input's
  // gradient) over the group and returns this rank's tokens of the sum: copied into `own` under
  // sequence parallelism, the partial itself otherwise.
  const float* reduce_to_own_tokens(float* partial, FluxStream stream, int64_t width, float* own);
  // A modulation's gradient [B, chunks·C], summed over the group under sequence parallelism,
  // where each rank's tokens add their part.
  void sum_modulation_gradient(float* dmod, int64_t width);

  Linear& linear(const std::string& name);
  float* parameter(const std::string& name);
  float* gradient(const std::string& name);
  // y = x·Wᵀ + b; and its backward, which adds into dx (when not null), dW and db.
  void linear_forward(Linear& layer, const float* x, float* y);
  void linear_backward(Linear& layer, const float* dy, const float* x, float* dx);
  // A modulation linear on SiLU(vec): its whole chunks into mod [B, chunks·C] (gathered over the
  // group when split); backward adds its part of d SiLU(vec) from dmod [B, chunks·C].
  void modulation_forward(Linear& layer, float* mod);
  void modulation_backward(Linear& layer, const float* dmod);
  // BFL's MLPEmbedder: out = out_layer(SiLU(in_layer(input))), the input already saved.
  void embedder_forward(const std::string& name, FluxEmbedderActivations& saved, float* out);
  void embedder_backward(const std::string& name, const FluxEmbedderActivations& saved,
                         const float* dout);
  // The joint attention of a block, from the workspace's raw q and k and the saved v: QK norm
  // with the scale of each token's stream (txt_norm, img_norm: the norms' parameter prefixes,
  // the same in single blocks), RoPE, softmax(q kᵀ / √D) v into the workspace's output.
  // `attention` numbers the block's attention, double blocks first (for FP8 attention's state).
  void attention_forward(FluxAttentionActivations& saved, int attention,
                         const std::string& txt_norm, const std::string& img_norm);
  // From the workspace's gradient of the attention output to those of the raw q, k and of v.
  // With fp8_attention, the workspace's output must hold the forward's again.
  void attention_backward(const FluxAttentionActivations& saved, int attention,
                          const std::string& txt_norm, const std::string& img_norm);
  void double_block_forward(int block);
  void double_block_backward(int block);
  void single_block_forward(int block);
  void single_block_backward(int block);
  // Full recompute: the forward of a group's blocks again, from the group's saved input, just
  // before the backward of its last block; the FP8 linears record no amax and count no health
  // meanwhile, so that the FP8 state is that of one forward.
  void rerun_double_group(int group);
  void rerun_single_group(int group);

  FluxConfig config_;
  int64_t batch_, img_tokens_, txt_tokens_;
  FluxPrecision precision_;
  RecomputeOptions recompute_;
  TensorParallel tensor_parallel_;
  bool sequence_ = false;  // sequence parallelism (the constructor refuses it without a group)
  FluxRecomputeGroups recompute_groups_;  // full recompute's; empty otherwise
  bool training_ = true;
  bool recording_fp8_health_ = false;
  std::unique_ptr<Arena> parameter_arena_, gradient_arena_, activation_arena_, workspace_arena_;
  std::unique_ptr<FluxParameterSet> parameters_, gradients_;
  std::unique_ptr<FluxActivations> activations_;
  std::unique_ptr<FluxWorkspace> workspace_;
  std::vector<float> ids_;                  // [L, 3]: the text's zeros, then img_ids
  std::vector<float> rope_cos_, rope_sin_;  // [L, head_dim / 2]
  std::vector<FluxLinearPrecision> linear_precision_;
  std::map<std::string, Linear> linears_;
  // Per attention, double blocks first; empty without fp8_attention.
  std::vector<ops::AttentionFp8> fp8_attention_;
};

}  // namespace fp8t
