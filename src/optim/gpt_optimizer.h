// The optimizer of the GPT: nanochat's MuonAdamW (gpt.py setup_optimizer and base_train.py at
// commit 92d63d4) or plain AdamW as Megatron and Primus run it, fp32 on the CPU path. The
// trainer computes the schedule of each step (nanochat_step_schedule) and passes it in; the
// state (moments and the step counter) is a list of named views a checkpoint saves and loads.
#pragma once

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "models/gpt_config.h"
#include "models/gpt_memory.h"
#include "optim/adamw.h"
#include "optim/muon.h"
#include "optim/optimizer_shard.h"
#include "optim/schedule.h"

namespace fp8t::optim {

// nanochat tuned its learning rates at this batch (tokens per optimizer step, d12) and scales
// them by √(tokens_per_step / kReferenceBatchTokens).
inline constexpr int64_t kReferenceBatchTokens = int64_t{1} << 19;

enum class OptimizerKind : uint8_t {
  Muon,   // nanochat's MuonAdamW: Muon for the block matrices, AdamW groups for the rest
  AdamW,  // one AdamW for every parameter (Megatron, Primus)
};

struct OptimizerSettings {
  OptimizerKind kind = OptimizerKind::Muon;

  // Muon: nanochat's base_train defaults, tuned at d12 (dim 768) and kReferenceBatchTokens.
  // The AdamW groups' lrs scale by (n_embd / 768)^-0.5 (lm_head, wte, value_embeds) and all
  // by the batch; their betas and weight decays are nanochat's per-group constants.
  double matrix_lr = 0.02;        // Muon
  double embedding_lr = 0.3;      // wte; value_embeds get half
  double unembedding_lr = 0.008;  // lm_head
  double scalar_lr = 0.5;         // x0_lambdas; resid_lambdas get 1 %
  // Muon's cautious weight decay at d12 and the reference batch; scaled as nanochat does by
  // √(B / B_ref) · D_ref / D (nanochat_muon_weight_decay) and then by the schedule.
  double weight_decay = 0.28;
  // Training tokens per scaling parameter (nanochat's --target-param-data-ratio): the horizon
  // D of the weight-decay scaling.
  double target_param_data_ratio = 12.0;
  double adam_eps = 1e-10;
  // Fp32: nanochat on a CPU. Bf16: nanochat on sm80+ GPUs, which orthogonalizes in bf16.
  MuonPrecision muon_precision = MuonPrecision::Fp32;
  // wte and the value embeddings, and their AdamW moments, held in bf16 (nanochat on a GPU;
  // the GPU path's choice): each update computed in fp32 from the bf16 values, then rounded.
  // Off, they stay fp32 (nanochat on a CPU).
  bool bf16_embeddings = false;

  // AdamW: one set for every parameter; 1-D parameters get no weight decay (Megatron's rule).
  // No dimension or batch scaling.
  AdamWHyperparameters adamw{
      .lr = 3e-4, .beta1 = 0.9, .beta2 = 0.95, .eps = 1e-8, .weight_decay = 0.1};

  // Throws ConfigError naming the field when a value is out of range.
  void validate() const;
};

// The per-step values of the schedules, computed by the trainer.
struct StepSchedule {
  double lr_multiplier = 1.0;            // every group's lr
  double muon_momentum = 0.95;           // Muon groups
  double weight_decay_multiplier = 1.0;  // Muon groups (AdamW groups keep theirs constant)
};

// nanochat's Muon weight-decay schedule: cosine from 1 to 0 over the run, 0.5·(1 + cos(π·it/N)).
double nanochat_weight_decay_multiplier(int64_t it, int64_t total_iters);

// base_train's three schedules at optimizer step `it` (from 0).
StepSchedule nanochat_step_schedule(const LrSchedule& schedule, int64_t it);

// nanochat's scaling parameters: block matrices (transformer.h.*) plus lm_head.
int64_t nanochat_scaling_params(const GptConfig& config);

// λ · √(B / B_ref) · D_ref / D with D = int(ratio · scaling params) and D_ref the same for d12
// (GptConfig::from_depth(12) with this vocabulary): base_train's weight_decay_scaled.
double nanochat_muon_weight_decay(const GptConfig& config, double weight_decay,
                                  int64_t tokens_per_step, double target_param_data_ratio);

enum class UpdateRule : uint8_t { Muon, AdamW };

// A parameter group, for logging and inspection.
struct OptimizerGroup {
  // Muon kind: "lm_head", "wte", "value_embeds", "resid_lambdas", "x0_lambdas", "smear" and
  // "matrix RxC" (one per shape, sorted by shape). AdamW kind: "weight_decay" (matrices) and
  // "no_weight_decay" (1-D parameters, Megatron's rule).
  std::string name;
  UpdateRule rule;
  std::vector<std::string> parameters;  // in gpt_parameters() order
  double initial_lr;                    // with the dimension and batch scaling, before the schedule
  double beta1;                         // AdamW
  double beta2;                         // AdamW's second moment, or NorMuon's
  double eps;                           // AdamW
  // AdamW: constant. Muon: nanochat_muon_weight_decay, before the schedule.
  double weight_decay;
  // The lr of the last step: initial_lr · lr_multiplier, times muon_lr_scale for Muon groups
  // (the multiplier is 1 before the first step).
  double lr;
};

class GptOptimizer {
 public:
  // tokens_per_step: tokens per optimizer step over all ranks and micro-batches (nanochat's
  // total_batch_size), for the batch scaling of the lrs and the weight decay. With ranks > 1
  // (ZeRO-1, optim/optimizer_shard.h) step() updates only the parameters `rank` owns, and only
  // their part of the state; the state stays whole, for checkpoints, and the other ranks' part
  // of it is current only after gather_optimizer_state (train/training_engine.h).
  GptOptimizer(const GptConfig& config, const OptimizerSettings& settings, int64_t tokens_per_step,
               int rank = 0, int ranks = 1);
  // The state views point into the optimizer.
  GptOptimizer(const GptOptimizer&) = delete;
  GptOptimizer& operator=(const GptOptimizer&) = delete;

  // One step over every parameter this rank owns; params and grads are fp32 ParameterSets of
  // this config.
  void step(ParameterSet& params, const ParameterSet& grads, const StepSchedule& schedule);

  OptimizerKind kind() const { return kind_; }
  const std::vector<OptimizerGroup>& groups() const { return groups_; }
  const OptimizerGroup& group_of(const std::string& parameter) const;
  // Whether the parameter and its moments are held in bf16 (OptimizerSettings::bf16_embeddings).
  bool stored_in_bf16(const std::string& parameter) const;
  int64_t steps_taken() const { return steps_; }
  // Which rank updates each parameter.
  const OptimizerShard& shard() const { return *shard_; }

  // Every state buffer and the step counter, in a fixed order, as views of the optimizer's
  // memory: "<parameter>.momentum" / ".second_moment" (Muon), "<parameter>.exp_avg" /
  // ".exp_avg_sq" (AdamW) and "optimizer.step" (I64 [1], the steps taken).
  std::vector<NamedTensor> state();
  // Copies buffers of the same names, shapes and dtypes into the state. Throws fp8t::Error
  // naming the first missing, mismatched or unexpected buffer, before copying anything.
  void load_state(std::span<const NamedTensor> buffers);
  size_t state_bytes() const;

 private:
  struct AdamWSlot {
    std::string parameter;
    size_t group;
    std::vector<int64_t> shape;
    std::vector<float> exp_avg, exp_avg_sq;
    bool bf16 = false;  // the parameter and the moments hold bf16 values
  };
  struct MuonSlot {
    size_t group;
    MuonGroup state;
  };

  void add_adamw_groups(const AdamWHyperparameters& adamw, const std::vector<ParamSpec>& specs);
  void add_nanochat_groups(const GptConfig& config, const OptimizerSettings& settings,
                           int64_t tokens_per_step, const std::vector<ParamSpec>& specs);
  void add_group(OptimizerGroup group, const std::vector<ParamSpec>& specs);

  OptimizerKind kind_;
  MuonPrecision muon_precision_;
  bool bf16_embeddings_;
  std::vector<OptimizerGroup> groups_;
  std::vector<AdamWSlot> adamw_;
  std::vector<MuonSlot> muon_;
  std::optional<OptimizerShard> shard_;  // set once the groups are known
  int64_t steps_ = 0;
};

}  // namespace fp8t::optim
