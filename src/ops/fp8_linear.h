// The FP8 linear layer: y = dequant(quant(x))·dequant(quant(W))ᵀ with the scaling recipe of the
// configuration (delayed, tensorwise, blockwise, mxfp8), and its two backward GEMMs.
//
// Layout as nn.Linear: x [tokens, in_features], W [out_features, in_features] (fp32 master),
// y [tokens, out_features], row-major. On the CPU each GEMM is "quantize → dequantize → fp32
// GEMM", which is exact for FP8 operands up to fp32 accumulation. Every GEMM is TN (both
// operands contiguous along the reduced dimension), as FP8 tensor cores require:
//   forward  y  = x̂·Ŵᵀ       x̂ [tokens, in] (blocks along in),  Ŵ [out, in]
//   dgrad    dx += dŷ·(Ŵᵗ)ᵀ  dŷ [tokens, out] (blocks along out), Ŵᵗ [in, out] (blocks along out)
//   wgrad    dW += dŷᵗ·(x̂ᵗ)ᵀ dŷᵗ [out, tokens], x̂ᵗ [in, tokens] (blocks along tokens)
// where ᵗ marks a transposed quantization: the quantization of the transposed tensor, with its
// own blocks (for 1x128 and 1x32 blocks these are different numbers from a transposed copy of
// the row-wise quantization; for per-tensor scales and 128x128 tiles they are the same).
#pragma once

#include <array>
#include <cstdint>
#include <functional>
#include <optional>
#include <vector>

#include "numerics/float_bits.h"
#include "numerics/formats.h"
#include "numerics/quantize.h"
#include "numerics/scaling.h"
#include "ops/fp8_health.h"

namespace fp8t::ops {

// An FP8 operand: codes plus the scales to dequantize them.
struct Fp8Tensor {
  Fp8Format format = Fp8Format::E4M3;
  std::optional<BlockScaling> blocks;  // none: one scale for the whole tensor
  int64_t rows = 0;
  int64_t cols = 0;
  std::vector<uint8_t> data;         // [rows, cols]
  std::vector<float> scale_inv;      // one per tensor, or row-major over the block grid
  std::vector<uint8_t> e8m0_scales;  // mxfp8 instead of scale_inv: one E8M0 code per block

  // out[i] = decode(data[i]) · scale_inv of its block: what the CPU GEMM multiplies.
  void dequantize(float* out) const;
};

class Fp8Linear {
 public:
  // `family` is the resolved platform family (resolve_family). With fp8_wgrad false the weight
  // gradient is a BF16 GEMM (dy and x rounded to bf16, fp32 accumulation), as TE's
  // "fp8_wgrad: false". Throws for fp8: none, and under blockwise (mxfp8) for features that are
  // not multiples of 128 (32): such layers stay in BF16 (see models/precision_policy.h).
  Fp8Linear(const Fp8Config& config, Fp8Family family, int64_t in_features, int64_t out_features,
            bool fp8_wgrad = true);

  // y = x̂·Ŵᵀ rounded to bf16 (y holds bf16 values in fp32 storage); y is overwritten.
  // The weight is quantized on the first forward after construction, end_step() or
  // invalidate_weight_cache() (or when a different weight pointer is passed) and reused by the
  // micro-batches in between: changing the weight's values without one of those calls leaves
  // the old quantization in use.
  // Saves for backward the quantized input, not x itself: x̂ᵗ, the wgrad operand (or, with
  // fp8_wgrad false, bf16(x)). One forward is saved at a time: backward pairs with the latest.
  void forward(const float* x, int64_t tokens, const float* weight, float* y);

  // ADDS the gradients: grad_input += dŷ·Ŵ, grad_weight += dŷᵀ·x̂ (summed over the tokens), so
  // micro-batches accumulate. Uses the weight quantization of the paired forward. Either
  // output may be null when not needed.
  void backward(const float* grad_output, int64_t tokens, float* grad_input, float* grad_weight);

  // Once per optimizer step, after the weights are updated: delayed scaling's update() for
  // input, weight and grad_output, and invalidation of the cached weight quantization.
  void end_step();
  // Marks the cached weight quantization stale (e.g. after loading weights).
  void invalidate_weight_cache();
  // Tensor parallelism: a tensorwise scale of an operand that is split over the ranks (marked
  // in `split`, indexed by TensorRole) comes from the largest amax in the group, `group_max`, so
  // that every rank casts with the scale of the whole tensor. Delayed scaling's amaxes are
  // reduced with the data-parallel ones at the end of the step; block scales are local.
  void set_split_operands(std::function<float(float)> group_max, std::array<bool, 3> split);
  // Evaluation passes turn this off so that they leave delayed scaling's amax history alone; the
  // weight's amax is recorded whenever it is cast (once per optimizer step), since the next
  // training forward uses that cast.
  void set_record_amax(bool record) { record_amax_ = record; }
  // While on, each tensor's first cast (x̂, Ŵ, dŷ; not the transposed copies made from the same
  // values) adds to health(role): amax, scale, values, saturated and underflowed counts.
  void set_record_health(bool record) { record_health_ = record; }
  const Fp8OperandHealth& health(TensorRole role) const {
    return health_[static_cast<size_t>(role)];
  }
  void clear_health() { health_ = {}; }

  int64_t in_features() const { return in_features_; }
  int64_t out_features() const { return out_features_; }
  ScalingRecipe recipe() const { return config_.recipe; }
  bool fp8_wgrad() const { return fp8_wgrad_; }
  Fp8Format format(TensorRole role) const { return config_.format_for(role, family_); }
  // How often the weight has been quantized (each time Ŵ and Ŵᵗ together).
  int64_t weight_quantizations() const { return weight_quantizations_; }

  // Ŵ [out, in] and Ŵᵗ [in, out] of the current cache.
  const Fp8Tensor& quantized_weight() const { return weight_; }
  const Fp8Tensor& quantized_weight_t() const { return weight_t_; }
  // What the last forward saved: x̂ᵗ [in, tokens] (fp8_wgrad), or bf16(x) [tokens, in].
  const Fp8Tensor& saved_input_t() const { return saved_input_t_; }
  const std::vector<bf16>& saved_input_bf16() const { return saved_input_bf16_; }
  // The operands of the last backward: dŷ [tokens, out] (dgrad) and dŷᵗ [out, tokens] (wgrad).
  const Fp8Tensor& quantized_grad_output() const { return grad_output_; }
  const Fp8Tensor& quantized_grad_output_t() const { return grad_output_t_; }

  // Delayed scaling state (scale, amax history) per role, for checkpoints; throws unless the
  // recipe is delayed. Stateless recipes have nothing to save.
  bool has_delayed_scaling() const { return !delayed_.empty(); }
  DelayedScaling& delayed_scaling(TensorRole role);
  const DelayedScaling& delayed_scaling(TensorRole role) const;

 private:
  // Quantizes src [rows, cols] for `role` into `rowwise` and, when not null, `transposed`
  // ([cols, rows], its own blocks); records the amax under delayed scaling.
  void quantize_operand(const float* src, int64_t rows, int64_t cols, TensorRole role,
                        Fp8Tensor& rowwise, Fp8Tensor* transposed);
  void ensure_weight(const float* weight);

  Fp8Config config_;
  Fp8Family family_;
  int64_t in_features_;
  int64_t out_features_;
  bool fp8_wgrad_;
  std::vector<DelayedScaling> delayed_;  // indexed by TensorRole; empty unless delayed
  bool record_amax_ = true;
  bool record_health_ = false;
  std::array<Fp8OperandHealth, 3> health_;  // indexed by TensorRole
  std::function<float(float)> group_max_;
  std::array<bool, 3> split_{};  // indexed by TensorRole

  // Weight cache: Ŵ, Ŵᵗ and their dequantized values for the CPU GEMMs.
  const float* cached_weight_ = nullptr;
  bool weight_valid_ = false;
  int64_t weight_quantizations_ = 0;
  Fp8Tensor weight_;
  Fp8Tensor weight_t_;
  std::vector<float> weight_values_;    // dequantized Ŵ
  std::vector<float> weight_t_values_;  // dequantized Ŵᵗ

  // Saved by forward for backward.
  int64_t saved_tokens_ = -1;  // -1: no forward yet
  Fp8Tensor saved_input_t_;
  std::vector<bf16> saved_input_bf16_;

  // Scratch of the current call.
  Fp8Tensor input_;
  Fp8Tensor grad_output_;
  Fp8Tensor grad_output_t_;
  std::vector<float> lhs_values_;
  std::vector<float> rhs_values_;
};

}  // namespace fp8t::ops
