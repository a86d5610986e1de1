// FP8 attention (`fp8_dot_product_attention`): the two products of attention on FP8 operands,
// with the quantization points of cuDNN's FP8 SDPA on Hopper, emulated on the CPU. This is the
// reference of the GPU path (ops/cuda/attention_fp8_cuda.h) and the CPU path's own attention
// when the option is on. Layouts, masks and the log-sum-exp are those of ops/attention.h.
//
// Every quantized tensor x is stored as x̂ = encode_saturating(x · scale) and read back as
// decode(x̂) / scale. The quantization points:
//   forward   Q, K, V (forward format); the probabilities P before P·V (forward format); the
//             output O (forward format): out = O read back.
//   backward  dO (backward format); dV = P̂ᵀ·dÔ; dP = dÔ·V̂ᵀ; dS = P ∘ (dP − rowsum(dÔ ∘ Ô)) ·
//             attn_scale, quantized (backward format); dQ = dŜ·K̂ and dK = dŜᵀ·Q̂; dQ, dK and dV
//             quantized (backward format) and read back.
// The backward recomputes P from Q̂, K̂ and the forward's log-sum-exp; P̂ is it quantized again.
// cuDNN's flash kernels quantize each probability relative to the running row maximum and
// normalize at the end; the reference quantizes the normalized probabilities. The rounding
// steps are the same, the bits are not: GPU and CPU agree to FP8 rounding, not bit for bit.
//
// The scales (the same rule on the CPU and the GPU, so that both paths quantize alike):
//   Q, K, V, dO    current scaling: from the tensor's own amax, as tensorwise linears do.
//   P              from amax 1: probabilities never exceed 1.
//   O              from 2 · amax(V): O is a convex combination of V's rows; the factor 2 covers
//                  the rounding of P̂ and V̂.
//   dS, dQ, dK, dV from kAttentionGradientHeadroom × the amax the previous backward of the same
//                  attention measured (their amax is not known before the products run).
// Until an attention has measured, its backward first runs two measuring passes into scratch:
// the first from amaxes 0 (scale 1) measures dS exactly (its amax is taken before
// quantization), while its dQ, dK and dV may come from a dS that underflowed; the second, with
// the scales the first gives, measures dQ, dK and dV from a well-scaled dS. The real pass then
// uses the scales of the second pass's amaxes. An attention has measured once a backward ran
// with dO's amax > 0: a zero dO (the GPT's zero-initialized projections at step 1) measures
// only zeros, and the next backward measures again. From then on each backward scales from the
// amaxes of the previous one. The state is not saved in checkpoints: after a resume the first
// backward measures again.
// Formats: forward E4M3 (the recipe's input format), backward the recipe's gradient format
// (E5M2 in hybrid mode). Power-of-2 rounding and the amax epsilon follow the recipe.
#pragma once

#include <cstdint>

#include "core/host_device.h"
#include "core/non_deduced.h"
#include "numerics/formats.h"
#include "numerics/scaling.h"
#include "ops/attention.h"

namespace fp8t::ops {

// How much larger than the previous backward's amax a gradient may grow before it saturates.
inline constexpr float kAttentionGradientHeadroom = 4.0f;

struct AttentionFp8Formats {
  Fp8Format forward = Fp8Format::E4M3;   // Q, K, V, P, O
  Fp8Format backward = Fp8Format::E5M2;  // dO, dS, dQ, dK, dV
  bool power_of_2_scales = false;
  float amax_epsilon = 0.0f;
};

// One scale per quantized tensor (x̂ = encode(x · scale)).
struct AttentionFp8Scales {
  float q = 1.0f, k = 1.0f, v = 1.0f, p = 1.0f, o = 1.0f;         // forward
  float dout = 1.0f, ds = 1.0f, dq = 1.0f, dk = 1.0f, dv = 1.0f;  // backward
};

// What a call measures: the amax of each tensor it quantizes, before quantization.
struct AttentionFp8Amaxes {
  float p = 0.0f, o = 0.0f;                          // forward
  float ds = 0.0f, dq = 0.0f, dk = 0.0f, dv = 0.0f;  // backward
};

FP8T_HD inline float attention_fp8_scale(float amax, Fp8Format format,
                                         const AttentionFp8Formats& formats) {
  return scale_from_amax(amax, format_max(format), formats.power_of_2_scales, formats.amax_epsilon);
}

// The forward's scales from the amaxes of its inputs.
FP8T_HD inline void attention_fp8_forward_scales(AttentionFp8Scales& scales, float amax_q,
                                                 float amax_k, float amax_v,
                                                 const AttentionFp8Formats& formats) {
  scales.q = attention_fp8_scale(amax_q, formats.forward, formats);
  scales.k = attention_fp8_scale(amax_k, formats.forward, formats);
  scales.v = attention_fp8_scale(amax_v, formats.forward, formats);
  scales.p = attention_fp8_scale(1.0f, formats.forward, formats);
  scales.o = attention_fp8_scale(2.0f * amax_v, formats.forward, formats);
}

// The backward's scales from dO's amax and the amaxes the previous backward measured.
FP8T_HD inline void attention_fp8_backward_scales(AttentionFp8Scales& scales, float amax_dout,
                                                  const AttentionFp8Amaxes& previous,
                                                  const AttentionFp8Formats& formats) {
  const Fp8Format format = formats.backward;
  scales.dout = attention_fp8_scale(amax_dout, format, formats);
  scales.ds = attention_fp8_scale(kAttentionGradientHeadroom * previous.ds, format, formats);
  scales.dq = attention_fp8_scale(kAttentionGradientHeadroom * previous.dq, format, formats);
  scales.dk = attention_fp8_scale(kAttentionGradientHeadroom * previous.dk, format, formats);
  scales.dv = attention_fp8_scale(kAttentionGradientHeadroom * previous.dv, format, formats);
}

// out = the read-back FP8 output of softmax(scale · Q̂K̂ᵀ + mask)·V̂ (quantization points above);
// lse as attention_forward's, from the quantized Q and K. q, k, v are the unquantized inputs:
// they are quantized here with scales.q, .k, .v. amaxes->p and ->o receive what was measured.
template <typename T>
void attention_fp8_forward(T* out, T* lse, const T* q, const T* k, const T* v,
                           const AttentionShape& shape, NonDeduced<T> scale,
                           const AttentionFp8Formats& formats, const AttentionFp8Scales& scales,
                           AttentionFp8Amaxes* amaxes);

// dq, dk, dv += the read-back FP8 gradients (quantization points above). q, k, v, out and lse
// are the forward's inputs and results; out is quantized again with scales.o (the same codes).
// amaxes->ds, ->dq, ->dk and ->dv receive what was measured.
template <typename T>
void attention_fp8_backward(T* dq, T* dk, T* dv, const T* dout, const T* q, const T* k, const T* v,
                            const T* out, const T* lse, const AttentionShape& shape,
                            NonDeduced<T> scale, const AttentionFp8Formats& formats,
                            const AttentionFp8Scales& scales, AttentionFp8Amaxes* amaxes);

// One attention's FP8 scaling state on the CPU path, and the calls that use it: the forward
// scales Q, K and V from their own amaxes, the backward dS, dQ, dK and dV from what its previous
// backward measured, measuring first while it has not (the scale rules above). Float, like the
// CPU models.
class AttentionFp8 {
 public:
  explicit AttentionFp8(const AttentionFp8Formats& formats) : formats_(formats) {}

  // out and lse as attention_fp8_forward's.
  void forward(float* out, float* lse, const float* q, const float* k, const float* v,
               const AttentionShape& shape, float scale);

  // dq, dk, dv += the gradients, as attention_fp8_backward's; q, k, v and scale as given to the
  // last forward, out and lse as it returned them.
  void backward(float* dq, float* dk, float* dv, const float* dout, const float* q, const float* k,
                const float* v, const float* out, const float* lse, const AttentionShape& shape,
                float scale);

  // Whether a backward with a non-zero dO has measured the gradients' amaxes.
  bool measured() const { return measured_; }
  // The scales of the last forward and backward.
  const AttentionFp8Scales& scales() const { return scales_; }
  // What the last backward measured (its real pass): the next one scales from it.
  const AttentionFp8Amaxes& gradient_amaxes() const { return gradient_amaxes_; }

 private:
  AttentionFp8Formats formats_;
  AttentionFp8Scales scales_;
  AttentionFp8Amaxes gradient_amaxes_;
  bool measured_ = false;
};

}  // namespace fp8t::ops
