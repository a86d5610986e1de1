// What the GPT holds in memory: parameters and gradients by name, and the activations its
// forward saves for backward, as structs of views cut from arenas sized up front. One visitor
// per struct lists every tensor, so sizing, allocation and the printed plan cannot disagree.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/arena.h"
#include "core/tensor.h"
#include "models/gpt_config.h"
#include "models/recompute.h"

namespace fp8t {

// Parameters (or their gradients) by nanochat name, in gpt_parameters() order.
class ParameterSet {
 public:
  static size_t planned_bytes(const GptConfig& config, DType dtype);
  ParameterSet(Arena& arena, const GptConfig& config, DType dtype);

  TensorView& operator[](const std::string& name);
  const TensorView& operator[](const std::string& name) const;
  const std::vector<ParamSpec>& specs() const { return specs_; }
  void fill_zero();

 private:
  std::vector<ParamSpec> specs_;
  std::map<std::string, TensorView> tensors_;
};

// The activations of one block. Shapes: [B, T, C] unless noted (under sequence parallelism
// [R, C] and [R] for the residual stream's and norms' tensors, R this rank's rows). input, mid and
// fc_act are forward temporaries the backward does not read except fc_act (plain mlp.c_proj's
// wgrad), which selective recompute computes again; output is the next block's input.
struct BlockActivations {
  TensorView input;       // after the resid/x0 mix
  TensorView attn_rstd;   // [B, T]
  TensorView attn_norm;   // input of c_q, c_k, c_v and the value gate
  TensorView q_rstd;      // [B, T, H]
  TensorView k_rstd;      // [B, T, Hkv]
  TensorView q;           // [B, T, H, D] normed and scaled: the attention's inputs
  TensorView k;           // [B, T, Hkv, D]
  TensorView v;           // [B, T, Hkv, D] with the value embedding mixed in
  TensorView value_gate;  // [B, T, Hkv], layers with a value embedding only
  TensorView logsumexp;   // [B, H, T]
  TensorView attn_out;    // input of attn.c_proj
  TensorView mid;         // after the attention residual
  TensorView mlp_rstd;    // [B, T]
  TensorView mlp_norm;    // input of mlp.c_fc
  TensorView fc;          // [B, T, 4C] before relu²
  TensorView fc_act;      // [B, T, 4C] after relu²: input of mlp.c_proj
  TensorView output;      // after the MLP residual
};

// Where the blocks' activations live under activation recompute (models/recompute.h):
// - none: every block has its own;
// - selective: input, mid and fc_act are one buffer shared by every block;
// - full: a recomputed block uses the buffers of its place in its group, shared with the same
//   place of the other groups, and has its own output only when it is the last of its group or
//   the backout layer (whose output the final mix reads); the other blocks have their own.
struct GptActivations {
  TensorView embedding;       // wte lookup
  TensorView embedding_rstd;  // [B, T]
  TensorView embedding_norm;  // before the smear
  TensorView smear_gate;      // [B, T] sigmoid of the smear gate
  TensorView x0;              // after the smear: the x0 of every layer's mix
  std::vector<BlockActivations> blocks;
  TensorView final_input;  // after the backout
  TensorView final_rstd;   // [B, T]
  TensorView final_norm;   // input of lm_head
  TensorView logits;       // [B, T, padded vocab], f32 always; gradients overwrite it

  // tensor_parallel: ranks that split the blocks (models/tensor_parallel.h); the attention's and
  // the MLP's tensors hold this rank's heads and hidden features only. sequence_parallel (with
  // tensor_parallel > 1): the tensors outside them (x0 and the blocks' residuals and norms, the
  // final norm and the logits) hold this rank's rows [B·T / tensor_parallel] only.
  static size_t planned_bytes(const GptConfig& config, int64_t batch, int64_t seq, DType dtype,
                              const RecomputeOptions& recompute = {}, int tensor_parallel = 1,
                              bool sequence_parallel = false);
  GptActivations(Arena& arena, const GptConfig& config, int64_t batch, int64_t seq, DType dtype,
                 const RecomputeOptions& recompute = {}, int tensor_parallel = 1,
                 bool sequence_parallel = false);

 private:
  GptActivations() = default;
  // Calls visit(slot, dtype, shape) for every tensor that takes memory, in one place for sizing
  // and allocation, then points the blocks that share buffers at them.
  template <typename Visit>
  void visit(const GptConfig& config, int64_t batch, int64_t seq, DType dtype,
             const RecomputeOptions& recompute, int tensor_parallel, bool sequence_parallel,
             Visit&& visit_tensor);
};

// Temporaries of one forward and backward, planned like the activations (the widths of the
// heads and the hidden layer: this rank's share under tensor parallelism; R: this rank's rows,
// N / tensor_parallel under sequence parallelism, else N).
struct GptWorkspace {
  TensorView q_lin, k_lin;  // [N, H*D], [N, Hkv*D] before rotary
  TensorView value_embed;   // [N, Hkv*D]
  TensorView branch;        // [N, C] attention or MLP branch output before the residual add
  TensorView dx, dx_next, dx0, dbackout, dbranch;  // [R, C] residual gradients
  TensorView dnorm;                                // [N, C] a norm's output gradient
  TensorView dattn_out;                            // [N, H*D]
  TensorView gathered;      // [N, C] sequence parallelism only: the rows of the whole group
  TensorView dfc, dfc_act;  // [N, 4C]
  TensorView dq, dk, dv, dq_rot, dk_rot, dq_lin, dk_lin;  // [N, H*D] / [N, Hkv*D]
  TensorView dvalue_embed;                                // [N, Hkv*D]

  static size_t planned_bytes(const GptConfig& config, int64_t tokens, int tensor_parallel = 1,
                              bool sequence_parallel = false);
  GptWorkspace(Arena& arena, const GptConfig& config, int64_t tokens, int tensor_parallel = 1,
               bool sequence_parallel = false);

 private:
  GptWorkspace() = default;
  template <typename Visit>
  void visit(const GptConfig& config, int64_t tokens, int tensor_parallel, bool sequence_parallel,
             Visit&& visit_tensor);
};

// Bytes per category, for the summary printed before a run.
struct GptMemoryPlan {
  size_t parameters = 0;
  size_t gradients = 0;
  size_t optimizer_state = 0;
  size_t activations = 0;
  size_t workspace = 0;
  size_t total() const {
    return parameters + gradients + optimizer_state + activations + workspace;
  }
};

// The CPU path: f32 parameters, gradients and activations; optimizer state as the MuonAdamW
// optimizer keeps it (Muon for the block matrices: a momentum and a NorMuon second moment of
// max(rows, cols); AdamW for the rest: two moments). With tensor parallelism the activations and
// the workspace are one rank's of `tensor_parallel` (and of its tokens with sequence_parallel);
// the rest is whole on every rank.
GptMemoryPlan plan_gpt_memory(const GptConfig& config, int64_t batch, int64_t seq,
                              const RecomputeOptions& recompute = {}, int tensor_parallel = 1,
                              bool sequence_parallel = false);

}  // namespace fp8t
