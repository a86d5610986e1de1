#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <map>
#include <memory>
#include <random>
#include <set>
#include <string>
#include <vector>

#include "core/arena.h"
#include "core/error.h"
#include "models/gpt_config.h"
#include "models/gpt_memory.h"
#include "numerics/float_bits.h"
#include "optim/adamw.h"
#include "optim/gpt_optimizer.h"

namespace fp8t::optim {
namespace {

// 2 layers of width 128: Muon groups of shapes [1, 12] (the one value-embedding gate),
// [128, 128], [128, 512] and [512, 128]; a padded vocabulary of 128.
GptConfig tiny_config() {
  GptConfig config = GptConfig::from_depth(2);
  config.vocab_size = 100;
  config.sequence_len = 64;
  return config;
}

// Parameters, gradients and targets of a quadratic loss ½‖p − target‖², in one arena.
struct QuadraticProblem {
  GptConfig config;
  Arena arena;
  ParameterSet params, grads, targets;

  explicit QuadraticProblem(const GptConfig& gpt_config, unsigned seed = 5)
      : config(gpt_config),
        arena("test", 3 * ParameterSet::planned_bytes(gpt_config, DType::F32)),
        params(arena, gpt_config, DType::F32),
        grads(arena, gpt_config, DType::F32),
        targets(arena, gpt_config, DType::F32) {
    std::mt19937 generator(seed);
    std::normal_distribution<float> normal(0.0f, 0.1f);
    for (const ParamSpec& spec : params.specs()) {
      for (ParameterSet* set : {&params, &targets}) {
        float* data = (*set)[spec.name].data<float>();
        for (int64_t i = 0; i < spec.numel(); ++i)
          data[i] = normal(generator);
      }
    }
  }

  float* data(ParameterSet& set, const std::string& name) { return set[name].data<float>(); }

  // Fills the gradients and returns the loss of the parameters named, or of all of them.
  double evaluate(const std::vector<std::string>& names = {}) {
    double loss = 0;
    for (const ParamSpec& spec : params.specs()) {
      const bool counted = names.empty() || std::count(names.begin(), names.end(), spec.name);
      const float* p = data(params, spec.name);
      const float* t = data(targets, spec.name);
      float* g = data(grads, spec.name);
      for (int64_t i = 0; i < spec.numel(); ++i) {
        g[i] = p[i] - t[i];
        if (counted) loss += 0.5 * double(g[i]) * g[i];
      }
    }
    return loss;
  }

  std::vector<float> snapshot() {
    std::vector<float> values;
    for (const ParamSpec& spec : params.specs()) {
      const float* p = data(params, spec.name);
      values.insert(values.end(), p, p + spec.numel());
    }
    return values;
  }

  void restore(const std::vector<float>& values) {
    size_t offset = 0;
    for (const ParamSpec& spec : params.specs()) {
      std::copy_n(values.begin() + static_cast<std::ptrdiff_t>(offset), spec.numel(),
                  data(params, spec.name));
      offset += static_cast<size_t>(spec.numel());
    }
  }
};

OptimizerSettings settings_of(OptimizerKind kind) {
  OptimizerSettings settings;
  settings.kind = kind;
  return settings;
}

StepSchedule schedule_at(int step) {
  return {.lr_multiplier = 1.0 - 0.05 * step,
          .muon_momentum = 0.85 + 0.01 * step,
          .weight_decay_multiplier = 1.0 - 0.1 * step};
}

TEST(GptOptimizer, GroupsCoverEveryParameterOnceAsNanochatDoes) {
  const GptConfig config = tiny_config();
  const GptOptimizer optimizer(config, settings_of(OptimizerKind::Muon), kReferenceBatchTokens);
  std::map<std::string, int> seen;
  std::vector<std::string> adamw_groups, muon_groups;
  for (const OptimizerGroup& group : optimizer.groups()) {
    (group.rule == UpdateRule::Muon ? muon_groups : adamw_groups).push_back(group.name);
    for (const std::string& name : group.parameters)
      ++seen[name];
  }
  for (const ParamSpec& spec : gpt_parameters(config)) {
    EXPECT_EQ(seen[spec.name], 1) << spec.name;
    // nanochat's Muon takes everything in transformer.h, the value-embedding gates included.
    const bool block_matrix = spec.layer >= 0 && spec.kind != ParamKind::Embedding;
    EXPECT_EQ(optimizer.group_of(spec.name).rule == UpdateRule::Muon, block_matrix) << spec.name;
  }
  EXPECT_EQ(seen.size(), gpt_parameters(config).size());
  EXPECT_EQ(adamw_groups, (std::vector<std::string>{"lm_head", "wte", "value_embeds",
                                                    "resid_lambdas", "x0_lambdas", "smear"}));
  EXPECT_EQ(muon_groups, (std::vector<std::string>{"matrix 1x12", "matrix 128x128",
                                                   "matrix 128x512", "matrix 512x128"}));
  EXPECT_EQ(optimizer.group_of("transformer.h.1.attn.c_proj.weight").name, "matrix 128x128");
  EXPECT_EQ(optimizer.group_of("backout_lambda").name, "smear");
  EXPECT_EQ(optimizer.group_of("smear_gate.weight").name, "smear");
  EXPECT_THROW(optimizer.group_of("no.such.weight"), Error);
}

TEST(GptOptimizer, LearningRatesBetasAndDecaysFollowNanochat) {
  // Width 192 and 2^21 tokens: the dimension scale (192/768)^-0.5 and the batch scale
  // √(2^21 / 2^19) are both 2.
  GptConfig config = tiny_config();
  config.n_embd = 192;
  config.n_head = 3;
  config.n_kv_head = 3;
  const GptOptimizer optimizer(config, settings_of(OptimizerKind::Muon), int64_t{1} << 21);
  struct Expected {
    const char* parameter;
    double lr, beta1, beta2, weight_decay;
  };
  const Expected table[] = {
      {"lm_head.weight", 0.008 * 4, 0.8, 0.96, 0.01},
      {"transformer.wte.weight", 0.3 * 4, 0.8, 0.995, 0.001},
      {"value_embeds.1.weight", 0.3 * 4 * 0.5, 0.8, 0.995, 0.01},
      {"resid_lambdas", 0.5 * 2 * 0.01, 0.8, 0.95, 0.05},
      {"x0_lambdas", 0.5 * 2, 0.96, 0.95, 0.0},
      {"smear_lambda", 0.2, 0.8, 0.95, 0.0},  // a literal in nanochat: no batch scaling
  };
  for (const Expected& expected : table) {
    const OptimizerGroup& group = optimizer.group_of(expected.parameter);
    EXPECT_NEAR(group.initial_lr, expected.lr, 1e-15) << expected.parameter;
    EXPECT_EQ(group.beta1, expected.beta1) << expected.parameter;
    EXPECT_EQ(group.beta2, expected.beta2) << expected.parameter;
    EXPECT_EQ(group.eps, 1e-10) << expected.parameter;
    EXPECT_EQ(group.weight_decay, expected.weight_decay) << expected.parameter;
  }
  const OptimizerGroup& fc = optimizer.group_of("transformer.h.0.mlp.c_fc.weight");
  EXPECT_NEAR(fc.initial_lr, 0.02 * 2, 1e-15);
  EXPECT_NEAR(fc.lr, 0.02 * 2 * 2, 1e-15);  // [768, 192]: √(rows / cols) = 2
  EXPECT_EQ(fc.beta2, 0.9);
  EXPECT_DOUBLE_EQ(fc.weight_decay,
                   nanochat_muon_weight_decay(config, 0.28, int64_t{1} << 21, 12.0));
}

TEST(GptOptimizer, StepAppliesTheScheduleToTheLoggedLearningRates) {
  QuadraticProblem problem(tiny_config());
  GptOptimizer optimizer(problem.config, settings_of(OptimizerKind::Muon), kReferenceBatchTokens);
  problem.evaluate();
  optimizer.step(problem.params, problem.grads, {0.5, 0.9, 0.5});
  EXPECT_EQ(optimizer.steps_taken(), 1);
  EXPECT_DOUBLE_EQ(optimizer.group_of("lm_head.weight").lr,
                   0.5 * optimizer.group_of("lm_head.weight").initial_lr);
  const OptimizerGroup& fc = optimizer.group_of("transformer.h.1.mlp.c_fc.weight");
  EXPECT_DOUBLE_EQ(fc.lr, 0.5 * fc.initial_lr * 2.0);  // [512, 128]
}

TEST(GptOptimizer, NanochatScheduleHelpers) {
  EXPECT_EQ(nanochat_scaling_params(GptConfig::from_depth(12)), 110100912);
  GptConfig d12 = GptConfig::from_depth(12);
  d12.vocab_size = 1000;
  // At d12 and the reference batch the weight decay is the one configured.
  EXPECT_DOUBLE_EQ(nanochat_muon_weight_decay(d12, 0.28, kReferenceBatchTokens, 12.0), 0.28);
  const GptConfig d24 = GptConfig::from_depth(24);
  EXPECT_NEAR(nanochat_muon_weight_decay(d24, 0.28, int64_t{1} << 20, 12.0),
              0.28 * std::sqrt(2.0) * double(nanochat_scaling_params(GptConfig::from_depth(12))) /
                  double(nanochat_scaling_params(d24)),
              1e-12);
  EXPECT_DOUBLE_EQ(nanochat_weight_decay_multiplier(0, 100), 1.0);
  EXPECT_NEAR(nanochat_weight_decay_multiplier(50, 100), 0.5, 1e-15);
  EXPECT_NEAR(nanochat_weight_decay_multiplier(100, 100), 0.0, 1e-15);

  const LrSchedule schedule{LrDecayStyle::Nanochat, 1000, 40, 0.65, 0.05, 0.0};
  for (const int64_t it : {0, 39, 500, 999}) {
    const StepSchedule step = nanochat_step_schedule(schedule, it);
    EXPECT_EQ(step.lr_multiplier, lr_multiplier(schedule, it));
    EXPECT_EQ(step.muon_momentum, muon_momentum(it, 1000, 0.65));
    EXPECT_EQ(step.weight_decay_multiplier, nanochat_weight_decay_multiplier(it, 1000));
  }
}

class GptOptimizerKinds : public ::testing::TestWithParam<OptimizerKind> {};

TEST_P(GptOptimizerKinds, DecreasesAQuadraticLossInEveryGroup) {
  QuadraticProblem problem(tiny_config());
  OptimizerSettings settings = settings_of(GetParam());
  settings.matrix_lr = 0.1;     // Muon moves each element by about lr / √128 per step
  settings.scalar_lr = 0.1;     // nanochat's 0.5 would circle these targets of scale 0.1
  settings.weight_decay = 0.0;  // decay pulls towards zero, not towards the targets
  settings.adamw.lr = 0.05;
  settings.adamw.weight_decay = 0.0;
  GptOptimizer optimizer(problem.config, settings, kReferenceBatchTokens);
  const double initial_total = problem.evaluate();
  std::vector<double> initial;
  for (const OptimizerGroup& group : optimizer.groups())
    initial.push_back(problem.evaluate(group.parameters));
  // Both take steps of about lr whatever the gradient's size, so they circle the target until
  // the lr decays: from 1 to 0.1.
  constexpr int kSteps = 30;
  for (int step = 0; step < kSteps; ++step) {
    problem.evaluate();
    const double lr_multiplier = std::pow(0.1, double(step) / (kSteps - 1));
    optimizer.step(problem.params, problem.grads, {lr_multiplier, 0.85, 1.0});
  }
  EXPECT_LT(problem.evaluate(), 0.5 * initial_total);
  for (size_t i = 0; i < initial.size(); ++i) {
    const OptimizerGroup& group = optimizer.groups()[i];
    EXPECT_LT(problem.evaluate(group.parameters), initial[i]) << group.name;
  }
}

// Copies of every state buffer, and views of the copies to load.
struct SavedState {
  std::vector<std::vector<std::byte>> bytes;
  std::vector<NamedTensor> buffers;

  explicit SavedState(GptOptimizer& optimizer) {
    for (const NamedTensor& buffer : optimizer.state()) {
      const auto* data = static_cast<const std::byte*>(buffer.view.raw());
      bytes.emplace_back(data, data + buffer.view.bytes());
    }
    size_t index = 0;
    for (const NamedTensor& buffer : optimizer.state()) {
      TensorView view = buffer.view;
      std::vector<int64_t> shape;
      for (int axis = 0; axis < view.rank(); ++axis)
        shape.push_back(view.dim(axis));
      buffers.push_back({buffer.name, TensorView(bytes[index++].data(), view.dtype(), shape.data(),
                                                 view.rank())});
    }
  }
};

TEST_P(GptOptimizerKinds, RestoredStateContinuesBitForBit) {
  QuadraticProblem problem(tiny_config());
  GptOptimizer uninterrupted(problem.config, settings_of(GetParam()), kReferenceBatchTokens);
  for (int step = 0; step < 3; ++step) {
    problem.evaluate();
    uninterrupted.step(problem.params, problem.grads, schedule_at(step));
  }
  const SavedState saved(uninterrupted);
  const std::vector<float> saved_params = problem.snapshot();
  for (int step = 3; step < 6; ++step) {
    problem.evaluate();
    uninterrupted.step(problem.params, problem.grads, schedule_at(step));
  }
  const std::vector<float> expected = problem.snapshot();

  GptOptimizer resumed(problem.config, settings_of(GetParam()), kReferenceBatchTokens);
  resumed.load_state(saved.buffers);
  EXPECT_EQ(resumed.steps_taken(), 3);
  problem.restore(saved_params);
  for (int step = 3; step < 6; ++step) {
    problem.evaluate();
    resumed.step(problem.params, problem.grads, schedule_at(step));
  }
  const std::vector<float> actual = problem.snapshot();
  ASSERT_EQ(actual.size(), expected.size());
  EXPECT_EQ(std::memcmp(actual.data(), expected.data(), actual.size() * sizeof(float)), 0);
  const std::vector<NamedTensor> a = uninterrupted.state(), b = resumed.state();
  ASSERT_EQ(a.size(), b.size());
  for (size_t i = 0; i < a.size(); ++i)
    EXPECT_EQ(std::memcmp(a[i].view.raw(), b[i].view.raw(), a[i].view.bytes()), 0) << a[i].name;
}

// ZeRO-1 on 3 ranks (one of them owns no matrix of the 2-matrix Muon groups): each rank steps
// its own copy of the parameters with its share of the optimizer. Taking every parameter from
// its owner gives the unsharded step's parameters bit for bit; a rank leaves the state of the
// others' parameters untouched (zero), and the owners' buffers summed over the ranks (as
// gather_optimizer_state sums them) give the unsharded state.
TEST_P(GptOptimizerKinds, ShardedStepsAndStateSumToTheUnshardedOnes) {
  constexpr int ranks = 3;
  QuadraticProblem whole(tiny_config());
  GptOptimizer unsharded(whole.config, settings_of(GetParam()), kReferenceBatchTokens);
  std::vector<std::unique_ptr<QuadraticProblem>> copies;
  std::vector<std::unique_ptr<GptOptimizer>> shards;
  for (int rank = 0; rank < ranks; ++rank) {
    copies.push_back(std::make_unique<QuadraticProblem>(tiny_config()));
    shards.push_back(std::make_unique<GptOptimizer>(whole.config, settings_of(GetParam()),
                                                    kReferenceBatchTokens, rank, ranks));
  }
  for (int step = 0; step < 3; ++step) {
    whole.evaluate();
    unsharded.step(whole.params, whole.grads, schedule_at(step));
    for (int rank = 0; rank < ranks; ++rank) {
      QuadraticProblem& copy = *copies[size_t(rank)];
      copy.evaluate();
      shards[size_t(rank)]->step(copy.params, copy.grads, schedule_at(step));
    }
    // The owners' values to every copy, as gather_parameters does.
    for (const ParamSpec& spec : whole.params.specs()) {
      const int owner = shards[0]->shard().owner(spec.name);
      const float* updated = copies[size_t(owner)]->data(copies[size_t(owner)]->params, spec.name);
      for (auto& copy : copies) {
        std::copy_n(updated, spec.numel(), copy->data(copy->params, spec.name));
      }
    }
  }
  const std::vector<float> expected = whole.snapshot(), actual = copies[0]->snapshot();
  ASSERT_EQ(actual.size(), expected.size());
  EXPECT_EQ(std::memcmp(actual.data(), expected.data(), actual.size() * sizeof(float)), 0);

  const std::vector<NamedTensor> reference = unsharded.state();
  std::vector<std::vector<NamedTensor>> parts;
  for (auto& shard : shards)
    parts.push_back(shard->state());
  for (size_t b = 0; b < reference.size(); ++b) {
    const NamedTensor& buffer = reference[b];
    if (buffer.view.dtype() != DType::F32) {  // the step counter: every rank counts every step
      for (const auto& part : parts)
        EXPECT_EQ(*part[b].view.data<int64_t>(), *buffer.view.data<int64_t>());
      continue;
    }
    const int owner = shards[0]->shard().owner(parameter_of_state(buffer.name));
    std::vector<float> sum(size_t(buffer.view.numel()), 0.0f);
    for (int rank = 0; rank < ranks; ++rank) {
      ASSERT_EQ(parts[size_t(rank)][b].name, buffer.name);
      const float* values = parts[size_t(rank)][b].view.data<float>();
      if (rank != owner) {
        EXPECT_TRUE(std::all_of(values, values + sum.size(), [](float v) { return v == 0.0f; }))
            << buffer.name << " on rank " << rank;
        continue;
      }
      for (size_t i = 0; i < sum.size(); ++i)
        sum[i] += values[i];
    }
    EXPECT_EQ(std::memcmp(sum.data(), buffer.view.raw(), buffer.view.bytes()), 0) << buffer.name;
  }
}

TEST_P(GptOptimizerKinds, StateNamesEveryBufferWithItsShape) {
  const GptConfig config = tiny_config();
  GptOptimizer optimizer(config, settings_of(GetParam()), kReferenceBatchTokens);
  std::map<std::string, std::vector<int64_t>> expected = {{"optimizer.step", {1}}};
  for (const ParamSpec& spec : gpt_parameters(config)) {
    if (optimizer.group_of(spec.name).rule == UpdateRule::Muon) {
      const int64_t rows = spec.shape[0], cols = spec.shape[1];
      expected[spec.name + ".momentum"] = spec.shape;
      expected[spec.name + ".second_moment"] =
          rows >= cols ? std::vector<int64_t>{rows, 1} : std::vector<int64_t>{1, cols};
    } else {
      expected[spec.name + ".exp_avg"] = spec.shape;
      expected[spec.name + ".exp_avg_sq"] = spec.shape;
    }
  }
  std::map<std::string, std::vector<int64_t>> actual;
  size_t bytes = 0;
  for (const NamedTensor& buffer : optimizer.state()) {
    std::vector<int64_t> shape;
    for (int axis = 0; axis < buffer.view.rank(); ++axis)
      shape.push_back(buffer.view.dim(axis));
    EXPECT_TRUE(actual.emplace(buffer.name, shape).second) << buffer.name << " twice";
    EXPECT_EQ(buffer.view.dtype(), buffer.name == "optimizer.step" ? DType::I64 : DType::F32);
    bytes += buffer.view.bytes();
  }
  EXPECT_EQ(actual, expected);
  EXPECT_EQ(optimizer.state_bytes(), bytes);
}

INSTANTIATE_TEST_SUITE_P(GptOptimizer, GptOptimizerKinds,
                         ::testing::Values(OptimizerKind::Muon, OptimizerKind::AdamW),
                         [](const auto& test_info) {
                           return test_info.param == OptimizerKind::Muon ? "Muon" : "AdamW";
                         });

void expect_load_error(GptOptimizer& optimizer, const std::vector<NamedTensor>& buffers,
                       const std::string& mentioned) {
  try {
    optimizer.load_state(buffers);
    ADD_FAILURE() << "expected an error naming " << mentioned;
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find(mentioned), std::string::npos) << error.what();
  }
}

TEST(GptOptimizer, LoadStateNamesTheBufferThatDoesNotFitAndChangesNothing) {
  const GptConfig config = tiny_config();
  GptOptimizer source(config, settings_of(OptimizerKind::Muon), kReferenceBatchTokens);
  GptOptimizer target(config, settings_of(OptimizerKind::Muon), kReferenceBatchTokens);
  const SavedState saved(source);
  const std::string dropped = "transformer.h.0.attn.c_q.weight.second_moment";

  std::vector<NamedTensor> missing;
  for (const NamedTensor& buffer : saved.buffers) {
    if (buffer.name != dropped) missing.push_back(buffer);
  }
  expect_load_error(target, missing, "missing buffer '" + dropped + "'");

  std::vector<NamedTensor> misshapen = saved.buffers;
  for (NamedTensor& buffer : misshapen) {
    if (buffer.name == "lm_head.weight.exp_avg") buffer.view = buffer.view.reshaped({64, 256});
  }
  expect_load_error(target, misshapen, "'lm_head.weight.exp_avg' is f32 [64, 256]");

  std::vector<NamedTensor> extra = saved.buffers;
  extra.push_back({"lm_head.weight.momentum", saved.buffers.front().view});
  expect_load_error(target, extra, "unexpected buffer 'lm_head.weight.momentum'");

  int64_t negative = -1;
  std::vector<NamedTensor> bad_step = saved.buffers;
  for (NamedTensor& buffer : bad_step) {
    if (buffer.name == "optimizer.step") buffer.view = TensorView(&negative, DType::I64, {1});
  }
  expect_load_error(target, bad_step, "optimizer.step");

  // The AdamW kind has other buffers: a checkpoint of one does not load into the other.
  GptOptimizer adamw(config, settings_of(OptimizerKind::AdamW), kReferenceBatchTokens);
  expect_load_error(adamw, saved.buffers, "missing buffer");
  EXPECT_EQ(target.steps_taken(), 0);
}

TEST(GptOptimizer, AdamWKindIsAdamwStepOnEveryTensor) {
  QuadraticProblem problem(tiny_config());
  QuadraticProblem reference(tiny_config());
  OptimizerSettings settings = settings_of(OptimizerKind::AdamW);
  GptOptimizer optimizer(problem.config, settings, kReferenceBatchTokens);
  std::map<std::string, std::pair<std::vector<float>, std::vector<float>>> moments;
  for (const ParamSpec& spec : reference.params.specs()) {
    const auto numel = static_cast<size_t>(spec.numel());
    moments[spec.name] = {std::vector<float>(numel, 0.0f), std::vector<float>(numel, 0.0f)};
  }
  for (int step = 0; step < 3; ++step) {
    problem.evaluate();
    optimizer.step(problem.params, problem.grads, schedule_at(step));
    reference.evaluate();
    for (const ParamSpec& spec : reference.params.specs()) {
      AdamWHyperparameters hyper = settings.adamw;
      hyper.lr *= schedule_at(step).lr_multiplier;
      if (spec.shape.size() == 1) hyper.weight_decay = 0.0;  // Megatron: no decay on 1-D
      auto& [exp_avg, exp_avg_sq] = moments[spec.name];
      adamw_step(reference.data(reference.params, spec.name),
                 reference.data(reference.grads, spec.name), exp_avg.data(), exp_avg_sq.data(),
                 spec.numel(), step + 1, hyper);
    }
  }
  const std::vector<float> actual = problem.snapshot(), expected = reference.snapshot();
  EXPECT_EQ(std::memcmp(actual.data(), expected.data(), actual.size() * sizeof(float)), 0);
}

// bf16 embeddings: wte and the value embeddings, and their moments, hold bf16 values after
// every step, each the fp32 step of the bf16 values before it, rounded; every other tensor steps
// exactly as with fp32 embeddings.
TEST_P(GptOptimizerKinds, Bf16EmbeddingsRoundTheirStepsOnly) {
  QuadraticProblem fp32(tiny_config()), bf16(tiny_config()), reference(tiny_config());
  OptimizerSettings settings = settings_of(GetParam());
  GptOptimizer fp32_optimizer(fp32.config, settings, kReferenceBatchTokens);
  settings.bf16_embeddings = true;
  GptOptimizer bf16_optimizer(bf16.config, settings, kReferenceBatchTokens);
  std::map<std::string, std::pair<std::vector<float>, std::vector<float>>> moments;
  std::vector<std::string> tables;
  for (const ParamSpec& spec : bf16.params.specs()) {
    const bool table = spec.kind == ParamKind::Embedding;
    EXPECT_EQ(bf16_optimizer.stored_in_bf16(spec.name), table) << spec.name;
    EXPECT_FALSE(fp32_optimizer.stored_in_bf16(spec.name)) << spec.name;
    if (!table) continue;
    tables.push_back(spec.name);
    const auto numel = static_cast<size_t>(spec.numel());
    moments[spec.name] = {std::vector<float>(numel, 0.0f), std::vector<float>(numel, 0.0f)};
  }
  ASSERT_EQ(tables.size(), 2u);  // wte and layer 1's value embedding
  const auto rounded = [](float* values, int64_t count) {
    std::transform(values, values + count, values, round_to_bf16);
  };
  for (int step = 0; step < 3; ++step) {
    fp32.evaluate();
    bf16.evaluate();
    reference.evaluate();
    fp32_optimizer.step(fp32.params, fp32.grads, schedule_at(step));
    bf16_optimizer.step(bf16.params, bf16.grads, schedule_at(step));
    for (const std::string& name : tables) {
      const OptimizerGroup& group = bf16_optimizer.group_of(name);
      auto& [exp_avg, exp_avg_sq] = moments[name];
      float* param = reference.data(reference.params, name);
      const int64_t count = std::ssize(exp_avg);
      rounded(param, count);
      adamw_step(param, reference.data(reference.grads, name), exp_avg.data(), exp_avg_sq.data(),
                 count, step + 1,
                 {group.lr, group.beta1, group.beta2, group.eps, group.weight_decay});
      for (float* values : {param, exp_avg.data(), exp_avg_sq.data()})
        rounded(values, count);
    }
  }
  for (const ParamSpec& spec : bf16.params.specs()) {
    const float* actual = bf16.data(bf16.params, spec.name);
    const bool table = spec.kind == ParamKind::Embedding;
    const float* expected =
        table ? reference.data(reference.params, spec.name) : fp32.data(fp32.params, spec.name);
    EXPECT_EQ(std::memcmp(actual, expected, static_cast<size_t>(spec.numel()) * sizeof(float)), 0)
        << spec.name;
    if (table) {  // the reference would hide a step that left the tables unrounded
      EXPECT_TRUE(std::all_of(actual, actual + spec.numel(), [](float value) {
        return round_to_bf16(value) == value;
      })) << spec.name;
    }
  }
  for (const NamedTensor& buffer : bf16_optimizer.state()) {
    const auto table = std::ranges::find_if(
        tables, [&](const std::string& name) { return buffer.name.starts_with(name + "."); });
    if (table == tables.end()) continue;
    const auto& [exp_avg, exp_avg_sq] = moments[*table];
    const std::vector<float>& expected = buffer.name.ends_with(".exp_avg") ? exp_avg : exp_avg_sq;
    EXPECT_EQ(std::memcmp(buffer.view.raw(), expected.data(), expected.size() * sizeof(float)), 0)
        << buffer.name;
  }
}

// Every rank computes the same owners; Muon groups split into contiguous, even ranges; AdamW
// loads differ by at most the largest AdamW tensor; the owners work every parameter once.
TEST(OptimizerShard, SplitsMuonEvenlyAndBalancesAdamW) {
  GptConfig config = GptConfig::from_depth(6);
  config.vocab_size = 1000;
  for (const OptimizerKind kind : {OptimizerKind::Muon, OptimizerKind::AdamW}) {
    for (const int ranks : {1, 2, 3, 4}) {
      SCOPED_TRACE(::testing::Message() << "ranks " << ranks << ", kind " << int(kind));
      std::vector<std::unique_ptr<GptOptimizer>> optimizers;
      for (int rank = 0; rank < ranks; ++rank) {
        optimizers.push_back(std::make_unique<GptOptimizer>(config, settings_of(kind),
                                                            kReferenceBatchTokens, rank, ranks));
      }
      const std::vector<ParamSpec> specs = gpt_parameters(config);
      const std::vector<OptimizerGroup>& groups = optimizers[0]->groups();
      std::vector<int64_t> adamw_load(size_t(ranks), 0);
      int64_t largest_adamw = 0;
      for (size_t g = 0; g < groups.size(); ++g) {
        const OptimizerGroup& group = groups[g];
        for (size_t i = 0; i < group.parameters.size(); ++i) {
          const std::string& name = group.parameters[i];
          const int owner = optimizers[0]->shard().owner(name);
          ASSERT_GE(owner, 0);
          ASSERT_LT(owner, ranks);
          for (const auto& other : optimizers) {
            EXPECT_EQ(other->shard().owner(name), owner) << name;
            EXPECT_EQ(other->shard().owns(name), other->shard().rank() == owner);
          }
          if (group.rule == UpdateRule::AdamW) {
            const int64_t numel = find_parameter(specs, name)->numel();
            adamw_load[size_t(owner)] += numel;
            largest_adamw = std::max(largest_adamw, numel);
          }
        }
        if (group.rule != UpdateRule::Muon) continue;
        const auto count = std::ssize(group.parameters);
        int64_t next = 0;
        for (const auto& optimizer : optimizers) {
          const auto [first, matrices] = optimizer->shard().muon_range(g);
          EXPECT_EQ(first, next) << group.name;
          EXPECT_GE(matrices, count / ranks);
          EXPECT_LE(matrices, (count + ranks - 1) / ranks);
          for (int64_t m = first; m < first + matrices; ++m)
            EXPECT_TRUE(optimizer->shard().owns(group.parameters[size_t(m)]));
          next = first + matrices;
        }
        EXPECT_EQ(next, count) << group.name;
      }
      const auto [lightest, heaviest] = std::ranges::minmax(adamw_load);
      EXPECT_LE(heaviest - lightest, largest_adamw);
    }
  }
  EXPECT_EQ(parameter_of_state("transformer.h.0.attn.c_q.weight.exp_avg_sq"),
            "transformer.h.0.attn.c_q.weight");
  EXPECT_THROW(parameter_of_state("step"), Error);
  EXPECT_THROW(GptOptimizer(config, settings_of(OptimizerKind::Muon), kReferenceBatchTokens, 2, 2),
               Error);
}

TEST(GptOptimizer, RejectsBadSettingsAndParameters) {
  const GptConfig config = tiny_config();
  OptimizerSettings settings;
  settings.matrix_lr = -1;
  try {
    GptOptimizer optimizer(config, settings, kReferenceBatchTokens);
    FAIL() << "a negative matrix_lr must be rejected";
  } catch (const ConfigError& error) {
    EXPECT_NE(std::string(error.what()).find("matrix_lr"), std::string::npos);
  }
  settings = OptimizerSettings{};
  settings.adamw.beta2 = 1.0;
  EXPECT_THROW(GptOptimizer(config, settings, kReferenceBatchTokens), ConfigError);
  EXPECT_THROW(GptOptimizer(config, OptimizerSettings{}, 0), ConfigError);

  // The CPU path keeps fp32 parameters.
  Arena arena("bf16", 2 * ParameterSet::planned_bytes(config, DType::BF16));
  ParameterSet params(arena, config, DType::BF16), grads(arena, config, DType::BF16);
  GptOptimizer optimizer(config, OptimizerSettings{}, kReferenceBatchTokens);
  EXPECT_THROW(optimizer.step(params, grads, {}), Error);
}

}  // namespace
}  // namespace fp8t::optim
