// EvaluationMode turns training off for its scope and back on when the scope ends, whether by
// return or by an exception from an evaluation pass.
#include <gtest/gtest.h>

#include <stdexcept>
#include <vector>

#include "train/evaluation_mode.h"

namespace fp8t::train {
namespace {

// Records every set_training call.
struct RecordingModel {
  std::vector<bool> calls;
  void set_training(bool training) { calls.push_back(training); }
};

TEST(EvaluationMode, TrainingIsOffWithinTheScopeAndOnAfterIt) {
  RecordingModel model;
  {
    const EvaluationMode evaluation(model);
    EXPECT_EQ(model.calls, std::vector<bool>{false});
  }
  EXPECT_EQ(model.calls, (std::vector<bool>{false, true}));
}

TEST(EvaluationMode, AnExceptionLeavesTheModelTraining) {
  RecordingModel model;
  const auto evaluate = [&] {
    const EvaluationMode evaluation(model);
    throw std::runtime_error("forward failed");
  };
  EXPECT_THROW(evaluate(), std::runtime_error);
  EXPECT_EQ(model.calls, (std::vector<bool>{false, true}));
}

}  // namespace
}  // namespace fp8t::train
