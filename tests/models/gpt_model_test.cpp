#include "models/gpt_model.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "io/safetensors.h"
#include "models/golden.h"
#include "models/recompute_checks.h"
#include "numerics/test_util.h"
#include "optim/gpt_optimizer.h"

namespace fp8t {
namespace {

// The model of tests/reference/gpt_reference.py (PyTorch, fp32) on the golden file's weights and
// tokens: logits, loss and every gradient; with sliding windows and without.
class GptGolden : public ::testing::TestWithParam<const char*> {};

TEST_P(GptGolden, MatchesThePytorchReference) {
  const auto path = testing::golden_path(GetParam());
  ASSERT_TRUE(std::filesystem::exists(path)) << path;
  const io::SafetensorsFile file(path);
  const GptConfig config = testing::golden_config(file);
  const int64_t batch = std::stoi(file.metadata_value("batch"));
  GptModel model(config, batch, config.sequence_len, GptPrecision::fp32_reference());
  for (const ParamSpec& spec : gpt_parameters(config)) {
    const io::Tensor<float> weights = file.tensor<float>(spec.name);
    TensorView& param = model.parameters()[spec.name];
    ASSERT_EQ(weights.numel(), param.numel()) << spec.name;
    std::memcpy(param.raw(), weights.data.data(), param.bytes());
  }
  const io::Tensor<int32_t> idx = file.tensor<int32_t>("input.idx");
  const io::Tensor<int32_t> targets = file.tensor<int32_t>("input.targets");

  const double loss = model.forward(idx.data.data(), targets.data.data());
  const float reference_loss = file.tensor<float>("output.loss").data[0];
  EXPECT_NEAR(loss, reference_loss, 1e-5 * std::abs(reference_loss));
  const io::Tensor<float> reference_logits = file.tensor<float>("output.logits");
  std::vector<float> logits(reference_logits.data.size());
  model.capped_logits(logits.data());
  EXPECT_LE(testing::relative_error(logits.data(), reference_logits.data.data(),
                                    reference_logits.numel()),
            1e-5);

  model.zero_gradients();
  model.backward();
  for (const ParamSpec& spec : gpt_parameters(config)) {
    const io::Tensor<float> reference = file.tensor<float>("grad." + spec.name);
    const TensorView& grad = model.gradients()[spec.name];
    EXPECT_LE(testing::relative_error(grad.data<float>(), reference.data.data(), grad.numel()),
              1e-4)
        << spec.name;
  }
}

INSTANTIATE_TEST_SUITE_P(GptModel, GptGolden,
                         ::testing::Values("gpt_tiny_golden", "gpt_tiny_golden_full"));

GptConfig tiny_config(const char* window_pattern = "SL") {
  GptConfig config;
  config.n_layer = 2;
  config.n_embd = 32;
  config.n_head = 2;
  config.n_kv_head = 1;
  config.vocab_size = 20;
  config.sequence_len = 8;
  config.window_pattern = window_pattern;
  config.short_window = 2;
  config.pad_vocab_to = 16;
  return config;
}

// Weights drawn around nanochat's initialization, with the zero-initialized projections, gates
// and smear made non-zero so that every gradient path is exercised.
void randomize(GptModel& model, std::mt19937& generator) {
  model.init_weights(generator());
  std::normal_distribution<float> normal(0.0f, 0.3f);
  for (const ParamSpec& spec : gpt_parameters(model.config())) {
    if (spec.kind == ParamKind::Scalar) continue;
    float* data = model.parameters()[spec.name].data<float>();
    for (int64_t i = 0; i < spec.numel(); ++i)
      data[i] += normal(generator);
  }
  model.parameters()["smear_lambda"].data<float>()[0] = 0.7f;
  model.end_step();
}

// Central differences of the loss against backward, on a few entries of every parameter, with
// a sliding window and without. In fp32, so the tolerance is loose; the golden comparison above
// is the tight check.
class GptGradients : public ::testing::TestWithParam<const char*> {};

TEST_P(GptGradients, MatchFiniteDifferences) {
  const GptConfig config = tiny_config(GetParam());
  GptModel model(config, 2, 8, GptPrecision::fp32_reference());
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 generator(seed);
  randomize(model, generator);
  std::uniform_int_distribution<int32_t> token(0, config.vocab_size - 1);
  std::vector<int32_t> idx(16), targets(16);
  for (size_t i = 0; i < idx.size(); ++i) {
    idx[i] = token(generator);
    targets[i] = i % 5 == 3 ? -1 : token(generator);
  }
  model.forward(idx.data(), targets.data());
  model.zero_gradients();
  model.backward();

  for (const ParamSpec& spec : gpt_parameters(config)) {
    float* data = model.parameters()[spec.name].data<float>();
    const float* grad = model.gradients()[spec.name].data<float>();
    std::uniform_int_distribution<int64_t> pick(0, spec.numel() - 1);
    for (int probe = 0; probe < 3; ++probe) {
      const int64_t i = pick(generator);
      const float saved = data[i];
      const float step = 1e-2f * std::max(1.0f, std::abs(saved));
      data[i] = saved + step;
      const double up = model.forward(idx.data(), targets.data());
      data[i] = saved - step;
      const double down = model.forward(idx.data(), targets.data());
      data[i] = saved;
      const double numeric = (up - down) / (2.0 * step);
      EXPECT_NEAR(grad[i], numeric, 2e-3 + 3e-2 * std::abs(numeric))
          << spec.name << "[" << i << "]";
    }
  }
}

INSTANTIATE_TEST_SUITE_P(GptModel, GptGradients, ::testing::Values("SL", "L"));

double cosine(const float* a, const float* b, int64_t n) {
  double dot = 0, norm_a = 0, norm_b = 0;
  for (int64_t i = 0; i < n; ++i) {
    dot += double(a[i]) * b[i];
    norm_a += double(a[i]) * a[i];
    norm_b += double(b[i]) * b[i];
  }
  return dot / std::sqrt(norm_a * norm_b);
}

// The same weights and tokens through FP8 linears (hybrid, each recipe) and through fp32: the
// loss agrees to FP8 precision and the gradients point the same way. E5M2 gradients (2 mantissa
// bits) over 16 tokens are noisy, most of all for c_q and c_k behind the QK norm.
class GptFp8 : public ::testing::TestWithParam<ScalingRecipe> {};

// FP8 linears (hybrid) with `recipe`, the rest fp32.
GptPrecision hybrid_precision(ScalingRecipe recipe) {
  GptPrecision fp8 = GptPrecision::fp32_reference();
  fp8.fp8.mode = Fp8Mode::Hybrid;
  fp8.fp8.recipe = recipe;
  fp8.policy = precision_options(fp8.fp8);
  fp8.policy.min_dim = 16;  // the tiny model's 32-wide linears qualify
  fp8.policy.require_divisible_by = 16;
  return fp8;
}

TEST_P(GptFp8, TracksTheFp32Model) {
  GptConfig config = tiny_config();
  if (GetParam() == ScalingRecipe::Blockwise) {  // 128x128 weight blocks need 128-wide linears
    config.n_embd = 128;
    config.n_head = 1;
    config.vocab_size = 100;
    config.pad_vocab_to = 128;
  }
  const GptPrecision fp8 = hybrid_precision(GetParam());
  GptModel reference(config, 2, 8, GptPrecision::fp32_reference());
  GptModel model(config, 2, 8, fp8);
  int fp8_linears = 0;
  for (const LinearPrecision& decision : model.linear_precision())
    fp8_linears += decision.fp8;
  // Gates stay BF16. Per tensor: the 2 x 6 block linears and lm_head; MX blocks of 32 also
  // exclude the 16-wide c_k and c_v.
  EXPECT_EQ(fp8_linears, GetParam() == ScalingRecipe::Mxfp8 ? 2 * 4 + 1 : 2 * 6 + 1);

  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 generator(seed);
  randomize(reference, generator);
  for (const ParamSpec& spec : gpt_parameters(config)) {
    std::memcpy(model.parameters()[spec.name].raw(), reference.parameters()[spec.name].raw(),
                model.parameters()[spec.name].bytes());
  }
  model.end_step();
  std::uniform_int_distribution<int32_t> token(0, config.vocab_size - 1);
  std::vector<int32_t> idx(16), targets(16);
  for (size_t i = 0; i < idx.size(); ++i) {
    idx[i] = token(generator);
    targets[i] = token(generator);
  }
  const double reference_loss = reference.forward(idx.data(), targets.data());
  const double fp8_loss = model.forward(idx.data(), targets.data());
  EXPECT_NEAR(fp8_loss, reference_loss, 0.05 * reference_loss);
  EXPECT_NE(fp8_loss, reference_loss);  // the FP8 path really ran
  reference.zero_gradients();
  reference.backward();
  model.zero_gradients();
  model.backward();
  for (const ParamSpec& spec : gpt_parameters(config)) {
    if (spec.kind != ParamKind::BlockLinear && spec.kind != ParamKind::LmHead) continue;
    const TensorView& grad = model.gradients()[spec.name];
    const bool behind_qk_norm = spec.name.find(".c_q.") != std::string::npos ||
                                spec.name.find(".c_k.") != std::string::npos;
    EXPECT_GT(
        cosine(grad.data<float>(), reference.gradients()[spec.name].data<float>(), grad.numel()),
        behind_qk_norm ? 0.7 : 0.9)
        << spec.name;
  }
}

INSTANTIATE_TEST_SUITE_P(GptModel, GptFp8,
                         ::testing::Values(ScalingRecipe::Delayed, ScalingRecipe::Tensorwise,
                                           ScalingRecipe::Blockwise, ScalingRecipe::Mxfp8));

// FP8 attention from nanochat's initialization, stepped as the trainer steps. At step 1 the
// zero-initialized c_proj makes every attention's dO zero, and c_q and c_k, whose gradients
// come only through attention's dS, get none. At step 2 the first backward with a non-zero dO
// measures the gradients' amaxes first (ops/attention_fp8.h), so c_q and c_k get gradients near
// those of the same model with fp32 attention. dS's amax is 1e-5 to 4e-4 here, about E5M2's
// smallest value (2^-16) at scale 1: scaling from step 1's zeros gave errors above 1. Both
// models take the fp32-attention model's optimizer step, so that they hold the same weights.
// c_q's and c_k's gradients are as noisy as in GptFp8 (E5M2 dS, dQ and dK behind the QK norm):
// over 100 seeds their relative errors had median 0.18 and at most 0.31; the losses differed
// by at most 0.15 %.
TEST(GptModel, Fp8AttentionLearnsFromTheZeroInitializedProjections) {
  GptConfig config = tiny_config();
  config.sequence_len = 32;
  const int64_t batch = 2, seq = config.sequence_len;
  GptPrecision precision = hybrid_precision(ScalingRecipe::Tensorwise);
  GptModel reference(config, batch, seq, precision);
  precision.fp8_attention = true;
  GptModel model(config, batch, seq, precision);
  test::TestRng rng;
  SCOPED_TRACE(rng.trace());
  const uint32_t seed = rng.bits();
  reference.init_weights(seed);
  model.init_weights(seed);
  std::vector<int32_t> idx(size_t(batch * seq)), targets(idx.size());
  for (size_t i = 0; i < idx.size(); ++i) {
    idx[i] = rng.uniform_int(0, config.vocab_size - 1);
    targets[i] = rng.uniform_int(0, config.vocab_size - 1);
  }
  const auto attention_weights = [&](const char* linear) {
    std::vector<std::string> names;
    for (int layer = 0; layer < config.n_layer; ++layer)
      names.push_back(fmt::format("transformer.h.{}.attn.{}.weight", layer, linear));
    return names;
  };
  std::vector<std::string> behind_dscores = attention_weights("c_q");
  for (std::string& name : attention_weights("c_k"))
    behind_dscores.push_back(std::move(name));

  optim::GptOptimizer optimizer(config, {}, optim::kReferenceBatchTokens);
  for (int step = 1; step <= 2; ++step) {
    SCOPED_TRACE(fmt::format("step {}", step));
    reference.zero_gradients();
    model.zero_gradients();
    const double reference_loss = reference.forward(idx.data(), targets.data());
    const double loss = model.forward(idx.data(), targets.data());
    reference.backward();
    model.backward();
    EXPECT_NEAR(loss, reference_loss, 0.01 * reference_loss);
    for (const std::string& name : behind_dscores) {
      const float* grad = model.gradients()[name].data<float>();
      const int64_t count = model.gradients()[name].numel();
      const bool zero = std::all_of(grad, grad + count, [](float g) { return g == 0.0f; });
      EXPECT_EQ(zero, step == 1) << name;
      if (step == 2) {
        EXPECT_LT(testing::relative_error(grad, reference.gradients()[name].data<float>(), count),
                  0.4)
            << name;
      }
    }
    optimizer.step(reference.parameters(), reference.gradients(), {});
    for (const ParamSpec& spec : gpt_parameters(config)) {
      std::memcpy(model.parameters()[spec.name].raw(), reference.parameters()[spec.name].raw(),
                  model.parameters()[spec.name].bytes());
    }
    reference.end_step();
    model.end_step();
  }
}

double standard_deviation(const TensorView& view) {
  const float* data = view.data<float>();
  double sum = 0, squares = 0;
  for (int64_t i = 0; i < view.numel(); ++i) {
    sum += data[i];
    squares += double(data[i]) * data[i];
  }
  const double mean = sum / double(view.numel());
  return std::sqrt(squares / double(view.numel()) - mean * mean);
}

std::pair<float, float> range(const TensorView& view) {
  const float* data = view.data<float>();
  const auto [low, high] = std::minmax_element(data, data + view.numel());
  return {*low, *high};
}

// MODELS.md: wte N(0, 0.8); lm_head N(0, 0.001); c_q, c_k, c_v and value embeddings U(±√3/√dim);
// c_fc U(±0.4·√3/√dim); projections zero; gates U(0, 0.02); resid 1.15 → 1.05, x0 0.20 → 0.05;
// smear 0, backout 0.2.
TEST(GptModel, InitializesAsNanochat) {
  GptConfig config = GptConfig::from_depth(2);
  config.vocab_size = 512;
  GptModel model(config, 1, 2, GptPrecision::fp32_reference());
  model.init_weights(7);
  ParameterSet& params = model.parameters();
  const double bound = std::sqrt(3.0 / config.n_embd);
  EXPECT_NEAR(standard_deviation(params["transformer.wte.weight"]), 0.8, 0.01);
  EXPECT_NEAR(standard_deviation(params["lm_head.weight"]), 0.001, 0.00002);
  for (const char* name : {"transformer.h.1.attn.c_q.weight", "transformer.h.1.attn.c_v.weight",
                           "value_embeds.1.weight"}) {
    const auto [low, high] = range(params[name]);
    EXPECT_GE(low, -bound) << name;
    EXPECT_LE(high, bound) << name;
    EXPECT_NEAR(standard_deviation(params[name]), bound / std::sqrt(3.0), 0.02 * bound) << name;
  }
  EXPECT_LE(range(params["transformer.h.0.mlp.c_fc.weight"]).second, 0.4 * bound);
  EXPECT_GT(range(params["transformer.h.0.mlp.c_fc.weight"]).second, 0.39 * bound);
  for (const char* name : {"transformer.h.0.attn.c_proj.weight",
                           "transformer.h.1.mlp.c_proj.weight", "smear_lambda"}) {
    EXPECT_EQ(range(params[name]), std::make_pair(0.0f, 0.0f)) << name;
  }
  for (const char* name : {"transformer.h.1.attn.ve_gate.weight", "smear_gate.weight"}) {
    const auto [low, high] = range(params[name]);
    EXPECT_GE(low, 0.0f) << name;
    EXPECT_LE(high, 0.02f) << name;
  }
  EXPECT_FLOAT_EQ(params["resid_lambdas"].data<float>()[0], 1.15f);
  EXPECT_FLOAT_EQ(params["resid_lambdas"].data<float>()[1], 1.05f);
  EXPECT_FLOAT_EQ(params["x0_lambdas"].data<float>()[0], 0.20f);
  EXPECT_FLOAT_EQ(params["x0_lambdas"].data<float>()[1], 0.05f);
  EXPECT_EQ(params["backout_lambda"].data<float>()[0], 0.2f);
}

// An evaluation forward between two training steps (as validation and sample grids run) leaves
// delayed scaling where the steps alone would: the weights' cast it makes is the one the next
// training forward uses, and it records their amax for that step.
TEST(GptModel, EvaluationBetweenStepsLeavesDelayedScalingAsTheStepsAlone) {
  GptConfig config = tiny_config();
  config.n_embd = 64;
  config.n_head = 4;
  config.n_kv_head = 2;
  const GptPrecision precision = testing::precision_of(testing::Numbers::Delayed);
  const unsigned seed = std::random_device{}();
  SCOPED_TRACE(::testing::Message() << "seed " << seed);
  std::mt19937 generator(seed);
  std::uniform_int_distribution<int32_t> token(0, config.vocab_size - 1);
  std::vector<int32_t> idx(16), targets(16);
  for (size_t i = 0; i < idx.size(); ++i) {
    idx[i] = token(generator);
    targets[i] = token(generator);
  }
  const uint64_t weights = generator();
  const auto run = [&](bool evaluate) {
    auto model = std::make_unique<GptModel>(config, 2, 8, precision);
    model->init_weights(weights);
    for (int step = 0; step < 3; ++step) {
      model->zero_gradients();
      model->forward(idx.data(), targets.data());
      model->backward();
      // A stand-in for the optimizer: every weight moves, so its amax does.
      for (const ParamSpec& spec : gpt_parameters(config)) {
        float* data = model->parameters()[spec.name].data<float>();
        for (int64_t i = 0; i < spec.numel(); ++i)
          data[i] *= 1.25f;
      }
      model->end_step();
      if (evaluate) {
        model->set_training(false);
        model->forward(idx.data(), targets.data());
        model->set_training(true);
      }
    }
    return model;
  };
  const std::unique_ptr<GptModel> plain = run(false), evaluated = run(true);
  ASSERT_FALSE(plain->delayed_scalings().empty());
  testing::expect_same_delayed_scalings(plain->delayed_scalings(), evaluated->delayed_scalings());
}

TEST(GptModel, RejectsTokensOutsideTheVocabulary) {
  const GptConfig config = tiny_config();
  GptModel model(config, 1, 4, GptPrecision::fp32_reference());
  model.init_weights(1);
  std::vector<int32_t> idx = {1, 2, 20, 3}, targets = {1, 2, 3, 4};
  EXPECT_THROW(model.forward(idx.data(), targets.data()), Error);
  idx[2] = 0;
  targets[1] = -2;
  EXPECT_THROW(model.forward(idx.data(), targets.data()), Error);
}

}  // namespace
}  // namespace fp8t
