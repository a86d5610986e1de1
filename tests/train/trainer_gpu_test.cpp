// The trainer on the GPU path: the loss falls, a resumed run continues where it stopped (to the
// last bits only where the GPU's atomic embedding gradients add in another order), and a CPU
// checkpoint resumes on the GPU.
#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <string>
#include <vector>

#include "config/train_config.h"
#include "core/error.h"
#include "test_files.h"
#include "train/checkpoint.h"
#include "train/trainer.h"
#include "train/trainer_fixture.h"

namespace fp8t::train {
namespace {

class TrainerGpuTest : public TrainerTest {
 protected:
  std::string device() const override { return "cuda"; }

  // 6 steps straight, and a second run resumed at step 3: the losses of steps 4 to 6 agree.
  void expect_resume_continues(const std::vector<std::string>& precision) {
    run_training(load_train_config(args("straight", precision)));
    run_training(load_train_config(args("resumed", precision)));
    std::vector<std::string> resume = precision;
    resume.push_back("--resume-from-step=3");
    run_training(load_train_config(args("resumed", resume)));
    const std::map<int64_t, double> straight = losses(root_ / "runs" / "straight");
    const std::map<int64_t, double> resumed = losses(root_ / "runs" / "resumed");
    ASSERT_EQ(straight.size(), 6u);
    for (int64_t step = 4; step <= 6; ++step) {
      EXPECT_NEAR(resumed.at(step), straight.at(step), 1e-3 * straight.at(step)) << "step " << step;
    }
  }
};

// Depth 4, for the reason TrainerTest.LossFalls gives (seen here first).
TEST_F(TrainerGpuTest, LossFalls) {
  const TrainOutcome outcome = run_training(load_train_config(
      args("falls", {"--depth=4", "--train-iters=30", "--save-every=0", "--lr=0.1",
                     "--embedding-lr=1.5", "--unembedding-lr=0.04"})));
  const std::map<int64_t, double> by_step = losses(root_ / "runs" / "falls");
  ASSERT_EQ(outcome.steps_done, 30);
  EXPECT_LT(by_step.at(30), 0.7 * by_step.at(1));
}

TEST_F(TrainerGpuTest, ResumeContinuesInBf16) {
  expect_resume_continues({});
}

TEST_F(TrainerGpuTest, ResumeContinuesWithDelayedScaling) {
  expect_resume_continues({"--fp8=hybrid", "--fp8-recipe=delayed", "--fp8-amax-history-len=4"});
}

TEST_F(TrainerGpuTest, ResumeContinuesWithAdamW) {
  expect_resume_continues({"--optimizer=adamw", "--lr=0.003", "--clip-grad=1.0"});
}

// The same checkpoint format on both paths: a CPU run's step 3 resumes on the GPU, whose step 4
// is the CPU's within bf16 activations' difference.
TEST_F(TrainerGpuTest, CpuCheckpointResumesOnTheGpu) {
  run_training(load_train_config(args("cpu", {"--device=cpu"})));
  const std::map<int64_t, double> cpu = losses(root_ / "runs" / "cpu");
  const TrainOutcome outcome =
      run_training(load_train_config(args("cpu", {"--resume-from-step=3"})));
  EXPECT_EQ(outcome.steps_done, 6);
  const std::map<int64_t, double> resumed = losses(root_ / "runs" / "cpu");
  EXPECT_NEAR(resumed.at(4), cpu.at(4), 0.02 * cpu.at(4));
}

// A plan larger than the GPU's free memory fails before anything is allocated, naming the
// micro-batch that would fit.
TEST_F(TrainerGpuTest, ModelThatDoesNotFitOnTheGpuIsRefused) {
  const std::string message = test::error_message<ConfigError>([&] {
    run_training(load_train_config(
        args("huge", {"--micro-batch-size=1000000", "--global-batch-size=1000000"})));
  });
  EXPECT_TRUE(test::Contains(message, "the GPU path, with micro_batch_size 1000000, needs"))
      << message;
  EXPECT_TRUE(test::Contains(message, "is free on")) << message;
  EXPECT_TRUE(test::Contains(message, "would fit")) << message;
  EXPECT_FALSE(test::Contains(message, "fp8_weight_transposes")) << "BF16: " << message;
}

// An FP8 plan that does not fit and keeps its weight transposes also says what making them in
// backward would save; one that makes them there already does not.
TEST_F(TrainerGpuTest, Fp8ModelThatDoesNotFitIsToldWhatTransposesInBackwardSave) {
  const std::vector<std::string> huge = {"--micro-batch-size=1000000",
                                         "--global-batch-size=1000000", "--fp8=hybrid",
                                         "--fp8-recipe=tensorwise"};
  const std::string kept = test::error_message<ConfigError>(
      [&] { run_training(load_train_config(args("huge_fp8", huge))); });
  EXPECT_TRUE(test::Contains(kept, "; fp8_weight_transposes: in_backward takes ")) << kept;
  EXPECT_TRUE(test::Contains(kept, " off the linear copies")) << kept;
  std::vector<std::string> in_backward = huge;
  in_backward.push_back("--fp8-weight-transposes=in_backward");
  const std::string made = test::error_message<ConfigError>(
      [&] { run_training(load_train_config(args("huge_fp8", in_backward))); });
  EXPECT_TRUE(test::Contains(made, "would fit")) << made;
  EXPECT_FALSE(test::Contains(made, "fp8_weight_transposes")) << made;
}

}  // namespace
}  // namespace fp8t::train
