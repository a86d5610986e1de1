// The GPU linear's backward in chunks of rows (a scratch narrower than the layer) against the
// same layer with a scratch that holds it whole: dx bit for bit (each row's dgrad is the same
// GEMM row under the same scales), dW up to the order of its fp32 sums, for every recipe and for
// the relu² input; the backward through relu² against relu2_backward and the plain backward;
// the MLP pair whose c_fc gradient cast makes c_proj's x̂ᵗ against their separate backwards;
// and the forward's residual; the joint weight gradient of layers sharing an input against
// separate ones; the input cast fused into the norm before against the layer's own, dy's amax
// taken by the bias gradient, the input's by its producer and the weight's by the optimizer
// against the layer's own; Ŵᵗ transposed in backward against the kept one, and the transposes
// against host transposes; dy cast by the rotary norm's gradient kernel against the layer's own
// cast. The models' GPU tests compare the whole-layer path with the CPU.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <functional>
#include <limits>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <cuda_runtime_api.h>
#include <fmt/format.h>

#include "core/cuda_check.h"
#include "core/device_arena.h"
#include "core/error.h"
#include "gemm/cublaslt_gemm.h"
#include "numerics/scaling.h"
#include "ops/cuda/flux_ops.h"
#include "ops/cuda/linear_cuda.h"
#include "ops/cuda/ops_cuda.h"
#include "ops/fp8_linear_layout.h"
#include "ops/rmsnorm.h"
#include "ops/rotary.h"
// The GPU tests target has no tests/ include directory.
#include "ops/gpu_compare.h"

namespace fp8t {
namespace {

using namespace test;
namespace kernels = ops::cuda;

constexpr int64_t kIn = 256, kOut = 512, kTokens = 1024;
// 64 · 1024 elements hold 128 rows of the 512-wide layer: 8 chunks.
constexpr int64_t kNarrowWidth = 64;
// Weight gradients summed in another order: fp32 rounding only.
constexpr Tolerance kReorderedSums{1e-5, 1e-4, 1e-6};

// An FP8 linear [kIn -> kOut] over kTokens tokens under `recipe`, with its scaling floats.
kernels::LinearSetup layer_setup(ScalingRecipe recipe, float* scaling) {
  kernels::LinearSetup setup;
  setup.in_features = kIn;
  setup.out_features = kOut;
  setup.max_tokens = kTokens;
  setup.fp8 = true;
  setup.fp8_config.recipe = recipe;
  setup.scaling = scaling;
  return setup;
}

// One linear (FP8 unless told, then BF16) with its own scratch and scaling floats (scales 1,
// amaxes 0), and the health counters it records into, if given.
struct LinearUnderTest {
  DeviceArena arena{"FP8 scratch"};
  float* scaling = nullptr;
  kernels::Fp8Scratch scratch;
  std::unique_ptr<kernels::CudaLinear> layer;

  LinearUnderTest(ScalingRecipe recipe, bool relu2, int64_t backward_width,
                  gemm::CublasLtGemm& gemm, bool fp8 = true, bool output_relu2 = false,
                  ops::WeightTransposes transposes = ops::WeightTransposes::Kept,
                  CastHealth* health = nullptr) {
    ops::WeightTScratch weight_t;
    if (transposes == ops::WeightTransposes::InBackward) weight_t.fit(kIn, kOut, recipe);
    for (bool planning : {true, false}) {
      scaling = arena.take<float>(kernels::kLinearScalingFloats);
      scratch =
          kernels::take_fp8_scratch(arena, recipe, kTokens, kIn, kOut, backward_width, weight_t);
      if (planning) arena.allocate_planned();
    }
    std::vector<float> initial(kernels::kLinearScalingFloats, 0.0f);
    for (size_t i = 0; i < initial.size(); ++i) {
      const auto slot = static_cast<int>(i % kernels::kScalingFloatsPerRole);
      if (slot == kernels::kScaleSlot || slot == kernels::kScaleInvSlot) initial[i] = 1.0f;
    }
    FP8T_CUDA_CHECK(cudaMemcpy(scaling, initial.data(), initial.size() * sizeof(float),
                               cudaMemcpyHostToDevice));
    kernels::LinearSetup setup = layer_setup(recipe, scaling);
    setup.fp8 = fp8;
    setup.input_relu2 = relu2;
    setup.output_relu2 = output_relu2;
    setup.weight_transposes = transposes;
    setup.health = health;
    layer = std::make_unique<kernels::CudaLinear>(setup, gemm, scratch);
  }

  // The scaling floats as they are now (synchronizes).
  std::vector<float> scaling_floats() const {
    std::vector<float> floats(kernels::kLinearScalingFloats);
    FP8T_CUDA_CHECK(
        cudaMemcpy(floats.data(), scaling, floats.size() * sizeof(float), cudaMemcpyDeviceToHost));
    return floats;
  }
};

// Every test's layer: a random weight, input and output gradient.
class LinearCuda : public StreamTest {
 protected:
  gemm::CublasLtGemm gemm_;
  const Device<float> weight_{random_floats(rng_, size_t(kIn* kOut), -0.1, 0.1)};
  const Device<bf16> x_{random_bf16(rng_, size_t(kTokens* kIn))};
  const Device<bf16> dy_{random_bf16(rng_, size_t(kTokens* kOut))};

  // What a backward test needs: the layer's weight prepared and its forward run on x_, recording
  // amaxes as a training step does; the output y, a poisoned dx and a zeroed dW.
  struct AfterForward {
    Device<bf16> y{size_t(kTokens * kOut)};
    Device<bf16> dx{size_t(kTokens * kIn)};
    Device<float> dweight{std::vector<float>(size_t(kIn * kOut), 0.0f)};
    AfterForward(const LinearCuda& test, LinearUnderTest& linear) {
      linear.layer->prepare_weight(test.weight_.get(), /*record_amax=*/true, test.stream_);
      linear.layer->forward(test.x_.get(), kTokens, y.get(), /*record_amax=*/true, test.stream_);
      dx.poison_nan();
    }
  };

  // The index of a role's slot among a linear's scaling floats.
  static size_t scaling_index(TensorRole role, int slot) {
    return static_cast<size_t>(static_cast<int>(role) * kernels::kScalingFloatsPerRole + slot);
  }

  // `take` (a layer's slot for an amax another kernel takes) gives null for delayed, blockwise
  // and mxfp8 layers and for BF16 ones: only tensorwise FP8 layers have such a slot.
  void expect_only_tensorwise_gives(const std::function<float*(kernels::CudaLinear&)>& take) {
    for (ScalingRecipe recipe :
         {ScalingRecipe::Delayed, ScalingRecipe::Blockwise, ScalingRecipe::Mxfp8}) {
      LinearUnderTest other(recipe, false, kOut, gemm_);
      EXPECT_EQ(take(*other.layer), nullptr) << recipe_name(recipe);
    }
    LinearUnderTest bf16(ScalingRecipe::Tensorwise, false, kOut, gemm_, false);
    EXPECT_EQ(take(*bf16.layer), nullptr) << "BF16";
  }
};

TEST_F(LinearCuda, BackwardInChunksMatchesTheWholeBackward) {
  SCOPED_TRACE(rng_.trace());
  struct Case {
    ScalingRecipe recipe;
    bool relu2;
  };
  const Case cases[] = {{ScalingRecipe::Tensorwise, false}, {ScalingRecipe::Delayed, false},
                        {ScalingRecipe::Blockwise, false},  {ScalingRecipe::Mxfp8, false},
                        {ScalingRecipe::Tensorwise, true},  {ScalingRecipe::Delayed, true},
                        {ScalingRecipe::Blockwise, true}};
  for (const Case& c : cases) {
    const std::string name = std::string(recipe_name(c.recipe)) + (c.relu2 ? " relu²" : "");
    std::vector<bf16> dx[2];
    std::vector<float> dweight[2];
    for (int narrow : {0, 1}) {
      LinearUnderTest linear(c.recipe, c.relu2, narrow ? kNarrowWidth : kOut, gemm_);
      AfterForward step(*this, linear);
      linear.layer->backward(dy_.get(), x_.get(), kTokens, step.dx.get(), false, step.dweight.get(),
                             /*record_amax=*/true, stream_);
      FP8T_CUDA_CHECK(cudaStreamSynchronize(stream_));
      dx[narrow] = step.dx.download();
      dweight[narrow] = step.dweight.download();
    }
    expect_bitwise_equal(dx[1], dx[0], name + " dx");
    expect_close(widen(dweight[1]), widen(dweight[0]), kReorderedSums, name + " dW");
  }
}

// A layer whose output feeds relu² casts its output gradient from d relu²(y) and y: the same
// bytes as relu2_backward followed by the plain backward, so dx, dW and the recorded amaxes and
// scales are equal bit for bit, whole and in chunks, for the per-tensor recipes and blockwise.
TEST_F(LinearCuda, BackwardThroughRelu2MatchesRelu2BackwardThenBackward) {
  SCOPED_TRACE(rng_.trace());
  for (ScalingRecipe recipe :
       {ScalingRecipe::Tensorwise, ScalingRecipe::Delayed, ScalingRecipe::Blockwise}) {
    for (int64_t width : {kOut, kNarrowWidth}) {
      const std::string name = fmt::format("{}, backward width {}", recipe_name(recipe), width);
      std::vector<bf16> dx[2];
      std::vector<float> dweight[2], scaling[2];
      for (int fused : {0, 1}) {
        LinearUnderTest linear(recipe, false, width, gemm_, true, fused == 1);
        AfterForward step(*this, linear);
        if (fused == 1) {
          linear.layer->backward(dy_.get(), x_.get(), kTokens, step.dx.get(), false,
                                 step.dweight.get(), /*record_amax=*/true, stream_, step.y.get());
        } else {
          Device<bf16> fc_gradient(size_t(kTokens * kOut));
          kernels::relu2_backward(fc_gradient.get(), dy_.get(), step.y.get(), kTokens * kOut,
                                  kernels::GradStore::Write, stream_);
          linear.layer->backward(fc_gradient.get(), x_.get(), kTokens, step.dx.get(), false,
                                 step.dweight.get(), /*record_amax=*/true, stream_);
        }
        FP8T_CUDA_CHECK(cudaStreamSynchronize(stream_));
        dx[fused] = step.dx.download();
        dweight[fused] = step.dweight.download();
        scaling[fused] = linear.scaling_floats();
      }
      expect_bitwise_equal(dx[1], dx[0], name + " dx");
      expect_bitwise_equal(dweight[1], dweight[0], name + " dW");
      expect_bitwise_equal(scaling[1], scaling[0], name + " scaling floats");
    }
  }
}

// The MLP's pair, blockwise: c_fc [kIn -> kOut] feeding relu² to c_proj [kOut -> kIn], sharing
// a scratch. With c_fc's gradient cast making c_proj's x̂ᵗ (c_proj.backward_leaving_wgrad(),
// then c_fc.backward(…, reader)), dx, the gradient of relu²'s output and both weight gradients
// equal those of c_proj.backward() then c_fc.backward() bit for bit. The pair is refused where
// its operands do not fit the scratch whole, under a per-tensor recipe, and out of order.
TEST_F(LinearCuda, Relu2ReaderInputTCastByItsFeederMatchesSeparateBackwards) {
  SCOPED_TRACE(rng_.trace());
  constexpr int64_t kWeight = kIn * kOut;
  const Device<float> weights{random_floats(rng_, size_t(2 * kWeight), -0.1, 0.1)};
  const Device<bf16> dy{random_bf16(rng_, size_t(kTokens * kIn))};
  struct MlpPair {
    DeviceArena arena{"FP8 scratch"};
    float* scaling = nullptr;
    kernels::Fp8Scratch scratch;
    std::unique_ptr<kernels::CudaLinear> fc, proj;
    Device<bf16> hidden{size_t(kTokens * kOut)}, out{size_t(kTokens * kIn)};
    Device<bf16> d_act{size_t(kTokens * kOut)}, dx{size_t(kTokens * kIn)};
    Device<float> dweight{std::vector<float>(size_t(2 * kWeight), 0.0f)};
    MlpPair(ScalingRecipe recipe, int64_t backward_width, gemm::CublasLtGemm& gemm) {
      for (bool planning : {true, false}) {
        scaling = arena.take<float>(2 * kernels::kLinearScalingFloats);
        scratch = kernels::take_fp8_scratch(arena, recipe, kTokens, kOut, kOut, backward_width);
        if (planning) arena.allocate_planned();
      }
      const std::vector<float> ones(2 * kernels::kLinearScalingFloats, 1.0f);
      FP8T_CUDA_CHECK(
          cudaMemcpy(scaling, ones.data(), ones.size() * sizeof(float), cudaMemcpyHostToDevice));
      kernels::LinearSetup setup = layer_setup(recipe, scaling);
      setup.output_relu2 = true;
      fc = std::make_unique<kernels::CudaLinear>(setup, gemm, scratch);
      setup = layer_setup(recipe, scaling + kernels::kLinearScalingFloats);
      std::swap(setup.in_features, setup.out_features);
      setup.input_relu2 = true;
      proj = std::make_unique<kernels::CudaLinear>(setup, gemm, scratch);
      d_act.poison_nan();
      dx.poison_nan();
    }
    void forward(const Device<float>& weights, const bf16* x, cudaStream_t stream) {
      fc->prepare_weight(weights.get(), false, stream);
      proj->prepare_weight(weights.get() + kWeight, false, stream);
      fc->forward(x, kTokens, hidden.get(), false, stream);
      proj->forward(hidden.get(), kTokens, out.get(), false, stream);
    }
    void backward(bool reader_cast_by_fc, const bf16* dy, const bf16* x, cudaStream_t stream) {
      float* proj_gradient = dweight.get() + kWeight;
      if (reader_cast_by_fc) {
        proj->backward_leaving_wgrad(dy, kTokens, d_act.get(), false, stream);
        fc->backward(d_act.get(), x, kTokens, dx.get(), false, dweight.get(), false, stream,
                     hidden.get(), {proj.get(), proj_gradient});
      } else {
        proj->backward(dy, hidden.get(), kTokens, d_act.get(), false, proj_gradient, false, stream);
        fc->backward(d_act.get(), x, kTokens, dx.get(), false, dweight.get(), false, stream,
                     hidden.get());
      }
      FP8T_CUDA_CHECK(cudaStreamSynchronize(stream));
    }
  };
  std::vector<bf16> d_act[2], dx[2];
  std::vector<float> dweight[2];
  for (int fused : {0, 1}) {
    MlpPair pair(ScalingRecipe::Blockwise, kOut, gemm_);
    ASSERT_TRUE(pair.fc->casts_reader_input_t(*pair.proj, kTokens));
    EXPECT_FALSE(pair.proj->casts_reader_input_t(*pair.fc, kTokens)) << "the pair turned round";
    pair.forward(weights, x_.get(), stream_);
    pair.backward(fused == 1, dy.get(), x_.get(), stream_);
    d_act[fused] = pair.d_act.download();
    dx[fused] = pair.dx.download();
    dweight[fused] = pair.dweight.download();
  }
  expect_bitwise_equal(d_act[1], d_act[0], "relu² reader's x̂ᵗ from its feeder: d relu²");
  expect_bitwise_equal(dx[1], dx[0], "relu² reader's x̂ᵗ from its feeder: dx");
  expect_bitwise_equal(dweight[1], dweight[0], "relu² reader's x̂ᵗ from its feeder: both dW");

  MlpPair narrow(ScalingRecipe::Blockwise, kNarrowWidth, gemm_);
  EXPECT_FALSE(narrow.fc->casts_reader_input_t(*narrow.proj, kTokens)) << "backward in chunks";
  MlpPair tensorwise(ScalingRecipe::Tensorwise, kOut, gemm_);
  EXPECT_FALSE(tensorwise.fc->casts_reader_input_t(*tensorwise.proj, kTokens)) << "tensorwise";
  MlpPair pair(ScalingRecipe::Blockwise, kOut, gemm_);
  pair.forward(weights, x_.get(), stream_);
  EXPECT_THROW(pair.fc->backward(pair.d_act.get(), x_.get(), kTokens, pair.dx.get(), false,
                                 pair.dweight.get(), false, stream_, pair.hidden.get(),
                                 {pair.proj.get(), pair.dweight.get() + kWeight}),
               Error)
      << "the feeder's backward before the reader's";
  FP8T_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

// forward(…, residual) = x·Wᵀ + residual, summed in the GEMM's epilogue and rounded once:
// within two bf16 roundings of the layer's own output plus
// the residual, for BF16 and every FP8 recipe (the same scales in both calls); the residual is
// left as it was.
TEST_F(LinearCuda, ForwardAddsTheResidual) {
  SCOPED_TRACE(rng_.trace());
  const std::vector<bf16> residual_values = random_bf16(rng_, size_t(kTokens * kOut));
  const Device<bf16> residual(residual_values);
  struct Case {
    ScalingRecipe recipe;
    bool fp8;
  };
  const Case cases[] = {{ScalingRecipe::Tensorwise, false},
                        {ScalingRecipe::Tensorwise, true},
                        {ScalingRecipe::Delayed, true},
                        {ScalingRecipe::Blockwise, true},
                        {ScalingRecipe::Mxfp8, true}};
  for (const Case& c : cases) {
    const std::string name = c.fp8 ? std::string(recipe_name(c.recipe)) : "bf16";
    LinearUnderTest linear(c.recipe, false, kOut, gemm_, c.fp8);
    linear.layer->prepare_weight(weight_.get(), /*record_amax=*/false, stream_);
    Device<bf16> y(size_t(kTokens * kOut)), y_with_residual(size_t(kTokens * kOut));
    y_with_residual.poison_nan();
    linear.layer->forward(x_.get(), kTokens, y.get(), /*record_amax=*/false, stream_);
    linear.layer->forward(x_.get(), kTokens, y_with_residual.get(), /*record_amax=*/false, stream_,
                          residual.get());
    FP8T_CUDA_CHECK(cudaStreamSynchronize(stream_));
    std::vector<double> expected = widen(y.download());
    for (size_t i = 0; i < expected.size(); ++i)
      expected[i] += bf16_to_float(residual_values[i]);
    expect_close(widen(y_with_residual.download()), expected, {0x1p-8, 0x1p-7, 0x1p-7},
                 name + " y + residual");
    expect_bitwise_equal(residual.download(), residual_values, name + " residual");
  }
}

// The cast an RMSNorm does for the layer after it (fused_input_cast) against the layer's own cast
// of the norm's output: the same output y and scaling floats bit for bit, for every recipe that
// fuses it, and then the same backward (which casts x̂ᵗ from that output itself).
TEST_F(LinearCuda, NormFusedInputCastMatchesTheLayersOwnCast) {
  SCOPED_TRACE(rng_.trace());
  for (ScalingRecipe recipe :
       {ScalingRecipe::Tensorwise, ScalingRecipe::Delayed, ScalingRecipe::Blockwise}) {
    const std::string name(recipe_name(recipe));
    std::vector<bf16> y[2], dx[2];
    std::vector<float> dweight[2], scaling[2];
    for (int fused : {0, 1}) {
      LinearUnderTest linear(recipe, false, kOut, gemm_);
      Device<bf16> normed(size_t(kTokens * kIn));
      Device<float> rstd{size_t(kTokens)};
      Device<bf16> output(size_t(kTokens * kOut)), dx_out(size_t(kTokens * kIn));
      Device<float> dweight_out(std::vector<float>(size_t(kIn * kOut), 0.0f));
      output.poison_nan();
      dx_out.poison_nan();
      linear.layer->prepare_weight(weight_.get(), /*record_amax=*/true, stream_);
      const kernels::FusedCast cast =
          fused == 1 ? linear.layer->fused_input_cast(/*record_amax=*/true, stream_)
                     : kernels::FusedCast{};
      EXPECT_EQ(fused == 1, cast.out != nullptr || cast.amax != nullptr)
          << name << ": the norm's share of the cast";
      kernels::rmsnorm_forward(normed.get(), rstd.get(), x_.get(), kTokens, kIn, 1e-6f, stream_,
                               cast);
      linear.layer->forward(normed.get(), kTokens, output.get(), /*record_amax=*/true, stream_);
      linear.layer->backward(dy_.get(), normed.get(), kTokens, dx_out.get(), false,
                             dweight_out.get(), /*record_amax=*/true, stream_);
      FP8T_CUDA_CHECK(cudaStreamSynchronize(stream_));
      y[fused] = output.download();
      dx[fused] = dx_out.download();
      dweight[fused] = dweight_out.download();
      scaling[fused] = linear.scaling_floats();
    }
    expect_bitwise_equal(y[1], y[0], name + " y");
    expect_bitwise_equal(scaling[1], scaling[0], name + " scaling floats");
    expect_bitwise_equal(dx[1], dx[0], name + " dx");
    expect_bitwise_equal(dweight[1], dweight[0], name + " dW");
  }
  LinearUnderTest mx(ScalingRecipe::Mxfp8, false, kOut, gemm_);
  const kernels::FusedCast none = mx.layer->fused_input_cast(true, stream_);
  EXPECT_TRUE(none.out == nullptr && none.amax == nullptr) << "MXFP8 casts its input itself";
}

// Tensorwise, dy's amax taken by the bias gradient's pass before the backward (the Flux linears'
// order) gives the backward of a layer measuring it itself, bit for bit, whole and in chunks; the
// backward reads the taken amax (a larger one written into the slot gives a smaller dy scale) and
// only once (the next backward measures again). The other recipes take no amax of dy first.
TEST_F(LinearCuda, GradOutputAmaxTakenByTheBiasGradientMatchesTheLayersOwn) {
  SCOPED_TRACE(rng_.trace());
  const size_t grad_amax = scaling_index(TensorRole::GradOutput, kernels::kAmaxSlot);
  const size_t grad_scale = scaling_index(TensorRole::GradOutput, kernels::kScaleSlot);
  Device<float> workspace(size_t(kernels::flux_reduction_workspace_floats()));
  for (int64_t width : {kOut, kNarrowWidth}) {
    const std::string name = fmt::format("tensorwise, backward width {}", width);
    std::vector<bf16> dx[2];
    std::vector<float> dweight[2], dbias[2], scaling[2];
    for (int fused : {0, 1}) {
      LinearUnderTest linear(ScalingRecipe::Tensorwise, false, width, gemm_);
      AfterForward step(*this, linear);
      Device<float> dbias_out(std::vector<float>(size_t(kOut), 0.0f));
      workspace.poison_nan();
      float* amax = fused == 1 ? linear.layer->fused_grad_output_amax(stream_) : nullptr;
      EXPECT_EQ(amax != nullptr, fused == 1) << name;
      kernels::bias_backward(dbias_out.get(), dy_.get(), kTokens, kOut, workspace.get(), stream_,
                             amax);
      linear.layer->backward(dy_.get(), x_.get(), kTokens, step.dx.get(), false, step.dweight.get(),
                             /*record_amax=*/true, stream_);
      FP8T_CUDA_CHECK(cudaStreamSynchronize(stream_));
      dx[fused] = step.dx.download();
      dweight[fused] = step.dweight.download();
      dbias[fused] = dbias_out.download();
      scaling[fused] = linear.scaling_floats();
    }
    expect_bitwise_equal(scaling[1], scaling[0], name + " scaling floats");
    expect_bitwise_equal(dx[1], dx[0], name + " dx");
    expect_bitwise_equal(dweight[1], dweight[0], name + " dW");
    expect_bitwise_equal(dbias[1], dbias[0], name + " dbias");

    // The backward reads the slot: four times dy's amax there quarters dy's scale. The backward
    // after it measures dy again.
    LinearUnderTest linear(ScalingRecipe::Tensorwise, false, width, gemm_);
    AfterForward step(*this, linear);
    float* amax = linear.layer->fused_grad_output_amax(stream_);
    const float larger = 4.0f * scaling[0][grad_amax];
    FP8T_CUDA_CHECK(cudaMemcpyAsync(amax, &larger, sizeof(float), cudaMemcpyHostToDevice, stream_));
    linear.layer->backward(dy_.get(), x_.get(), kTokens, step.dx.get(), false, step.dweight.get(),
                           true, stream_);
    const std::vector<float> read = linear.scaling_floats();
    EXPECT_EQ(read[grad_amax], larger) << name;
    EXPECT_EQ(read[grad_scale], scaling[0][grad_scale] / 4.0f) << name;
    linear.layer->backward(dy_.get(), x_.get(), kTokens, step.dx.get(), false, step.dweight.get(),
                           true, stream_);
    EXPECT_EQ(linear.scaling_floats()[grad_amax], scaling[0][grad_amax])
        << name << ": the next backward measures dy";
  }
  expect_only_tensorwise_gives(
      [&](kernels::CudaLinear& layer) { return layer.fused_grad_output_amax(stream_); });
  LinearUnderTest relu2(ScalingRecipe::Tensorwise, false, kOut, gemm_, true, true);
  EXPECT_EQ(relu2.layer->fused_grad_output_amax(stream_), nullptr)
      << "a gradient through relu² is cast from more than dy";
}

// Tensorwise, the input's amax taken by the kernel that writes the input (here a row copy of x,
// as the Flux's copies out of the joint sequence and its GELU take it) gives the forward of a
// layer measuring x itself, bit for bit: the same output and scaling floats. The forward reads
// the slot (a larger amax there gives a smaller input scale), once. Layers that cast another
// layer's input, relu² of it, or no FP8 at all have no slot to fill.
TEST_F(LinearCuda, InputAmaxTakenByItsProducerMatchesTheLayersOwn) {
  SCOPED_TRACE(rng_.trace());
  const size_t input_amax = scaling_index(TensorRole::Input, kernels::kAmaxSlot);
  const size_t input_scale = scaling_index(TensorRole::Input, kernels::kScaleSlot);
  const auto forward = [&](LinearUnderTest& linear, const bf16* x) {
    Device<bf16> y(size_t(kTokens * kOut));
    y.poison_nan();
    linear.layer->forward(x, kTokens, y.get(), /*record_amax=*/true, stream_);
    FP8T_CUDA_CHECK(cudaStreamSynchronize(stream_));
    return y.download();
  };
  LinearUnderTest own(ScalingRecipe::Tensorwise, false, kOut, gemm_);
  own.layer->prepare_weight(weight_.get(), true, stream_);
  const std::vector<bf16> own_y = forward(own, x_.get());
  const std::vector<float> own_scaling = own.scaling_floats();

  LinearUnderTest taking(ScalingRecipe::Tensorwise, false, kOut, gemm_);
  taking.layer->prepare_weight(weight_.get(), true, stream_);
  Device<bf16> x_copy(size_t(kTokens * kIn));
  float* amax = taking.layer->fused_input_amax(stream_);
  ASSERT_NE(amax, nullptr);
  kernels::copy_rows({x_copy.get(), kIn, kTokens}, {x_.get(), kIn, kTokens}, 1, kTokens, kIn,
                     stream_, amax);
  expect_bitwise_equal(forward(taking, x_copy.get()), own_y, "y");
  expect_bitwise_equal(taking.scaling_floats(), own_scaling, "scaling floats");

  const float larger = 4.0f * own_scaling[input_amax];
  amax = taking.layer->fused_input_amax(stream_);
  FP8T_CUDA_CHECK(cudaMemcpyAsync(amax, &larger, sizeof(float), cudaMemcpyHostToDevice, stream_));
  forward(taking, x_.get());
  std::vector<float> read = taking.scaling_floats();
  EXPECT_EQ(read[input_amax], larger);
  EXPECT_EQ(read[input_scale], own_scaling[input_scale] / 4.0f);
  forward(taking, x_.get());
  read = taking.scaling_floats();
  EXPECT_EQ(read[input_amax], own_scaling[input_amax]) << "the next forward measures x";

  expect_only_tensorwise_gives(
      [&](kernels::CudaLinear& layer) { return layer.fused_input_amax(stream_); });
  LinearUnderTest relu2(ScalingRecipe::Tensorwise, true, kOut, gemm_);
  EXPECT_EQ(relu2.layer->fused_input_amax(stream_), nullptr) << "an input cast through relu²";
}

// Tensorwise, the weight's amax written into weight_amax_slot() by someone else (the optimizer's
// step) and read by prepare_weight gives the layer's own cast bit for bit: the same scaling floats
// and the same forward output. The cast reads the slot (four times the amax there quarters the
// weight's scale), and measures again when not told otherwise. Other recipes and BF16 layers have
// no slot to fill.
TEST_F(LinearCuda, WeightAmaxTakenByTheOptimizerMatchesTheLayersOwn) {
  SCOPED_TRACE(rng_.trace());
  const size_t weight_amax = scaling_index(TensorRole::Weight, kernels::kAmaxSlot);
  const size_t weight_scale = scaling_index(TensorRole::Weight, kernels::kScaleSlot);
  float host_amax = 0.0f;
  for (const float value : weight_.download())
    host_amax = std::max(host_amax, std::fabs(value));
  std::vector<bf16> y[2];
  std::vector<float> scaling[2];
  for (int taken : {0, 1}) {
    LinearUnderTest linear(ScalingRecipe::Tensorwise, false, kOut, gemm_);
    float* slot = linear.layer->weight_amax_slot();
    ASSERT_NE(slot, nullptr);
    if (taken == 1) {
      FP8T_CUDA_CHECK(
          cudaMemcpyAsync(slot, &host_amax, sizeof(float), cudaMemcpyHostToDevice, stream_));
    }
    linear.layer->prepare_weight(weight_.get(), /*record_amax=*/true, stream_, nullptr,
                                 /*amax_measured=*/taken == 1);
    Device<bf16> out(size_t(kTokens * kOut));
    out.poison_nan();
    linear.layer->forward(x_.get(), kTokens, out.get(), true, stream_);
    FP8T_CUDA_CHECK(cudaStreamSynchronize(stream_));
    y[taken] = out.download();
    scaling[taken] = linear.scaling_floats();
  }
  EXPECT_EQ(scaling[0][weight_amax], host_amax);
  expect_bitwise_equal(scaling[1], scaling[0], "scaling floats");
  expect_bitwise_equal(y[1], y[0], "y");

  LinearUnderTest linear(ScalingRecipe::Tensorwise, false, kOut, gemm_);
  const float larger = 4.0f * host_amax;
  FP8T_CUDA_CHECK(cudaMemcpyAsync(linear.layer->weight_amax_slot(), &larger, sizeof(float),
                                  cudaMemcpyHostToDevice, stream_));
  linear.layer->prepare_weight(weight_.get(), true, stream_, nullptr, /*amax_measured=*/true);
  std::vector<float> read = linear.scaling_floats();
  EXPECT_EQ(read[weight_amax], larger);
  EXPECT_EQ(read[weight_scale], scaling[0][weight_scale] / 4.0f);
  linear.layer->prepare_weight(weight_.get(), true, stream_);
  read = linear.scaling_floats();
  EXPECT_EQ(read[weight_amax], host_amax) << "an unmeasured cast measures the weight";

  // Those without a slot also refuse a cast told that the amax is in it.
  expect_only_tensorwise_gives([&](kernels::CudaLinear& layer) {
    EXPECT_THROW(layer.prepare_weight(weight_.get(), true, stream_, nullptr, true), Error);
    return layer.weight_amax_slot();
  });
}

// CudaLinear::prepare_weights beside each layer's own prepare_weight: the blockwise layers'
// casts grouped (Ŵᵗ kept or made in backward) give the same y and dx bit for bit, as do the
// layers cast alone (tensorwise, BF16, a blockwise one recording FP8 health, whose weight's
// values are counted).
TEST_F(LinearCuda, WeightsPreparedTogetherMatchEachLayersOwnCast) {
  SCOPED_TRACE(rng_.trace());
  struct Kind {
    ScalingRecipe recipe;
    bool fp8;
    ops::WeightTransposes transposes;
    bool health;
    const char* name;
  };
  const std::vector<Kind> kinds = {
      {ScalingRecipe::Blockwise, true, ops::WeightTransposes::Kept, false, "blockwise"},
      {ScalingRecipe::Blockwise, true, ops::WeightTransposes::InBackward, false,
       "blockwise, Ŵᵗ made in backward"},
      {ScalingRecipe::Blockwise, true, ops::WeightTransposes::Kept, true,
       "blockwise, recording FP8 health"},
      {ScalingRecipe::Tensorwise, true, ops::WeightTransposes::Kept, false, "tensorwise"},
      {ScalingRecipe::Tensorwise, false, ops::WeightTransposes::Kept, false, "BF16"}};
  Device<CastHealth> health(std::vector<CastHealth>(3));
  std::vector<std::vector<bf16>> y[2], dx[2];
  for (const bool together : {false, true}) {
    std::vector<std::unique_ptr<LinearUnderTest>> linears;
    std::vector<kernels::CudaLinear::WeightToPrepare> weights;
    for (const Kind& kind : kinds) {
      linears.push_back(std::make_unique<LinearUnderTest>(kind.recipe, false, kOut, gemm_, kind.fp8,
                                                          false, kind.transposes,
                                                          kind.health ? health.get() : nullptr));
      linears.back()->layer->set_record_health(kind.health);
      weights.push_back({linears.back()->layer.get(), weight_.get()});
    }
    if (together) {
      kernels::CudaLinear::prepare_weights(weights, stream_);
    } else {
      for (const auto& linear : linears)
        linear->layer->prepare_weight(weight_.get(), true, stream_);
    }
    for (size_t i = 0; i < kinds.size(); ++i) {
      kernels::CudaLinear& layer = *linears[i]->layer;
      if (kinds[i].health) {
        EXPECT_EQ(layer.health_elements()[static_cast<size_t>(TensorRole::Weight)],
                  static_cast<uint64_t>(kIn * kOut))
            << kinds[i].name << (together ? ", together" : ", alone");
      }
      Device<bf16> out(size_t(kTokens * kOut)), grad(size_t(kTokens * kIn));
      out.poison_nan();
      grad.poison_nan();
      layer.forward(x_.get(), kTokens, out.get(), true, stream_);
      layer.backward(dy_.get(), x_.get(), kTokens, grad.get(), false, nullptr, true, stream_);
      FP8T_CUDA_CHECK(cudaStreamSynchronize(stream_));
      y[together].push_back(out.download());
      dx[together].push_back(grad.download());
    }
  }
  for (size_t i = 0; i < kinds.size(); ++i) {
    expect_bitwise_equal(y[1][i], y[0][i], std::string("y, ") + kinds[i].name);
    expect_bitwise_equal(dx[1][i], dx[0][i], std::string("dx, ") + kinds[i].name);
  }
}

// Three blockwise layers sharing an input (the GPT's c_q, c_k and c_v), with a joint weight
// gradient or separate ones: their scratch, a poisoned dx and a zeroed dW for all three.
constexpr int kLayers = 3;
constexpr int64_t kWeight = kIn * kOut;
struct SharedInput {
  DeviceArena arena{"FP8 scratch"};
  float* scaling = nullptr;
  kernels::Fp8Scratch scratch;
  std::vector<std::unique_ptr<kernels::CudaLinear>> layers;
  Device<bf16> dx{size_t(kTokens * kIn)};
  Device<float> dweight{std::vector<float>(size_t(kLayers * kWeight), 0.0f)};
  SharedInput(bool joint, gemm::CublasLtGemm& gemm) {
    for (bool planning : {true, false}) {
      scaling = arena.take<float>(kLayers * kernels::kLinearScalingFloats);
      scratch = kernels::take_fp8_scratch(arena, ScalingRecipe::Blockwise, kTokens, kIn,
                                          kLayers * kOut, kLayers * kOut);
      if (planning) arena.allocate_planned();
    }
    for (int i = 0; i < kLayers; ++i) {
      kernels::LinearSetup setup;
      setup.in_features = kIn;
      setup.out_features = kOut;
      setup.max_tokens = kTokens;
      setup.fp8 = true;
      setup.fp8_config.recipe = ScalingRecipe::Blockwise;
      setup.scaling = scaling + i * kernels::kLinearScalingFloats;
      if (i > 0) setup.input_from = layers[0].get();
      if (joint) setup.wgrad_group = {i * kOut, kLayers * kOut};
      layers.push_back(std::make_unique<kernels::CudaLinear>(setup, gemm, scratch));
    }
    dx.poison_nan();
  }
  void forward(const Device<float>& weights, const bf16* x, cudaStream_t stream) {
    Device<bf16> y(size_t(kTokens * kOut));
    for (int i = 0; i < kLayers; ++i) {
      layers[i]->prepare_weight(weights.get() + i * kWeight, false, stream);
      layers[i]->forward(x, kTokens, y.get(), false, stream);
    }
    FP8T_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  // Layer i's backward, its weight gradient at `gradient` layers' gradients into dweight.
  void backward(int i, int gradient, const bf16* dy, const bf16* x, cudaStream_t stream) {
    layers[i]->backward(dy + i * kTokens * kOut, x, kTokens, dx.get(), i > 0,
                        dweight.get() + gradient * kWeight, false, stream);
  }
};

// Three blockwise layers reading one input (the GPT's c_q, c_k, c_v), their weight gradients back
// to back in one buffer, with and without a joint weight gradient: dx bit for bit (the same
// dgrads), dW up to the order of its fp32 sums (one GEMM of all rows instead of three). Out of
// order, or with gradients that do not follow each other, the group refuses.
TEST_F(LinearCuda, JointWeightGradientMatchesSeparateOnes) {
  SCOPED_TRACE(rng_.trace());
  const Device<float> weights{random_floats(rng_, size_t(kLayers * kWeight), -0.1, 0.1)};
  const Device<bf16> dy{random_bf16(rng_, size_t(kLayers * kTokens * kOut))};
  std::vector<bf16> dx[2];
  std::vector<float> dweight[2];
  for (int joint : {0, 1}) {
    SharedInput linears(joint == 1, gemm_);
    linears.forward(weights, x_.get(), stream_);
    for (int i = 0; i < kLayers; ++i)
      linears.backward(i, i, dy.get(), x_.get(), stream_);
    FP8T_CUDA_CHECK(cudaStreamSynchronize(stream_));
    dx[joint] = linears.dx.download();
    dweight[joint] = linears.dweight.download();
  }
  expect_bitwise_equal(dx[1], dx[0], "joint weight gradient: dx");
  expect_close(widen(dweight[1]), widen(dweight[0]), kReorderedSums, "joint weight gradient: dW");

  SharedInput linears(true, gemm_);
  linears.forward(weights, x_.get(), stream_);
  linears.backward(0, 0, dy.get(), x_.get(), stream_);
  EXPECT_THROW(linears.backward(2, 2, dy.get(), x_.get(), stream_), Error)
      << "the group's third layer before its second";
  EXPECT_THROW(linears.backward(1, 2, dy.get(), x_.get(), stream_), Error)
      << "weight gradients that do not follow each other";
  FP8T_CUDA_CHECK(cudaStreamSynchronize(stream_));

  kernels::LinearSetup tensorwise;
  tensorwise.in_features = kIn;
  tensorwise.out_features = kOut;
  tensorwise.max_tokens = kTokens;
  tensorwise.fp8 = true;
  tensorwise.scaling = linears.scaling;
  tensorwise.wgrad_group = {0, kLayers * kOut};
  EXPECT_THROW(std::make_unique<kernels::CudaLinear>(tensorwise, gemm_, linears.scratch), Error)
      << "a joint weight gradient with per-tensor scales";
}

// dy through a per-head RMSNorm and rotary (the GPT's q and k), cast by that gradient's kernel
// into the layer's scratch, gives the dx and dW of the layer's own cast of the stored gradient,
// bit for bit: alone and as parts of a joint weight gradient. Layers that cast dy themselves
// offer no such cast, and a backward without dy needs one over the same rows.
TEST_F(LinearCuda, GradOutputCastByItsProducerMatchesTheLayersOwn) {
  SCOPED_TRACE(rng_.trace());
  const kernels::RotaryShape rotary{2, kTokens / 2, kOut / 128, 128};
  const size_t count = size_t(kTokens * kOut);
  const Device<float> weights{random_floats(rng_, size_t(kLayers * kWeight), -0.1, 0.1)};
  const Device<bf16> dout{random_bf16(rng_, kLayers * count)};
  const Device<bf16> pre_norm{random_bf16(rng_, kLayers * count, -3.0, 3.0)};
  std::vector<float> cos(size_t(rotary.seq_len * 64)), sin(cos.size());
  ops::rotary_tables(cos.data(), sin.data(), rotary.seq_len, 128);
  const Device<float> device_cos(cos), device_sin(sin);
  Device<bf16> out(kLayers * count), dlin(count);
  Device<float> rstd(size_t(kLayers * kTokens * rotary.heads));
  for (int i = 0; i < kLayers; ++i) {
    kernels::rotary_rmsnorm_forward(out.get() + i * count, rstd.get() + i * kTokens * rotary.heads,
                                    pre_norm.get() + i * count, device_cos.get(), device_sin.get(),
                                    rotary, static_cast<float>(ops::kRmsNormEps), stream_);
  }
  for (const bool joint : {false, true}) {
    std::vector<bf16> dx[2];
    std::vector<float> dweight[2];
    for (const bool fused : {false, true}) {
      SharedInput linears(joint, gemm_);
      linears.forward(weights, x_.get(), stream_);
      for (int i = 0; i < kLayers; ++i) {
        kernels::CudaLinear& layer = *linears.layers[i];
        const bf16* layer_dout = dout.get() + i * count;
        const bf16* layer_out = out.get() + i * count;
        const float* layer_rstd = rstd.get() + i * kTokens * rotary.heads;
        const bf16* dy = dlin.get();
        if (fused) {
          const auto cast = layer.fused_grad_output_cast(kTokens);
          ASSERT_TRUE(cast.has_value()) << "layer " << i;
          kernels::rotary_rmsnorm_backward_cast(layer_dout, layer_out, layer_rstd, device_cos.get(),
                                                device_sin.get(), rotary, *cast, stream_);
          dy = nullptr;
        } else {
          dlin.poison_nan();
          kernels::rotary_rmsnorm_backward(dlin.get(), layer_dout, layer_out, layer_rstd,
                                           device_cos.get(), device_sin.get(), rotary,
                                           kernels::GradStore::Write, stream_);
        }
        layer.backward(dy, x_.get(), kTokens, linears.dx.get(), i > 0,
                       linears.dweight.get() + i * kWeight, false, stream_);
      }
      dx[fused] = linears.dx.download();
      dweight[fused] = linears.dweight.download();
    }
    const std::string what = joint ? "joint weight gradient" : "separate weight gradients";
    expect_bitwise_equal(dx[1], dx[0], "dx, " + what);
    expect_bitwise_equal(dweight[1], dweight[0], "dW, " + what);
  }

  SharedInput linears(false, gemm_);
  kernels::CudaLinear& layer = *linears.layers[0];
  EXPECT_THROW(layer.backward(nullptr, x_.get(), kTokens, linears.dx.get(), false,
                              linears.dweight.get(), false, stream_),
               Error)
      << "no dy and no cast";
  ASSERT_TRUE(layer.fused_grad_output_cast(kTokens / 2).has_value());
  EXPECT_THROW(layer.backward(nullptr, x_.get(), kTokens, linears.dx.get(), false,
                              linears.dweight.get(), false, stream_),
               Error)
      << "a cast over other rows";
  layer.set_record_health(true);
  EXPECT_FALSE(layer.fused_grad_output_cast(kTokens).has_value()) << "recording FP8 health";
  LinearUnderTest tensorwise(ScalingRecipe::Tensorwise, false, kOut, gemm_);
  EXPECT_FALSE(tensorwise.layer->fused_grad_output_cast(kTokens).has_value()) << "tensorwise";
  LinearUnderTest chunks(ScalingRecipe::Blockwise, false, kNarrowWidth, gemm_);
  EXPECT_FALSE(chunks.layer->fused_grad_output_cast(kTokens).has_value()) << "in chunks";
  LinearUnderTest relu2_output(ScalingRecipe::Blockwise, false, kOut, gemm_, true, true);
  EXPECT_FALSE(relu2_output.layer->fused_grad_output_cast(kTokens).has_value())
      << "an output feeding relu²";
  FP8T_CUDA_CHECK(cudaStreamSynchronize(stream_));
}

}  // namespace
}  // namespace fp8t

namespace fp8t {
namespace {

// Ŵᵗ transposed from Ŵ before the backward holds the bytes (and, blockwise, the scales) the
// weight cast gives the kept Ŵᵗ: y, dx, dW and the scaling floats are equal bit for bit, with
// the backward whole and in chunks (one transpose before them), and the layer holds a byte per
// weight less (and, blockwise, no transposed grid of scales).
TEST_F(LinearCuda, WeightTransposedInBackwardMatchesTheKeptOne) {
  SCOPED_TRACE(rng_.trace());
  for (ScalingRecipe recipe :
       {ScalingRecipe::Tensorwise, ScalingRecipe::Delayed, ScalingRecipe::Blockwise}) {
    for (int64_t width : {kOut, kNarrowWidth}) {
      const std::string name = fmt::format("{}, backward width {}", recipe_name(recipe), width);
      std::vector<bf16> y[2], dx[2];
      std::vector<float> dweight[2], scaling[2];
      size_t bytes[2] = {};
      for (int in_backward : {0, 1}) {
        LinearUnderTest linear(
            recipe, /*relu2=*/false, width, gemm_, /*fp8=*/true,
            /*output_relu2=*/false,
            in_backward ? ops::WeightTransposes::InBackward : ops::WeightTransposes::Kept);
        AfterForward step(*this, linear);
        linear.layer->backward(dy_.get(), x_.get(), kTokens, step.dx.get(), false,
                               step.dweight.get(), /*record_amax=*/true, stream_);
        FP8T_CUDA_CHECK(cudaStreamSynchronize(stream_));
        y[in_backward] = step.y.download();
        dx[in_backward] = step.dx.download();
        dweight[in_backward] = step.dweight.download();
        scaling[in_backward] = linear.scaling_floats();
        bytes[in_backward] = linear.layer->device_bytes();
      }
      expect_bitwise_equal(y[1], y[0], name + " y");
      expect_bitwise_equal(dx[1], dx[0], name + " dx");
      expect_bitwise_equal(dweight[1], dweight[0], name + " dW");
      expect_bitwise_equal(scaling[1], scaling[0], name + " scaling floats");
      const size_t scales = recipe == ScalingRecipe::Blockwise
                                ? sizeof(float) * size_t(ops::tile_floats(kIn, kOut))
                                : 0;
      EXPECT_EQ(bytes[0] - bytes[1], size_t(kIn * kOut) + scales) << name;
    }
  }
}

TEST_F(LinearCuda, WeightTransposedInBackwardNeedsRoomAndATransposableRecipe) {
  const auto setup_for = [](ScalingRecipe recipe, float* scaling) {
    kernels::LinearSetup setup = layer_setup(recipe, scaling);
    setup.weight_transposes = ops::WeightTransposes::InBackward;
    return setup;
  };
  // Room for a weight 16 rows smaller than this layer's.
  LinearUnderTest small(ScalingRecipe::Tensorwise, false, kOut, gemm_);
  small.scratch.weight_t_room.fit(kIn, kOut - 16, ScalingRecipe::Tensorwise);
  EXPECT_THROW(kernels::CudaLinear(setup_for(ScalingRecipe::Tensorwise, small.scaling), gemm_,
                                   small.scratch),
               Error)
      << "no room";
  LinearUnderTest mx(ScalingRecipe::Mxfp8, false, kOut, gemm_);
  mx.scratch.weight_t_room.fit(kIn, kOut, ScalingRecipe::Mxfp8);
  EXPECT_THROW(kernels::CudaLinear(setup_for(ScalingRecipe::Mxfp8, mx.scaling), gemm_, mx.scratch),
               Error)
      << "mxfp8";
}

// The transposes on shapes that fill no tile and on whole tiles, against host transposes; the
// outputs poisoned first, and the pads of the grid's input too.
TEST_F(LinearCuda, TransposesMatchHostTransposes) {
  SCOPED_TRACE(rng_.trace());
  const std::pair<int64_t, int64_t> shapes[] = {{4, 4},    {20, 36},   {64, 64},
                                                {132, 68}, {16, 1000}, {1000, 16}};
  for (const auto& [rows, cols] : shapes) {
    std::vector<uint8_t> bytes(size_t(rows * cols));
    for (uint8_t& byte : bytes)
      byte = static_cast<uint8_t>(rng_.bits());
    const Device<uint8_t> in(bytes);
    Device<uint8_t> out(bytes.size());
    out.poison_nan();
    kernels::transpose_fp8(in.get(), rows, cols, out.get(), stream_);
    std::vector<uint8_t> expected(bytes.size());
    for (int64_t r = 0; r < rows; ++r) {
      for (int64_t c = 0; c < cols; ++c)
        expected[size_t(c * rows + r)] = bytes[size_t(r * cols + c)];
    }
    expect_bitwise_equal(out.download(), expected, fmt::format("[{}, {}] bytes", rows, cols));
  }
  const Device<uint8_t> six_rows(48);
  Device<uint8_t> six_cols(48);
  EXPECT_THROW(kernels::transpose_fp8(six_rows.get(), 6, 8, six_cols.get(), stream_), Error)
      << "6 rows";

  const auto padded = [](int64_t count) { return (count + 3) / 4 * 4; };
  const std::pair<int64_t, int64_t> grids[] = {{1, 1}, {3, 5}, {5, 9}, {8, 4}};
  for (const auto& [grid_rows, grid_cols] : grids) {
    std::vector<float> grid(size_t(grid_rows * padded(grid_cols)),
                            std::numeric_limits<float>::quiet_NaN());
    for (int64_t r = 0; r < grid_rows; ++r) {
      for (int64_t c = 0; c < grid_cols; ++c)
        grid[size_t(r * padded(grid_cols) + c)] = static_cast<float>(rng_.uniform(0.5, 4.0));
    }
    const Device<float> in(grid);
    Device<float> out(size_t(grid_cols * padded(grid_rows)));
    out.poison_nan();
    kernels::transpose_tile_scale_grid(out.get(), in.get(), grid_rows, grid_cols, stream_);
    std::vector<float> expected(size_t(grid_cols * padded(grid_rows)), 0.0f);
    for (int64_t r = 0; r < grid_rows; ++r) {
      for (int64_t c = 0; c < grid_cols; ++c)
        expected[size_t(c * padded(grid_rows) + r)] = grid[size_t(r * padded(grid_cols) + c)];
    }
    expect_bitwise_equal(out.download(), expected,
                         fmt::format("[{}, {}] scale grid", grid_rows, grid_cols));
  }
}

}  // namespace
}  // namespace fp8t
