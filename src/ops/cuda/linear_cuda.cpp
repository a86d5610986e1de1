#if FP8TRAIN_WITH_CUDA

#include "ops/cuda/linear_cuda.h"

#include "core/cuda_check.h"
#include "core/error.h"
#include "numerics/quantize_cuda.h"
#include "ops/cuda/ops_cuda.h"

namespace fp8t::ops::cuda {

namespace {

// cuBLASLt's FP8 GEMMs want every reduced dimension and every FP8 row a multiple of 16.
constexpr int64_t kFp8Multiple = 16;

}  // namespace

CudaLinear::CudaLinear(const LinearSetup& setup, gemm::CublasLtGemm& gemm,
                       const Fp8Scratch& scratch)
    : setup_(setup), gemm_(gemm), scratch_(scratch) {
  const int64_t in = setup.in_features, out = setup.out_features;
  FP8T_CHECK(in > 0 && out > 0 && setup.max_tokens > 0,
             "expected a linear [{} -> {}] over at least one token, found {} tokens", in, out,
             setup.max_tokens);
  const auto weight_count = static_cast<size_t>(in * out);
  if (!setup.fp8) {
    weight_bf16_ = std::make_unique<DeviceBuffer<bf16>>(weight_count);
    return;
  }
  const ScalingRecipe recipe = setup.fp8_config.recipe;
  FP8T_CHECK(recipe == ScalingRecipe::Delayed || recipe == ScalingRecipe::Tensorwise,
             "the GPU FP8 linear runs the delayed and tensorwise recipes, not {}",
             recipe_name(recipe));
  FP8T_CHECK(setup.family == Fp8Family::Ocp,
             "cuBLASLt's FP8 GEMMs take the OCP formats (e4m3, e5m2), not fnuz");
  FP8T_CHECK(
      in % kFp8Multiple == 0 && out % kFp8Multiple == 0 && setup.max_tokens % kFp8Multiple == 0,
      "an FP8 linear on the GPU needs features and tokens that are multiples of {}, found "
      "[{} -> {}] over {} tokens",
      kFp8Multiple, in, out, setup.max_tokens);
  FP8T_CHECK(setup.scaling != nullptr && reinterpret_cast<uintptr_t>(setup.scaling) % 16 == 0,
             "an FP8 linear needs its scaling floats, 16-byte aligned");
  FP8T_CHECK(scratch.input != nullptr && scratch.grad_output != nullptr &&
                 scratch.grad_output_t != nullptr,
             "an FP8 linear needs the quantization scratch");
  if (setup.input_from != nullptr) {
    const LinearSetup& owner = setup.input_from->setup_;
    FP8T_CHECK(owner.fp8 && owner.in_features == in && owner.max_tokens == setup.max_tokens &&
                   owner.fp8_wgrad == setup.fp8_wgrad && owner.input_from == nullptr,
               "a linear can share the input quantization only of an FP8 linear of the same input "
               "that quantizes it itself");
  }
  weight_fp8_ = std::make_unique<DeviceBuffer<uint8_t>>(weight_count);
  weight_fp8_t_ = std::make_unique<DeviceBuffer<uint8_t>>(weight_count);
  if (setup.fp8_wgrad && setup.input_from == nullptr) {
    saved_input_t_ =
        std::make_unique<DeviceBuffer<uint8_t>>(static_cast<size_t>(in) * setup.max_tokens);
  }
}

size_t CudaLinear::device_bytes() const {
  size_t bytes = 0;
  if (weight_bf16_) bytes += weight_bf16_->bytes();
  for (const auto* buffer : {&weight_fp8_, &weight_fp8_t_, &saved_input_t_}) {
    if (*buffer) bytes += (*buffer)->bytes();
  }
  return bytes;
}

template <typename T>
void CudaLinear::quantize(const T* x, int64_t rows, int64_t cols, TensorRole role, uint8_t* out,
                          uint8_t* out_t, bool record_amax, cudaStream_t stream) {
  const Fp8Config& config = setup_.fp8_config;
  const Fp8Format format = config.format_for(role, setup_.family);
  float* scale = slot(role, kScaleSlot);
  float* amax = slot(role, kAmaxSlot);
  float* recorded = nullptr;
  if (config.recipe == ScalingRecipe::Tensorwise) {
    // Current scaling: this tensor's own amax, then its scale, all on the device.
    FP8T_CUDA_CHECK(cudaMemsetAsync(amax, 0, sizeof(float), stream));
    fp8t::cuda::amax(x, rows * cols, amax, stream);
    fp8t::cuda::scale_from_amax(amax, format_max(format), config.use_power_of_2_scales(),
                                config.amax_epsilon, scale, slot(role, kScaleInvSlot), stream);
  } else if (record_amax) {
    recorded = amax;  // delayed: the history's scale; this amax feeds the next update
  }
  if (out_t != nullptr) {
    fp8t::cuda::quantize_transpose(x, rows, cols, scale, format, out, out_t, recorded, stream);
  } else {
    fp8t::cuda::quantize(x, rows * cols, scale, format, out, recorded, stream);
  }
}

gemm::Fp8Operand CudaLinear::operand(const uint8_t* data, int64_t ld, TensorRole role) const {
  gemm::Fp8Operand result;
  result.data = data;
  result.ld = ld;
  result.format = setup_.fp8_config.format_for(role, setup_.family);
  result.scale_mode = gemm::ScaleMode::Tensor;
  result.scale_inv = slot(role, kScaleInvSlot);
  return result;
}

void CudaLinear::prepare_weight(const float* weight, bool record_amax, cudaStream_t stream) {
  const int64_t in = setup_.in_features, out = setup_.out_features;
  if (!setup_.fp8) {
    cast_to_bf16(weight_bf16_->get(), weight, in * out, stream);
    return;
  }
  quantize(weight, out, in, TensorRole::Weight, weight_fp8_->get(), weight_fp8_t_->get(),
           record_amax, stream);
}

void CudaLinear::forward(const bf16* x, int64_t tokens, bf16* y, bool record_amax,
                         cudaStream_t stream) {
  const int64_t in = setup_.in_features, out = setup_.out_features;
  FP8T_CHECK(tokens > 0 && tokens <= setup_.max_tokens && tokens % kFp8Multiple == 0,
             "expected 1 to {} tokens, a multiple of {}, found {}", setup_.max_tokens, kFp8Multiple,
             tokens);
  gemm::GemmOutput output;
  output.data = y;
  output.ld = out;
  output.type = gemm::GemmType::BF16;
  if (!setup_.fp8) {
    gemm_.bf16_gemm(gemm::Bf16Form::XWt, tokens, out, in, x, in, weight_bf16_->get(), in, output,
                    stream);
    return;
  }
  if (setup_.input_from == nullptr) {
    quantize(x, tokens, in, TensorRole::Input, scratch_.input,
             saved_input_t_ ? saved_input_t_->get() : nullptr, record_amax, stream);
  }
  gemm_.fp8_gemm(tokens, out, in, input_owner().operand(scratch_.input, in, TensorRole::Input),
                 operand(weight_fp8_->get(), in, TensorRole::Weight), output,
                 /*fast_accumulation=*/true, stream);
}

void CudaLinear::backward(const bf16* dy, const bf16* x, int64_t tokens, bf16* dx,
                          bool accumulate_dx, float* dweight, bool record_amax,
                          cudaStream_t stream) {
  const int64_t in = setup_.in_features, out = setup_.out_features;
  FP8T_CHECK(tokens > 0 && tokens <= setup_.max_tokens, "expected 1 to {} tokens, found {}",
             setup_.max_tokens, tokens);
  gemm::GemmOutput grad_input;
  grad_input.data = dx;
  grad_input.ld = in;
  grad_input.type = gemm::GemmType::BF16;
  grad_input.accumulate = accumulate_dx;
  gemm::GemmOutput grad_weight;
  grad_weight.data = dweight;
  grad_weight.ld = in;
  grad_weight.type = gemm::GemmType::F32;
  grad_weight.accumulate = true;
  const auto bf16_wgrad = [&] {
    FP8T_CHECK(x != nullptr, "a BF16 weight gradient needs the forward's input");
    gemm_.bf16_gemm(gemm::Bf16Form::DytX, tokens, out, in, dy, out, x, in, grad_weight, stream);
  };
  if (!setup_.fp8) {
    if (dx != nullptr) {
      gemm_.bf16_gemm(gemm::Bf16Form::DyW, tokens, out, in, dy, out, weight_bf16_->get(), in,
                      grad_input, stream);
    }
    if (dweight != nullptr) bf16_wgrad();
    return;
  }
  const bool fp8_wgrad = dweight != nullptr && setup_.fp8_wgrad;
  if (dx != nullptr || fp8_wgrad) {
    quantize(dy, tokens, out, TensorRole::GradOutput, scratch_.grad_output,
             fp8_wgrad ? scratch_.grad_output_t : nullptr, record_amax, stream);
  }
  if (dx != nullptr) {  // dx[tokens, in] = dŷ[tokens, out] · (Ŵᵗ[in, out])ᵀ
    gemm_.fp8_gemm(tokens, in, out, operand(scratch_.grad_output, out, TensorRole::GradOutput),
                   operand(weight_fp8_t_->get(), out, TensorRole::Weight), grad_input,
                   /*fast_accumulation=*/false, stream);
  }
  if (dweight == nullptr) return;
  if (!fp8_wgrad) {
    bf16_wgrad();
    return;
  }
  // dW[out, in] += dŷᵗ[out, tokens] · (x̂ᵗ[in, tokens])ᵀ
  const CudaLinear& owner = input_owner();
  gemm_.fp8_gemm(out, in, tokens, operand(scratch_.grad_output_t, tokens, TensorRole::GradOutput),
                 owner.operand(owner.saved_input_t_->get(), tokens, TensorRole::Input), grad_weight,
                 /*fast_accumulation=*/false, stream);
}

template void CudaLinear::quantize<float>(const float*, int64_t, int64_t, TensorRole, uint8_t*,
                                          uint8_t*, bool, cudaStream_t);
template void CudaLinear::quantize<bf16>(const bf16*, int64_t, int64_t, TensorRole, uint8_t*,
                                         uint8_t*, bool, cudaStream_t);

}  // namespace fp8t::ops::cuda

#endif  // FP8TRAIN_WITH_CUDA
