// The FP8 linear layer: for every recipe, mode and family, its outputs and gradients equal an
// independent recomputation from the numerics API (quantize, dequantize, naive GEMM in double)
// and stay within the formats' quantization error of the fp32 result; plus the BF16 wgrad, the
// weight cache, delayed scaling across steps, formats per role and shape checks.
#include "ops/fp8_linear.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include <gtest/gtest.h>

#include "core/error.h"
#include "numerics/float_bits.h"
#include "numerics/formats.h"
#include "numerics/quantize.h"
#include "numerics/scaling.h"
#include "numerics/test_util.h"
#include "ops/gradient_check.h"
#include "ops/linear.h"

namespace fp8t {
namespace {

using ops::Fp8Linear;

struct Shape {
  int64_t tokens, in, out;
};

// Block recipes need whole blocks along in/out; tokens are left ragged on purpose (the wgrad
// blocks along tokens then end in a partial block).
Shape shape_for(ScalingRecipe recipe) {
  switch (recipe) {
    case ScalingRecipe::Blockwise:
      return {160, 256, 128};
    case ScalingRecipe::Mxfp8:
      return {45, 96, 64};
    default:
      return {37, 80, 48};
  }
}

size_t count(int64_t rows, int64_t cols) {
  return static_cast<size_t>(rows * cols);
}

// Values with a different scale per row and per column, so that per-tensor, 1x128, 128x128
// and 1x32 scalings (and row-wise versus transposed blocks) all give different numbers.
std::vector<float> random_matrix(test::TestRng& rng, int64_t rows, int64_t cols, double scale) {
  std::vector<double> row_scale(static_cast<size_t>(rows)), col_scale(static_cast<size_t>(cols));
  for (double& s : row_scale)
    s = std::ldexp(1.0, rng.uniform_int(-3, 3));
  for (double& s : col_scale)
    s = std::ldexp(1.0, rng.uniform_int(-2, 2));
  std::normal_distribution<double> normal(0.0, 1.0);
  std::vector<float> values(count(rows, cols));
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c) {
      values[count(r, cols) + size_t(c)] = static_cast<float>(
          scale * row_scale[size_t(r)] * col_scale[size_t(c)] * normal(rng.engine()));
    }
  }
  return values;
}

std::vector<float> transposed(const std::vector<float>& values, int64_t rows, int64_t cols) {
  std::vector<float> result(values.size());
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t c = 0; c < cols; ++c)
      result[count(c, rows) + size_t(r)] = values[count(r, cols) + size_t(c)];
  }
  return result;
}

// C[m, n] = Σ_k A[m, k]·B[n, k] in double (the TN form), and Σ_k |A·B| for error bounds.
struct Product {
  std::vector<double> value, magnitude;
};
Product naive_abt(const std::vector<float>& a, const std::vector<float>& b, int64_t m, int64_t n,
                  int64_t k) {
  Product p{std::vector<double>(count(m, n)), std::vector<double>(count(m, n))};
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double sum = 0, magnitude = 0;
      for (int64_t l = 0; l < k; ++l) {
        const double term = double(a[count(i, k) + size_t(l)]) * double(b[count(j, k) + size_t(l)]);
        sum += term;
        magnitude += std::fabs(term);
      }
      p.value[count(i, n) + size_t(j)] = sum;
      p.magnitude[count(i, n) + size_t(j)] = magnitude;
    }
  }
  return p;
}

// The quantized operands of one linear as the numerics API makes them, written out in the
// test: per-tensor scale from `scales` (tensorwise: the tensor's amax; delayed: the given
// scale), blocks by quantize_transpose_blocks. Returns the dequantized row-wise values and
// those of the transposed quantization.
struct Dequantized {
  std::vector<float> rowwise;     // [rows, cols]
  std::vector<float> transposed;  // [cols, rows]
  std::vector<uint8_t> transposed_codes;
};

Dequantized reference_quantization(const std::vector<float>& x, int64_t rows, int64_t cols,
                                   const Fp8Config& config, TensorRole role, Fp8Family family,
                                   float delayed_scale) {
  const Fp8Format format = config.format_for(role, family);
  Dequantized result{std::vector<float>(count(rows, cols)), std::vector<float>(count(rows, cols)),
                     std::vector<uint8_t>(count(rows, cols))};
  std::vector<uint8_t> codes(count(rows, cols));
  if (config.recipe == ScalingRecipe::Delayed || config.recipe == ScalingRecipe::Tensorwise) {
    const float scale = config.recipe == ScalingRecipe::Delayed
                            ? delayed_scale
                            : scale_from_amax(amax(x.data(), int64_t(x.size())), format_max(format),
                                              config.use_power_of_2_scales(), config.amax_epsilon);
    quantize(x.data(), int64_t(x.size()), scale, format, codes.data(), nullptr);
    dequantize(codes.data(), int64_t(codes.size()), 1.0f / scale, format, result.rowwise.data());
    result.transposed = transposed(result.rowwise, rows, cols);
    std::vector<float> x_t = transposed(x, rows, cols);
    quantize(x_t.data(), int64_t(x_t.size()), scale, format, result.transposed_codes.data(),
             nullptr);
    return result;
  }
  BlockQuantization spec;
  spec.format = format;
  spec.power_of_2_scales = config.use_power_of_2_scales();
  spec.amax_epsilon = config.amax_epsilon;
  if (config.recipe == ScalingRecipe::Mxfp8) {
    spec.scaling = BlockScaling::Mx1x32;
  } else {
    spec.scaling = role == TensorRole::Weight ? BlockScaling::Tile128x128 : BlockScaling::Rows1x128;
  }
  const BlockShape grid = scale_grid(spec.scaling, rows, cols);
  const BlockShape grid_t = scale_grid(spec.scaling, cols, rows);
  // Room for fp32 scales; E8M0 codes use the first bytes.
  std::vector<float> scales(size_t(grid.rows) * size_t(grid.cols));
  std::vector<float> scales_t(size_t(grid_t.rows) * size_t(grid_t.cols));
  quantize_transpose_blocks(x.data(), rows, cols, spec, codes.data(), scales.data(),
                            result.transposed_codes.data(), scales_t.data());
  dequantize_blocks(codes.data(), rows, cols, spec, scales.data(), result.rowwise.data());
  dequantize_blocks(result.transposed_codes.data(), cols, rows, spec, scales_t.data(),
                    result.transposed.data());
  return result;
}

// Relative precision of a format: half an ulp relative to the value, 2^-(m+1).
double relative_precision(Fp8Format format) {
  return std::ldexp(1.0, -(format_traits(format).mantissa_bits + 1));
}

Fp8Config make_config(ScalingRecipe recipe, Fp8Mode mode) {
  Fp8Config config;
  config.recipe = recipe;
  config.mode = mode;
  config.amax_history_len = 4;
  return config;
}

struct LinearData {
  std::vector<float> x, w, dy;
};

LinearData random_data(test::TestRng& rng, const Shape& s) {
  return {random_matrix(rng, s.tokens, s.in, 1.0), random_matrix(rng, s.out, s.in, 0.05),
          random_matrix(rng, s.tokens, s.out, 1e-3)};
}

using RecipeCase = std::tuple<ScalingRecipe, Fp8Mode, Fp8Family>;

class Fp8LinearRecipe : public ::testing::TestWithParam<RecipeCase> {};

TEST_P(Fp8LinearRecipe, MatchesRecomputationAndQuantizationBound) {
  const auto [recipe, mode, family] = GetParam();
  test::TestRng rng;
  SCOPED_TRACE(rng.trace());
  const Shape s = shape_for(recipe);
  const Fp8Config config = make_config(recipe, mode);
  const LinearData data = random_data(rng, s);
  Fp8Linear linear(config, family, s.in, s.out);

  // A first step sets the delayed scales from these very tensors (scale 1 before it would
  // quantize tiny gradients to zero); stateless recipes are unaffected by it.
  std::vector<float> y(count(s.tokens, s.out)), dx(count(s.tokens, s.in)), dw(count(s.out, s.in));
  linear.forward(data.x.data(), s.tokens, data.w.data(), y.data());
  linear.backward(data.dy.data(), s.tokens, dx.data(), dw.data());
  linear.end_step();
  const auto scale_of = [&](TensorRole role, const std::vector<float>& tensor) {
    return format_max(config.format_for(role, family)) /
           amax(tensor.data(), int64_t(tensor.size()));
  };

  std::fill(dx.begin(), dx.end(), 0.0f);
  std::fill(dw.begin(), dw.end(), 0.0f);
  linear.forward(data.x.data(), s.tokens, data.w.data(), y.data());
  linear.backward(data.dy.data(), s.tokens, dx.data(), dw.data());

  const Dequantized x_hat =
      reference_quantization(data.x, s.tokens, s.in, config, TensorRole::Input, family,
                             scale_of(TensorRole::Input, data.x));
  const Dequantized w_hat = reference_quantization(data.w, s.out, s.in, config, TensorRole::Weight,
                                                   family, scale_of(TensorRole::Weight, data.w));
  const Dequantized dy_hat =
      reference_quantization(data.dy, s.tokens, s.out, config, TensorRole::GradOutput, family,
                             scale_of(TensorRole::GradOutput, data.dy));
  EXPECT_EQ(linear.saved_input_t().data, x_hat.transposed_codes) << "saved x̂ᵗ";

  // Forward: exact up to fp32 accumulation, then rounded to bf16. The fp32 sum lies within
  // (K+2)·2^-24·Σ|terms| of the exact one; rounding is monotone, so y lies between the bf16
  // roundings of the ends of that interval (a single value unless near a rounding boundary).
  const Product y_ref = naive_abt(x_hat.rowwise, w_hat.rowwise, s.tokens, s.out, s.in);
  int mismatches = 0;
  for (size_t i = 0; i < y.size(); ++i) {
    const double slack = double(s.in + 2) * std::ldexp(1.0, -24) * y_ref.magnitude[i];
    const float low = bf16_to_float(float_to_bf16(static_cast<float>(y_ref.value[i] - slack)));
    const float high = bf16_to_float(float_to_bf16(static_cast<float>(y_ref.value[i] + slack)));
    if (!(low <= y[i] && y[i] <= high) || bf16_to_float(float_to_bf16(y[i])) != y[i]) {
      if (++mismatches <= 5)
        ADD_FAILURE() << "y[" << i << "] = " << y[i] << ", expected in [" << low << ", " << high
                      << "]";
    }
  }
  EXPECT_EQ(mismatches, 0);

  // Backward: dgrad on dŷ and Ŵᵗ (blocks along out), wgrad on dŷᵗ and x̂ᵗ (blocks along tokens).
  const Product dx_ref = naive_abt(dy_hat.rowwise, w_hat.transposed, s.tokens, s.in, s.out);
  const Product dw_ref = naive_abt(dy_hat.transposed, x_hat.transposed, s.out, s.in, s.tokens);
  EXPECT_LE(test::relative_error(dx, dx_ref.value), 1e-6);
  EXPECT_LE(test::relative_error(dw, dw_ref.value), 1e-6);

  // Against the fp32 linear: within the quantization error of the two operands (and bf16 for y).
  const double input_precision = relative_precision(config.format_for(TensorRole::Input, family));
  const double weight_precision = relative_precision(config.format_for(TensorRole::Weight, family));
  const double grad_precision =
      relative_precision(config.format_for(TensorRole::GradOutput, family));
  const Product y32 = naive_abt(data.x, data.w, s.tokens, s.out, s.in);
  const Product dx32 = naive_abt(data.dy, transposed(data.w, s.out, s.in), s.tokens, s.in, s.out);
  const Product dw32 = naive_abt(transposed(data.dy, s.tokens, s.out),
                                 transposed(data.x, s.tokens, s.in), s.out, s.in, s.tokens);
  EXPECT_LE(test::relative_error(y, y32.value),
            input_precision + weight_precision + std::ldexp(1.0, -8));
  EXPECT_LE(test::relative_error(dx, dx32.value), grad_precision + weight_precision);
  EXPECT_LE(test::relative_error(dw, dw32.value), grad_precision + input_precision);
}

std::string case_name(const ::testing::TestParamInfo<RecipeCase>& info) {
  const auto [recipe, mode, family] = info.param;
  return std::string(recipe_name(recipe)) + "_" + std::string(mode_name(mode)) + "_" +
         std::string(family_name(family));
}

INSTANTIATE_TEST_SUITE_P(
    Fp8Linear, Fp8LinearRecipe,
    ::testing::Combine(::testing::Values(ScalingRecipe::Delayed, ScalingRecipe::Tensorwise,
                                         ScalingRecipe::Blockwise, ScalingRecipe::Mxfp8),
                       ::testing::Values(Fp8Mode::E4M3, Fp8Mode::Hybrid),
                       ::testing::Values(Fp8Family::Ocp, Fp8Family::Fnuz)),
    case_name);

TEST(Fp8Linear, Bf16WgradIsTheBf16LinearGradient) {
  test::TestRng rng;
  SCOPED_TRACE(rng.trace());
  for (ScalingRecipe recipe : {ScalingRecipe::Tensorwise, ScalingRecipe::Blockwise}) {
    SCOPED_TRACE(recipe_name(recipe));
    const Shape s = shape_for(recipe);
    const Fp8Config config = make_config(recipe, Fp8Mode::Hybrid);
    const LinearData data = random_data(rng, s);
    Fp8Linear fp8_wgrad(config, Fp8Family::Ocp, s.in, s.out, /*fp8_wgrad=*/true);
    Fp8Linear bf16_wgrad(config, Fp8Family::Ocp, s.in, s.out, /*fp8_wgrad=*/false);
    EXPECT_FALSE(bf16_wgrad.fp8_wgrad());

    std::vector<float> y(count(s.tokens, s.out)), y_bf16(y.size());
    std::vector<float> dx(count(s.tokens, s.in)), dx_bf16(dx.size());
    std::vector<float> dw(count(s.out, s.in)), dw_bf16(dw.size()), dw_ref(dw.size());
    fp8_wgrad.forward(data.x.data(), s.tokens, data.w.data(), y.data());
    bf16_wgrad.forward(data.x.data(), s.tokens, data.w.data(), y_bf16.data());
    EXPECT_TRUE(bf16_wgrad.saved_input_t().data.empty()) << "keeps bf16(x), not x̂ᵗ";
    EXPECT_EQ(bf16_wgrad.saved_input_bf16().size(), data.x.size());
    fp8_wgrad.backward(data.dy.data(), s.tokens, dx.data(), dw.data());
    bf16_wgrad.backward(data.dy.data(), s.tokens, dx_bf16.data(), dw_bf16.data());
    ops::linear_backward(data.dy.data(), data.x.data(), nullptr, nullptr, dw_ref.data(),
                         {s.tokens, s.in, s.out}, ops::LinearOperands::Bf16);

    EXPECT_EQ(dw_bf16, dw_ref);  // bit for bit
    EXPECT_NE(dw_bf16, dw);      // and not the FP8 wgrad
    EXPECT_EQ(y_bf16, y);        // forward and dgrad stay FP8
    EXPECT_EQ(dx_bf16, dx);
  }
}

TEST(Fp8Linear, WeightIsQuantizedOncePerStep) {
  test::TestRng rng;
  SCOPED_TRACE(rng.trace());
  for (ScalingRecipe recipe : {ScalingRecipe::Delayed, ScalingRecipe::Tensorwise,
                               ScalingRecipe::Blockwise, ScalingRecipe::Mxfp8}) {
    SCOPED_TRACE(recipe_name(recipe));
    const Shape s = shape_for(recipe);
    Fp8Linear linear(make_config(recipe, Fp8Mode::Hybrid), Fp8Family::Ocp, s.in, s.out);
    LinearData data = random_data(rng, s);
    std::vector<float> y(count(s.tokens, s.out)), y_again(y.size());
    std::vector<float> dx(count(s.tokens, s.in)), dw(count(s.out, s.in));
    EXPECT_EQ(linear.weight_quantizations(), 0);
    for (int micro_batch = 0; micro_batch < 3; ++micro_batch) {
      const std::vector<float> x = random_matrix(rng, s.tokens, s.in, 1.0);
      linear.forward(x.data(), s.tokens, data.w.data(), y.data());
      linear.backward(data.dy.data(), s.tokens, dx.data(), dw.data());
    }
    EXPECT_EQ(linear.weight_quantizations(), 1);

    // Changing the values without telling the layer keeps the cached quantization in use.
    linear.forward(data.x.data(), s.tokens, data.w.data(), y.data());
    for (float& value : data.w)
      value *= 1.5f;
    linear.forward(data.x.data(), s.tokens, data.w.data(), y_again.data());
    EXPECT_EQ(y_again, y);
    EXPECT_EQ(linear.weight_quantizations(), 1);

    linear.invalidate_weight_cache();
    linear.forward(data.x.data(), s.tokens, data.w.data(), y_again.data());
    EXPECT_EQ(linear.weight_quantizations(), 2);
    EXPECT_NE(y_again, y);
    linear.forward(data.x.data(), s.tokens, data.w.data(), y_again.data());
    EXPECT_EQ(linear.weight_quantizations(), 2);

    linear.end_step();  // after the optimizer step
    linear.forward(data.x.data(), s.tokens, data.w.data(), y_again.data());
    EXPECT_EQ(linear.weight_quantizations(), 3);

    const std::vector<float> other_weight = data.w;  // another tensor: quantized anew
    linear.forward(data.x.data(), s.tokens, other_weight.data(), y_again.data());
    EXPECT_EQ(linear.weight_quantizations(), 4);
  }
}

TEST(Fp8Linear, DelayedScalesFollowDelayedScalingAcrossSteps) {
  test::TestRng rng;
  SCOPED_TRACE(rng.trace());
  const Shape s = shape_for(ScalingRecipe::Delayed);
  Fp8Config config = make_config(ScalingRecipe::Delayed, Fp8Mode::Hybrid);
  config.amax_history_len = 2;
  config.margin = 1.0f;
  const Fp8Family family = Fp8Family::Fnuz;
  Fp8Linear linear(config, family, s.in, s.out);
  std::vector<DelayedScaling> expected;
  for (TensorRole role : {TensorRole::Input, TensorRole::Weight, TensorRole::GradOutput}) {
    expected.emplace_back(config.amax_history_len, config.amax_compute_algo, config.margin,
                          format_max(config.format_for(role, family)), role);
  }
  const auto state = [&](TensorRole role) -> DelayedScaling& {
    return expected[static_cast<size_t>(role)];
  };

  std::vector<float> y(count(s.tokens, s.out)), dx(count(s.tokens, s.in)), dw(count(s.out, s.in));
  for (int step = 0; step < 4; ++step) {
    SCOPED_TRACE(::testing::Message() << "step " << step);
    // Each step its own magnitudes, so that the history matters.
    const std::vector<float> w = random_matrix(rng, s.out, s.in, std::ldexp(0.05, step % 3));
    for (int micro_batch = 0; micro_batch < 2; ++micro_batch) {
      const std::vector<float> x = random_matrix(rng, s.tokens, s.in, rng.uniform(0.5, 4.0));
      const std::vector<float> dy = random_matrix(rng, s.tokens, s.out, rng.uniform(0.5, 4.0));
      linear.forward(x.data(), s.tokens, w.data(), y.data());
      linear.backward(dy.data(), s.tokens, dx.data(), dw.data());
      // Casts use the current scale ...
      const float input_scale = state(TensorRole::Input).scale();
      EXPECT_EQ(linear.saved_input_t().scale_inv.at(0), 1.0f / input_scale);
      std::vector<uint8_t> codes(x.size());
      const std::vector<float> x_t = transposed(x, s.tokens, s.in);
      quantize(x_t.data(), int64_t(x_t.size()), input_scale,
               config.format_for(TensorRole::Input, family), codes.data(), nullptr);
      EXPECT_EQ(linear.saved_input_t().data, codes);
      EXPECT_EQ(linear.quantized_weight().scale_inv.at(0),
                1.0f / state(TensorRole::Weight).scale());
      EXPECT_EQ(linear.quantized_grad_output().scale_inv.at(0),
                1.0f / state(TensorRole::GradOutput).scale());
      // ... and record the amax.
      state(TensorRole::Input).record_amax(amax(x.data(), int64_t(x.size())));
      state(TensorRole::Weight).record_amax(amax(w.data(), int64_t(w.size())));
      state(TensorRole::GradOutput).record_amax(amax(dy.data(), int64_t(dy.size())));
    }
    for (TensorRole role : {TensorRole::Input, TensorRole::Weight, TensorRole::GradOutput}) {
      EXPECT_EQ(linear.delayed_scaling(role).pending_amax(), state(role).pending_amax());
    }
    linear.end_step();
    for (DelayedScaling& reference : expected)
      reference.update();
    for (TensorRole role : {TensorRole::Input, TensorRole::Weight, TensorRole::GradOutput}) {
      EXPECT_EQ(linear.delayed_scaling(role).scale(), state(role).scale());
      EXPECT_EQ(linear.delayed_scaling(role).history(), state(role).history());
      EXPECT_NE(linear.delayed_scaling(role).scale(), 1.0f);
    }
  }
  EXPECT_TRUE(linear.has_delayed_scaling());
  Fp8Linear tensorwise(make_config(ScalingRecipe::Tensorwise, Fp8Mode::Hybrid), family, s.in,
                       s.out);
  EXPECT_FALSE(tensorwise.has_delayed_scaling());
  EXPECT_THROW(tensorwise.delayed_scaling(TensorRole::Input), Error);
}

TEST(Fp8Linear, FormatsPerRole) {
  test::TestRng rng;
  SCOPED_TRACE(rng.trace());
  struct Case {
    Fp8Mode mode;
    Fp8Family family;
    Fp8Format forward, backward;
  };
  const Case cases[] = {
      {Fp8Mode::Hybrid, Fp8Family::Ocp, Fp8Format::E4M3, Fp8Format::E5M2},
      {Fp8Mode::Hybrid, Fp8Family::Fnuz, Fp8Format::E4M3FNUZ, Fp8Format::E5M2FNUZ},
      {Fp8Mode::E4M3, Fp8Family::Ocp, Fp8Format::E4M3, Fp8Format::E4M3},
      {Fp8Mode::E4M3, Fp8Family::Fnuz, Fp8Format::E4M3FNUZ, Fp8Format::E4M3FNUZ},
  };
  for (ScalingRecipe recipe : {ScalingRecipe::Tensorwise, ScalingRecipe::Mxfp8}) {
    const Shape s = shape_for(recipe);
    const LinearData data = random_data(rng, s);
    for (const Case& c : cases) {
      SCOPED_TRACE(::testing::Message() << recipe_name(recipe) << " " << mode_name(c.mode) << " "
                                        << family_name(c.family));
      Fp8Linear linear(make_config(recipe, c.mode), c.family, s.in, s.out);
      EXPECT_EQ(linear.format(TensorRole::GradOutput), c.backward);
      std::vector<float> y(count(s.tokens, s.out)), dx(count(s.tokens, s.in));
      std::vector<float> dw(count(s.out, s.in));
      linear.forward(data.x.data(), s.tokens, data.w.data(), y.data());
      linear.backward(data.dy.data(), s.tokens, dx.data(), dw.data());
      EXPECT_EQ(linear.saved_input_t().format, c.forward);
      EXPECT_EQ(linear.quantized_weight().format, c.forward);
      EXPECT_EQ(linear.quantized_weight_t().format, c.forward);
      EXPECT_EQ(linear.quantized_grad_output().format, c.backward);
      EXPECT_EQ(linear.quantized_grad_output_t().format, c.backward);
    }
  }
}

void expect_error_containing(const std::function<void()>& action, const std::string& text) {
  try {
    action();
    ADD_FAILURE() << "expected an error containing '" << text << "'";
  } catch (const Error& error) {
    EXPECT_NE(std::string(error.what()).find(text), std::string::npos) << error.what();
  }
}

TEST(Fp8Linear, RejectsShapesTheRecipeCannotBlock) {
  const Fp8Config blockwise = make_config(ScalingRecipe::Blockwise, Fp8Mode::Hybrid);
  expect_error_containing([&] { Fp8Linear(blockwise, Fp8Family::Ocp, 100, 256); },
                          "divisible by 128");
  expect_error_containing([&] { Fp8Linear(blockwise, Fp8Family::Ocp, 256, 192); },
                          "found in=256 out=192");
  EXPECT_NO_THROW(Fp8Linear(blockwise, Fp8Family::Ocp, 256, 384));
  const Fp8Config mxfp8 = make_config(ScalingRecipe::Mxfp8, Fp8Mode::E4M3);
  expect_error_containing([&] { Fp8Linear(mxfp8, Fp8Family::Ocp, 48, 64); }, "divisible by 32");
  EXPECT_NO_THROW(Fp8Linear(mxfp8, Fp8Family::Ocp, 64, 96));
  EXPECT_NO_THROW(
      Fp8Linear(make_config(ScalingRecipe::Tensorwise, Fp8Mode::E4M3), Fp8Family::Ocp, 12, 24));
  expect_error_containing(
      [&] {
        Fp8Linear(make_config(ScalingRecipe::Tensorwise, Fp8Mode::None), Fp8Family::Ocp, 64, 64);
      },
      "fp8: none");
}

TEST(Fp8Linear, BackwardNeedsTheMatchingForward) {
  const Fp8Config config = make_config(ScalingRecipe::Tensorwise, Fp8Mode::Hybrid);
  Fp8Linear linear(config, Fp8Family::Ocp, 16, 8);
  std::vector<float> x(4 * 16, 1.0f), w(8 * 16, 0.5f), y(4 * 8), dy(4 * 8, 1.0f), dx(4 * 16);
  expect_error_containing([&] { linear.backward(dy.data(), 4, dx.data(), nullptr); },
                          "forward before backward");
  linear.forward(x.data(), 4, w.data(), y.data());
  expect_error_containing([&] { linear.backward(dy.data(), 3, dx.data(), nullptr); },
                          "expected grad_output for the 4 tokens");
  linear.backward(dy.data(), 4, dx.data(), nullptr);
  EXPECT_NEAR(dx[0], 4.0f, 1e-5f);  // 8 outputs · 1 · 0.5
}

}  // namespace
}  // namespace fp8t
