// A model in evaluation mode for one scope: its forward passes leave the FP8 scaling state alone
// (set_training(false)), and training mode comes back when the scope ends, by return or by
// exception.
#pragma once

namespace fp8t::train {

template <typename Model>
class EvaluationMode {
 public:
  explicit EvaluationMode(Model& model) : model_(model) { model_.set_training(false); }
  ~EvaluationMode() { model_.set_training(true); }
  EvaluationMode(const EvaluationMode&) = delete;
  EvaluationMode& operator=(const EvaluationMode&) = delete;

 private:
  Model& model_;
};

}  // namespace fp8t::train
