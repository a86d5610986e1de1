// The nanochat GPT on the CPU path: an explicit forward that saves what backward needs, and an
// explicit backward (no autograd graph). Memory is planned from the configuration and taken
// once, at construction: parameters, gradients, saved activations and a workspace.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/arena.h"
#include "models/gpt_config.h"
#include "models/gpt_memory.h"
#include "models/precision_policy.h"
#include "models/recompute.h"
#include "models/tensor_parallel.h"
#include "models/weight_share.h"
#include "ops/attention_fp8.h"
#include "ops/fp8_linear.h"
#include "ops/linear.h"

namespace fp8t {

using GptPrecision = ModelPrecision;

// nanochat's initialization (MODELS.md) of every parameter, from a seed: the same values on
// the CPU and the GPU path.
void init_gpt_weights(ParameterSet& parameters, const GptConfig& config, uint64_t seed);

// Throws fp8t::Error naming the position of the first token outside the vocabulary, or target
// neither -1 (ignored) nor in it.
void check_tokens(const GptConfig& config, const int32_t* idx, const int32_t* targets,
                  int64_t count);

class GptModel {
 public:
  // recompute: which activations the forward saves and which the backward computes again
  // (models/recompute.h); the results are the same either way. tensor_parallel: the group this
  // rank shares its blocks' heads and hidden features with (models/tensor_parallel.h); every
  // rank of it must be given the same batches; with its `sequence` on, each rank keeps its
  // consecutive 1/size of the batch's B·T rows outside the split linears. Throws ConfigError
  // naming tensor_model_parallel_size when the heads or the hidden layer do not split evenly,
  // and sequence_parallel when the rows do not.
  GptModel(const GptConfig& config, int64_t batch, int64_t seq, const GptPrecision& precision,
           const RecomputeOptions& recompute = {}, const TensorParallel& tensor_parallel = {});

  const GptConfig& config() const { return config_; }
  ParameterSet& parameters() { return *parameters_; }
  ParameterSet& gradients() { return *gradients_; }
  const GptActivations& activations() const { return *activations_; }

  // nanochat's initialization (MODELS.md), from a seed.
  void init_weights(uint64_t seed);

  // Runs the model on idx [B, T] and returns the mean cross-entropy over targets != -1. Saves
  // the activations of this call for backward().
  double forward(const int32_t* idx, const int32_t* targets);
  // Adds d(loss)/d(parameter) to the gradients (zero them first with zero_gradients()). Uses,
  // and overwrites, the logits of the last forward.
  void backward();
  void zero_gradients() { gradients_->fill_zero(); }
  // Tensor parallelism, once after the step's backward passes: each rank holds the gradients of
  // its share of the split parameters (zeros elsewhere); this sums them over the group, so that
  // every rank holds the whole gradient. Nothing to do without tensor parallelism.
  void gather_split_gradients();
  // The soft-capped logits of the last forward, cropped to the vocabulary: [B, T, vocab].
  void capped_logits(float* out) const;

  // Per linear: "fp8" or the reason it is not (from the precision policy).
  const std::vector<LinearPrecision>& linear_precision() const { return linear_precision_; }
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
    std::string weight;                   // parameter name
    ops::LinearShape shape;               // this rank's share
    std::unique_ptr<ops::Fp8Linear> fp8;  // null: plain linear
    WeightShare share;                    // this rank's rows or columns of the weight
  };
  void linear_forward(Linear& linear, const float* x, float* y);
  void linear_backward(Linear& linear, const float* dy, const float* x, float* dx);
  // The value embedding of this rank's kv heads, [B * T, kv_heads_ * head_dim], into
  // ws.value_embed; and its gradient, from ws.dvalue_embed, into the table's gradient.
  void value_embedding_forward(int layer);
  void value_embedding_backward(int layer);
  // This rank's kv heads' rows of a block's ve_gate.weight in `tensors` (the parameters or
  // their gradients).
  float* value_gate_weight(const std::string& prefix, const std::unique_ptr<ParameterSet>& tensors);
  // The sum over the tensor-parallel group of a row-parallel output or of a column-parallel
  // input's gradient; nothing to do without tensor parallelism.
  void sum_over_group(const TensorView& partial);
  // Sequence parallelism: the group's rows [N, C] of a tensor of this rank's rows, gathered into
  // ws.gathered (valid until the next gather); otherwise the tensor itself.
  const float* gather_rows(const TensorView& local);
  // sum_over_group(partial), then this rank's rows of it (all of them without sequence
  // parallelism).
  const float* sum_rows_over_group(const TensorView& partial);
  // The first of this rank's rows in the micro-batch: 0 without sequence parallelism.
  int64_t first_row() const { return sequence_ ? tensor_parallel_.rank * rows_ : 0; }
  Linear& linear(const std::string& name);
  // The attention of a block: ops/attention.h, or ops/attention_fp8.h with fp8_attention.
  void attention_forward(int layer, const ops::AttentionShape& shape);
  void attention_backward(int layer, const ops::AttentionShape& shape);
  // The residual a block starts from: the previous block's output, x0 for the first (for
  // n_layer, the last block's output).
  const float* previous_output(int layer) const;
  // One block: from previous_output(layer) to this block's output. The backward reads ws.dx
  // (d output) and leaves d input of the next lower block there.
  void block_forward(int layer);
  void block_backward(int layer);
  // Full recompute: the forward of the group's blocks again, from its saved input, without
  // recording FP8 amaxes or health a second time.
  void recompute_group(const RecomputeGroup& group);
  float scalar(const std::string& name, int index = 0);
  float* parameter(const std::string& name);
  float* gradient(const std::string& name);

  GptConfig config_;
  int64_t batch_, seq_;
  GptPrecision precision_;
  RecomputeOptions recompute_;
  TensorParallel tensor_parallel_;
  int64_t heads_, kv_heads_, hidden_;  // this rank's query and kv heads and MLP hidden features
  bool sequence_ = false;              // sequence parallelism (refused without a group)
  int64_t rows_ = 0;         // of the residual stream on this rank: B·T, or its share of them
  float loss_share_ = 1.0f;  // sequence parallelism: this rank's share of the counted rows
  std::vector<RecomputeGroup> recompute_groups_;  // full recompute's; empty otherwise
  bool training_ = true;
  bool recording_fp8_health_ = false;
  std::vector<int32_t> idx_, targets_;  // of the last forward, [B * T]
  std::unique_ptr<Arena> parameter_arena_, gradient_arena_, activation_arena_, workspace_arena_;
  std::unique_ptr<ParameterSet> parameters_, gradients_;
  std::unique_ptr<GptActivations> activations_;
  std::unique_ptr<GptWorkspace> workspace_;
  std::vector<float> rotary_cos_, rotary_sin_;  // [T, D/2]
  std::vector<LinearPrecision> linear_precision_;
  std::map<std::string, Linear> linears_;
  std::vector<ops::AttentionFp8> fp8_attention_;  // per block; empty without fp8_attention
};

}  // namespace fp8t
