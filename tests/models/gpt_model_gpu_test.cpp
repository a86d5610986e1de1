// The GPU GPT against the CPU GPT: the same weights and tokens give the same loss and
// gradients within bf16-activation tolerances, in BF16 and in FP8 (tensorwise, delayed).
#include <gtest/gtest.h>

#include <cmath>
#include <memory>
#include <string>
#include <vector>

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include "core/arena.h"
#include "core/cuda_check.h"
#include "models/cuda/gpt_model_cuda.h"
#include "models/gpt_model.h"
#include "numerics/test_util.h"
#include "ops/gpu_compare.h"

namespace fp8t {
namespace {

// Four layers (value embeddings, the backout layer, short and long windows), grouped heads.
GptConfig small_config() {
  GptConfig config;
  config.n_layer = 4;
  config.n_embd = 128;
  config.n_head = 2;
  config.n_kv_head = 1;
  config.vocab_size = 500;  // padded to 512
  config.sequence_len = 64;
  config.window_pattern = "SL";
  config.short_window = 16;
  return config;
}

constexpr int64_t kBatch = 2;
constexpr int64_t kSeq = 64;

struct Tokens {
  std::vector<int32_t> idx, targets;
};

Tokens random_tokens(test::TestRng& rng, const GptConfig& config) {
  Tokens tokens;
  for (int64_t i = 0; i < kBatch * kSeq; ++i) {
    tokens.idx.push_back(rng.uniform_int(0, config.vocab_size - 1));
    // Some ignored targets, as at document ends.
    tokens.targets.push_back(i % 17 == 5 ? -1 : rng.uniform_int(0, config.vocab_size - 1));
  }
  return tokens;
}

GptPrecision precision_for(Fp8Mode mode, ScalingRecipe recipe) {
  GptPrecision precision;
  precision.fp8.mode = mode;
  precision.fp8.recipe = recipe;
  precision.policy.mode = mode;
  precision.policy.recipe = recipe;
  precision.policy.min_dim = 64;  // let the small model's linears into FP8
  precision.other_linears = ops::LinearOperands::Bf16;
  return precision;
}

// ‖a − b‖ / ‖b‖
double relative_error(const TensorView& a, const TensorView& b) {
  double diff = 0.0, norm = 0.0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const double x = a.data<float>()[i], y = b.data<float>()[i];
    diff += (x - y) * (x - y);
    norm += y * y;
  }
  return norm > 0.0 ? std::sqrt(diff / norm) : std::sqrt(diff);
}

class GptModelGpuTest : public ::testing::TestWithParam<std::pair<Fp8Mode, ScalingRecipe>> {};

TEST_P(GptModelGpuTest, LossAndGradientsMatchTheCpuModel) {
  const auto [mode, recipe] = GetParam();
  const GptConfig config = small_config();
  const GptPrecision precision = precision_for(mode, recipe);
  test::TestRng rng;
  SCOPED_TRACE(rng.trace());
  const Tokens tokens = random_tokens(rng, config);

  GptModel cpu(config, kBatch, kSeq, precision);
  cpu.init_weights(rng.bits());
  // Non-zero output projections and smear, so that every path carries gradient.
  for (const ParamSpec& spec : gpt_parameters(config)) {
    float* data = cpu.parameters()[spec.name].data<float>();
    if (spec.name.find("c_proj") != std::string::npos || spec.name == "smear_lambda") {
      for (int64_t i = 0; i < spec.numel(); ++i)
        data[i] = static_cast<float>(rng.uniform(-0.05, 0.05));
    }
  }
  cpu.weights_changed();

  cudaStream_t stream = nullptr;
  FP8T_CUDA_CHECK(cudaStreamCreate(&stream));
  {
    CudaGptModel gpu(config, kBatch, kSeq, precision, stream);
    gpu.upload_parameters(cpu.parameters());

    // Delayed scaling starts at scale 1 on both paths; one step of amax history makes the
    // comparison meaningful (the same tokens and weights give nearly the same amaxes).
    if (recipe == ScalingRecipe::Delayed && mode != Fp8Mode::None) {
      cpu.forward(tokens.idx.data(), tokens.targets.data());
      cpu.backward();
      cpu.end_step();
      gpu.forward(tokens.idx.data(), tokens.targets.data(), true);
      gpu.backward();
      gpu.end_step();
      const auto cpu_scalings = cpu.delayed_scalings();
      const auto gpu_scalings = gpu.delayed_scalings();
      ASSERT_EQ(cpu_scalings.size(), gpu_scalings.size());
      for (size_t i = 0; i < cpu_scalings.size(); ++i) {
        EXPECT_EQ(cpu_scalings[i].first, gpu_scalings[i].first);
        // bf16 against fp32 activations moves an amax by up to ~15 %; a history that never
        // reached the scale would leave it at 1, dozens of octaves off.
        EXPECT_NEAR(std::log2(gpu_scalings[i].second->scale()),
                    std::log2(cpu_scalings[i].second->scale()), 0.5)
            << cpu_scalings[i].first;
      }
      cpu.zero_gradients();
      gpu.zero_gradients();
    }

    const double cpu_loss = cpu.forward(tokens.idx.data(), tokens.targets.data());
    cpu.backward();
    gpu.forward(tokens.idx.data(), tokens.targets.data(), true);
    const double gpu_loss = gpu.loss_value();
    gpu.backward();
    EXPECT_NEAR(gpu_loss, cpu_loss, 0.01 * cpu_loss);

    Arena arena("gradients", ParameterSet::planned_bytes(config, DType::F32));
    ParameterSet gpu_gradients(arena, config, DType::F32);
    gpu.download_gradients(gpu_gradients);
    // FP8 quantizes bf16 activations on the GPU, fp32 ones on the CPU: a code can round the
    // other way, which the small model's few tokens do not average out; E5M2 gradient codes
    // are 12.5 to 25 % apart.
    const double bound = mode == Fp8Mode::None ? 0.05 : 0.2;
    std::vector<double> gpu_scalars, cpu_scalars;
    for (const ParamSpec& spec : gpt_parameters(config)) {
      const TensorView& gpu_gradient = gpu_gradients[spec.name];
      const TensorView& cpu_gradient = cpu.gradients()[spec.name];
      const double error = relative_error(gpu_gradient, cpu_gradient);
      if (test::verbose()) {
        fmt::print("{:40} error {:.2e} (first: gpu {:.4e} cpu {:.4e})\n", spec.name, error,
                   gpu_gradient.data<float>()[0], cpu_gradient.data<float>()[0]);
      }
      if (spec.kind != ParamKind::Scalar) {
        EXPECT_LT(error, bound) << spec.name;
        continue;
      }
      for (int64_t i = 0; i < spec.numel(); ++i) {
        gpu_scalars.push_back(gpu_gradient.data<float>()[i]);
        cpu_scalars.push_back(cpu_gradient.data<float>()[i]);
      }
    }
    // A scalar's gradient sums dout * x over every token and channel, where the terms cancel
    // to a small remainder that bf16 activations move by much more than their own rounding:
    // the scalars are compared together, as one vector.
    double diff = 0.0, norm = 0.0;
    for (size_t i = 0; i < cpu_scalars.size(); ++i) {
      diff += (gpu_scalars[i] - cpu_scalars[i]) * (gpu_scalars[i] - cpu_scalars[i]);
      norm += cpu_scalars[i] * cpu_scalars[i];
    }
    EXPECT_LT(std::sqrt(diff / norm), 3 * bound) << "the scalars' gradients";
  }
  FP8T_CUDA_CHECK(cudaStreamDestroy(stream));
}

INSTANTIATE_TEST_SUITE_P(
    Precisions, GptModelGpuTest,
    ::testing::Values(std::make_pair(Fp8Mode::None, ScalingRecipe::Tensorwise),
                      std::make_pair(Fp8Mode::Hybrid, ScalingRecipe::Tensorwise),
                      std::make_pair(Fp8Mode::Hybrid, ScalingRecipe::Delayed),
                      std::make_pair(Fp8Mode::E4M3, ScalingRecipe::Tensorwise)),
    [](const auto& test_param) {
      return fmt::format("{}_{}", mode_name(test_param.param.first),
                         recipe_name(test_param.param.second));
    });

// Evaluation passes leave the FP8 state alone and compute the same loss as a training forward.
TEST(GptModelGpu, EvaluationForwardMatchesTrainingForward) {
  const GptConfig config = small_config();
  test::TestRng rng;
  const Tokens tokens = random_tokens(rng, config);
  cudaStream_t stream = nullptr;
  FP8T_CUDA_CHECK(cudaStreamCreate(&stream));
  {
    CudaGptModel gpu(config, kBatch, kSeq,
                     precision_for(Fp8Mode::Hybrid, ScalingRecipe::Tensorwise), stream);
    Arena arena("parameters", ParameterSet::planned_bytes(config, DType::F32));
    ParameterSet parameters(arena, config, DType::F32);
    init_gpt_weights(parameters, config, rng.bits());
    gpu.upload_parameters(parameters);
    gpu.set_training(false);
    gpu.forward(tokens.idx.data(), tokens.targets.data(), false);
    const double eval_loss = gpu.loss_value();
    gpu.set_training(true);
    gpu.forward(tokens.idx.data(), tokens.targets.data(), true);
    EXPECT_EQ(gpu.loss_value(), eval_loss);
    EXPECT_GT(eval_loss, 5.0);  // about log(500) for nearly uniform logits
  }
  FP8T_CUDA_CHECK(cudaStreamDestroy(stream));
}

}  // namespace
}  // namespace fp8t
