// The GPU Flux against the CPU Flux: the same weights and inputs give the same prediction, loss
// and gradients within bf16-activation tolerances, in BF16 and in FP8 (tensorwise, blockwise,
// mxfp8, and delayed after two warm-up steps, whose scales are compared too); the weights'
// amaxes taken by AdamW against casts that measure them; and split over a tensor-parallel group,
// against itself whole.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include "core/arena.h"
#include "core/device_buffer.h"
#include "models/cuda/flux_model_cuda.h"
#include "models/device_tensor_parallel_checks.h"
#include "models/flux_memory.h"
#include "models/flux_model.h"
#include "models/flux_objective.h"
#include "models/golden.h"
#include "models/recompute_checks.h"
#include "numerics/test_util.h"
#include "ops/gpu_compare.h"
#include "optim/adamw.h"
#include "optim/cuda/adamw_cuda.h"
#include "optim/optimizer_shard.h"

namespace fp8t {
namespace {

using test::TestRng;

// Wide enough for the FP8 policy at min_dim 64; two double and one single block; the guidance
// embedder on. head_dim 64 = 16 + 24 + 24.
FluxConfig small_config() {
  FluxConfig config = FluxConfig::preset("flux_tiny");
  config.hidden_size = 128;
  config.num_heads = 2;
  config.axes_dim = {16, 24, 24};
  config.double_blocks = 2;
  config.single_blocks = 1;
  config.guidance_embed = true;
  return config;
}

// 2 samples of an 8×8 latent grid (64 image tokens) and 8 text tokens: every row count a
// multiple of 16.
constexpr int64_t kBatch = 2, kGrid = 8, kImgTokens = kGrid * kGrid, kTxtTokens = 8;

std::vector<float> uniform(TestRng& rng, int64_t n, double lo, double hi) {
  std::vector<float> values(static_cast<size_t>(n));
  for (float& value : values)
    value = static_cast<float>(rng.uniform(lo, hi));
  return values;
}

struct Batch {
  std::vector<float> img, img_ids, txt, y, timesteps, guidance, target;
  FluxInputs inputs() const {
    return {img.data(), img_ids.data(), txt.data(), y.data(), timesteps.data(), guidance.data()};
  }
};

Batch random_batch(const FluxConfig& config, TestRng& rng) {
  Batch batch;
  const int64_t prediction = kBatch * kImgTokens * config.in_channels;
  batch.img = uniform(rng, prediction, -1.0, 1.0);
  for (int64_t row = 0; row < kGrid; ++row) {
    for (int64_t col = 0; col < kGrid; ++col)
      batch.img_ids.insert(batch.img_ids.end(), {0.0f, float(row), float(col)});
  }
  batch.txt = uniform(rng, kBatch * kTxtTokens * config.context_in_dim, -1.0, 1.0);
  batch.y = uniform(rng, kBatch * config.vec_in_dim, -1.0, 1.0);
  batch.timesteps = uniform(rng, kBatch, 0.0, 1.0);
  batch.guidance = uniform(rng, kBatch, 1.0, 5.0);
  batch.target = uniform(rng, prediction, -1.0, 1.0);
  return batch;
}

// Every weight and bias uniform in ±1/√in (modulation and final layer included, so that every
// gradient path carries signal), norm scales in [0.5, 1.5).
void randomize(FluxParameterSet& parameters, const FluxConfig& config, TestRng& rng) {
  for (const FluxLinear& linear : flux_linears(config)) {
    const double bound = 1.0 / std::sqrt(double(linear.in_features));
    for (const char* part : {".weight", ".bias"}) {
      TensorView& view = parameters[linear.name + part];
      const std::vector<float> values = uniform(rng, view.numel(), -bound, bound);
      std::copy(values.begin(), values.end(), view.data<float>());
    }
  }
  for (const FluxParam& param : flux_parameters(config)) {
    if (param.kind != FluxParamKind::NormScale) continue;
    const std::vector<float> values = uniform(rng, param.numel(), 0.5, 1.5);
    std::copy(values.begin(), values.end(), parameters[param.name].data<float>());
  }
}

FluxPrecision precision_for(Fp8Mode mode, ScalingRecipe recipe) {
  FluxPrecision precision;
  precision.fp8.mode = mode;
  precision.fp8.recipe = recipe;
  precision.policy.mode = mode;
  precision.policy.recipe = recipe;
  precision.policy.min_dim = 64;
  precision.other_linears = ops::LinearOperands::Bf16;
  return precision;
}

// A CPU model with random weights and the GPU model with the same weights, on `stream`.
struct Models {
  Models(const FluxConfig& config, const FluxPrecision& precision, TestRng& rng,
         cudaStream_t stream)
      : cpu(config, kBatch, kImgTokens, kTxtTokens, precision),
        gpu(config, kBatch, kImgTokens, kTxtTokens, precision, stream) {
    randomize(cpu.parameters(), config, rng);
    cpu.weights_changed();
    gpu.upload_parameters(cpu.parameters());
  }
  FluxModel cpu;
  CudaFluxModel gpu;
};

// A model's forward and backward of `batch` from zeroed gradients: its prediction and loss.
struct Step {
  std::vector<float> prediction;
  double loss = 0.0;
};

Step cpu_step(FluxModel& cpu, const FluxConfig& config, const Batch& batch) {
  const int64_t count = kBatch * kImgTokens * config.in_channels;
  Step step;
  step.prediction.resize(static_cast<size_t>(count));
  std::vector<float> dpred(step.prediction.size());
  cpu.zero_gradients();
  cpu.forward(batch.inputs(), step.prediction.data());
  step.loss =
      flow_mse_loss_with_gradient(dpred.data(), step.prediction.data(), batch.target.data(), count);
  cpu.backward(dpred.data());
  return step;
}

Step gpu_step(CudaFluxModel& gpu, const Batch& batch) {
  Step step;
  gpu.zero_gradients();
  gpu.forward(batch.inputs(), batch.target.data(), true);
  step.loss = gpu.loss_value();
  gpu.backward();
  step.prediction = gpu.prediction();
  return step;
}

// One step of `batch` on both models: the GPU's prediction, loss and every gradient against the
// CPU's.
void expect_steps_match(Models& models, const FluxConfig& config, const Batch& batch,
                        Fp8Mode mode) {
  const auto [cpu_prediction, cpu_loss] = cpu_step(models.cpu, config, batch);
  const auto [gpu_prediction, gpu_loss] = gpu_step(models.gpu, batch);

  // bf16 activations against fp32 ones: a few bf16 roundings (2^-9) per layer.
  const double bound = mode == Fp8Mode::None ? 0.05 : 0.2;
  EXPECT_LT(testing::relative_error(gpu_prediction.data(), cpu_prediction.data(),
                                    std::ssize(cpu_prediction)),
            bound / 2);
  EXPECT_NEAR(gpu_loss, cpu_loss, 0.01 * cpu_loss);

  Arena arena("gradients", FluxParameterSet::planned_bytes(config, DType::F32));
  FluxParameterSet gradients(arena, config, DType::F32);
  models.gpu.download_gradients(gradients);
  for (const FluxParam& param : flux_parameters(config)) {
    const float* got = gradients[param.name].data<float>();
    const float* want = models.cpu.gradients()[param.name].data<float>();
    const double error = testing::relative_error(got, want, param.numel());
    if (test::verbose()) fmt::print("{:48} error {:.2e}\n", param.name, error);
    EXPECT_LT(error, bound) << param.name;
  }
}

class FluxModelGpuTest : public test::StreamTest,
                         public ::testing::WithParamInterface<std::pair<Fp8Mode, ScalingRecipe>> {};

TEST_P(FluxModelGpuTest, PredictionLossAndGradientsMatchTheCpuModel) {
  const auto [mode, recipe] = GetParam();
  const FluxConfig config = small_config();
  SCOPED_TRACE(rng_.trace());
  const Batch batch = random_batch(config, rng_);
  Models models(config, precision_for(mode, recipe), rng_, stream_);
  if (mode != Fp8Mode::None) {
    const auto& decisions = models.cpu.linear_precision();
    const auto fp8 = std::count_if(decisions.begin(), decisions.end(),
                                   [](const FluxLinearPrecision& d) { return d.fp8; });
    ASSERT_GT(fp8, 0) << "no linear took the FP8 path";
  }
  expect_steps_match(models, config, batch, mode);
}

INSTANTIATE_TEST_SUITE_P(
    Precisions, FluxModelGpuTest,
    ::testing::Values(std::make_pair(Fp8Mode::None, ScalingRecipe::Tensorwise),
                      std::make_pair(Fp8Mode::Hybrid, ScalingRecipe::Tensorwise),
                      std::make_pair(Fp8Mode::Hybrid, ScalingRecipe::Blockwise),
                      std::make_pair(Fp8Mode::Hybrid, ScalingRecipe::Mxfp8)),
    [](const auto& test_param) {
      return fmt::format("{}_{}", mode_name(test_param.param.first),
                         recipe_name(test_param.param.second));
    });

// Tensorwise: AdamW taking the FP8 weights' amaxes as it writes them (CudaAdamW::measure_amaxes,
// end_step(true)) gives the next steps of a model whose casts measure the weights themselves, bit
// for bit: the same predictions, losses and gradients in the three steps after the first. A slot
// for every FP8 linear's weight; BF16 layers have none.
class FluxModelGpuAmaxes : public test::StreamTest {};

TEST_F(FluxModelGpuAmaxes, TakenByTheOptimizerGiveTheSameSteps) {
  const FluxConfig config = small_config();
  SCOPED_TRACE(rng_.trace());
  const FluxPrecision precision = precision_for(Fp8Mode::Hybrid, ScalingRecipe::Tensorwise);
  Models models(config, precision, rng_, stream_);
  CudaFluxModel taking(config, kBatch, kImgTokens, kTxtTokens, precision, stream_);
  taking.upload_parameters(models.cpu.parameters());
  const auto& decisions = taking.linear_precision();
  const auto fp8 = std::count_if(decisions.begin(), decisions.end(),
                                 [](const FluxLinearPrecision& d) { return d.fp8; });
  ASSERT_GT(fp8, 0);
  ASSERT_LT(fp8, std::ssize(decisions)) << "expected BF16 linears too";
  EXPECT_EQ(std::ssize(taking.weight_amax_slots()), fp8);

  const optim::AdamWHyperparameters adamw{.lr = 1e-2, .weight_decay = 0.1};
  optim::CudaAdamW plain_optimizer(models.gpu.layout(), adamw);
  optim::CudaAdamW taking_optimizer(taking.layout(), adamw);
  taking_optimizer.measure_amaxes(taking.weight_amax_slots());
  const auto planned = FluxParameterSet::planned_bytes(config, DType::F32);
  Arena plain_arena("gradients", planned), taking_arena("gradients", planned);
  FluxParameterSet plain_gradients(plain_arena, config, DType::F32);
  FluxParameterSet taking_gradients(taking_arena, config, DType::F32);
  for (int step = 0; step < 4; ++step) {
    const std::string where = fmt::format("step {}", step + 1);
    const Batch batch = random_batch(config, rng_);
    const Step plain = gpu_step(models.gpu, batch);
    const Step took = gpu_step(taking, batch);
    EXPECT_EQ(took.loss, plain.loss) << where;
    test::expect_bitwise_equal(took.prediction, plain.prediction, where + " prediction");
    models.gpu.download_gradients(plain_gradients);
    taking.download_gradients(taking_gradients);
    for (const FluxParam& param : flux_parameters(config)) {
      const TensorView& want = plain_gradients[param.name];
      EXPECT_EQ(std::memcmp(taking_gradients[param.name].raw(), want.raw(), want.bytes()), 0)
          << where << ", " << param.name;
    }
    plain_optimizer.step(models.gpu.parameters(), models.gpu.gradients(), 1.0, stream_);
    models.gpu.end_step();
    taking_optimizer.step(taking.parameters(), taking.gradients(), 1.0, stream_);
    taking.end_step(/*weight_amaxes_measured=*/true);
  }
  CudaFluxModel bf16_gpu(config, kBatch, kImgTokens, kTxtTokens, precision_for(Fp8Mode::None, {}),
                         stream_);
  EXPECT_TRUE(bf16_gpu.weight_amax_slots().empty());
}

class FluxModelGpuDelayed : public test::StreamTest {};

// Delayed scaling starts at scale 1 on both paths (no amax history yet), where E5M2 flushes the
// tiny txt-stream gradients to zero on both: their relative errors mean nothing. Two warm-up
// steps (the same weights, a fresh batch each) fill the histories with real amaxes; then a third
// batch compares as the other FP8 recipes do.
TEST_F(FluxModelGpuDelayed, MatchesTheCpuModelAfterTwoWarmUpSteps) {
  const FluxConfig config = small_config();
  SCOPED_TRACE(rng_.trace());
  Models models(config, precision_for(Fp8Mode::Hybrid, ScalingRecipe::Delayed), rng_, stream_);
  for (int step = 0; step < 2; ++step) {
    const Batch batch = random_batch(config, rng_);
    cpu_step(models.cpu, config, batch);
    models.cpu.end_step();
    gpu_step(models.gpu, batch);
    models.gpu.end_step();
  }

  // Both paths fold their amaxes into the same host DelayedScaling code; the amaxes differ where
  // the tensors do. A weight's amax is that of the same fp32 master weights on both: its scale
  // is bit-identical. An input's or a gradient's is the largest of bf16 values on the GPU, of
  // fp32 ones on the CPU. On the CPU with bf16-rounded weights and inputs (8 seeds), input
  // scales moved by up to 1.6 % and gradient ones by up to 16 %, and the GPU GPT's gradient
  // scales by up to ~0.65 octaves: inputs within 1/16, gradients within one octave, as the GPT's
  // test. A history that never saw an amax would leave a scale at 1, dozens of octaves off.
  const auto cpu_scalings = models.cpu.delayed_scalings();
  const auto gpu_scalings = models.gpu.delayed_scalings();
  ASSERT_FALSE(cpu_scalings.empty()) << "no linear took the FP8 path";
  ASSERT_EQ(gpu_scalings.size(), cpu_scalings.size());
  for (size_t i = 0; i < cpu_scalings.size(); ++i) {
    const auto& [name, cpu_scaling] = cpu_scalings[i];
    ASSERT_EQ(gpu_scalings[i].first, name);
    const float cpu_scale = cpu_scaling->scale(), gpu_scale = gpu_scalings[i].second->scale();
    EXPECT_NE(cpu_scale, 1.0f) << name << ": no amax reached the history";
    if (name.ends_with(".weight")) {
      EXPECT_EQ(gpu_scale, cpu_scale) << name;
    } else if (name.ends_with(".input")) {
      EXPECT_NEAR(gpu_scale, cpu_scale, cpu_scale / 16) << name;
    } else {
      EXPECT_NEAR(std::log2(gpu_scale), std::log2(cpu_scale), 1.0) << name;
    }
  }

  expect_steps_match(models, config, random_batch(config, rng_), Fp8Mode::Hybrid);
}

// BF16 and the per-tensor and 1x128 block recipes, and their names in the tests' names.
const auto kRecipes = ::testing::Values(std::make_pair(Fp8Mode::None, ScalingRecipe::Tensorwise),
                                        std::make_pair(Fp8Mode::Hybrid, ScalingRecipe::Tensorwise),
                                        std::make_pair(Fp8Mode::Hybrid, ScalingRecipe::Delayed),
                                        std::make_pair(Fp8Mode::Hybrid, ScalingRecipe::Blockwise));
std::string precision_name(
    const ::testing::TestParamInfo<std::pair<Fp8Mode, ScalingRecipe>>& test_param) {
  return fmt::format("{}_{}", mode_name(test_param.param.first),
                     recipe_name(test_param.param.second));
}

// Selective and full recompute against the same GPU model without it, over two steps (the second
// counting FP8 health): the same losses and predictions, gradients up to the order of atomic sums,
// the same FP8 health counts and delayed-scaling state, fewer saved activations, and the memory
// plan (models/flux_memory.h) counting what the model takes. Three double and two single blocks, so
// that groups of two end inside each stack and the block method crosses from one to the other.
class FluxRecomputeGpu : public test::StreamTest,
                         public ::testing::WithParamInterface<std::pair<Fp8Mode, ScalingRecipe>> {};

TEST_P(FluxRecomputeGpu, GivesTheLossesGradientsAndFp8StateOfTheModelWithout) {
  const auto [mode, recipe] = GetParam();
  FluxConfig config = small_config();
  config.double_blocks = 3;
  config.single_blocks = 2;
  const FluxPrecision precision = precision_for(mode, recipe);
  SCOPED_TRACE(rng_.trace());
  Arena arena("parameters", FluxParameterSet::planned_bytes(config, DType::F32));
  FluxParameterSet parameters(arena, config, DType::F32);
  randomize(parameters, config, rng_);
  const FluxMicroBatch micro_batch{
      .batch = kBatch, .img_tokens = kImgTokens, .txt_tokens = kTxtTokens};
  for (const RecomputeOptions& recompute :
       {RecomputeOptions{RecomputeGranularity::Selective},
        RecomputeOptions{RecomputeGranularity::Full, RecomputeMethod::Uniform, 1},
        RecomputeOptions{RecomputeGranularity::Full, RecomputeMethod::Uniform, 2},
        RecomputeOptions{RecomputeGranularity::Full, RecomputeMethod::Block, 4}}) {
    SCOPED_TRACE(recompute_summary(recompute, 5));
    CudaFluxModel plain(config, kBatch, kImgTokens, kTxtTokens, precision, stream_);
    CudaFluxModel recomputing(config, kBatch, kImgTokens, kTxtTokens, precision, stream_,
                              recompute);
    EXPECT_LT(recomputing.memory().activations, plain.memory().activations);
    EXPECT_EQ(plan_flux_memory(config, micro_batch, precision, 1, recompute).activations,
              recomputing.memory().activations);
    plain.upload_parameters(parameters);
    recomputing.upload_parameters(parameters);
    for (int step = 1; step <= 2; ++step) {
      SCOPED_TRACE(fmt::format("step {}", step));
      const Batch batch = random_batch(config, rng_);
      plain.set_record_fp8_health(step == 2);
      recomputing.set_record_fp8_health(step == 2);
      const Step want = gpu_step(plain, batch);
      const Step got = gpu_step(recomputing, batch);
      EXPECT_EQ(got.loss, want.loss);
      EXPECT_EQ(got.prediction, want.prediction);
      Arena want_arena("gradients", FluxParameterSet::planned_bytes(config, DType::F32));
      Arena got_arena("gradients", FluxParameterSet::planned_bytes(config, DType::F32));
      FluxParameterSet want_gradients(want_arena, config, DType::F32);
      FluxParameterSet got_gradients(got_arena, config, DType::F32);
      plain.download_gradients(want_gradients);
      recomputing.download_gradients(got_gradients);
      for (const FluxParam& param : flux_parameters(config)) {
        EXPECT_LT(testing::relative_error(got_gradients[param.name].data<float>(),
                                          want_gradients[param.name].data<float>(), param.numel()),
                  1e-5)
            << param.name;
      }
      plain.end_step();
      recomputing.end_step();
      if (step == 2 && mode != Fp8Mode::None)
        testing::expect_same_fp8_health(plain.take_fp8_health(), recomputing.take_fp8_health());
    }
    testing::expect_same_delayed_scalings(plain.delayed_scalings(), recomputing.delayed_scalings());
  }
}

INSTANTIATE_TEST_SUITE_P(Precisions, FluxRecomputeGpu, kRecipes, precision_name);

// Tensor parallelism over two ranks (threads on one GPU, each on its own stream) against the
// same model whole, over three steps (delayed scaling's first two are its warm-up, as above, and
// not compared): every rank has the whole model's prediction,
// loss and, once gathered, gradients within the rounding of the partial sums; the ranks agree
// bit for bit on the prediction, the loss, the split gradients and every FP8 scale, and their
// weights' scales are the whole weights'. An optimizer over each rank's shares takes the whole
// model's step (expect_optimizer_over_shares). The memory plan counts what the first rank takes.
// The ranks run without recompute, then with full recompute, each without and with sequence
// parallelism (each rank then keeps 32 of a sample's 64 image tokens and 4 of its 8 text tokens
// outside the split linears, and plans fewer activations), and with selective recompute and
// sequence parallelism. AdamW over each rank's layout (its shares first, then the replicated
// tensors), after the last step's backward: the gradient norm (the shares' squares summed over
// the group) is that of the gathered gradients; one step moves every parameter, gathered from the
// shares, by AdamW's first step from its gathered gradient, −lr·g / (|g| + eps), the same on
// every rank; the moments, gathered, are (1 − β1)·g; and they come back onto every rank from the
// first rank's host copy alone.
void expect_optimizer_over_shares(const std::vector<std::unique_ptr<CudaFluxModel>>& ranks,
                                  const FluxConfig& config, const FluxParameterSet& before,
                                  const FluxParameterSet& gradients) {
  const optim::AdamWHyperparameters adamw{.lr = 1e-2};
  std::vector<optim::AdamWOptimizer::Parameter> specs;
  for (const FluxParam& param : flux_parameters(config))
    specs.push_back({param.name, param.shape});
  const auto planned = FluxParameterSet::planned_bytes(config, DType::F32);
  std::vector<std::unique_ptr<Arena>> arenas;
  std::vector<std::unique_ptr<FluxParameterSet>> after;
  std::vector<std::unique_ptr<optim::AdamWOptimizer>> states;
  for (size_t rank = 0; rank < ranks.size(); ++rank) {
    arenas.push_back(std::make_unique<Arena>("parameters", planned));
    after.push_back(std::make_unique<FluxParameterSet>(*arenas.back(), config, DType::F32));
    states.push_back(std::make_unique<optim::AdamWOptimizer>(specs, adamw));
  }
  std::vector<float> norms(ranks.size());
  testing::run_ranks<CudaFluxModel>(ranks, [&](CudaFluxModel& model, size_t rank) {
    optim::CudaAdamW optimizer(model.layout(), adamw, nullptr, model.gradient_shares());
    DeviceBuffer<float> norm(1);
    optimizer.clip(model.gradients(), norm.get(), 0.0f, model.stream());
    optimizer.step(model.parameters(), model.gradients(), 1.0, model.stream());
    FP8T_CUDA_CHECK(cudaStreamSynchronize(model.stream()));
    FP8T_CUDA_CHECK(cudaMemcpy(&norms[rank], norm.get(), sizeof(float), cudaMemcpyDeviceToHost));
    model.download_parameters(*after[rank]);
    optimizer.download_state(states[rank].get(),
                             {[&](const std::string& name, const float* device, float* host) {
                                model.download_tensor(name, device, host);
                              },
                              {}});
  });
  double squares = 0.0;
  for (const FluxParam& param : flux_parameters(config)) {
    const TensorView& view = gradients[param.name];
    for (int64_t i = 0; i < view.numel(); ++i)
      squares += double(view.data<float>()[i]) * double(view.data<float>()[i]);
  }
  for (size_t rank = 0; rank < ranks.size(); ++rank)
    EXPECT_NEAR(norms[rank], std::sqrt(squares), 1e-5 * std::sqrt(squares)) << "rank " << rank;

  for (const FluxParam& param : flux_parameters(config)) {
    const float* g = gradients[param.name].data<float>();
    const float* p = before[param.name].data<float>();
    std::vector<float> moved(size_t(param.numel())), want(moved.size());
    for (size_t i = 0; i < moved.size(); ++i) {
      moved[i] = (*after[0])[param.name].data<float>()[i] - p[i];
      want[i] = static_cast<float>(-adamw.lr * g[i] / (std::fabs(double(g[i])) + adamw.eps));
    }
    EXPECT_LT(testing::relative_error(moved.data(), want.data(), param.numel()), 1e-4)
        << param.name;
    for (size_t rank = 1; rank < ranks.size(); ++rank) {
      const TensorView& first = (*after[0])[param.name];
      EXPECT_EQ(std::memcmp((*after[rank])[param.name].raw(), first.raw(), first.bytes()), 0)
          << param.name << ": rank " << rank << " holds other parameters";
    }
  }
  // The moments back onto the ranks from the first rank's host copy alone (the second keeps
  // none), and gathered again: the same on every rank.
  std::vector<std::unique_ptr<optim::AdamWOptimizer>> returned;
  for (size_t rank = 0; rank < ranks.size(); ++rank)
    returned.push_back(std::make_unique<optim::AdamWOptimizer>(specs, adamw));
  testing::run_ranks<CudaFluxModel>(ranks, [&](CudaFluxModel& model, size_t rank) {
    const optim::StateTransfer transfer{
        [&](const std::string& name, const float* device, float* host) {
          model.download_tensor(name, device, host);
        },
        [&](const std::string& name, const float* host, float* device) {
          model.upload_tensor(name, host, device);
        }};
    optim::CudaAdamW restored(model.layout(), adamw, nullptr, model.gradient_shares());
    restored.upload_state(rank == 0 ? states[0].get() : nullptr, transfer);
    restored.download_state(returned[rank].get(), transfer);
  });
  for (size_t rank = 0; rank < ranks.size(); ++rank) {
    const std::vector<NamedTensor> want = states[0]->state(), got = returned[rank]->state();
    for (size_t i = 0; i < want.size(); ++i) {
      if (want[i].view.dtype() != DType::F32) continue;  // the step count stays the engine's
      EXPECT_EQ(std::memcmp(got[i].view.raw(), want[i].view.raw(), want[i].view.bytes()), 0)
          << want[i].name << ": rank " << rank << " got other moments back";
    }
  }
  for (size_t rank = 0; rank < ranks.size(); ++rank) {
    for (const NamedTensor& moment : states[rank]->state()) {
      if (!moment.name.ends_with(".exp_avg")) continue;
      const TensorView& gradient = gradients[optim::parameter_of_state(moment.name)];
      for (int64_t i = 0; i < gradient.numel(); ++i) {
        const float want = static_cast<float>(1.0 - adamw.beta1) * gradient.data<float>()[i];
        ASSERT_NEAR(moment.view.data<float>()[i], want, 1e-6f * (1.0f + std::fabs(want)))
            << moment.name << "[" << i << "], rank " << rank;
      }
    }
  }
}

class FluxTensorParallelGpu : public ::testing::TestWithParam<std::pair<Fp8Mode, ScalingRecipe>> {};

TEST_P(FluxTensorParallelGpu, TwoRanksGiveThePredictionLossGradientsAndScalesOfTheWholeModel) {
  const auto [mode, recipe] = GetParam();
  FluxConfig config = small_config();
  config.hidden_size = 256;  // two heads of 128: each rank's share is whole 1x128 blocks
  config.axes_dim = {32, 48, 48};
  const FluxPrecision precision = precision_for(mode, recipe);
  const bool fp8 = mode != Fp8Mode::None;
  TestRng rng;
  SCOPED_TRACE(rng.trace());
  const auto planned = FluxParameterSet::planned_bytes(config, DType::F32);
  Arena arena("parameters", planned);
  FluxParameterSet parameters(arena, config, DType::F32);
  randomize(parameters, config, rng);

  constexpr int kRanks = 2;
  std::vector<cudaStream_t> streams(kRanks + 1);
  for (cudaStream_t& stream : streams)
    FP8T_CUDA_CHECK(cudaStreamCreate(&stream));
  // The ranks without recompute, then with full recompute (their reruns sum over the group too),
  // each without and with sequence parallelism, and with selective recompute and sequence
  // parallelism.
  for (const auto& [recompute, sequence] :
       {std::pair{RecomputeOptions{}, false},
        std::pair{RecomputeOptions{RecomputeGranularity::Full}, false},
        std::pair{RecomputeOptions{}, true},
        std::pair{RecomputeOptions{RecomputeGranularity::Full}, true},
        std::pair{RecomputeOptions{RecomputeGranularity::Selective}, true}}) {
    SCOPED_TRACE(recompute_summary(recompute, config.double_blocks + config.single_blocks) +
                 (sequence ? ", sequence parallel" : ""));
    CudaFluxModel whole(config, kBatch, kImgTokens, kTxtTokens, precision, streams[kRanks]);
    whole.upload_parameters(parameters);
    testing::ThreadGroup group(kRanks);
    std::vector<std::unique_ptr<CudaFluxModel>> ranks;
    for (int rank = 0; rank < kRanks; ++rank) {
      DeviceTensorParallel member = testing::device_member(group, rank);
      member.sequence = sequence;
      ranks.push_back(std::make_unique<CudaFluxModel>(config, kBatch, kImgTokens, kTxtTokens,
                                                      precision, streams[size_t(rank)], recompute,
                                                      member));
      ASSERT_EQ(ranks.back()->linear_precision().size(), whole.linear_precision().size());
      for (size_t i = 0; i < whole.linear_precision().size(); ++i)
        ASSERT_EQ(ranks.back()->linear_precision()[i].fp8, whole.linear_precision()[i].fp8);
      EXPECT_LT(ranks.back()->memory().activations, whole.memory().activations);
    }
    // The second rank keeps no host copy: it gets every tensor from the first.
    testing::run_ranks<CudaFluxModel>(ranks, [&](CudaFluxModel& model, size_t rank) {
      model.upload_parameters(rank == 0 ? &parameters : nullptr);
    });
    const FluxMicroBatch micro_batch{
        .batch = kBatch, .img_tokens = kImgTokens, .txt_tokens = kTxtTokens};
    const FluxMemoryPlan plan =
        plan_flux_memory(config, micro_batch, precision, kRanks, recompute, kRanks, sequence);
    if (sequence) {
      EXPECT_LT(
          plan.activations,
          plan_flux_memory(config, micro_batch, precision, kRanks, recompute, kRanks).activations);
    }
    const CudaFluxMemory& first = ranks[0]->memory();
    EXPECT_LT(first.parameters, whole.memory().parameters);  // the shares only
    EXPECT_EQ(plan.parameters, first.parameters);
    EXPECT_EQ(plan.gradients, first.gradients);
    EXPECT_EQ(plan.activations, first.activations);
    EXPECT_EQ(plan.workspace, first.workspace);
    EXPECT_EQ(plan.linear_copies, first.linear_copies);
    size_t fp8_linears = 0;
    for (const FluxLinearPrecision& decision : whole.linear_precision())
      fp8_linears += decision.fp8;
    if (fp8) {
      ASSERT_GT(fp8_linears, 0u) << "no linear took the FP8 path";
    }
    // The gradients each rank computes a share or a part of, gathered or summed over the group.
    std::vector<std::string> split;
    for (const FluxLinear& linear : flux_linears(config)) {
      if (flux_tensor_share(linear, config, kRanks, 0).split == TensorSplit::None) continue;
      split.push_back(linear.name + ".weight");
      split.push_back(linear.name + ".bias");
    }
    for (const FluxParam& param : flux_parameters(config))
      if (param.kind == FluxParamKind::NormScale) split.push_back(param.name);
    for (const FluxLinear& linear : flux_linears(config)) {
      if (!sequence || !flux_reads_own_tokens(linear.name)) continue;
      split.push_back(linear.name + ".weight");  // each rank's tokens add their part
      split.push_back(linear.name + ".bias");
    }

    Arena whole_arena("gradients", planned), first_arena("gradients", planned),
        second_arena("gradients", planned);
    FluxParameterSet whole_gradients(whole_arena, config, DType::F32);
    FluxParameterSet first_gradients(first_arena, config, DType::F32);
    FluxParameterSet second_gradients(second_arena, config, DType::F32);
    const bool delayed = recipe == ScalingRecipe::Delayed && fp8;
    for (int step = 1; step <= 3; ++step) {
      SCOPED_TRACE(fmt::format("step {}", step));
      const Batch batch = random_batch(config, rng);
      const Step want = gpu_step(whole, batch);
      std::vector<Step> got(kRanks);
      testing::run_ranks<CudaFluxModel>(ranks, [&](CudaFluxModel& model, size_t rank) {
        got[rank] = gpu_step(model, batch);
        model.sum_partial_gradients();
      });
      EXPECT_EQ(got[1].loss, got[0].loss);
      EXPECT_EQ(got[1].prediction, got[0].prediction);
      EXPECT_NEAR(got[0].loss, want.loss, 2e-3 * want.loss);
      // The partial sums round to bf16 once more than the whole model's outputs, which moves an
      // FP8 code now and then: the bounds of the GPU-against-CPU test.
      const double bound = fp8 ? 0.2 : 0.05;
      EXPECT_LT(testing::relative_error(got[0].prediction.data(), want.prediction.data(),
                                        std::ssize(want.prediction)),
                bound / 2);
      whole.download_gradients(whole_gradients);
      testing::run_ranks<CudaFluxModel>(ranks, [&](CudaFluxModel& model, size_t rank) {
        model.download_gradients(rank == 0 ? first_gradients : second_gradients);
      });
      if (!delayed || step == 3) {
        for (const FluxParam& param : flux_parameters(config)) {
          for (const FluxParameterSet* gradients : {&first_gradients, &second_gradients}) {
            const double error =
                testing::relative_error((*gradients)[param.name].data<float>(),
                                        whole_gradients[param.name].data<float>(), param.numel());
            if (test::verbose()) fmt::print("{:48} error {:.2e}\n", param.name, error);
            EXPECT_LT(error, bound) << param.name;
          }
        }
      }
      for (const std::string& name : split) {
        EXPECT_EQ(std::memcmp(first_gradients[name].raw(), second_gradients[name].raw(),
                              first_gradients[name].bytes()),
                  0)
            << name << ": the ranks hold other gradients";
      }
      testing::end_step_with_same_scales(whole, ranks, fp8_linears, recipe);
    }
    expect_optimizer_over_shares(ranks, config, parameters, first_gradients);
  }
  for (cudaStream_t stream : streams)
    FP8T_CUDA_CHECK(cudaStreamDestroy(stream));
}

INSTANTIATE_TEST_SUITE_P(Precisions, FluxTensorParallelGpu, kRecipes, precision_name);

}  // namespace
}  // namespace fp8t
