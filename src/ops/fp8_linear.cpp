#include "ops/fp8_linear.h"

#include <algorithm>
#include <cmath>
#include <utility>

#include "core/error.h"
#include "gemm/cpu_gemm.h"
#include "ops/linear.h"

namespace fp8t::ops {

namespace {

constexpr TensorRole kRoles[] = {TensorRole::Input, TensorRole::Weight, TensorRole::GradOutput};

// The block layout of a role under a recipe; none for the per-tensor recipes.
std::optional<BlockScaling> block_scaling_for(ScalingRecipe recipe, TensorRole role) {
  if (recipe == ScalingRecipe::Blockwise) {
    return role == TensorRole::Weight ? BlockScaling::Tile128x128 : BlockScaling::Rows1x128;
  }
  if (recipe == ScalingRecipe::Mxfp8) return BlockScaling::Mx1x32;
  return std::nullopt;
}

size_t to_size(int64_t count) {
  return static_cast<size_t>(count);
}

// Sizes the storage of `tensor` for [rows, cols] under the given scaling.
void prepare(Fp8Tensor& tensor, Fp8Format format, std::optional<BlockScaling> blocks, int64_t rows,
             int64_t cols) {
  tensor.format = format;
  tensor.blocks = blocks;
  tensor.rows = rows;
  tensor.cols = cols;
  tensor.data.resize(to_size(rows * cols));
  tensor.scale_inv.clear();
  tensor.e8m0_scales.clear();
  if (!blocks) {
    tensor.scale_inv.assign(1, 1.0f);
    return;
  }
  const BlockShape grid = scale_grid(*blocks, rows, cols);
  const size_t scale_count = to_size(int64_t{grid.rows} * grid.cols);
  if (*blocks == BlockScaling::Mx1x32) {
    tensor.e8m0_scales.resize(scale_count);
  } else {
    tensor.scale_inv.resize(scale_count);
  }
}

void* scale_storage(Fp8Tensor& tensor) {
  if (tensor.blocks == BlockScaling::Mx1x32) return tensor.e8m0_scales.data();
  return tensor.scale_inv.data();
}

void round_to_bf16(float* values, int64_t count) {
  for (int64_t i = 0; i < count; ++i)
    values[i] = fp8t::round_to_bf16(values[i]);
}

}  // namespace

void Fp8Tensor::dequantize(float* out) const {
  if (data.empty()) return;
  if (!blocks) {
    fp8t::dequantize(data.data(), rows * cols, scale_inv.at(0), format, out);
    return;
  }
  BlockQuantization spec;
  spec.scaling = *blocks;
  spec.format = format;
  const void* scales = *blocks == BlockScaling::Mx1x32
                           ? static_cast<const void*>(e8m0_scales.data())
                           : static_cast<const void*>(scale_inv.data());
  dequantize_blocks(data.data(), rows, cols, spec, scales, out);
}

Fp8Linear::Fp8Linear(const Fp8Config& config, Fp8Family family, int64_t in_features,
                     int64_t out_features, bool fp8_wgrad)
    : config_(config),
      family_(family),
      in_features_(in_features),
      out_features_(out_features),
      fp8_wgrad_(fp8_wgrad) {
  validate(config, "Fp8Linear");
  FP8T_CHECK(config.mode != Fp8Mode::None,
             "expected fp8: e4m3 or hybrid for an FP8 linear layer, found fp8: none");
  FP8T_CHECK(in_features > 0 && out_features > 0,
             "expected positive in and out features, found in={} out={}", in_features,
             out_features);
  // The block GEMMs need whole blocks along every reduced dimension; the precision policy keeps
  // other layers in BF16.
  if (config.recipe == ScalingRecipe::Blockwise) {
    FP8T_CHECK(in_features % 128 == 0 && out_features % 128 == 0,
               "blockwise FP8 needs in_features and out_features divisible by 128 (128x128 weight "
               "tiles), found in={} out={}; keep this layer in BF16",
               in_features, out_features);
  }
  if (config.recipe == ScalingRecipe::Mxfp8) {
    FP8T_CHECK(in_features % 32 == 0 && out_features % 32 == 0,
               "mxfp8 needs in_features and out_features divisible by 32 (1x32 blocks), found "
               "in={} out={}; keep this layer in BF16",
               in_features, out_features);
  }
  if (config.recipe == ScalingRecipe::Delayed) {
    for (TensorRole role : kRoles) {  // in TensorRole order, so a role indexes delayed_
      delayed_.emplace_back(config.amax_history_len, config.amax_compute_algo, config.margin,
                            format_max(format(role)), role);
    }
  }
}

void Fp8Linear::quantize_operand(const float* src, int64_t rows, int64_t cols, TensorRole role,
                                 Fp8Tensor& rowwise, Fp8Tensor* transposed) {
  const Fp8Format data_format = format(role);
  const std::optional<BlockScaling> blocks = block_scaling_for(config_.recipe, role);
  prepare(rowwise, data_format, blocks, rows, cols);
  if (transposed != nullptr) prepare(*transposed, data_format, blocks, cols, rows);
  uint8_t* out_t = transposed != nullptr ? transposed->data.data() : nullptr;

  Fp8OperandHealth* health = record_health_ ? &health_[static_cast<size_t>(role)] : nullptr;
  CastHealth* counts = health != nullptr ? &health->counts : nullptr;
  if (health != nullptr) health->elements += static_cast<uint64_t>(rows * cols);
  if (blocks) {
    const BlockQuantization spec{*blocks, data_format, config_.use_power_of_2_scales(),
                                 config_.amax_epsilon};
    if (transposed != nullptr) {
      quantize_transpose_blocks(src, rows, cols, spec, rowwise.data.data(), scale_storage(rowwise),
                                out_t, scale_storage(*transposed), counts);
    } else {
      quantize_blocks(src, rows, cols, spec, rowwise.data.data(), scale_storage(rowwise), counts);
    }
    return;
  }

  // Per-tensor scale: delayed takes the current scale and records this tensor's amax for the
  // update at the end of the step; tensorwise derives it from this very tensor.
  const bool delayed = config_.recipe == ScalingRecipe::Delayed;
  float tensor_amax = 0.0f;
  float* amax_out = delayed ? &tensor_amax : nullptr;
  float scale;
  if (delayed) {
    scale = delayed_scaling(role).scale();
  } else {
    tensor_amax = amax(src, rows * cols);
    if (split_[static_cast<size_t>(role)]) tensor_amax = group_max_(tensor_amax);
    scale = scale_from_amax(tensor_amax, format_max(data_format), config_.use_power_of_2_scales(),
                            config_.amax_epsilon);
  }
  if (transposed != nullptr) {
    quantize_transpose(src, rows, cols, scale, data_format, rowwise.data.data(), out_t, amax_out,
                       counts);
  } else {
    fp8t::quantize(src, rows * cols, scale, data_format, rowwise.data.data(), amax_out, counts);
  }
  const float scale_inv = 1.0f / scale;
  rowwise.scale_inv[0] = scale_inv;
  if (transposed != nullptr) transposed->scale_inv[0] = scale_inv;
  // A weight's cast serves every forward until the weights change, the next training one
  // included, whichever pass made it: its amax is recorded even in an evaluation pass.
  if (delayed && (record_amax_ || role == TensorRole::Weight))
    delayed_scaling(role).record_amax(tensor_amax);
  if (health != nullptr) {
    // The step's first cast of this tensor starts the amax; after it a NaN sticks, as in the
    // scaling state.
    const bool first = health->elements == static_cast<uint64_t>(rows * cols);
    if (first || std::isnan(tensor_amax)) {
      health->amax = tensor_amax;
    } else if (!std::isnan(health->amax)) {
      health->amax = std::max(health->amax, tensor_amax);
    }
    health->scale = scale;
  }
}

void Fp8Linear::ensure_weight(const float* weight) {
  if (weight_valid_ && weight == cached_weight_) return;
  quantize_operand(weight, out_features_, in_features_, TensorRole::Weight, weight_, &weight_t_);
  weight_values_.resize(to_size(out_features_ * in_features_));
  weight_.dequantize(weight_values_.data());
  weight_t_values_.resize(to_size(in_features_ * out_features_));
  weight_t_.dequantize(weight_t_values_.data());
  cached_weight_ = weight;
  weight_valid_ = true;
  ++weight_quantizations_;
}

void Fp8Linear::forward(const float* x, int64_t tokens, const float* weight, float* y) {
  FP8T_CHECK(tokens >= 0, "expected a non-negative token count, found {}", tokens);
  FP8T_CHECK(weight != nullptr, "expected the weight [{}, {}], found null", out_features_,
             in_features_);
  FP8T_CHECK(tokens == 0 || (x != nullptr && y != nullptr),
             "expected x [{}, {}] and y [{}, {}], found a null pointer", tokens, in_features_,
             tokens, out_features_);
  ensure_weight(weight);

  // With an FP8 wgrad the transposed quantization is made now, while x is at hand, and kept
  // instead of x; otherwise the BF16 wgrad needs bf16(x).
  quantize_operand(x, tokens, in_features_, TensorRole::Input, input_,
                   fp8_wgrad_ ? &saved_input_t_ : nullptr);
  if (fp8_wgrad_) {
    saved_input_bf16_.clear();
  } else {
    saved_input_t_ = Fp8Tensor{};
    saved_input_bf16_.resize(to_size(tokens * in_features_));
    for (size_t i = 0; i < saved_input_bf16_.size(); ++i)
      saved_input_bf16_[i] = float_to_bf16(x[i]);
  }
  saved_tokens_ = tokens;

  lhs_values_.resize(to_size(tokens * in_features_));
  input_.dequantize(lhs_values_.data());
  gemm::forward_xwt(tokens, out_features_, in_features_, lhs_values_.data(), in_features_,
                    weight_values_.data(), in_features_, y, out_features_, /*accumulate=*/false);
  round_to_bf16(y, tokens * out_features_);
}

void Fp8Linear::backward(const float* grad_output, int64_t tokens, float* grad_input,
                         float* grad_weight) {
  FP8T_CHECK(saved_tokens_ >= 0, "expected a forward before backward, found none");
  FP8T_CHECK(tokens == saved_tokens_,
             "expected grad_output for the {} tokens of the last forward, found {}", saved_tokens_,
             tokens);
  FP8T_CHECK(tokens == 0 || grad_output != nullptr, "expected grad_output [{}, {}], found null",
             tokens, out_features_);
  const bool fp8_wgrad_now = grad_weight != nullptr && fp8_wgrad_;
  if (grad_input != nullptr || fp8_wgrad_now) {
    quantize_operand(grad_output, tokens, out_features_, TensorRole::GradOutput, grad_output_,
                     fp8_wgrad_now ? &grad_output_t_ : nullptr);
  }

  if (grad_input != nullptr) {  // dx[tokens, in] += dŷ[tokens, out] · (Ŵᵗ[in, out])ᵀ
    lhs_values_.resize(to_size(tokens * out_features_));
    grad_output_.dequantize(lhs_values_.data());
    gemm::forward_xwt(tokens, in_features_, out_features_, lhs_values_.data(), out_features_,
                      weight_t_values_.data(), out_features_, grad_input, in_features_,
                      /*accumulate=*/true);
  }
  if (grad_weight == nullptr) return;
  if (fp8_wgrad_) {  // dW[out, in] += dŷᵗ[out, tokens] · (x̂ᵗ[in, tokens])ᵀ
    lhs_values_.resize(to_size(out_features_ * tokens));
    grad_output_t_.dequantize(lhs_values_.data());
    rhs_values_.resize(to_size(in_features_ * tokens));
    saved_input_t_.dequantize(rhs_values_.data());
    gemm::forward_xwt(out_features_, in_features_, tokens, lhs_values_.data(), tokens,
                      rhs_values_.data(), tokens, grad_weight, in_features_, /*accumulate=*/true);
  } else {  // the BF16 GEMM of ops::linear, on bf16(dy) and the saved bf16(x)
    rhs_values_.resize(saved_input_bf16_.size());
    for (size_t i = 0; i < rhs_values_.size(); ++i)
      rhs_values_[i] = bf16_to_float(saved_input_bf16_[i]);
    linear_backward(grad_output, rhs_values_.data(), nullptr, nullptr, grad_weight,
                    {tokens, in_features_, out_features_}, LinearOperands::Bf16);
  }
}

void Fp8Linear::set_split_operands(std::function<float(float)> group_max,
                                   std::array<bool, 3> split) {
  const bool any_split = split[0] || split[1] || split[2];
  FP8T_CHECK(group_max || !any_split,
             "expected a group amax reduction for split operands, found none");
  group_max_ = std::move(group_max);
  split_ = split;
}

void Fp8Linear::end_step() {
  for (DelayedScaling& state : delayed_)
    state.update();
  // The optimizer has changed the weight, and under delayed scaling its scale changed too.
  invalidate_weight_cache();
}

void Fp8Linear::invalidate_weight_cache() {
  weight_valid_ = false;
}

DelayedScaling& Fp8Linear::delayed_scaling(TensorRole role) {
  FP8T_CHECK(has_delayed_scaling(),
             "expected fp8_recipe: delayed for delayed-scaling state, found {}",
             recipe_name(config_.recipe));
  return delayed_[static_cast<size_t>(role)];
}

const DelayedScaling& Fp8Linear::delayed_scaling(TensorRole role) const {
  FP8T_CHECK(has_delayed_scaling(),
             "expected fp8_recipe: delayed for delayed-scaling state, found {}",
             recipe_name(config_.recipe));
  return delayed_[static_cast<size_t>(role)];
}

}  // namespace fp8t::ops
