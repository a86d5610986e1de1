// The GPT trainer's guard against bad steps, steps whose loss or gradient norm is not finite.
// The engines do not apply them (StepResult::finite); the guard counts them, names the first
// non-finite gradient of each, and after nan_restore_after of them in a row decides the remedies
// (nan_remedy) that the trainer applies when it restores the last good checkpoint. Its state is
// saved in each checkpoint's trainer_state.json, so that a resumed run keeps the remedies.
#pragma once

#include <cstdint>
#include <filesystem>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "config/train_config.h"
#include "models/gpt_config.h"
#include "models/precision_policy.h"

namespace fp8t::train {

// The GPT's parameters in the order the backward completes their gradients: lm_head, then the
// blocks from the last to the first, then the parameters outside the blocks (within each group
// the parameter table's order reversed; a value embedding counts with its block). A NaN spreads
// to whatever the backward computes after it, so the first non-finite gradient in this order is
// the one nearest to where it arose.
std::vector<std::string> gradient_scan_order(const GptConfig& config);

bool all_finite(std::span<const float> values);

// Where a parameter of the GPT sits, for the log: "block 7", "lm_head", or "outside the blocks".
std::string layer_of(const GptConfig& config, const std::string& parameter);

struct NanGuardState {
  int64_t bad_steps = 0;  // in the run so far
  int64_t bad_in_a_row = 0;
  int64_t restores = 0;
  // The first non-finite gradient of each bad step in a row; "" where every gradient was finite
  // (the loss was not).
  std::vector<std::string> streak_gradients;
  // The remedies in force.
  double lr_scale = 1.0;
  int fp8_margin_added = 0;
  std::vector<std::string> bf16_linears;
};
void to_json(nlohmann::json& json, const NanGuardState& state);
// Missing fields keep their defaults: a checkpoint saved before the guard reads as a fresh one.
void from_json(const nlohmann::json& json, NanGuardState& state);

// What a restore changed, for the log.
struct RemedyChange {
  std::string description;
  bool precision_changed = false;  // the engine must be rebuilt with precision()
};

class NanGuard {
 public:
  NanGuard(const RunSection& settings, GptConfig model);

  const NanGuardState& state() const { return state_; }
  // A resumed run's state, from its checkpoint.
  void resume(NanGuardState state) { state_ = std::move(state); }

  void good_step();
  // Counts a bad step whose first non-finite gradient is `gradient` (nothing: all were finite);
  // returns the note for its log line.
  std::string bad_step(const std::optional<std::string>& gradient);
  // nan_restore_after (> 0) bad steps in a row.
  bool restore_due() const;
  // The streak, for messages: "5 bad steps in a row (first non-finite gradients: ...)".
  std::string describe_streak() const;
  // Starts a restore: throws Error when nan_max_restores are spent; else counts it, applies
  // nan_remedy to the remedies in force and ends the streak.
  RemedyChange begin_restore();

  // `configured` with the remedies in force: the margin raised, the linears kept in BF16.
  ModelPrecision precision(ModelPrecision configured) const;
  bool changes_precision() const;
  double lr_scale() const { return state_.lr_scale; }
  // "lr × 0.5, fp8_margin + 1, 7 linears in BF16 (block 1)", or "none".
  std::string describe_remedies() const;

 private:
  int64_t restore_after_;
  int64_t max_restores_;
  std::vector<NanRemedy> remedies_;
  double lr_factor_;
  GptConfig model_;
  NanGuardState state_;
};

// The run folder's checkpoints saved after a good step (not during a streak of bad steps),
// ascending. A checkpoint whose trainer_state.json cannot be read is listed: its load says why.
std::vector<int64_t> good_checkpoint_steps(const std::filesystem::path& run_folder);

}  // namespace fp8t::train
