// Judging the FP8 health records of a statistics step (ops/fp8_health.h): warnings for tensors
// past the configured thresholds and, with fp8_auto_fallback, the decision to move a linear
// that keeps tripping them to BF16. Its state (the trips in a row per linear, the last amaxes,
// the decisions in force) is saved in each checkpoint's trainer_state.json, so that a resumed
// run keeps the decisions. Also the records' forms in RUN/fp8_health.jsonl and TensorBoard.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "config/train_config.h"
#include "distributed/communicator.h"
#include "models/precision_policy.h"
#include "ops/fp8_health.h"

namespace fp8t::train {

struct Fp8Fallback {
  std::string linear;
  int64_t step = 0;      // the statistics step that decided it
  std::string evidence;  // the warnings of the steps in a row that led to it
};

struct Fp8HealthState {
  std::map<std::string, int64_t> trips_in_a_row;  // by linear
  // The last statistics step's warnings per linear, in a row with trips_in_a_row.
  std::map<std::string, std::vector<std::string>> recent_warnings;
  std::map<std::string, float> last_amax;  // by "<linear>.<operand>"
  std::vector<Fp8Fallback> fallbacks;      // in force, in the order decided
};
void to_json(nlohmann::json& json, const Fp8HealthState& state);
// Missing fields keep their defaults: a checkpoint saved before the monitor reads as fresh.
void from_json(const nlohmann::json& json, Fp8HealthState& state);

// What one statistics step gave.
struct Fp8HealthVerdict {
  std::vector<std::string> warnings;   // one per tripping tensor
  std::vector<Fp8Fallback> fallbacks;  // decided now (fp8_auto_fallback)
};

class Fp8HealthMonitor {
 public:
  explicit Fp8HealthMonitor(const Fp8Section& settings, bool fp8);

  // Whether step `step` (counting from 1) collects statistics: FP8 runs every health_every.
  bool due(int64_t step) const;
  // Judges the records of statistics step `step` (the same on every rank: summed over them).
  Fp8HealthVerdict check(int64_t step, const std::vector<Fp8TensorHealth>& records);

  const Fp8HealthState& state() const { return state_; }
  void resume(Fp8HealthState state) { state_ = std::move(state); }
  // `configured` with the fallen-back linears kept in BF16.
  ModelPrecision precision(ModelPrecision configured) const;
  bool changes_precision() const { return !state_.fallbacks.empty(); }
  // "transformer.h.3.mlp.c_fc (step 400)", or "none".
  std::string describe_fallbacks() const;

 private:
  // The reasons `record` trips a threshold, each a phrase with the numbers; empty: healthy.
  std::vector<std::string> trips(const Fp8TensorHealth& record) const;

  Fp8Section settings_;
  bool fp8_;
  Fp8HealthState state_;
};

// Every rank's records summed (values, saturated, underflowed) and their amaxes maxed, so that
// every rank judges the same numbers. Every rank together, with the same records in order.
void sum_over_ranks(std::vector<Fp8TensorHealth>& records, distributed::Communicator& communicator);

class RunLog;

// The trainers' part of a statistics step, after its train_step: the engine's records summed
// over the ranks (communicator null: one process), written to the log (fp8_health.jsonl,
// TensorBoard), judged by the monitor, each warning logged as an event; returns the fallbacks
// decided, which the trainer applies once the step is done.
std::vector<Fp8Fallback> judge_fp8_health(int64_t step, std::vector<Fp8TensorHealth> records,
                                          Fp8HealthMonitor& monitor, RunLog& log,
                                          distributed::Communicator* communicator);
// Logs each fallback (the linear, the step and the evidence) as an event.
void log_fp8_fallbacks(const std::vector<Fp8Fallback>& fallbacks, RunLog& log);

// A record as a line of RUN/fp8_health.jsonl (docs/training.md): step, layer, operand, amax and
// scale (null under block recipes), elements, saturated, underflow and the two fractions.
nlohmann::json health_line(int64_t step, const Fp8TensorHealth& record);
// The TensorBoard scalars of a record: fp8/<layer>/<operand>/{saturated_fraction,
// underflow_fraction} and, for per-tensor recipes, .../amax and .../scale.
std::vector<std::pair<std::string, float>> health_scalars(const Fp8TensorHealth& record);

}  // namespace fp8t::train
