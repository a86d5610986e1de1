#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <string>
#include <vector>

#include <fmt/format.h>

#include "io/safetensors.h"
#include "models/flux_model.h"
#include "models/flux_objective.h"
#include "models/golden.h"

namespace fp8t {
namespace {

// The golden file's configuration: its preset, with the guidance embedder as recorded; the
// sizes the metadata records must be the preset's.
FluxConfig golden_flux_config(const io::SafetensorsFile& file) {
  EXPECT_EQ(file.metadata_value("format"), "fp8train-golden");
  EXPECT_EQ(file.metadata_value("model"), "flux");
  FluxConfig config = FluxConfig::preset(file.metadata_value("preset"));
  config.guidance_embed = file.metadata_value("guidance_embed") == "true";
  const auto integer = [&](const char* key) { return std::stoi(file.metadata_value(key)); };
  EXPECT_EQ(integer("hidden_size"), config.hidden_size);
  EXPECT_EQ(integer("num_heads"), config.num_heads);
  EXPECT_EQ(integer("mlp_ratio"), config.mlp_ratio);
  EXPECT_EQ(integer("in_channels"), config.in_channels);
  EXPECT_EQ(integer("context_in_dim"), config.context_in_dim);
  EXPECT_EQ(integer("vec_in_dim"), config.vec_in_dim);
  EXPECT_EQ(integer("double_blocks"), config.double_blocks);
  EXPECT_EQ(integer("single_blocks"), config.single_blocks);
  EXPECT_EQ(integer("timestep_dim"), config.timestep_dim());
  EXPECT_EQ(file.metadata_value("axes_dim"),
            fmt::format("{},{},{}", config.axes_dim[0], config.axes_dim[1], config.axes_dim[2]));
  EXPECT_EQ(std::stod(file.metadata_value("rope_theta")), config.rope_theta);
  return config;
}

// The model of tests/reference/flux_reference.py (PyTorch, fp32) on the golden file's weights
// (random everywhere, the zero-initialized modulation and final linears included) and batch:
// the prediction, the rectified-flow loss and every parameter gradient.
//
// Tolerances: both sides run in fp32 and differ only in the order of their sums (GEMMs up to
// 320 deep, the sinusoid's 256, softmax and norm reductions) and in libm's exp, cos and sin
// against torch's, each within an ulp or so: the prediction and the loss agree to a few 1e-7.
// Backward adds the cancellation of the LayerNorm, RMSNorm and softmax backward (differences
// of nearly equal terms) and sums over every token for biases and norm scales, so gradients
// lose a few more bits: they agree to within 1e-5 per tensor, and 1e-4 leaves a margin of ten.
// The formula errors tried against it (halves instead of adjacent RoPE pairs, sin before cos,
// shift and scale swapped, exact instead of tanh GELU) move the prediction by 1e-5 to 0.2 and
// some gradient by 3e-4 to O(1). An eps of 1e-5 instead of 1e-6 in the QK norm stays within
// it (6e-5 on the scales' gradients).
class FluxGolden : public ::testing::TestWithParam<const char*> {};

TEST_P(FluxGolden, MatchesThePytorchReference) {
  const auto path = testing::golden_path(GetParam());
  ASSERT_TRUE(std::filesystem::exists(path)) << path;
  const io::SafetensorsFile file(path);
  const FluxConfig config = golden_flux_config(file);
  const int64_t batch = std::stoi(file.metadata_value("batch"));
  const int64_t img_tokens = std::stoi(file.metadata_value("img_tokens"));
  const int64_t txt_tokens = std::stoi(file.metadata_value("txt_tokens"));
  FluxModel model(config, batch, img_tokens, txt_tokens, FluxPrecision::fp32_reference());

  // The parameters are stored as bf16 (the reference rounded them so, then ran in fp32).
  int64_t stored_parameters = 0;
  for (const std::string& name : file.names())
    stored_parameters +=
        !name.starts_with("input.") && !name.starts_with("output.") && !name.starts_with("grad.");
  EXPECT_EQ(stored_parameters, static_cast<int64_t>(flux_parameters(config).size()));
  for (const FluxParam& spec : flux_parameters(config)) {
    const io::Tensor<bf16> weights = file.tensor<bf16>(spec.name);
    ASSERT_EQ(weights.shape, spec.shape) << spec.name;
    float* param = model.parameters()[spec.name].data<float>();
    for (int64_t i = 0; i < weights.numel(); ++i)
      param[i] = bf16_to_float(weights.data[static_cast<size_t>(i)]);
  }
  model.weights_changed();

  const auto input = [&](const std::string& name, std::vector<int64_t> shape) {
    io::Tensor<float> tensor = file.tensor<float>("input." + name);
    EXPECT_EQ(tensor.shape, shape) << name;
    return tensor;
  };
  const io::Tensor<float> img = input("img", {batch, img_tokens, config.in_channels});
  const io::Tensor<float> img_ids = input("img_ids", {img_tokens, 3});
  const io::Tensor<float> txt = input("txt", {batch, txt_tokens, config.context_in_dim});
  const io::Tensor<float> y = input("y", {batch, config.vec_in_dim});
  const io::Tensor<float> timesteps = input("timesteps", {batch});
  const io::Tensor<float> target = input("target", img.shape);
  const io::Tensor<float> guidance =
      config.guidance_embed ? input("guidance", {batch}) : io::Tensor<float>{};
  EXPECT_EQ(file.contains("input.guidance"), config.guidance_embed);

  const FluxInputs inputs{
      img.data.data(),       img_ids.data.data(),
      txt.data.data(),       y.data.data(),
      timesteps.data.data(), guidance.data.empty() ? nullptr : guidance.data.data()};
  std::vector<float> prediction(img.data.size());
  model.forward(inputs, prediction.data());
  const io::Tensor<float> reference_prediction = file.tensor<float>("output.prediction");
  ASSERT_EQ(reference_prediction.shape, img.shape);
  EXPECT_LE(testing::relative_error(prediction.data(), reference_prediction.data.data(),
                                    reference_prediction.numel()),
            1e-5);

  // d loss / d prediction = 2 (pred - target) / n.
  std::vector<float> grad_prediction(prediction.size());
  const double loss = flow_mse_loss_with_gradient(grad_prediction.data(), prediction.data(),
                                                  target.data.data(), target.numel());
  const float reference_loss = file.tensor<float>("output.loss").data[0];
  EXPECT_NEAR(loss, reference_loss, 1e-5 * std::abs(reference_loss));

  model.zero_gradients();
  model.backward(grad_prediction.data());
  for (const FluxParam& spec : flux_parameters(config)) {
    const io::Tensor<float> reference = file.tensor<float>("grad." + spec.name);
    const TensorView& grad = model.gradients()[spec.name];
    ASSERT_EQ(reference.numel(), grad.numel()) << spec.name;
    EXPECT_LE(testing::relative_error(grad.data<float>(), reference.data.data(), grad.numel()),
              1e-4)
        << spec.name;
  }
}

INSTANTIATE_TEST_SUITE_P(FluxModel, FluxGolden,
                         ::testing::Values("flux_tiny_golden", "flux_tiny_guidance_golden"));

}  // namespace
}  // namespace fp8t
