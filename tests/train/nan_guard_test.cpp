// The NaN guard: the order in which gradients are scanned for the first non-finite value, the
// guard's counting and remedies, the CPU engine's attribution and fault injection, and whole
// runs with injected NaNs: a bad step is skipped and named, K in a row restore the last good
// checkpoint with the remedies, and a resumed run keeps them.
#include "train/nan_guard.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "core/error.h"
#include "data/token_loader.h"
#include "io/safetensors.h"
#include "test_files.h"
#include "train/checkpoint.h"
#include "train/trainer.h"
#include "train/trainer_fixture.h"
#include "train/training_engine.h"

namespace fp8t::train {
namespace {

namespace fs = std::filesystem;
using ::testing::HasSubstr;

GptConfig depth(int layers) {
  GptConfig config;
  config.n_layer = layers;
  return config;
}

TEST(GradientScanOrder, LmHeadThenTheBlocksFromTheLastThenTheRest) {
  const std::vector<std::string> expected = {
      "lm_head.weight",
      // block 1, the last: its value embedding, then its parameters last first
      "value_embeds.1.weight",
      "transformer.h.1.mlp.c_proj.weight",
      "transformer.h.1.mlp.c_fc.weight",
      "transformer.h.1.attn.ve_gate.weight",
      "transformer.h.1.attn.c_proj.weight",
      "transformer.h.1.attn.c_v.weight",
      "transformer.h.1.attn.c_k.weight",
      "transformer.h.1.attn.c_q.weight",
      // block 0 (no value embedding)
      "transformer.h.0.mlp.c_proj.weight",
      "transformer.h.0.mlp.c_fc.weight",
      "transformer.h.0.attn.c_proj.weight",
      "transformer.h.0.attn.c_v.weight",
      "transformer.h.0.attn.c_k.weight",
      "transformer.h.0.attn.c_q.weight",
      // outside the blocks, the embedding last
      "backout_lambda",
      "smear_lambda",
      "smear_gate.weight",
      "x0_lambdas",
      "resid_lambdas",
      "transformer.wte.weight",
  };
  EXPECT_EQ(gradient_scan_order(depth(2)), expected);
}

TEST(GradientScanOrder, HoldsEveryParameterOnce) {
  const GptConfig config = GptConfig::from_depth(24);
  std::vector<std::string> order = gradient_scan_order(config);
  std::vector<std::string> parameters;
  for (const ParamSpec& spec : gpt_parameters(config))
    parameters.push_back(spec.name);
  std::sort(order.begin(), order.end());
  std::sort(parameters.begin(), parameters.end());
  EXPECT_EQ(order, parameters);
}

TEST(NanGuard, LayerOfAParameter) {
  const GptConfig config = GptConfig::from_depth(24);
  EXPECT_EQ(layer_of(config, "transformer.h.7.mlp.c_fc.weight"), "block 7");
  EXPECT_EQ(layer_of(config, "value_embeds.23.weight"), "block 23");
  EXPECT_EQ(layer_of(config, "lm_head.weight"), "lm_head");
  EXPECT_EQ(layer_of(config, "transformer.wte.weight"), "outside the blocks");
  EXPECT_THAT(test::error_message([&] { layer_of(config, "transformer.h.24.mlp.c_fc.weight"); }),
              HasSubstr("no parameter named 'transformer.h.24.mlp.c_fc.weight'"));
}

RunSection guard_settings(std::vector<NanRemedy> remedies) {
  RunSection settings;
  settings.nan_restore_after = 3;
  settings.nan_max_restores = 1;
  settings.nan_remedy = std::move(remedies);
  settings.nan_lr_factor = 0.25;
  return settings;
}

TEST(NanGuard, CountsStreaksAndAppliesEveryRemedy) {
  NanGuard guard(guard_settings({NanRemedy::LowerLr, NanRemedy::Fp8Margin, NanRemedy::Bf16Layer}),
                 depth(2));
  const std::string fc = "transformer.h.1.mlp.c_fc.weight";
  EXPECT_EQ(guard.bad_step(fc),
            "; first non-finite gradient: transformer.h.1.mlp.c_fc.weight (block 1); bad steps: "
            "1 in a row, 1 in the run");
  guard.bad_step(fc);
  guard.good_step();  // ends the streak
  EXPECT_EQ(guard.state().bad_in_a_row, 0);
  EXPECT_EQ(guard.bad_step(std::nullopt),
            "; every gradient is finite (the loss is not); bad steps: 1 in a row, 3 in the run");
  guard.bad_step(fc);
  EXPECT_FALSE(guard.restore_due());
  guard.bad_step("lm_head.weight");
  ASSERT_TRUE(guard.restore_due());
  EXPECT_EQ(guard.describe_streak(),
            "3 bad steps in a row (first non-finite gradients: transformer.h.1.mlp.c_fc.weight, "
            "lm_head.weight)");

  const RemedyChange change = guard.begin_restore();
  EXPECT_TRUE(change.precision_changed);
  EXPECT_EQ(change.description,
            "lr × 0.25, fp8_margin + 1, the linears of block 1, lm_head in BF16");
  EXPECT_FALSE(guard.restore_due());
  EXPECT_EQ(guard.state().restores, 1);
  EXPECT_EQ(guard.lr_scale(), 0.25);
  const std::vector<std::string> bf16 = {
      "transformer.h.1.attn.c_q",     "transformer.h.1.attn.c_k",
      "transformer.h.1.attn.c_v",     "transformer.h.1.attn.c_proj",
      "transformer.h.1.attn.ve_gate", "transformer.h.1.mlp.c_fc",
      "transformer.h.1.mlp.c_proj",   "lm_head"};
  EXPECT_EQ(guard.state().bf16_linears, bf16);
  ModelPrecision configured;
  configured.fp8.margin = 2.0f;
  configured.policy.bf16_linears = {"lm_head"};
  const ModelPrecision remedied = guard.precision(configured);
  EXPECT_EQ(remedied.fp8.margin, 3.0f);
  EXPECT_EQ(remedied.policy.bf16_linears.size(), bf16.size());  // lm_head once

  // The one restore allowed is spent.
  for (int i = 0; i < 3; ++i)
    guard.bad_step(fc);
  EXPECT_THAT(test::error_message([&] { guard.begin_restore(); }),
              HasSubstr("NaN guard: 3 bad steps in a row (first non-finite gradients: "
                        "transformer.h.1.mlp.c_fc.weight) after 1 restore(s) of the last good "
                        "checkpoint (nan_max_restores: 1); stopping. The remedies in force: lr × "
                        "0.25, fp8_margin + 1, 8 linear(s) kept in BF16"));
}

TEST(NanGuard, Bf16LayerNeedsALayer) {
  NanGuard guard(guard_settings({NanRemedy::Bf16Layer}), depth(2));
  guard.bad_step(std::nullopt);
  guard.bad_step("transformer.wte.weight");
  guard.bad_step("smear_lambda");
  const RemedyChange change = guard.begin_restore();
  EXPECT_FALSE(change.precision_changed);
  EXPECT_EQ(change.description, "bf16_layer: no non-finite gradient in a block or lm_head");
  EXPECT_FALSE(guard.changes_precision());
  EXPECT_EQ(guard.describe_remedies(), "none");
}

TEST(NanGuard, StateRoundTripsThroughJson) {
  NanGuard guard(guard_settings({NanRemedy::LowerLr, NanRemedy::Bf16Layer}), depth(2));
  for (int i = 0; i < 3; ++i)
    guard.bad_step("transformer.h.0.attn.c_q.weight");
  guard.begin_restore();
  guard.bad_step(std::nullopt);
  const nlohmann::json json = guard.state();
  const auto read = json.get<NanGuardState>();
  EXPECT_EQ(nlohmann::json(read), json);
  EXPECT_EQ(read.bad_steps, 4);
  EXPECT_EQ(read.streak_gradients, std::vector<std::string>{""});
  EXPECT_EQ(read.lr_scale, 0.25);
  // A checkpoint saved before the guard existed reads as a fresh state.
  EXPECT_EQ(nlohmann::json(nlohmann::json::object().get<NanGuardState>()),
            nlohmann::json(NanGuardState{}));
}

// Whole runs on the CPU path, and the CPU engine itself, over the trainer tests' data.
class NanGuardRunTest : public TrainerTest {
 protected:
  fs::path run(const std::string& name) const { return root_ / "runs" / name; }

  // Every record of metrics.jsonl, in order (a restore logs steps again).
  static std::vector<nlohmann::json> records(const fs::path& run_folder) {
    std::vector<nlohmann::json> all;
    std::ifstream in(run_folder / "metrics.jsonl");
    std::string line;
    while (std::getline(in, line))
      all.push_back(nlohmann::json::parse(line));
    return all;
  }

  // The messages of the events of one kind.
  static std::vector<std::string> events(const fs::path& run_folder, const std::string& kind) {
    std::vector<std::string> messages;
    for (const nlohmann::json& record : records(run_folder)) {
      if (record.value("event", "") == kind) messages.push_back(record["message"]);
    }
    return messages;
  }

  static std::vector<std::byte> file_bytes(const fs::path& file) {
    const io::SafetensorsFile tensors(file);
    std::vector<std::byte> bytes;
    for (const std::string& name : tensors.names()) {
      const io::RawTensor raw = tensors.raw(name);
      bytes.insert(bytes.end(), raw.bytes.begin(), raw.bytes.end());
    }
    return bytes;
  }

  static nlohmann::json guard_state(const fs::path& run_folder, int64_t step) {
    std::ifstream in(checkpoint_folder(run_folder, step) / "trainer_state.json");
    return nlohmann::json::parse(in).at("nan_guard");
  }

  // Three NaNs in a row in block 1's c_fc, delayed-scaling FP8, every remedy.
  std::vector<std::string> restore_args(std::vector<std::string> extra = {}) const {
    std::vector<std::string> all = {"--fp8=hybrid",
                                    "--fp8-recipe=delayed",
                                    "--fp8-amax-history-len=4",
                                    "--train-iters=8",
                                    "--save-every=2",
                                    "--nan-restore-after=3",
                                    "--nan-remedy=[lower_lr, fp8_margin, bf16_layer]",
                                    "--nan-inject-steps=[4, 5, 6]",
                                    "--nan-inject-parameter=transformer.h.1.mlp.c_fc.weight"};
    all.insert(all.end(), extra.begin(), extra.end());
    return all;
  }
};

TEST_F(NanGuardRunTest, CpuEngineNamesTheNonFiniteGradientNearestTheLoss) {
  EngineSetup setup;
  setup.model = depth(2);
  setup.model.n_embd = 128;
  setup.model.n_head = 1;
  setup.model.n_kv_head = 1;
  setup.model.vocab_size = vocab_;
  setup.model.sequence_len = 64;
  setup.precision = ModelPrecision::fp32_reference();
  setup.batch = 2;
  setup.seq = 64;
  setup.optimizer = TrainConfig{}.optimizer_settings();
  setup.tokens_per_step = 128;
  const std::unique_ptr<TrainingEngine> engine = make_cpu_engine(setup);
  init_gpt_weights(engine->host_parameters(), setup.model, 1);
  engine->from_host();
  data::TokenLoader loader({data_ / "train_00000.tokens"}, {.batch = 2, .sequence = 64, .seed = 1});
  ParameterSet& parameters = engine->host_parameters();
  const auto weights = [&] {
    std::vector<float> values;
    for (const ParamSpec& spec : parameters.specs()) {
      const TensorView& view = parameters[spec.name];
      values.insert(values.end(), view.data<float>(), view.data<float>() + view.numel());
    }
    return values;
  };
  const std::vector<float> initial = weights();

  engine->inject_nan("transformer.h.0.attn.c_q.weight");
  engine->inject_nan("transformer.h.1.mlp.c_fc.weight");
  const StepResult bad = engine->train_step(loader, 1, 0.0, {});
  EXPECT_FALSE(bad.finite());
  EXPECT_TRUE(std::isfinite(bad.loss));
  EXPECT_EQ(engine->first_non_finite_gradient(), "transformer.h.1.mlp.c_fc.weight");
  EXPECT_EQ(weights(), initial);  // not applied

  const StepResult good = engine->train_step(loader, 1, 0.0, {});
  EXPECT_TRUE(good.finite());
  EXPECT_EQ(engine->first_non_finite_gradient(), std::nullopt);
  EXPECT_NE(weights(), initial);
  EXPECT_THROW(engine->inject_nan("transformer.h.2.mlp.c_fc.weight"), Error);
}

TEST_F(NanGuardRunTest, BadStepIsSkippedNamedAndTheRunGoesOn) {
  const TrainOutcome outcome = run_training(
      load_train_config(args("skip", {"--save-every=1", "--nan-inject-steps=3",
                                      "--nan-inject-parameter=transformer.h.1.mlp.c_fc.weight"})));
  EXPECT_EQ(outcome.steps_done, 6);
  EXPECT_TRUE(std::isfinite(outcome.last_loss));
  const std::vector<std::string> skipped = events(run("skip"), "skipped_step");
  ASSERT_EQ(skipped.size(), 1u);
  EXPECT_THAT(skipped[0], HasSubstr("step 3: loss "));
  EXPECT_THAT(skipped[0], HasSubstr("gradient norm nan; the update is skipped; first non-finite "
                                    "gradient: transformer.h.1.mlp.c_fc.weight (block 1); bad "
                                    "steps: 1 in a row, 1 in the run"));
  EXPECT_TRUE(events(run("skip"), "restored").empty());
  // Step 3 changed neither the weights nor the optimizer state; step 4 trained again.
  const auto file = [&](int64_t step, const char* name) {
    return file_bytes(checkpoint_folder(run("skip"), step) / name);
  };
  EXPECT_EQ(file(3, "model.safetensors"), file(2, "model.safetensors"));
  EXPECT_EQ(file(3, "optimizer.safetensors"), file(2, "optimizer.safetensors"));
  EXPECT_NE(file(4, "model.safetensors"), file(3, "model.safetensors"));
  EXPECT_EQ(guard_state(run("skip"), 3).at("bad_in_a_row"), 1);
  EXPECT_EQ(guard_state(run("skip"), 4).at("bad_in_a_row"), 0);
  EXPECT_EQ(guard_state(run("skip"), 6).at("bad_steps"), 1);
}

TEST_F(NanGuardRunTest, BadStepsInARowRestoreTheLastGoodCheckpointWithTheRemedies) {
  const TrainOutcome outcome = run_training(load_train_config(args("restore", restore_args())));
  EXPECT_EQ(outcome.steps_done, 8);
  EXPECT_TRUE(std::isfinite(outcome.last_loss));
  EXPECT_EQ(events(run("restore"), "skipped_step").size(), 3u);
  const std::vector<std::string> restored = events(run("restore"), "restored");
  ASSERT_EQ(restored.size(), 1u);
  EXPECT_THAT(restored[0],
              HasSubstr("NaN guard: 3 bad steps in a row (first non-finite gradients: "
                        "transformer.h.1.mlp.c_fc.weight) up to step 6; restored the last good "
                        "checkpoint, step 2 (restore 1 of 3); remedies: lr × 0.5, fp8_margin + "
                        "1, the linears of block 1 in BF16; precision: FP8: "));
  EXPECT_THAT(restored[0], HasSubstr("non-finite gradients (nan_remedy: bf16_layer)"));

  // The checkpoints of the abandoned steps 4 and 6 were replaced by the restored run's.
  EXPECT_EQ(saved_steps(run("restore")), (std::vector<int64_t>{2, 4, 6, 8}));
  for (int64_t step : {2, 4, 6, 8}) {
    const nlohmann::json state = guard_state(run("restore"), step);
    EXPECT_EQ(state.at("restores"), 1) << step;
    EXPECT_EQ(state.at("bad_in_a_row"), 0) << step;
    EXPECT_EQ(state.at("lr_scale"), 0.5) << step;
    EXPECT_EQ(state.at("fp8_margin_added"), 1) << step;
  }
  // Block 1 has no delayed-scaling state any more; block 0 keeps its own.
  const io::SafetensorsFile scaling(checkpoint_folder(run("restore"), 8) /
                                    "fp8_scaling.safetensors");
  for (const std::string& name : scaling.names())
    EXPECT_FALSE(name.starts_with("transformer.h.1.")) << name;
  EXPECT_TRUE(scaling.contains("transformer.h.0.mlp.c_fc.input.state"));

  // Steps 3 to 6 ran twice; the second time at half the learning rate.
  std::map<int64_t, std::vector<double>> lrs;
  for (const nlohmann::json& record : records(run("restore"))) {
    if (record.contains("step")) lrs[record.at("step")].push_back(record.at("lr"));
  }
  ASSERT_EQ(lrs.at(3).size(), 2u);
  EXPECT_DOUBLE_EQ(lrs.at(3)[1], 0.5 * lrs.at(3)[0]);
  EXPECT_EQ(lrs.at(8).size(), 1u);
}

TEST_F(NanGuardRunTest, ResumeAfterARestoreKeepsTheRemediesBitForBit) {
  run_training(load_train_config(args("straight", restore_args())));
  const std::map<int64_t, double> straight = losses(run("straight"));
  const std::vector<std::byte> straight_weights = model_bytes(run("straight"), 8);
  // The same run resumed from step 6, which was saved after the restore.
  run_training(load_train_config(args("straight", restore_args({"--resume-from-step=6"}))));
  const std::map<int64_t, double> resumed = losses(run("straight"));
  for (int64_t step : {7, 8})
    EXPECT_EQ(resumed.at(step), straight.at(step)) << "step " << step;
  EXPECT_EQ(model_bytes(run("straight"), 8), straight_weights);
  EXPECT_EQ(guard_state(run("straight"), 8).at("restores"), 1);
}

TEST_F(NanGuardRunTest, NoGoodCheckpointToRestoreStopsTheRun) {
  EXPECT_THAT(
      test::error_message([&] {
        run_training(load_train_config(
            args("nothing", {"--save-every=0", "--nan-restore-after=2", "--nan-inject-steps=[1, 2]",
                             "--nan-inject-parameter=lm_head.weight"})));
      }),
      HasSubstr("NaN guard: 2 bad steps in a row (first non-finite gradients: "
                "lm_head.weight) up to step 2, and no checkpoint saved after a good step "
                "in "));
}

TEST_F(NanGuardRunTest, SpentRestoresStopTheRun) {
  EXPECT_THAT(test::error_message([&] {
                run_training(load_train_config(
                    args("spent", {"--save-every=1", "--nan-restore-after=2",
                                   "--nan-max-restores=0", "--nan-inject-steps=[2, 3]",
                                   "--nan-inject-parameter=transformer.wte.weight"})));
              }),
              HasSubstr("after 0 restore(s) of the last good checkpoint (nan_max_restores: 0); "
                        "stopping"));
}

}  // namespace
}  // namespace fp8t::train
