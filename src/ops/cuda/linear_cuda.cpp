#if FP8TRAIN_WITH_CUDA

#include "ops/cuda/linear_cuda.h"

#include <algorithm>
#include <utility>
#include <vector>

#include "core/cuda_check.h"
#include "core/error.h"
#include "core/phase_timer.h"
#include "numerics/quantize_cuda.h"
#include "ops/cuda/ops_cuda.h"

namespace fp8t::ops::cuda {

namespace {

// cuBLASLt's FP8 GEMMs want every reduced dimension and every FP8 row a multiple of 16.
constexpr int64_t kFp8Multiple = 16;
static_assert(kFusedCastBlock == kScaleBlock, "the norms' fused block casts are blockwise's");

}  // namespace

Fp8Scratch take_fp8_scratch(DeviceArena& arena, ScalingRecipe recipe, int64_t max_tokens,
                            int64_t max_in, int64_t max_out, int64_t backward_width,
                            const WeightTScratch& weight_t) {
  const auto count = [](int64_t a, int64_t b) { return static_cast<size_t>(a * b); };
  Fp8Scratch scratch;
  scratch.input = arena.take<uint8_t>(count(max_tokens, max_in));
  scratch.input_elements = max_tokens * max_in;
  scratch.backward_elements = fp8_backward_elements(max_tokens, max_in, max_out, backward_width);
  const auto backward_count = static_cast<size_t>(scratch.backward_elements);
  scratch.input_t = arena.take<uint8_t>(backward_count);
  scratch.input_t_holder = std::make_shared<InputTHolder>();
  scratch.grad_output = arena.take<uint8_t>(backward_count);
  scratch.grad_output_t = arena.take<uint8_t>(backward_count);
  scratch.weight_t_room = weight_t;
  if (weight_t.bytes > 0)
    scratch.weight_t = arena.take<uint8_t>(static_cast<size_t>(weight_t.bytes));
  if (weight_t.scale_floats > 0)
    scratch.weight_t_scales = arena.take<float>(static_cast<size_t>(weight_t.scale_floats));
  if (recipe != ScalingRecipe::Blockwise && recipe != ScalingRecipe::Mxfp8) return scratch;
  const int64_t max_features = std::max(max_in, max_out);
  scratch.scale_floats = fp8_scale_scratch_floats(max_tokens, max_in, max_out);
  const auto floats = static_cast<size_t>(scratch.scale_floats);
  for (float** buffer : {&scratch.input_scales, &scratch.input_t_scales,
                         &scratch.grad_output_scales, &scratch.grad_output_t_scales}) {
    *buffer = arena.take<float>(floats);
  }
  if (recipe == ScalingRecipe::Mxfp8) {  // the emulated GEMMs' bf16 operands
    scratch.dequantized_lhs = arena.take<bf16>(count(max_tokens, max_features));
    scratch.dequantized_rhs = arena.take<bf16>(count(max_tokens, max_in));
  }
  return scratch;
}

bool holds_wgrad_group(const Fp8Scratch& scratch, int64_t max_tokens, int64_t in_features,
                       int64_t rows) {
  return scratch.backward_elements >= max_tokens * std::max(in_features, rows) &&
         scratch.scale_floats >= row_block_floats(rows, max_tokens);
}

CudaLinear::CudaLinear(const LinearSetup& setup, gemm::CublasLtGemm& gemm,
                       const Fp8Scratch& scratch)
    : setup_(setup), gemm_(gemm), scratch_(scratch) {
  const int64_t in = setup.in_features, out = setup.out_features;
  FP8T_CHECK(in > 0 && out > 0 && setup.max_tokens > 0,
             "expected a linear [{} -> {}] over at least one token, found {} tokens", in, out,
             setup.max_tokens);
  const auto weight_count = static_cast<size_t>(in * out);
  const bool split_operands = std::any_of(setup.split_roles.begin(), setup.split_roles.end(),
                                          [](bool split) { return split; });
  FP8T_CHECK(setup.group_max || !split_operands,
             "a linear with split operands needs its group's amax reduction");
  if (setup.bias) bias_bf16_ = std::make_unique<DeviceBuffer<bf16>>(static_cast<size_t>(out));
  const bool relu2_casts = setup.input_relu2 || setup.output_relu2;
  FP8T_CHECK(!relu2_casts ||
                 (setup.fp8 && setup.fp8_config.recipe != ScalingRecipe::Mxfp8 && setup.fp8_wgrad),
             "a linear casts through relu² itself only in FP8 with a per-tensor or blockwise "
             "recipe and an FP8 weight gradient");
  if (!setup.fp8) {
    weight_bf16_ = std::make_unique<DeviceBuffer<bf16>>(weight_count);
    return;
  }
  const ScalingRecipe recipe = setup.fp8_config.recipe;
  static_cast<void>(recipe);  // every recipe runs: mxfp8 emulated
  FP8T_CHECK(setup.family == Fp8Family::Ocp,
             "cuBLASLt's FP8 GEMMs take the OCP formats (e4m3, e5m2), not fnuz");
  FP8T_CHECK(
      in % kFp8Multiple == 0 && out % kFp8Multiple == 0 && setup.max_tokens % kFp8Multiple == 0,
      "an FP8 linear on the GPU needs features and tokens that are multiples of {}, found "
      "[{} -> {}] over {} tokens",
      kFp8Multiple, in, out, setup.max_tokens);
  FP8T_CHECK(setup.scaling != nullptr && reinterpret_cast<uintptr_t>(setup.scaling) % 16 == 0,
             "an FP8 linear needs its scaling floats, 16-byte aligned");
  FP8T_CHECK(scratch.input != nullptr && scratch.input_t != nullptr &&
                 scratch.grad_output != nullptr && scratch.grad_output_t != nullptr &&
                 scratch.input_t_holder != nullptr,
             "an FP8 linear needs the quantization scratch");
  if (setup.input_from != nullptr) {
    const LinearSetup& owner = setup.input_from->setup_;
    FP8T_CHECK(owner.fp8 && owner.in_features == in && owner.max_tokens == setup.max_tokens &&
                   owner.fp8_wgrad == setup.fp8_wgrad && owner.input_from == nullptr,
               "a linear can share the input quantization only of an FP8 linear of the same input "
               "that quantizes it itself");
  }
  FP8T_CHECK(weight_t_kept() || !mx(),
             "an FP8 linear transposes its weight in backward only under a per-tensor or "
             "blockwise recipe");
  FP8T_CHECK(weight_t_kept() ||
                 (scratch.weight_t_room.bytes >= in * out &&
                  (!blockwise() || scratch.weight_t_room.scale_floats >= tile_floats(in, out))),
             "the FP8 scratch holds a Ŵᵗ of {} bytes ({} scale floats), less than a [{} -> {}] "
             "linear's",
             scratch.weight_t_room.bytes, scratch.weight_t_room.scale_floats, in, out);
  FP8T_CHECK(!mx() || (in % kMxScaleBlock == 0 && out % kMxScaleBlock == 0),
             "an MXFP8 linear needs features that are multiples of {}, found [{} -> {}]",
             kMxScaleBlock, in, out);
  FP8T_CHECK(
      scratch.backward_elements / std::max(in, out) >= std::min(setup.max_tokens, kScaleBlock),
      "the FP8 backward scratch holds {} elements, less than a block of {} rows of a "
      "[{} -> {}] linear",
      scratch.backward_elements, kScaleBlock, in, out);
  FP8T_CHECK(!setup.input_relu2 || setup.input_from == nullptr,
             "a linear casts relu² of its input itself only from its own input");
  if (const LinearSetup::WgradGroup group = setup.wgrad_group; group.rows != 0) {
    FP8T_CHECK(setup.fp8_config.recipe == ScalingRecipe::Blockwise && setup.fp8_wgrad,
               "a joint weight gradient is for blockwise linears with an FP8 weight gradient");
    FP8T_CHECK(group.first_row >= 0 && group.first_row + out <= group.rows &&
                   (group.first_row == 0) == (setup.input_from == nullptr),
               "a [{} -> {}] linear cannot take rows {} to {} of a joint weight gradient of {} "
               "rows (the input's owner takes the first)",
               in, out, group.first_row, group.first_row + out, group.rows);
    FP8T_CHECK(holds_wgrad_group(scratch, setup.max_tokens, in, group.rows),
               "a joint weight gradient of {} rows over {} tokens needs more backward scratch "
               "than {} elements",
               group.rows, setup.max_tokens, scratch.backward_elements);
  }
  weight_fp8_ = std::make_unique<DeviceBuffer<uint8_t>>(weight_count);
  if (weight_t_kept()) weight_fp8_t_ = std::make_unique<DeviceBuffer<uint8_t>>(weight_count);
  if (mx()) {
    FP8T_CHECK(scratch.input_scales != nullptr && scratch.input_t_scales != nullptr &&
                   scratch.grad_output_scales != nullptr &&
                   scratch.grad_output_t_scales != nullptr && scratch.dequantized_lhs != nullptr &&
                   scratch.dequantized_rhs != nullptr,
               "an MXFP8 linear needs the block-scale and dequantization scratch");
    const auto floats = [](int64_t count) { return static_cast<size_t>(count); };
    weight_bf16_ = std::make_unique<DeviceBuffer<bf16>>(weight_count);
    weight_t_bf16_ = std::make_unique<DeviceBuffer<bf16>>(weight_count);
    weight_scales_ = std::make_unique<DeviceBuffer<float>>(floats(mx_scale_floats(out, in)));
    weight_t_scales_ = std::make_unique<DeviceBuffer<float>>(floats(mx_scale_floats(in, out)));
  }
  if (blockwise()) {
    FP8T_CHECK(scratch.input_scales != nullptr && scratch.input_t_scales != nullptr &&
                   scratch.grad_output_scales != nullptr && scratch.grad_output_t_scales != nullptr,
               "a blockwise linear needs the block-scale scratch");
    // Zeros in the pads of the GEMMs' layout, which the casts leave as they are.
    const auto zeros = [](int64_t count) { return std::vector<float>(size_t(count), 0.0f); };
    weight_scales_ = std::make_unique<DeviceBuffer<float>>(zeros(tile_floats(out, in)));
    if (weight_t_kept())
      weight_t_scales_ = std::make_unique<DeviceBuffer<float>>(zeros(tile_floats(in, out)));
  }
}

size_t CudaLinear::device_bytes() const {
  size_t bytes = 0;
  for (const auto* buffer : {&weight_bf16_, &weight_t_bf16_, &bias_bf16_}) {
    if (*buffer) bytes += (*buffer)->bytes();
  }
  for (const auto* buffer : {&weight_fp8_, &weight_fp8_t_}) {
    if (*buffer) bytes += (*buffer)->bytes();
  }
  for (const auto* buffer : {&weight_scales_, &weight_t_scales_}) {
    if (*buffer) bytes += (*buffer)->bytes();
  }
  return bytes;
}

template <typename T>
void CudaLinear::quantize(const T* x, int64_t rows, int64_t cols, TensorRole role, uint8_t* out,
                          uint8_t* out_t, ScaleSource source, bool record_amax, cudaStream_t stream,
                          float* scales, float* scales_t, const bf16* y, bool first_cast,
                          int64_t scale_lines_t, const fp8t::cuda::ActivationTCast& activation_t) {
  const PhaseScope timed(StepPhase::Quantization, stream);
  FP8T_CHECK(activation_t.out_t == nullptr || (blockwise() && role == TensorRole::GradOutput),
             "relu²'s transposed copy comes with a blockwise cast of its gradient");
  const Fp8Config& config = setup_.fp8_config;
  const Fp8Format format = config.format_for(role, setup_.family);
  CastHealth* health = nullptr;
  if (record_health_ && first_cast) {
    health = setup_.health + static_cast<int>(role);
    health_elements_[static_cast<size_t>(role)] += static_cast<uint64_t>(rows * cols);
  }
  if (mx()) {  // E8M0 bytes straight into the scale buffers: only the dequantization reads them
    const BlockQuantization spec{BlockScaling::Mx1x32, format};
    fp8t::cuda::quantize_blocks(x, rows, cols, spec, out, out != nullptr ? scales : nullptr, out_t,
                                out_t != nullptr ? scales_t : nullptr, stream, health);
    return;
  }
  if (blockwise()) {
    const bool tiles = role == TensorRole::Weight;
    const BlockQuantization spec = block_spec(role);
    if (!tiles) {  // 1x128 scales go straight into the GEMMs' layout
      const fp8t::cuda::CastInput input = cast_input(role);
      fp8t::cuda::quantize_blocks(x, rows, cols, spec, out, out != nullptr ? scales : nullptr,
                                  out_t, out_t != nullptr ? scales_t : nullptr, stream, health,
                                  fp8t::cuda::BlockScaleOrder::BlockMajor, input,
                                  input == fp8t::cuda::CastInput::Relu2Gradient ? y : nullptr,
                                  scale_lines_t, activation_t);
      return;
    }
    // 128x128 grids [ceil(rows / 128), ceil(cols / 128)] and the transposed tiles', straight in
    // the GEMMs' padded layout (the buffers' pads zeroed once).
    fp8t::cuda::quantize_blocks(x, rows, cols, spec, out, scales, out_t,
                                out_t != nullptr ? scales_t : nullptr, stream, health,
                                fp8t::cuda::BlockScaleOrder::PaddedLineMajor);
    return;
  }
  const fp8t::cuda::CastInput input = cast_input(role);
  const bf16* relu2_input = input == fp8t::cuda::CastInput::Relu2Gradient ? y : nullptr;
  float* scale = slot(role, kScaleSlot);
  float* recorded = nullptr;
  if (tensorwise()) {
    if (source != ScaleSource::Reuse)
      tensorwise_scale(x, rows * cols, role, source == ScaleSource::Measured, stream, y);
  } else if (record_amax && source == ScaleSource::Measure) {
    // Delayed: the history's scale; this amax feeds the next update.
    recorded = slot(role, kAmaxSlot);
  }
  if (out_t != nullptr) {
    fp8t::cuda::quantize_transpose(x, rows, cols, scale, format, out, out_t, recorded, stream,
                                   input, relu2_input, health);
  } else {
    fp8t::cuda::quantize(x, rows * cols, scale, format, out, recorded, stream, input, relu2_input,
                         health);
  }
}

template <typename T>
void CudaLinear::tensorwise_scale(const T* x, int64_t count, TensorRole role, bool amax_measured,
                                  cudaStream_t stream, const bf16* y) {
  const Fp8Config& config = setup_.fp8_config;
  float* amax = slot(role, kAmaxSlot);
  if (!amax_measured) {
    zeroed_amax(role, stream);
    const fp8t::cuda::CastInput input = cast_input(role);
    fp8t::cuda::amax(x, count, amax, stream, input,
                     input == fp8t::cuda::CastInput::Relu2Gradient ? y : nullptr);
  }
  if (setup_.split_roles[static_cast<size_t>(role)]) setup_.group_max(amax, stream);
  fp8t::cuda::scale_from_amax(amax, format_max(config.format_for(role, setup_.family)),
                              config.use_power_of_2_scales(), config.amax_epsilon,
                              slot(role, kScaleSlot), slot(role, kScaleInvSlot), stream);
}

FusedCast CudaLinear::fused_input_cast(bool record_amax, cudaStream_t stream) {
  FusedCast cast;
  if (!setup_.fp8 || mx() || setup_.input_from != nullptr || setup_.input_relu2 || record_health_ ||
      (blockwise() && setup_.in_features % kScaleBlock != 0)) {
    return cast;
  }
  const Fp8Config& config = setup_.fp8_config;
  cast.format = config.format_for(TensorRole::Input, setup_.family);
  if (blockwise()) {
    cast.out = scratch_.input;
    cast.block_scales = scratch_.input_scales;
    cast.power_of_2_scales = config.use_power_of_2_scales();
    cast.amax_epsilon = config.amax_epsilon;
    input_cast_ = InputCast::CastDone;
  } else if (tensorwise()) {
    cast.amax = fused_input_amax(stream);
  } else {
    cast.scale = slot(TensorRole::Input, kScaleSlot);
    cast.out = scratch_.input;
    cast.amax = record_amax ? slot(TensorRole::Input, kAmaxSlot) : nullptr;
    input_cast_ = InputCast::CastDone;
  }
  return cast;
}

std::optional<fp8t::cuda::BlockCastOutput> CudaLinear::fused_grad_output_cast(int64_t tokens) {
  if (!setup_.fp8 || !blockwise() || !setup_.fp8_wgrad || setup_.output_relu2 || record_health_ ||
      setup_.out_features % kScaleBlock != 0 || tokens <= 0 || tokens > setup_.max_tokens ||
      backward_chunk(tokens) != tokens) {
    return std::nullopt;
  }
  fp8t::cuda::BlockCastOutput cast;
  cast.spec = block_spec(TensorRole::GradOutput);
  cast.out = scratch_.grad_output;
  cast.scales = scratch_.grad_output_scales;
  const TransposedTarget dy_t = grad_output_t_target(tokens);  // where backward_rows' cast puts it
  cast.out_t = dy_t.codes;
  cast.scales_t = dy_t.scales;
  cast.scale_lines_t = dy_t.scale_lines;
  grad_output_cast_rows_ = tokens;
  return cast;
}

CudaLinear::TransposedTarget CudaLinear::grad_output_t_target(int64_t rows) const {
  const LinearSetup::WgradGroup group = setup_.wgrad_group;
  return {.codes = scratch_.grad_output_t + group.first_row * rows,
          .scales = scratch_.grad_output_t_scales + group.first_row,
          .scale_lines = group.rows};
}

float* CudaLinear::fused_input_amax(cudaStream_t stream) {
  if (!setup_.fp8 || !tensorwise() || setup_.input_from != nullptr ||
      cast_input(TensorRole::Input) != fp8t::cuda::CastInput::Value) {
    return nullptr;
  }
  input_cast_ = InputCast::AmaxDone;
  return zeroed_amax(TensorRole::Input, stream);
}

float* CudaLinear::fused_grad_output_amax(cudaStream_t stream) {
  if (!setup_.fp8 || !tensorwise() ||
      cast_input(TensorRole::GradOutput) != fp8t::cuda::CastInput::Value) {
    return nullptr;
  }
  grad_output_amax_done_ = true;
  return zeroed_amax(TensorRole::GradOutput, stream);
}

float* CudaLinear::zeroed_amax(TensorRole role, cudaStream_t stream) {
  float* amax = slot(role, kAmaxSlot);
  FP8T_CUDA_CHECK(cudaMemsetAsync(amax, 0, sizeof(float), stream));
  return amax;
}

void CudaLinear::cast_input_t(const bf16* x, int64_t first_row, int64_t rows, cudaStream_t stream) {
  InputTHolder& holder = *scratch_.input_t_holder;
  if (setup_.input_from != nullptr) {
    FP8T_CHECK(
        holder.layer == setup_.input_from && holder.first_row == first_row && holder.rows == rows,
        "the backward of a linear sharing its input's cast must directly follow the "
        "backward of the linear that casts it, over the same rows");
    return;
  }
  FP8T_CHECK(x != nullptr, "an FP8 weight gradient needs the forward's input");
  // x̂ᵗ alone: the weight gradient reads nothing else.
  quantize(x, rows, setup_.in_features, TensorRole::Input, nullptr, scratch_.input_t,
           ScaleSource::Reuse, /*record_amax=*/false, stream, scratch_.input_scales,
           scratch_.input_t_scales, nullptr, /*first_cast=*/false);
  holder = {this, first_row, rows};
}

gemm::Fp8Operand CudaLinear::operand(const uint8_t* data, int64_t ld, TensorRole role,
                                     const float* scales) const {
  gemm::Fp8Operand result;
  result.data = data;
  result.ld = ld;
  result.format = setup_.fp8_config.format_for(role, setup_.family);
  if (blockwise()) {
    result.scale_mode =
        role == TensorRole::Weight ? gemm::ScaleMode::Block128x128 : gemm::ScaleMode::Block1x128;
    result.scale_inv = scales;
  } else {
    result.scale_mode = gemm::ScaleMode::Tensor;
    result.scale_inv = slot(role, kScaleInvSlot);
  }
  return result;
}

void CudaLinear::dequantize_mx(const uint8_t* data, const float* scales, int64_t rows, int64_t cols,
                               TensorRole role, bf16* out, cudaStream_t stream) const {
  const PhaseScope timed(StepPhase::Quantization, stream);
  const BlockQuantization spec{BlockScaling::Mx1x32,
                               setup_.fp8_config.format_for(role, setup_.family)};
  fp8t::cuda::dequantize_blocks(data, rows, cols, spec, scales, out, stream);
}

float* CudaLinear::weight_amax_slot() const {
  if (!setup_.fp8 || !tensorwise()) {
    return nullptr;
  }
  return slot(TensorRole::Weight, kAmaxSlot);
}

void CudaLinear::prepare_weight(const float* weight, bool record_amax, cudaStream_t stream,
                                const float* bias, bool amax_measured) {
  FP8T_CHECK(!amax_measured || weight_amax_slot() != nullptr,
             "a measured weight amax is only for tensorwise FP8 layers reading whole weights");
  const int64_t in = setup_.in_features, out = setup_.out_features;
  prepare_bias(bias, stream);
  if (!setup_.fp8) {
    const PhaseScope timed(StepPhase::Quantization, stream);
    cast_to_bf16(weight_bf16_->get(), weight, in * out, stream);
    return;
  }
  quantize(weight, out, in, TensorRole::Weight, weight_fp8_->get(),
           weight_fp8_t_ ? weight_fp8_t_->get() : nullptr,
           amax_measured ? ScaleSource::Measured : ScaleSource::Measure, record_amax, stream,
           weight_scales_ ? weight_scales_->get() : nullptr,
           weight_t_scales_ ? weight_t_scales_->get() : nullptr);
  if (mx()) {
    dequantize_mx(weight_fp8_->get(), weight_scales_->get(), out, in, TensorRole::Weight,
                  weight_bf16_->get(), stream);
    dequantize_mx(weight_fp8_t_->get(), weight_t_scales_->get(), in, out, TensorRole::Weight,
                  weight_t_bf16_->get(), stream);
  }
}

void CudaLinear::prepare_weights(const std::vector<WeightToPrepare>& weights, cudaStream_t stream) {
  std::vector<std::pair<BlockQuantization, std::vector<fp8t::cuda::TileCastJob>>> groups;
  for (const WeightToPrepare& each : weights) {
    const std::optional<fp8t::cuda::TileCastJob> job = each.layer->weight_cast_job(each.weight);
    if (!job) {
      each.layer->prepare_weight(each.weight, true, stream, each.bias, each.amax_measured);
      continue;
    }
    each.layer->prepare_bias(each.bias, stream);
    const BlockQuantization spec = each.layer->block_spec(TensorRole::Weight);
    auto group = std::find_if(groups.begin(), groups.end(), [&](const auto& candidate) {
      const BlockQuantization& other = candidate.first;
      return other.format == spec.format && other.power_of_2_scales == spec.power_of_2_scales &&
             other.amax_epsilon == spec.amax_epsilon;
    });
    if (group == groups.end()) group = groups.insert(groups.end(), {spec, {}});
    group->second.push_back(*job);
  }
  const PhaseScope timed(StepPhase::Quantization, stream);
  for (const auto& [spec, jobs] : groups)
    fp8t::cuda::quantize_tiles_grouped(jobs, spec, stream);
}

void CudaLinear::prepare_bias(const float* bias, cudaStream_t stream) {
  FP8T_CHECK((bias != nullptr) == setup_.bias, "a linear {} a bias, and was given {}",
             setup_.bias ? "with" : "without", bias != nullptr ? "one" : "none");
  if (bias == nullptr) return;
  const PhaseScope timed(StepPhase::Quantization, stream);
  cast_to_bf16(bias_bf16_->get(), bias, setup_.out_features, stream);
}

std::optional<fp8t::cuda::TileCastJob> CudaLinear::weight_cast_job(const float* weight) const {
  if (!setup_.fp8 || !blockwise() || record_health_) return std::nullopt;
  return fp8t::cuda::TileCastJob{weight,
                                 setup_.out_features,
                                 setup_.in_features,
                                 weight_fp8_->get(),
                                 weight_scales_->get(),
                                 weight_fp8_t_ ? weight_fp8_t_->get() : nullptr,
                                 weight_t_scales_ ? weight_t_scales_->get() : nullptr};
}

BlockQuantization CudaLinear::block_spec(TensorRole role) const {
  const Fp8Config& config = setup_.fp8_config;
  return {role == TensorRole::Weight ? BlockScaling::Tile128x128 : BlockScaling::Rows1x128,
          config.format_for(role, setup_.family), config.use_power_of_2_scales(),
          config.amax_epsilon};
}

void CudaLinear::forward(const bf16* x, int64_t tokens, bf16* y, bool record_amax,
                         cudaStream_t stream, const bf16* residual) {
  const int64_t in = setup_.in_features, out = setup_.out_features;
  FP8T_CHECK(
      tokens > 0 && tokens <= setup_.max_tokens && (!setup_.fp8 || tokens % kFp8Multiple == 0),
      "expected 1 to {} tokens{}, found {}", setup_.max_tokens,
      setup_.fp8 ? ", a multiple of 16" : "", tokens);
  FP8T_CHECK(residual == nullptr || !bias_bf16_, "a linear with a bias takes no residual");
  gemm::GemmOutput output;
  output.data = y;
  output.ld = out;
  output.type = gemm::GemmType::BF16;
  if (bias_bf16_) {
    output.bias = bias_bf16_->get();
    output.bias_type = gemm::GemmType::BF16;
  }
  output.addend = residual;
  if (!setup_.fp8) {
    gemm_.bf16_gemm(gemm::Bf16Form::XWt, tokens, out, in, x, in, weight_bf16_->get(), in, output,
                    stream);
    return;
  }
  const InputCast fused = std::exchange(input_cast_, InputCast::None);
  if (setup_.input_from == nullptr && fused != InputCast::CastDone) {
    quantize(x, tokens, in, TensorRole::Input, scratch_.input, nullptr,
             fused == InputCast::AmaxDone ? ScaleSource::Measured : ScaleSource::Measure,
             record_amax, stream, scratch_.input_scales);
  }
  if (mx()) {
    dequantize_mx(scratch_.input, scratch_.input_scales, tokens, in, TensorRole::Input,
                  scratch_.dequantized_lhs, stream);
    gemm_.bf16_gemm(gemm::Bf16Form::XWt, tokens, out, in, scratch_.dequantized_lhs, in,
                    weight_bf16_->get(), in, output, stream);
    return;
  }
  // Block scales need split accumulation on sm_90 (cuBLASLt has no fast variant there).
  gemm_.fp8_gemm(
      tokens, out, in,
      input_owner().operand(scratch_.input, in, TensorRole::Input, scratch_.input_scales),
      operand(weight_fp8_->get(), in, TensorRole::Weight,
              weight_scales_ ? weight_scales_->get() : nullptr),
      output, /*fast_accumulation=*/!blockwise(), stream);
}

void CudaLinear::backward(const bf16* dy, const bf16* x, int64_t tokens, bf16* dx,
                          bool accumulate_dx, float* dweight, bool record_amax, cudaStream_t stream,
                          const bf16* y, Relu2Reader reader) {
  const int64_t in = setup_.in_features, out = setup_.out_features;
  FP8T_CHECK(tokens > 0 && tokens <= setup_.max_tokens, "expected 1 to {} tokens, found {}",
             setup_.max_tokens, tokens);
  FP8T_CHECK(setup_.output_relu2 == (y != nullptr),
             "the backward of a linear whose output feeds relu² takes that output, and only it");
  const bool grad_amax_done = std::exchange(grad_output_amax_done_, false);
  const int64_t cast_rows = std::exchange(grad_output_cast_rows_, 0);
  FP8T_CHECK(cast_rows == 0 || cast_rows == tokens,
             "dy was cast for a backward over {} rows, and this one takes {}", cast_rows, tokens);
  FP8T_CHECK(dy != nullptr || cast_rows != 0,
             "a backward without dy needs dy cast by the kernel that made it "
             "(fused_grad_output_cast)");
  const bool fp8_wgrad = setup_.fp8 && dweight != nullptr && setup_.fp8_wgrad;
  if (reader.layer != nullptr) {
    const InputTHolder& holder = *scratch_.input_t_holder;
    FP8T_CHECK(casts_reader_input_t(*reader.layer, tokens) && fp8_wgrad &&
                   reader.dweight != nullptr && holder.waiting_wgrad == reader.layer &&
                   holder.waiting_rows == tokens,
               "a linear casts the x̂ᵗ of the relu² reader it feeds only right after that reader's "
               "backward_leaving_wgrad() over the same {} rows, both with weight gradients",
               tokens);
  }
  if (dweight != nullptr && !fp8_wgrad) {
    FP8T_CHECK(x != nullptr, "a BF16 weight gradient needs the forward's input");
    gemm::GemmOutput grad_weight;
    grad_weight.data = dweight;
    grad_weight.ld = setup_.in_features;
    grad_weight.type = gemm::GemmType::F32;
    grad_weight.accumulate = true;
    gemm_.bf16_gemm(gemm::Bf16Form::DytX, tokens, out, in, dy, out, x, in, grad_weight, stream);
  }
  if (!setup_.fp8) {
    if (dx != nullptr) {
      gemm::GemmOutput grad_input;
      grad_input.data = dx;
      grad_input.ld = in;
      grad_input.type = gemm::GemmType::BF16;
      grad_input.accumulate = accumulate_dx;
      gemm_.bf16_gemm(gemm::Bf16Form::DyW, tokens, out, in, dy, out, weight_bf16_->get(), in,
                      grad_input, stream);
    }
    return;
  }
  if (dx == nullptr && !fp8_wgrad) return;
  if (dx != nullptr && !weight_t_kept()) transpose_weight(stream);
  const int64_t chunk = backward_chunk(tokens);
  ScaleSource grad_scale = grad_amax_done ? ScaleSource::Measured : ScaleSource::Measure;
  if (chunk < tokens && tensorwise()) {
    // Every chunk takes the whole dy's scale, as one cast would.
    const PhaseScope timed(StepPhase::Quantization, stream);
    tensorwise_scale(dy, tokens * out, TensorRole::GradOutput, grad_amax_done, stream, y);
    grad_scale = ScaleSource::Reuse;
  }
  for (int64_t first = 0; first < tokens; first += chunk) {
    const int64_t rows = std::min(chunk, tokens - first);
    backward_rows(dy != nullptr ? dy + first * out : nullptr,
                  x != nullptr ? x + first * in : nullptr, first, rows,
                  dx != nullptr ? dx + first * in : nullptr, accumulate_dx,
                  fp8_wgrad ? dweight : nullptr, record_amax, grad_scale, stream,
                  y != nullptr ? y + first * out : nullptr, reader, cast_rows != 0);
  }
}

int64_t CudaLinear::backward_chunk(int64_t tokens) const {
  const int64_t width = std::max(setup_.in_features, setup_.out_features);
  const int64_t fits = scratch_.backward_elements / width;
  if (fits >= tokens) return tokens;
  return fits / kScaleBlock *
         kScaleBlock;  // whole blocks of rows for the block recipes' dŷᵗ and x̂ᵗ
}

void CudaLinear::backward_rows(const bf16* dy, const bf16* x, int64_t first_row, int64_t rows,
                               bf16* dx, bool accumulate_dx, float* dweight, bool record_amax,
                               ScaleSource grad_scale, cudaStream_t stream, const bf16* y,
                               Relu2Reader reader, bool dy_cast) {
  const int64_t out = setup_.out_features;
  const bool wgrad = dweight != nullptr;
  const LinearSetup::WgradGroup group = setup_.wgrad_group;
  const bool joint = wgrad && group.rows != 0;
  // A joint weight gradient's dŷᵗ takes this layer's rows of the group's operand (in one chunk:
  // the constructor saw to it that the scratch holds them all). A relu² reader's x̂ᵗ goes where
  // its own cast would put it.
  fp8t::cuda::ActivationTCast reader_input_t;
  if (reader.layer != nullptr) reader_input_t = {scratch_.input_t, scratch_.input_t_scales};
  if (!dy_cast) {
    const TransposedTarget dy_t = grad_output_t_target(rows);
    quantize(dy, rows, out, TensorRole::GradOutput, scratch_.grad_output,
             wgrad ? dy_t.codes : nullptr, grad_scale, record_amax, stream,
             scratch_.grad_output_scales, dy_t.scales, y, /*first_cast=*/true, dy_t.scale_lines,
             reader_input_t);
  }
  if (reader.layer != nullptr) {  // the reader's x̂ᵗ is in the scratch: its weight gradient
    InputTHolder& holder = *scratch_.input_t_holder;
    holder = {reader.layer, first_row, rows};
    CudaLinear& waiting = *reader.layer;
    waiting.wgrad_gemm(rows, waiting.setup_.out_features, reader.dweight, scratch_.input,
                       scratch_.input_scales, stream);
  }
  if (wgrad) cast_input_t(x, first_row, rows, stream);
  if (mx()) {
    gemm::GemmOutput grad_input;
    grad_input.data = dx;
    grad_input.ld = setup_.in_features;
    grad_input.type = gemm::GemmType::BF16;
    grad_input.accumulate = accumulate_dx;
    gemm::GemmOutput grad_weight;
    grad_weight.data = dweight;
    grad_weight.ld = setup_.in_features;
    grad_weight.type = gemm::GemmType::F32;
    grad_weight.accumulate = true;
    mx_backward(rows, grad_input, wgrad ? &grad_weight : nullptr, stream);
    return;
  }
  if (dx != nullptr) dgrad_gemm(rows, dx, accumulate_dx, stream);
  if (!wgrad) return;
  int64_t wgrad_rows = out;
  if (joint) {
    dweight = joint_wgrad(dweight);
    if (dweight == nullptr) return;  // a later layer completes the group
    wgrad_rows = group.rows;
  }
  wgrad_gemm(rows, wgrad_rows, dweight, scratch_.grad_output_t, scratch_.grad_output_t_scales,
             stream);
}

void CudaLinear::dgrad_gemm(int64_t rows, bf16* dx, bool accumulate_dx, cudaStream_t stream) {
  const int64_t in = setup_.in_features, out = setup_.out_features;
  gemm::GemmOutput grad_input;
  grad_input.data = dx;
  grad_input.ld = in;
  grad_input.type = gemm::GemmType::BF16;
  grad_input.accumulate = accumulate_dx;
  gemm_.fp8_gemm(
      rows, in, out,
      operand(scratch_.grad_output, out, TensorRole::GradOutput, scratch_.grad_output_scales),
      operand(weight_t(), out, TensorRole::Weight, weight_t_scales()), grad_input,
      /*fast_accumulation=*/false, stream);
}

void CudaLinear::wgrad_gemm(int64_t rows, int64_t wgrad_rows, float* dweight,
                            const uint8_t* grad_output_t, const float* grad_output_t_scales,
                            cudaStream_t stream) {
  gemm::GemmOutput grad_weight;
  grad_weight.data = dweight;
  grad_weight.ld = setup_.in_features;
  grad_weight.type = gemm::GemmType::F32;
  grad_weight.accumulate = true;
  gemm_.fp8_gemm(
      wgrad_rows, setup_.in_features, rows,
      operand(grad_output_t, rows, TensorRole::GradOutput, grad_output_t_scales),
      input_owner().operand(scratch_.input_t, rows, TensorRole::Input, scratch_.input_t_scales),
      grad_weight, /*fast_accumulation=*/false, stream);
}

bool CudaLinear::whole_blockwise_backward(int64_t tokens) const {
  return setup_.fp8 && blockwise() && setup_.fp8_wgrad && setup_.wgrad_group.rows == 0 &&
         backward_chunk(tokens) == tokens;
}

bool CudaLinear::can_leave_wgrad(int64_t tokens) const {
  return setup_.input_relu2 && whole_blockwise_backward(tokens) &&
         setup_.out_features * tokens <= scratch_.input_elements;
}

bool CudaLinear::casts_reader_input_t(const CudaLinear& reader, int64_t tokens) const {
  return setup_.output_relu2 && whole_blockwise_backward(tokens) &&
         reader.can_leave_wgrad(tokens) && reader.setup_.in_features == setup_.out_features &&
         reader.setup_.fp8_config.format_for(TensorRole::Input, reader.setup_.family) ==
             Fp8Format::E4M3;
}

void CudaLinear::backward_leaving_wgrad(const bf16* dy, int64_t tokens, bf16* dx, bool record_amax,
                                        cudaStream_t stream) {
  const int64_t out = setup_.out_features;
  FP8T_CHECK(can_leave_wgrad(tokens),
             "a linear leaves its weight gradient to the layer feeding it relu² only as a "
             "blockwise input_relu2 layer whose operands the scratch holds whole ({} tokens)",
             tokens);
  grad_output_amax_done_ = false;
  quantize(dy, tokens, out, TensorRole::GradOutput, scratch_.grad_output, scratch_.input,
           ScaleSource::Measure, record_amax, stream, scratch_.grad_output_scales,
           scratch_.input_scales);
  InputTHolder& holder = *scratch_.input_t_holder;
  holder.waiting_wgrad = this;
  holder.waiting_rows = tokens;
  if (dx == nullptr) return;
  if (!weight_t_kept()) transpose_weight(stream);
  dgrad_gemm(tokens, dx, false, stream);
}

const uint8_t* CudaLinear::weight_t() const {
  return weight_t_kept() ? weight_fp8_t_->get() : scratch_.weight_t;
}

const float* CudaLinear::weight_t_scales() const {
  if (!blockwise()) return nullptr;
  return weight_t_kept() ? weight_t_scales_->get() : scratch_.weight_t_scales;
}

void CudaLinear::transpose_weight(cudaStream_t stream) {
  const PhaseScope timed(StepPhase::Quantization, stream);
  const int64_t in = setup_.in_features, out = setup_.out_features;
  transpose_fp8(weight_fp8_->get(), out, in, scratch_.weight_t, stream);
  if (blockwise()) {
    transpose_tile_scale_grid(scratch_.weight_t_scales, weight_scales_->get(), scale_blocks(out),
                              scale_blocks(in), stream);
  }
}

float* CudaLinear::joint_wgrad(float* dweight) {
  const LinearSetup::WgradGroup group = setup_.wgrad_group;
  InputTHolder& holder = *scratch_.input_t_holder;
  FP8T_CHECK(holder.wgrad_rows_cast == group.first_row,
             "the layers of a joint weight gradient run their backward in order, each right "
             "after the one before: rows {} of {} come next, rows {} came",
             holder.wgrad_rows_cast, group.rows, group.first_row);
  if (group.first_row == 0) holder.wgrad_output = dweight;
  FP8T_CHECK(dweight == holder.wgrad_output + group.first_row * setup_.in_features,
             "the weight gradients of a joint weight gradient lie back to back in memory");
  holder.wgrad_rows_cast = group.first_row + setup_.out_features;
  if (holder.wgrad_rows_cast < group.rows) return nullptr;
  holder.wgrad_rows_cast = 0;
  return holder.wgrad_output;
}

void CudaLinear::mx_backward(int64_t tokens, const gemm::GemmOutput& grad_input,
                             const gemm::GemmOutput* grad_weight, cudaStream_t stream) {
  const int64_t in = setup_.in_features, out = setup_.out_features;
  bf16* lhs = scratch_.dequantized_lhs;
  if (grad_input.data != nullptr) {  // dx[tokens, in] = dŷ[tokens, out] · (Ŵᵗ[in, out])ᵀ
    dequantize_mx(scratch_.grad_output, scratch_.grad_output_scales, tokens, out,
                  TensorRole::GradOutput, lhs, stream);
    gemm_.bf16_gemm(gemm::Bf16Form::XWt, tokens, in, out, lhs, out, weight_t_bf16_->get(), out,
                    grad_input, stream);
  }
  if (grad_weight == nullptr) return;
  // dW[out, in] += dŷᵗ[out, tokens] · (x̂ᵗ[in, tokens])ᵀ
  dequantize_mx(scratch_.grad_output_t, scratch_.grad_output_t_scales, out, tokens,
                TensorRole::GradOutput, lhs, stream);
  dequantize_mx(scratch_.input_t, scratch_.input_t_scales, in, tokens, TensorRole::Input,
                scratch_.dequantized_rhs, stream);
  gemm_.bf16_gemm(gemm::Bf16Form::XWt, out, in, tokens, lhs, tokens, scratch_.dequantized_rhs,
                  tokens, *grad_weight, stream);
}

template void CudaLinear::quantize<float>(const float*, int64_t, int64_t, TensorRole, uint8_t*,
                                          uint8_t*, ScaleSource, bool, cudaStream_t, float*, float*,
                                          const bf16*, bool, int64_t,
                                          const fp8t::cuda::ActivationTCast&);
template void CudaLinear::quantize<bf16>(const bf16*, int64_t, int64_t, TensorRole, uint8_t*,
                                         uint8_t*, ScaleSource, bool, cudaStream_t, float*, float*,
                                         const bf16*, bool, int64_t,
                                         const fp8t::cuda::ActivationTCast&);

}  // namespace fp8t::ops::cuda

#endif  // FP8TRAIN_WITH_CUDA
